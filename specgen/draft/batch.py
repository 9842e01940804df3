"""The draft's training batch: samples with the target's hidden states, right-padded or packed, for every method."""

from dataclasses import dataclass

import torch

from specgen.draft.loss import target_positions_needed
from specgen.draft.target_head import TargetDistribution, TargetHead


@dataclass
class DraftBatch:
    """A batch of samples with the target's hidden states: right-padded rows, or packed rows (several samples end
    to end in one row, `train.packing`). `document_ids` says which sample each token belongs to (-1: padding);
    the draft attends, and is scored, within one sample only. `position_ids` count from 0 in every sample."""

    input_ids: torch.Tensor  # [B, T] long
    loss_mask: torch.Tensor  # [B, T] long 0/1 (0 on padding)
    aux_hidden_states: torch.Tensor  # [B, T, k*H]
    last_hidden_state: torch.Tensor  # [B, T, H], post-norm
    lengths: torch.Tensor  # [N] the N samples' lengths
    position_ids: torch.Tensor  # [B, T] long
    document_ids: torch.Tensor  # [B, T] long, -1 on padding

    def to(self, device: torch.device | str) -> "DraftBatch":
        return DraftBatch(*(t.to(device, non_blocking=True) for t in (
            self.input_ids, self.loss_mask, self.aux_hidden_states, self.last_hidden_state, self.lengths,
            self.position_ids, self.document_ids)))

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())


def collate(rows: list[dict], pad_id: int = 0, packed: bool = False) -> DraftBatch:
    """Per-sample dicts (`input_ids`, `loss_mask`, `aux_hidden_states`, `last_hidden_state`) -> one batch: one
    right-padded row per sample, or (`packed`) all samples end to end in a single row."""
    lengths = torch.tensor([len(row["input_ids"]) for row in rows])
    groups = [rows] if packed else [[row] for row in rows]
    width = int(lengths.sum()) if packed else int(lengths.max())
    first = rows[0]
    input_ids = torch.full((len(groups), width), pad_id, dtype=torch.long)
    loss_mask = torch.zeros(len(groups), width, dtype=torch.long)
    position_ids = torch.zeros(len(groups), width, dtype=torch.long)
    document_ids = torch.full((len(groups), width), -1, dtype=torch.long)
    aux = first["aux_hidden_states"].new_zeros(len(groups), width, first["aux_hidden_states"].shape[-1])
    last = first["last_hidden_state"].new_zeros(len(groups), width, first["last_hidden_state"].shape[-1])
    document = 0
    for b, group in enumerate(groups):
        start = 0
        for row in group:
            n = len(row["input_ids"])
            span = slice(start, start + n)
            input_ids[b, span] = torch.as_tensor(row["input_ids"])
            loss_mask[b, span] = torch.as_tensor(row["loss_mask"])
            position_ids[b, span] = torch.arange(n)
            document_ids[b, span] = document
            aux[b, span] = row["aux_hidden_states"]
            last[b, span] = row["last_hidden_state"]
            start += n
            document += 1
    return DraftBatch(input_ids, loss_mask, aux, last, lengths, position_ids, document_ids)


def batch_target(head: TargetHead, batch: DraftBatch, mask_shift: int = 2) -> TargetDistribution:
    """The target distributions one batch needs (the positions scored steps read, see target_positions_needed)."""
    return head.distribution(batch.last_hidden_state, target_positions_needed(batch.loss_mask, mask_shift))
