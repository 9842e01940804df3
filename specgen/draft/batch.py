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
    # [N, 3] long, on the host: each sample's index in its dataset, its row and first column in the batch; None
    # where samples have no lasting identity (online): what `ArgmaxCache` keys on
    samples: torch.Tensor | None = None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The per-token tensors and `lengths`, in field order (what moves to the device)."""
        return (self.input_ids, self.loss_mask, self.aux_hidden_states, self.last_hidden_state, self.lengths,
                self.position_ids, self.document_ids)

    def to(self, device: torch.device | str) -> "DraftBatch":
        return DraftBatch(*(t.to(device, non_blocking=True) for t in self.tensors()), samples=self.samples)

    def pin_memory(self) -> "DraftBatch":
        """Page-locked copies, which the DataLoader's `pin_memory=True` (CUDA) asks for, so that `to(device)`
        overlaps the copy with the work before it (without this method the loader left the batch as it was)."""
        return DraftBatch(*(t.pin_memory() for t in self.tensors()), samples=self.samples)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())


def collate(rows: list[dict], pad_id: int = 0, packed: bool = False) -> DraftBatch:
    """Per-sample dicts (`input_ids`, `loss_mask`, `aux_hidden_states`, `last_hidden_state`, and `sample_index` where
    the samples come from a dataset) -> one batch: one right-padded row per sample, or (`packed`) all samples end
    to end in a single row."""
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
    samples = []
    for b, group in enumerate(groups):
        start = 0
        for row in group:
            n = len(row["input_ids"])
            samples.append((row.get("sample_index", -1), b, start))
            span = slice(start, start + n)
            input_ids[b, span] = torch.as_tensor(row["input_ids"])
            loss_mask[b, span] = torch.as_tensor(row["loss_mask"])
            position_ids[b, span] = torch.arange(n)
            document_ids[b, span] = document
            aux[b, span] = row["aux_hidden_states"]
            last[b, span] = row["last_hidden_state"]
            start += n
            document += 1
    identified = all("sample_index" in row for row in rows)
    return DraftBatch(input_ids, loss_mask, aux, last, lengths, position_ids, document_ids,
                      samples=torch.tensor(samples, dtype=torch.long) if identified else None)


def batch_target(head: TargetHead, batch: DraftBatch, mask_shift: int = 2) -> TargetDistribution:
    """The target distributions one batch needs (the positions scored steps read, see target_positions_needed);
    the full-vocabulary argmax from the head's `ArgmaxCache` where it has one and the batch's samples are known."""
    needed = target_positions_needed(batch.loss_mask, mask_shift)
    if head.argmax_cache is None or batch.samples is None:
        return head.distribution(batch.last_hidden_state, needed)
    return head.distribution(batch.last_hidden_state, needed, argmax=cached_argmax(head, batch, mask_shift))


def cached_argmax(head: TargetHead, batch: DraftBatch, mask_shift: int = 2) -> torch.Tensor:
    """[B, T] (host) the target's full-vocabulary argmax wherever a batch can need it, -1 elsewhere. A sample the
    head's cache does not know yet is computed whole (`TargetHead.sample_argmax`): the positions its own loss mask
    needs, and its last `mask_shift - 1`, which a packed neighbour's loss mask can ask for. The loss mask comes to
    the host, the new samples' positions are gathered on the device and their argmaxes come back, each in one copy a
    batch (a few device syncs a batch, not a few a sample)."""
    cache = head.argmax_cache
    identified = list(zip(batch.samples.tolist(), batch.lengths.tolist()))
    new = [(sample, row, start, length) for (sample, row, start), length in identified if not cache.known[sample]]
    if new:
        loss_mask = batch.loss_mask.cpu()
        positions, rows = [], []
        for sample, row, start, length in new:
            own = target_positions_needed(loss_mask[row, start:start + length][None], mask_shift)[0]
            own[max(length - (mask_shift - 1), 0):] = True
            positions.append(own.nonzero().squeeze(1))
            rows.append(torch.full_like(positions[-1], row))
        counts = [len(where) for where in positions]
        starts = torch.tensor([start for _, _, start, _ in new]).repeat_interleave(torch.tensor(counts))
        hidden = batch.last_hidden_state[torch.cat(rows), starts + torch.cat(positions)]
        computed = torch.cat([head.sample_argmax(one) for one in hidden.split(counts)]).cpu().split(counts)
        for (sample, _, _, length), where, values in zip(new, positions, computed):
            stored = torch.full((length,), -1, dtype=torch.int32)
            stored[where] = values
            cache.values[cache.span(sample)] = stored
            cache.known[sample] = True
            cache.computed_positions += len(where)
            cache.computed_samples += 1
    cache.reused_samples += len(identified) - len(new)
    argmax = torch.full(batch.input_ids.shape, -1, dtype=torch.long)
    for (sample, row, start), length in identified:
        argmax[row, start:start + length] = cache.values[cache.span(sample)]
    return argmax
