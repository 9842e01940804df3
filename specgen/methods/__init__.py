"""Draft methods: one interface in the trainer, the evaluator and the exporter; one package per method.

`draft.method` (config) and config.json's `specgen.method` (checkpoint) name the method; each is a package:

    eagle3     specgen.methods.eagle3   EAGLE-3: one Llama layer over the fused aux states, TTT-unrolled chain
    eagle3.1   specgen.methods.eagle3   EAGLE-3 with fc_norm (an RMSNorm per aux layer before fc) and the post-norm
                                        output fed to the next step (norm_output), vLLM / speculators flags
    p-eagle    specgen.methods.peagle   parallel drafting: the EAGLE-3 layer proposes all K tokens in one forward
                                        (mask token + learned mask_hidden in the K-1 slots after the bonus token)
    dflash     specgen.methods.dflash   block diffusion: Qwen3 layers over [target context ; bonus token + K masks]
                                        propose all K tokens in one forward (vLLM qwen3_dflash)

What every method shares (vocabulary, aux layers, batches, loss-mask shift, target head, checkpoint files, export
layouts, speculative decoding) is in `specgen.draft`; training them is `specgen.training`.

A method package exposes `METHODS: dict[str, DraftMethod]`; registering a new method is one line in `MODULES`.
The trainer, `specgen.evaluate`, `specgen.export` and `load_draft` only call what `DraftMethod` lists, so a new
method (DSpark, MTP fine-tuning) is a new package, not a fork of the trainer. Every draft model a method builds
carries `method_name` (the name saved into its checkpoint).

What the stages read off a draft model besides the methods (so a new model class provides them too):
`method_name`; `config` with `vocab_size`, `draft_vocab_size`, `target_hidden_size`, the aux layers as
`specgen.draft.aux.aux_layers_of(config)` reads them (`eagle_config.eagle_aux_hidden_state_layer_ids`, vLLM's
ids) and, on loaded drafts, `config.specgen` (the checkpoint's "specgen" section); buffers `d2t` / `t2d` (the
vocabulary mapping the target head is restricted to); `lm_head` (draft.freeze_lm_head); `trainable_parameters()`;
and `state_dict()` names that `export` understands. The trainer computes the target distribution at the positions
`specgen.draft.loss.target_positions_needed` marks and hands it to the objective as (target_probs, target_argmax).
"""

import importlib
from pathlib import Path
from typing import Protocol

import torch
import transformers
from torch import nn

from specgen.errors import SpecgenError

MODULES = {"eagle3": "specgen.methods.eagle3", "eagle3.1": "specgen.methods.eagle3", "p-eagle": "specgen.methods.peagle",
           "dflash": "specgen.methods.dflash"}
DEFAULT = "eagle3"


class Proposer(Protocol):
    """Drafting for specgen.evaluate, as vLLM drafts (greedy, one chain of K tokens per verification round)."""

    def propose(self, aux: torch.Tensor, tokens: list[int], num_draft_tokens: int) -> list[int]:
        """Add the newly verified positions m (the target's aux hidden states `aux` [n, k*H] at m, and `tokens`,
        the token at m + 1 each; the last one is the target's next token, not yet verified) and return
        `num_draft_tokens` draft tokens (target ids) that follow it. Positions are never verified twice: what
        was drafted and rejected is forgotten by the proposer itself."""


class DraftMethod(Protocol):
    """What a method provides (see `specgen.methods.eagle3.method.EagleMethod` for the reference implementation)."""

    name: str

    def new_draft(self, target_config: transformers.PretrainedConfig, *, aux_layers: list[int], mapping,
                  embedding: torch.Tensor, lm_head: torch.Tensor, draft) -> nn.Module:
        """A fresh draft (weights initialised) for the target, its aux layers and vocabulary mapping
        (`specgen.draft.vocab.VocabMapping`); `draft` is the `draft` section's typed settings
        (`specgen.schema.settings`), whose values are the configured ones: a method has no defaults of its own."""

    def load(self, folder: Path, *, embedding: torch.Tensor | None, target_config, foreign_ids: str) -> nn.Module:
        """The draft stored in `folder` (any layout the method reads)."""

    def objective(self, model: nn.Module, *, train, draft, seed: int, mask_shift: int) -> nn.Module:
        """The training step as one module: forward(input_ids, loss_mask, aux_hidden_states, target_probs,
        target_argmax, position_ids, document_ids) -> (loss, stats); `stats` is a float64 tensor of sums (added
        over micro-steps and processes before `metrics` reads it). `train` and `draft` are the sections' typed
        settings, `seed` runtime.seed. An objective whose loss needs other target positions than
        train.loss_mask's has a `mask_shift` attribute, which the trainer then uses (DFlash: always 2)."""

    def metrics(self, stats: torch.Tensor, *, train, draft) -> dict[str, float]:
        """metrics.jsonl fields from summed stats: at least loss, acc_0, scored, trainable_positions."""

    def export(self, config, tensors: dict[str, torch.Tensor], fmt: str, *, info: dict | None,
               speculative_tokens: int, verifier: str | None) -> tuple[dict, dict[str, torch.Tensor]]:
        """(config.json content, tensors) of the draft in format `fmt` (`specgen.draft.exports.FORMATS`)."""

    def proposer(self, draft: nn.Module) -> Proposer:
        """Decoding state for one generation (see `Proposer`)."""


def get(name: str) -> DraftMethod:
    """The method called `name`; an unknown name is a one-line error listing the known ones."""
    if name not in MODULES:
        raise SpecgenError(f"draft.method={name!r} is unknown; use one of {list(MODULES)}")
    try:
        module = importlib.import_module(MODULES[name])
    except ModuleNotFoundError as error:
        if error.name != MODULES[name]:
            raise
        raise SpecgenError(f"draft.method={name} is reserved but not implemented in this version") from None
    return module.METHODS[name]


def method_of_config(raw: dict) -> str:
    """The method of a checkpoint's config.json: what specgen recorded, else read from the layout (peers)."""
    recorded = (raw.get("specgen") or {}).get("method")
    if recorded:
        return str(recorded)
    if ("dflash_config" in raw or "DFlashDraftModel" in (raw.get("architectures") or [])
            or raw.get("speculators_model_type") in ("dflash", "dflash2")):
        return "dflash"
    if raw.get("speculators_model_type") == "peagle" or raw.get("parallel_drafting"):
        return "p-eagle"
    if raw.get("fc_norm") or raw.get("norm_before_fc"):
        return "eagle3.1"
    return DEFAULT


def resolve(requested: str | None, raw: dict, path: str | Path) -> DraftMethod:
    """The method of the checkpoint at `path`; `requested` (draft.method) must name it when it is set."""
    stored = method_of_config(raw)
    if requested is not None and requested != stored:
        raise SpecgenError(f"draft.path {path} holds a {stored} draft but draft.method={requested}: drop "
                           f"draft.method or pass draft.method={stored}")
    return get(stored)


def of_model(draft: nn.Module) -> DraftMethod:
    """The method a draft model was built by."""
    return get(getattr(draft, "method_name", DEFAULT))
