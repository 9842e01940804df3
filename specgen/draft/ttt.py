"""Training-time test (TTT): unroll the draft as it runs when serving, and score every step against the target.

Alignment (index i of a sequence x[0..T-1] with target hidden states h and loss mask m):

    step 0 at index i reads  token x[i+1]  and the target's fused hidden state h[i]
    step j at index i reads  token x[i+1+j] and the draft's own step j-1 output at index i
    step j at index i predicts token x[i+2+j]; its target is the target's distribution at position i+1+j,
                         lm_head(last_hidden_state[i+1+j]), i.e. "position t predicts token t+1" with t = i+1+j
    step j at index i is trained only where m[i+2+j] = 1: the token being predicted is one the data trains

The mask therefore shifts together with the tokens, two places for step 0 and one more per step (`mask_shift=2`,
the default). speculators masks with m[i+1+j] instead (`mask_shift=1`: the step's input token is trained), which
also trains the prediction of the token after a reply and skips that of a reply's first token. (Masking with
m[i], as some tools do, trains on predictions of prompt tokens and skips the first two of every reply.)
Step j at index i sits at position i+j and attends to the base entries 0..i and its own chain (see
`specgen.draft.model`), exactly like the j-th drafted token after verifying position i.

Per step: loss_j = mean over valid positions of the cross-entropy between the target distribution (restricted to
the draft vocabulary and renormalised) and the draft's. With `drop_out_of_vocab` (train.out_of_vocab=drop) the
positions whose target argmax lies outside the draft vocabulary are left out of the loss (no draft token can match
there); with `keep` they are scored like the others (speculators'). Either way they count as misses in acc_j.
Total loss = sum_j decay^j loss_j.

Simulated acceptance (what a chain of `ttt_length` drafts would get accepted, greedy): at each index scored by
step 0, the number of leading steps whose argmax equals the target's; accept_len_sim = 1 + its mean. It equals
1 + sum_k prod_{j<=k} cacc_j with the conditional accuracies cacc_j = P(step j right | steps < j right).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from specgen.draft.model import DraftKV, Eagle3Draft
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


def shift_left(x: torch.Tensor, n: int, fill: int | float = 0) -> torch.Tensor:
    """x[:, n:] padded back to x's length with `fill` (dim 1)."""
    pad = x.new_full((x.shape[0], min(n, x.shape[1]), *x.shape[2:]), fill)
    return torch.cat([x[:, n:], pad], dim=1)


# Positions a step scores at once (its logits over the draft vocabulary); longer rows score in chunks.
SCORE_CHUNK = 4096

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


def ttt_forward(draft: Eagle3Draft, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                aux_hidden_states: torch.Tensor, target: TargetDistribution, *, ttt_length: int,
                decay: float, mask_shift: int = 2, drop_out_of_vocab: bool = True,
                position_ids: torch.Tensor | None = None, document_ids: torch.Tensor | None = None) -> TTTOutput:
    """Unroll the draft for `ttt_length` steps over a batch (padded or packed, see `DraftBatch`; without
    position and document ids: one sample per row, from position 0) and score it against the target."""
    seq_len = input_ids.shape[1]
    if position_ids is None:
        position_ids = torch.arange(seq_len, device=input_ids.device).expand(input_ids.shape[0], -1)
    if document_ids is None:
        document_ids = torch.zeros_like(input_ids)
    hidden = draft.project(aux_hidden_states)
    kv = DraftKV(document_ids=document_ids)
    losses, stats = [], torch.zeros(ttt_length, 6, dtype=torch.float64, device=input_ids.device)
    scorable = [predicted_token_mask(loss_mask, step, mask_shift) & same_document(document_ids, step, mask_shift)
                for step in range(ttt_length)]
    chain = scorable[0].clone()  # indices whose chain is still all right
    flat_probs = target.probs.reshape(-1, target.probs.shape[-1])  # [B*T, Vd]
    flat_index = torch.arange(flat_probs.shape[0], device=input_ids.device).view(input_ids.shape)
    for step in range(ttt_length):
        scored = seq_len - 1 - step  # indices whose target position i+1+step lies inside the sequence
        if scored <= 0:
            break
        hidden = draft(shift_left(input_ids, 1 + step), hidden, position_ids + step, kv, extend_base=step == 0)
        # Only positions whose predicted token is trained are scored (and only they need the LM head).
        predicted = scorable[step][:, :scored]
        target_argmax = target.argmax[:, 1 + step:][predicted]
        in_vocab = draft.t2d[target_argmax.clamp(min=0)]
        in_loss = in_vocab if drop_out_of_vocab else torch.ones_like(in_vocab)
        rows = flat_index[:, 1 + step:][predicted]  # where each scored index's target sits in target.probs
        loss_sum, guesses = score_positions(draft, hidden[:, :scored][predicted], flat_probs, rows, in_loss)
        valid = in_loss.sum()
        losses.append(loss_sum / valid.clamp(min=1) * decay ** step)
        with torch.no_grad():
            hits = draft.to_target_ids(guesses) == target_argmax
            right = torch.zeros_like(chain)
            right[:, :scored][predicted] = hits
            chain &= right
            stats[step] = torch.stack([loss_sum.detach().double(), valid.double(), hits.sum().double(),
                                       predicted.sum().double(), chain.sum().double(), in_vocab.sum().double()])
    # A batch of 1-token samples scores nothing; its zero loss still touches the weights so backward() works.
    loss = torch.stack(losses).sum() if losses else draft.fc.weight.sum() * 0
    return TTTOutput(loss=loss, stats=stats)


