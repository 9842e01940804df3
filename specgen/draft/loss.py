"""What every method's loss shares: the loss-mask shift (`train.loss_mask`), the per-step statistics columns and
the metrics computed from them (acc_j, accept_len_sim); the EAGLE-3 unroll that first used them is
`specgen.methods.eagle3.ttt`."""

from dataclasses import dataclass

import torch


def shift_left(x: torch.Tensor, n: int, fill: int | float = 0) -> torch.Tensor:
    """x[:, n:] padded back to x's length with `fill` (dim 1)."""
    pad = x.new_full((x.shape[0], min(n, x.shape[1]), *x.shape[2:]), fill)
    return torch.cat([x[:, n:], pad], dim=1)


# train.loss_mask -> mask_shift: step j at index i is scored where m[i + mask_shift + j] = 1.
MASK_SHIFTS = {"predicted": 2, "input": 1}


def predicted_token_mask(loss_mask: torch.Tensor, step: int, mask_shift: int = 2) -> torch.Tensor:
    """[B, T] bool: the indices step `step` is scored at; with mask_shift 2 it predicts token i+2+step, a trained
    token; with 1 its input token i+1+step is trained (speculators' convention)."""
    return shift_left(loss_mask, mask_shift + step).bool()


def target_positions_needed(loss_mask: torch.Tensor, mask_shift: int = 2) -> torch.Tensor:
    """[B, T] bool: positions t whose target distribution some step uses (t = i+1+j for a scored step j at i)."""
    return shift_left(loss_mask, mask_shift - 1).bool()


# Columns of the per-step statistics: sums, so they can be added over micro-steps and processes before dividing.
# STAT_VALID: positions in the loss; STAT_IN_VOCAB: positions whose target top token is in the draft vocabulary
# (the only ones a draft can get right; with train.out_of_vocab=drop the two are equal).
# STAT_CHAIN: indices (scored by step 0) where steps 0..j all matched the target's argmax.
STAT_LOSS_SUM, STAT_VALID, STAT_CORRECT, STAT_PREDICTED, STAT_CHAIN, STAT_IN_VOCAB = range(6)


@dataclass
class TTTOutput:
    loss: torch.Tensor  # what backward() runs on: sum_j decay^j * mean cross-entropy of step j
    stats: torch.Tensor  # [ttt_length, 6] float64: loss sum, valid, correct, predicted, chain, in vocab (above)


def same_document(document_ids: torch.Tensor, step: int, mask_shift: int = 2) -> torch.Tensor:
    """[B, T] bool: indices i whose step `step` reads and predicts inside i's own sample (the loss-mask index
    i + mask_shift + step, the farthest it looks at, belongs to the same document). All real indices of a padded
    row qualify up to the end of the sample; in a packed row this keeps a step from scoring the next sample."""
    reach = max(mask_shift, 1) + step
    return (shift_left(document_ids, reach, fill=-1) == document_ids) & (document_ids >= 0)


def soft_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[N]: -sum_v target[n, v] log softmax(logits[n])_v for logits, target [N, V] (the TTT steps' loss per position;
    masked by the caller with `torch.where`, not by indexing, so no masked copies are made). Of the formulations
    timed on the CPU (logsumexp minus a batched dot, F.cross_entropy with soft targets) this plain one was the
    fastest, forward and backward."""
    return -(target * torch.log_softmax(logits, dim=-1)).sum(-1)


def step_metrics(stats: torch.Tensor, decay: float) -> dict[str, float]:
    """loss, loss_j, acc_j, cacc_j and accept_len_sim from summed statistics (accuracy: draft argmax == target
    argmax; cacc_j and accept_len_sim: see the module docstring), and `scored`: the share of step 0's trainable
    positions whose target top token lies in the draft vocabulary (the others no draft token can match)."""
    stats = stats.double().cpu()
    metrics: dict[str, float] = {}
    losses = stats[:, STAT_LOSS_SUM] / stats[:, STAT_VALID].clamp(min=1)
    accuracies = stats[:, STAT_CORRECT] / stats[:, STAT_PREDICTED].clamp(min=1)
    metrics["loss"] = float(sum(decay ** step * loss for step, loss in enumerate(losses)))
    metrics.update({f"loss_{step}": float(loss) for step, loss in enumerate(losses)})
    metrics.update({f"acc_{step}": float(acc) for step, acc in enumerate(accuracies)})
    # Share of the trainable positions a draft can get right: the target's top token is in the draft vocabulary.
    metrics["trainable_positions"] = int(stats[0, STAT_PREDICTED])
    metrics["scored"] = float(stats[0, STAT_IN_VOCAB] / stats[0, STAT_PREDICTED].clamp(min=1))
    chains = torch.cat([stats[:1, STAT_PREDICTED], stats[:, STAT_CHAIN]])  # chain of length 0 is always right
    metrics.update({f"cacc_{step}": float(chains[step + 1] / chains[step].clamp(min=1))
                    for step in range(len(stats))})
    metrics["accept_len_sim"] = float(1 + stats[:, STAT_CHAIN].sum() / chains[0].clamp(min=1))
    return metrics
