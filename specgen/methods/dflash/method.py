"""DFlash as a draft method (`specgen.methods.DraftMethod`): a fresh draft, loading, the objective, metrics,
export, and the proposer that drafts K tokens in one forward as vLLM's DFlashProposer."""

import math
from dataclasses import dataclass

import torch

from specgen.draft import exports
from specgen.draft.loss import step_metrics
from specgen.draft.vocab import default_mask_token_id
from specgen.errors import SpecgenError
from specgen.methods.dflash.model import METHOD, DFlashDraft, dflash_config
from specgen.methods.dflash.objective import DFlashObjective
from specgen.methods.dflash.serving import config_dict, load_dflash


class DFlashProposer:
    """vLLM's DFlashProposer as a `specgen.methods.Proposer`: the draft's context grows by the target features
    of every verified position; each call drafts from ONE forward over [x, M x K] at the next K + 1 positions, x
    being the last of `tokens` (the target's next token), and returns the argmax of slots 1..K."""

    def __init__(self, draft: DFlashDraft):
        self.draft = draft
        self.device = next(draft.parameters()).device
        self.context: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.known = 0  # positions in the draft's context

    def propose(self, aux: torch.Tensor, tokens: list[int], num_draft_tokens: int) -> list[int]:
        draft, device = self.draft, self.device
        positions = torch.arange(self.known, self.known + aux.shape[0], device=device)[None]
        new = draft.context_kv(aux.to(device)[None], positions)
        self.context = new if self.context is None else [
            (torch.cat([k0, k1], 2), torch.cat([v0, v1], 2)) for (k0, v0), (k1, v1) in zip(self.context, new)]
        self.known += aux.shape[0]
        block = torch.tensor([[tokens[-1]] + [draft.mask_token_id] * num_draft_tokens], device=device)
        block_positions = torch.arange(self.known, self.known + num_draft_tokens + 1, device=device)[None]
        hidden = draft(block, block_positions, self.context, self._visibility(num_draft_tokens))
        return draft.to_target_ids(draft.logits(hidden[0, 1:]).argmax(-1)).tolist()

    def _visibility(self, k: int) -> torch.Tensor | None:
        """All context entries and the whole block (None), or with `causal` the block's earlier slots only."""
        if not self.draft.causal:
            return None
        own = torch.ones(k + 1, k + 1, dtype=torch.bool, device=self.device).tril()
        return torch.cat([torch.ones(k + 1, self.known, dtype=torch.bool, device=self.device), own], dim=1)[None]


@dataclass(frozen=True)
class DFlashMethod:
    """draft.method=dflash. Keys: draft.dflash.{num_layers, block_size, causal} shape a new draft,
    draft.dflash.{max_anchors, loss_decay_gamma} its loss; draft.mask_token_id (shared with p-eagle) the mask slots'
    token. Checkpoints are vLLM's DFlash layout (`specgen.methods.dflash.serving`), the only export format."""

    name: str = METHOD

    def new_draft(self, target_config, *, aux_layers: list[int], mapping, embedding: torch.Tensor,
                  lm_head: torch.Tensor, draft) -> DFlashDraft:
        mask_token_id = draft.mask_token_id
        config = dflash_config(target_config, aux_layers=aux_layers, draft_vocab_size=mapping.draft_vocab_size,
                               num_layers=draft.dflash.num_layers, block_size=draft.dflash.block_size,
                               mask_token_id=int(default_mask_token_id(target_config) if mask_token_id is None
                                                 else mask_token_id),
                               causal=draft.dflash.causal, overrides=draft.overrides)
        model = DFlashDraft(config)
        model.start_from_target(mapping, embedding, lm_head, init_lm_head=draft.init_lm_head)
        return model

    def load(self, folder, *, embedding: torch.Tensor | None, target_config, foreign_ids: str) -> DFlashDraft:
        return load_dflash(folder, embedding=embedding)

    def objective(self, model: DFlashDraft, *, train, draft, seed: int, mask_shift: int) -> DFlashObjective:
        return DFlashObjective(model, max_anchors=draft.dflash.max_anchors, gamma=draft.dflash.loss_decay_gamma,
                               seed=seed, drop_out_of_vocab=train.out_of_vocab == "drop")

    def metrics(self, stats: torch.Tensor, *, train, draft) -> dict[str, float]:
        """TTT's metrics with one row per block slot 1..K; the logged loss weighs slot k by exp(-(k-1)/gamma)
        (the ratio of neighbouring slot weights, as the loss does)."""
        gamma = draft.dflash.loss_decay_gamma
        return step_metrics(stats, math.exp(-1 / gamma) if gamma else 1.0)

    def export(self, config, tensors: dict[str, torch.Tensor], fmt: str, *, info: dict | None = None,
               speculative_tokens: int = 3, verifier: str | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
        """vLLM's DFlash layout (`specgen.methods.dflash.serving`); every other format is refused in one line."""
        if fmt != "vllm":
            raise SpecgenError(f"a DFlash draft exports as export.format=vllm only (served with method=dflash); "
                               f"{fmt} holds EAGLE-3 drafts")
        tensors = {name: t for name, t in tensors.items() if name != "embed_tokens.weight"}
        if config.draft_vocab_size == config.vocab_size:
            tensors.pop("d2t", None)  # vLLM has no draft_id_to_target_id parameter for a full vocabulary
        info = {key: value for key, value in (info or {}).items() if key != "checksums"}
        return config_dict(config, exports.stored_dtype(tensors), info), tensors

    def proposer(self, draft: DFlashDraft) -> DFlashProposer:
        return DFlashProposer(draft)


METHODS = {METHOD: DFlashMethod()}
