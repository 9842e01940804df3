"""DFlash's training objective: anchors sampled among trained positions, one block per anchor, KL to the
target's distribution per slot, decayed by slot (see `specgen.methods.dflash`)."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specgen.draft.loss import (
    MASK_SHIFTS,
    STAT_CHAIN,
    STAT_CORRECT,
    STAT_IN_VOCAB,
    STAT_LOSS_SUM,
    STAT_PREDICTED,
    STAT_VALID,
)
from specgen.draft.target_head import TargetDistribution
from specgen.methods.dflash.model import DFlashDraft


def valid_anchors(loss_mask: torch.Tensor, document_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: positions a that may anchor a block: x_a and x_{a+1} are trained tokens of one sample."""
    valid = torch.zeros_like(loss_mask, dtype=torch.bool)
    valid[:, :-1] = (loss_mask[:, :-1] > 0) & (loss_mask[:, 1:] > 0) & (document_ids[:, :-1] == document_ids[:, 1:]) \
        & (document_ids[:, :-1] >= 0)
    return valid


def batch_seed(input_ids: torch.Tensor, seed: int) -> int:
    """A seed fixed by the batch's content and the run's seed: the same batch gets the same anchors after a resume."""
    weights = torch.arange(1, input_ids.numel() + 1, device=input_ids.device, dtype=torch.long)
    return int((input_ids.reshape(-1).long() * weights).sum().item() + 1_000_003 * seed) % (2 ** 63 - 1)


