"""The two target tensors the draft needs, loaded without the rest of the target, and the target distribution.

Offline training never runs the target: the shards hold its post-norm last hidden state, so `lm_head` alone
rebuilds its logits. Only `lm_head.weight` (for the targets) and the input embedding (the draft's frozen token
embedding) are read from the checkpoint's safetensors files, a few hundred MB even for a 70B target.

The target distribution is restricted to the draft vocabulary (what the draft can express) and computed in chunks
of positions, so the full-vocabulary logits never exist for more than `chunk_tokens` positions at once.

Only the argmax needs the full vocabulary, and it never changes for a stored sample: with an `ArgmaxCache`
(offline training, `train.cache_target_argmax`) it is computed once per sample and the later epochs evaluate only
the draft vocabulary's rows of the LM head (a sixth of SmolLM2's, a quarter of Llama-3's).
"""

import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from safetensors import safe_open

from specgen.capture.positions import position_chunks
from specgen.draft.vocab import VocabMapping
from specgen.errors import SpecgenError
from specgen.progress import human_bytes

_EMBEDDING_SUFFIXES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight")
_HEAD_SUFFIXES = ("lm_head.weight",)


@dataclass
class TargetWeights:
    config: transformers.PretrainedConfig
    embedding: torch.Tensor  # [V, H], the target's input embedding
    lm_head: torch.Tensor  # [V, H], the target's output embedding (the same tensor when tied)


def _weight_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / "model.safetensors"
    if single.exists():
        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}
    raise SpecgenError(f"{folder} has no model.safetensors(.index.json): the target's LM head is read from "
                       "safetensors files; re-save the model with save_pretrained(safe_serialization=True)")


def _find(names: dict[str, Path], suffixes: tuple[str, ...]) -> str | None:
    matches = sorted(name for name in names if name.endswith(suffixes))
    # Multimodal checkpoints nest the language model; prefer the shortest (outermost text) name.
    return min(matches, key=len) if matches else None


def load_target_weights(model_path: str | Path, device: str | torch.device = "cpu") -> TargetWeights:
    """Read the target's input embedding and LM head (in the checkpoint's dtype) and its config."""
    folder = Path(model_path)
    if not (folder / "config.json").is_file():
        raise SpecgenError(f"model.path {str(model_path)!r} has no config.json; point it at the target's Hugging "
                           "Face folder (the one the shards were generated with)")
    config = transformers.AutoConfig.from_pretrained(folder)
    files = _weight_files(folder)
    embedding_name = _find(files, _EMBEDDING_SUFFIXES)
    if embedding_name is None:
        raise SpecgenError(f"no input embedding ({' / '.join(_EMBEDDING_SUFFIXES)}) in {folder}'s weights")
    head_name = _find(files, _HEAD_SUFFIXES)
    tied = head_name is None or getattr(config.get_text_config(), "tie_word_embeddings", False)

    def read(name: str) -> torch.Tensor:
        with safe_open(str(files[name]), framework="pt", device=str(device)) as f:
            return f.get_tensor(name)

    embedding = read(embedding_name)
    return TargetWeights(config=config, embedding=embedding, lm_head=embedding if tied else read(head_name))


@dataclass
class TargetDistribution:
    """The target's next-token distribution per position.

    probs: [B, T, draft_vocab] float32, softmax of the target logits restricted to the draft vocabulary;
    argmax: [B, T] the target's greedy token over its FULL vocabulary (target ids).
    Positions not requested hold zeros and -1.
    """

    probs: torch.Tensor
    argmax: torch.Tensor