def score_positions(draft: Eagle3Draft, outputs: torch.Tensor, target_probs: torch.Tensor, rows: torch.Tensor,
                    in_loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy sum against the target over the positions `in_loss` marks, and the draft's guesses (draft
    ids) at all of them: outputs [N, H] (a step's outputs), target_probs [M, Vd] with each output's target at row
    `rows` [N], in_loss [N] bool.

    Above SCORE_CHUNK positions (long rows) this runs a chunk of positions at a time, recomputed in backward
    (`torch.utils.checkpoint`), so no [N, Vd] logits, log-probabilities or target copies are kept per step.
    """
    if outputs.shape[0] <= SCORE_CHUNK:
        return _score(draft, outputs, target_probs, rows, in_loss)
    sums, guesses = [], []
    for lo in range(0, outputs.shape[0], SCORE_CHUNK):
        part = (outputs[lo:lo + SCORE_CHUNK], target_probs, rows[lo:lo + SCORE_CHUNK], in_loss[lo:lo + SCORE_CHUNK])
        loss_sum, guess = (checkpoint(_score, draft, *part, use_reentrant=False) if torch.is_grad_enabled()
                           else _score(draft, *part))
        sums.append(loss_sum)
        guesses.append(guess)
    return torch.stack(sums).sum(), torch.cat(guesses)


def _score(draft: Eagle3Draft, outputs: torch.Tensor, target_probs: torch.Tensor, rows: torch.Tensor,
           in_loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    log_probs = F.log_softmax(draft.logits(outputs).float(), dim=-1)  # [N, Vd]
    return -(target_probs[rows[in_loss]] * log_probs[in_loss]).sum(), log_probs.detach().argmax(-1)


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


class TTTObjective(nn.Module):
    """The draft and its TTT loss as one module, so DDP / DeepSpeed see one forward per micro-step.

    forward(input_ids, loss_mask, aux_hidden_states, target_probs, target_argmax, position_ids, document_ids)
        -> (loss, stats).
    """

    def __init__(self, draft: Eagle3Draft, *, ttt_length: int, decay: float, mask_shift: int = 2,
                 drop_out_of_vocab: bool = True):
        super().__init__()
        self.draft = draft
        self.ttt_length = ttt_length
        self.decay = decay
        self.mask_shift = mask_shift
        self.drop_out_of_vocab = drop_out_of_vocab

    def forward(self, input_ids: torch.Tensor, loss_mask: torch.Tensor, aux_hidden_states: torch.Tensor,
                target_probs: torch.Tensor, target_argmax: torch.Tensor, position_ids: torch.Tensor,
                document_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = ttt_forward(self.draft, input_ids, loss_mask, aux_hidden_states,
                          TargetDistribution(target_probs, target_argmax), ttt_length=self.ttt_length,
                          decay=self.decay, mask_shift=self.mask_shift, drop_out_of_vocab=self.drop_out_of_vocab,
                          position_ids=position_ids, document_ids=document_ids)
        return out.loss, out.stats


def batch_target(head: TargetHead, batch: DraftBatch, mask_shift: int = 2) -> TargetDistribution:
    """The target distributions one batch needs (the positions scored steps read, see target_positions_needed)."""
    return head.distribution(batch.last_hidden_state, target_positions_needed(batch.loss_mask, mask_shift))