def sample_anchors(valid: torch.Tensor, max_anchors: int,
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `max_anchors` anchors per row, uniformly among the valid positions, in increasing order.
    Returns (anchors [B, A] long, kept [B, A] bool); A = min(max_anchors, most valid positions of a row);
    padding anchors are 0 and not kept."""
    counts = valid.sum(dim=1)
    width = max(1, min(max_anchors, int(counts.max().item()) if counts.numel() else 0))
    noise = torch.rand(valid.shape, generator=generator, device="cpu").to(valid.device)
    noise = noise.masked_fill(~valid, 2.0)
    chosen = noise.argsort(dim=1)[:, :width]
    kept = torch.arange(width, device=valid.device)[None] < counts.clamp(max=width)[:, None]
    sentinel = valid.shape[1]
    anchors = torch.where(kept, chosen, torch.full_like(chosen, sentinel)).sort(dim=1).values
    kept = anchors < sentinel
    return torch.where(kept, anchors, 0), kept


def block_visibility(anchors: torch.Tensor, kept: torch.Tensor, document_ids: torch.Tensor, block_size: int,
                     causal: bool = False) -> torch.Tensor:
    """[B, A*B, T + A*B] bool: slot (anchor a, offset k) sees context entries s < a of a's own sample and the slots
    of its own block (all of them; with `causal` offsets <= k). A padding block sees only its own slots."""
    batch, num_anchors = anchors.shape
    seq_len = document_ids.shape[1]
    slots = num_anchors * block_size
    anchor = anchors.repeat_interleave(block_size, dim=1)  # [B, slots]
    anchor_doc = document_ids.gather(1, anchor)
    keep = kept.repeat_interleave(block_size, dim=1)
    position = torch.arange(seq_len, device=anchors.device)
    context = (position[None, None] < anchor[..., None]) & (document_ids[:, None] == anchor_doc[..., None]) \
        & keep[..., None]
    block = torch.arange(slots, device=anchors.device) // block_size
    offset = torch.arange(slots, device=anchors.device) % block_size
    own = block[:, None] == block[None, :]
    if causal:
        own = own & (offset[None, :] <= offset[:, None])
    return torch.cat([context, own[None].expand(batch, -1, -1)], dim=2)


@dataclass
class DFlashOutput:
    loss: torch.Tensor
    stats: torch.Tensor  # [block_size - 1, 6]: per slot 1..B-1, the columns of specgen.methods.eagle3.ttt (STAT_*)


def slot_weights(block_size: int, gamma: float | None, device=None) -> torch.Tensor:
    """[B] loss weight of each slot: 0 for the anchor slot, exp(-(k-1)/gamma) for slot k >= 1 (1 without gamma)."""
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    weights = torch.exp(-(k - 1).clamp(min=0) / gamma) if gamma else torch.ones(block_size, device=device)
    return weights * (k > 0)


def dflash_loss(draft: DFlashDraft, input_ids: torch.Tensor, loss_mask: torch.Tensor, aux_hidden_states: torch.Tensor,
                target: TargetDistribution, *, anchors: torch.Tensor, kept: torch.Tensor, gamma: float | None,
                position_ids: torch.Tensor | None = None, document_ids: torch.Tensor | None = None,
                drop_out_of_vocab: bool = True) -> DFlashOutput:
    """The DFlash training loss of one batch for the given anchors (see the module docstring)."""
    batch, seq_len = input_ids.shape
    size = draft.block_size
    device = input_ids.device
    if position_ids is None:
        position_ids = torch.arange(seq_len, device=device).expand(batch, -1)
    if document_ids is None:
        document_ids = torch.zeros_like(input_ids)
    num_anchors = anchors.shape[1]
    offsets = torch.arange(size, device=device)
    slot_index = anchors[..., None] + offsets  # [B, A, size]: the sequence index each slot stands for
    in_row = slot_index < seq_len
    safe = slot_index.clamp(max=seq_len - 1).reshape(batch, -1)
    anchor_doc = document_ids.gather(1, anchors)
    scored = (kept[..., None] & in_row & (offsets > 0)
              & (document_ids.gather(1, safe).view(batch, num_anchors, size) == anchor_doc[..., None])
              & (loss_mask.gather(1, safe).view(batch, num_anchors, size) > 0))

    block_ids = torch.full((batch, num_anchors, size), draft.mask_token_id, dtype=torch.long, device=device)
    block_ids[..., 0] = torch.where(kept, input_ids.gather(1, anchors), draft.mask_token_id)
    anchor_positions = position_ids.gather(1, anchors)
    block_positions = (anchor_positions[..., None] + offsets).reshape(batch, -1)
    visible = block_visibility(anchors, kept, document_ids, size, causal=draft.causal)
    context = draft.context_kv(aux_hidden_states, position_ids)
    hidden = draft(block_ids.reshape(batch, -1), block_positions, context, visible).view(batch, num_anchors, size, -1)

    # Slot k stands for token a+k; its target is the distribution at a+k-1 (which predicts token a+k).
    target_index = (slot_index - 1).clamp(min=0, max=seq_len - 1).reshape(batch, -1)
    picked = scored.reshape(batch, -1)
    slot_of = offsets.expand(batch, num_anchors, size).reshape(batch, -1)[picked]
    log_probs = F.log_softmax(draft.logits(hidden.reshape(batch, -1, hidden.shape[-1])[picked]).float(), dim=-1)
    rows = torch.arange(batch, device=device)[:, None].expand(-1, num_anchors * size)[picked]
    target_probs = target.probs[rows, target_index[picked]]
    target_argmax = target.argmax[rows, target_index[picked]]
    in_vocab = draft.t2d[target_argmax.clamp(min=0)]
    in_loss = in_vocab if drop_out_of_vocab else torch.ones_like(in_vocab)
    kl = (torch.xlogy(target_probs, target_probs) - target_probs * log_probs).sum(-1)  # KL(target || draft)
    weights = slot_weights(size, gamma, device)[slot_of]
    count = in_loss.sum()
    loss = (kl * weights * in_loss).sum() / count.clamp(min=1)
    if not picked.any():
        loss = loss + draft.fc.weight.sum() * 0  # nothing scored: a zero loss that still reaches the weights
    stats = _slot_stats(draft, scored, slot_of, kl.detach(), in_loss, in_vocab, log_probs.detach(), target_argmax)
    return DFlashOutput(loss=loss, stats=stats)


def _slot_stats(draft: DFlashDraft, scored: torch.Tensor, slot_of: torch.Tensor, kl: torch.Tensor,
                in_loss: torch.Tensor, in_vocab: torch.Tensor, log_probs: torch.Tensor,
                target_argmax: torch.Tensor) -> torch.Tensor:
    """Per slot 1..B-1 the sums of specgen.methods.eagle3.ttt's STAT_* columns: `chain` counts blocks whose slots 1..k were
    all right among the blocks scored at slot 1, so accept_len_sim is a block's simulated acceptance."""
    size = draft.block_size
    stats = torch.zeros(size - 1, 6, dtype=torch.float64, device=scored.device)
    with torch.no_grad():
        hits = draft.to_target_ids(log_probs.argmax(-1)) == target_argmax
        right = torch.zeros_like(scored)
        right[scored] = hits
        chain = scored[..., 1].clone()
        for k in range(1, size):
            at = slot_of == k
            chain &= right[..., k]
            stats[k - 1, STAT_LOSS_SUM] = (kl * in_loss)[at].sum().double()
            stats[k - 1, STAT_VALID] = in_loss[at].sum().double()
            stats[k - 1, STAT_CORRECT] = hits[at].sum().double()
            stats[k - 1, STAT_PREDICTED] = at.sum().double()
            stats[k - 1, STAT_CHAIN] = chain.sum().double()
            stats[k - 1, STAT_IN_VOCAB] = in_vocab[at].sum().double()
    return stats


class DFlashObjective(nn.Module):
    """The draft and its loss as one module, with the trainer's forward signature (`TTTObjective`'s):
    forward(input_ids, loss_mask, aux_hidden_states, target_probs, target_argmax, position_ids, document_ids)
    -> (loss, stats). Anchors are drawn with a generator seeded by (seed, the batch's content). Slot k is scored
    where its own token is trained, so the trainer computes the target at the positions of train.loss_mask=predicted
    whatever train.loss_mask says (`mask_shift`)."""

    mask_shift = MASK_SHIFTS["predicted"]

    def __init__(self, draft: DFlashDraft, *, max_anchors: int, gamma: float | None, seed: int,
                 drop_out_of_vocab: bool):
        super().__init__()
        self.draft = draft
        self.max_anchors = max_anchors
        self.gamma = gamma
        self.seed = seed
        self.drop_out_of_vocab = drop_out_of_vocab

    def forward(self, input_ids, loss_mask, aux_hidden_states, target_probs, target_argmax, position_ids,
                document_ids):
        generator = torch.Generator().manual_seed(batch_seed(input_ids, self.seed))
        anchors, kept = sample_anchors(valid_anchors(loss_mask, document_ids), self.max_anchors, generator)
        out = dflash_loss(self.draft, input_ids, loss_mask, aux_hidden_states,
                          TargetDistribution(target_probs, target_argmax), anchors=anchors, kept=kept,
                          gamma=self.gamma, position_ids=position_ids, document_ids=document_ids,
                          drop_out_of_vocab=self.drop_out_of_vocab)
        return out.loss, out.stats
