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
`specgen.methods.eagle3.model`), exactly like the j-th drafted token after verifying position i.

Per step: loss_j = mean over valid positions of the cross-entropy between the target distribution (restricted to
the draft vocabulary and renormalised) and the draft's. With `drop_out_of_vocab` (train.out_of_vocab=drop) the
positions whose target argmax lies outside the draft vocabulary are left out of the loss (no draft token can match
there); with `keep` they are scored like the others (speculators'). Either way they count as misses in acc_j.
Total loss = sum_j decay^j loss_j.

Simulated acceptance (what a chain of `ttt_length` drafts would get accepted, greedy): at each index scored by
step 0, the number of leading steps whose argmax equals the target's; accept_len_sim = 1 + its mean. It equals
1 + sum_k prod_{j<=k} cacc_j with the conditional accuracies cacc_j = P(step j right | steps < j right).
"""


import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from specgen.draft.loss import TTTOutput, predicted_token_mask, same_document, shift_left, soft_cross_entropy
from specgen.draft.target_head import TargetDistribution
from specgen.methods.eagle3.model import DraftKV, Eagle3Draft

# Positions a step scores at once (its logits over the draft vocabulary); longer rows score in chunks.
SCORE_CHUNK = 4096


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
    logits = draft.logits(outputs).float()  # [N, Vd]
    per_position = soft_cross_entropy(logits, target_probs.index_select(0, rows))
    return torch.where(in_loss, per_position, 0).sum(), logits.detach().argmax(-1)


class TTTObjective(nn.Module):
    """The draft and its TTT loss as one module, so DDP / DeepSpeed see one forward per micro-step.

    forward(input_ids, loss_mask, aux_hidden_states, target_probs, target_argmax, position_ids, document_ids)
        -> (loss, stats).
    """

    def __init__(self, draft: Eagle3Draft, *, ttt_length: int, decay: float, mask_shift: int,
                 drop_out_of_vocab: bool):
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