class ArgmaxCache:
    """The target's full-vocabulary argmax at every position of a fixed set of samples (a shard dataset's), kept on
    the host once computed: 4 bytes a token. A sample's argmaxes are computed together, from that sample's hidden
    states alone (`TargetHead.sample_argmax`), so they are the same whichever batch first holds the sample: a
    resumed or multi-process run reads the values an uninterrupted one-process run computed."""

    def __init__(self, lengths: Sequence[int]):
        self.offsets = [0, *itertools.accumulate(lengths)]
        self.values = torch.full((self.offsets[-1],), -1, dtype=torch.int32)
        self.known = torch.zeros(len(lengths), dtype=torch.bool)
        self.computed_positions = 0  # positions whose argmax the full LM head computed
        self.computed_samples = 0  # samples they belong to (each computed once)
        self.reused_samples = 0  # samples of later batches whose argmaxes were read back instead

    def describe(self) -> str:
        """One line for the training summary."""
        memory = human_bytes(self.values.numel() * self.values.element_size())
        return (f"full vocabulary at {self.computed_positions:,} positions of {self.computed_samples:,} samples "
                f"(each sample once); argmax read back for {self.reused_samples:,} samples of later batches, their "
                f"logits over the draft vocabulary alone (train.cache_target_argmax, {memory} of host memory)")

    def span(self, sample: int) -> slice:
        return slice(self.offsets[sample], self.offsets[sample + 1])


class TargetHead:
    """`lm_head` of the target, evaluating only where needed and a chunk of positions at a time; with an
    `argmax_cache`, the full vocabulary only where the cache does not know the argmax yet."""

    def __init__(self, lm_head_weight: torch.Tensor, mapping: VocabMapping, chunk_tokens: int = 1024,
                 argmax_cache: ArgmaxCache | None = None):
        if lm_head_weight.shape[0] != mapping.target_vocab_size:
            raise SpecgenError(f"the target LM head has {lm_head_weight.shape[0]} rows but the vocabulary mapping "
                               f"was built for {mapping.target_vocab_size} target tokens")
        self.weight = lm_head_weight
        self.draft_to_target = mapping.draft_to_target.to(lm_head_weight.device)
        self.chunk_tokens = chunk_tokens
        self.argmax_cache = argmax_cache
        # With a cache the probabilities always come from the draft vocabulary's rows alone (one computation,
        # whether or not the argmax was cached, so a run does not depend on which epoch computed an argmax).
        self.draft_weight = lm_head_weight[self.draft_to_target].contiguous() if argmax_cache is not None else None

    def _logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden.to(device=weight.device, dtype=weight.dtype), weight).float()

    @torch.no_grad()
    def distribution(self, last_hidden_state: torch.Tensor, needed: torch.Tensor,
                     argmax: torch.Tensor | None = None) -> TargetDistribution:
        """Target distributions for a batch: last_hidden_state [B, T, H] (post-norm), needed [B, T] bool. `argmax`
        [B, T] (known full-vocabulary argmaxes, `ArgmaxCache`): only the draft vocabulary's logits are computed."""
        batch, seq_len, _ = last_hidden_state.shape
        device = self.weight.device
        probs = torch.zeros(batch, seq_len, len(self.draft_to_target), dtype=torch.float32, device=device)
        if argmax is not None:
            argmax = torch.where(needed, argmax.to(device, non_blocking=True), -1)
            for r, c in position_chunks(needed, self.chunk_tokens):
                probs[r, c] = torch.softmax(self._logits(last_hidden_state[r, c], self.draft_weight), dim=-1)
            return TargetDistribution(probs=probs, argmax=argmax)
        argmax = torch.full((batch, seq_len), -1, dtype=torch.long, device=device)
        for r, c in position_chunks(needed, self.chunk_tokens):
            logits = self._logits(last_hidden_state[r, c], self.weight)
            argmax[r, c] = logits.argmax(-1)
            probs[r, c] = torch.softmax(logits[:, self.draft_to_target], dim=-1)
        return TargetDistribution(probs=probs, argmax=argmax)

    @torch.no_grad()
    def sample_argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary argmax [N] (on the head's device, int32) of one sample's positions hidden [N, H], in
        chunks counted from the sample's first position: the result depends on the sample alone."""
        chunks = [self._logits(hidden[start:start + self.chunk_tokens], self.weight).argmax(-1).int()
                  for start in range(0, len(hidden), self.chunk_tokens)]
        return torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.int32, device=self.weight.device)
