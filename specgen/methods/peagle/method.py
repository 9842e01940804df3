"""P-EAGLE's model (the EAGLE-3 layer with a learned mask hidden state), objective, proposer and method (see
`specgen.methods.peagle`)."""

from dataclasses import dataclass

import torch
from torch import nn

from specgen.draft.aux import num_aux_layers
from specgen.draft.loss import (
    TTTOutput,
    predicted_token_mask,
    same_document,
    shift_left,
    soft_cross_entropy,
    step_metrics,
)
from specgen.draft.target_head import TargetDistribution
from specgen.draft.vocab import default_mask_token_id
from specgen.errors import SpecgenError
from specgen.methods.eagle3.method import ChainProposer, EagleMethod
from specgen.methods.eagle3.model import DraftKV, Eagle3Draft


class PEagleDraft(Eagle3Draft):
    """The EAGLE-3 draft plus `mask_hidden` [1, 1, k*H_target], the aux states of every parallel slot
    (speculators' and vLLM's name and layout); `config.mask_token_id` is the slots' token."""

    method_name = "p-eagle"

    def __init__(self, config):
        super().__init__(config)
        self.method_name = "p-eagle"
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, num_aux_layers(config) * config.target_hidden_size))

    def mask_inputs(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mask token ids shaped like `like` [B, n], fc(mask_hidden) [B, n, H]) for parallel slots."""
        ids = torch.full_like(like, int(self.config.mask_token_id))
        hidden = self.project(self.mask_hidden)  # [1, 1, H]
        return ids, hidden.expand(like.shape[0], like.shape[1], -1)


def cod_selection(valid: torch.Tensor, document_ids: torch.Tensor, *, depths: int, ratio: float, ratio_min: float,
                  generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """speculators' COD sampling (peagle/data.py `generate_cod_sample_indices`) on one flattened row.

    `valid` [N] bool: positions p whose prediction is scored (p = index + depth); returns, per depth d, an [N] bool
    mask over the anchor indices a = p - d kept at depth d (depth 0: all). The random draws are speculators' own,
    in the same order, so with the same RNG state and no candidate crossing a document both select the same
    elements; specgen additionally drops candidates whose anchor lies in another document (or before 0).
    """
    n = valid.shape[0]
    keep = [torch.ones(n, dtype=torch.bool, device=valid.device)]
    all_valid = torch.where(valid)[0]
    previous = all_valid[all_valid >= 1]
    previous = previous[document_ids[previous] == document_ids[previous - 1]]
    for depth in range(1, depths):
        size = int(max(0, all_valid.shape[0] - depth) * max(ratio ** depth, ratio_min))
        if size <= 0:
            break
        if previous.shape[0] >= size:
            chosen = previous[torch.randperm(previous.shape[0], generator=generator, device=valid.device)[:size]]
            chosen = torch.sort(chosen)[0]
        else:
            chosen = previous
        mask = torch.zeros(n, dtype=torch.bool, device=valid.device)
        mask[chosen - depth] = True
        keep.append(mask)
        candidates = (chosen + 1) % n
        candidates = candidates[(candidates != 0) & valid[candidates]]
        previous = candidates[document_ids[candidates] == document_ids[candidates - (depth + 1)]]
    return keep + [torch.zeros(n, dtype=torch.bool, device=valid.device)] * (depths - len(keep))


def peagle_forward(draft: PEagleDraft, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                   aux_hidden_states: torch.Tensor, target: TargetDistribution, *, depths: int, mask_shift: int = 2,
                   drop_out_of_vocab: bool = True, position_ids: torch.Tensor | None = None,
                   document_ids: torch.Tensor | None = None,
                   selection: list[torch.Tensor] | None = None) -> TTTOutput:
    """Unroll the parallel slots for `depths` depths over a batch (as `ttt_forward`; module docstring) and score
    them. `selection[d]` [B, T] bool keeps depth d's elements at those indices in the loss (COD); None: all.
    stats rows are TTT's (`specgen.methods.eagle3.ttt`): acc_d and the chain of leading right depths are those vLLM's
    parallel drafting would accept."""
    seq_len = input_ids.shape[1]
    if position_ids is None:
        position_ids = torch.arange(seq_len, device=input_ids.device).expand(input_ids.shape[0], -1)
    if document_ids is None:
        document_ids = torch.zeros_like(input_ids)
    kv = DraftKV(document_ids=document_ids)
    stats = torch.zeros(depths, 6, dtype=torch.float64, device=input_ids.device)
    scorable = [predicted_token_mask(loss_mask, depth, mask_shift) & same_document(document_ids, depth, mask_shift)
                for depth in range(depths)]
    chain = scorable[0].clone()
    mask_ids, mask_hidden = draft.mask_inputs(input_ids)
    total, count = draft.fc.weight.sum() * 0, torch.zeros((), device=input_ids.device)
    for depth in range(depths):
        scored = seq_len - 1 - depth
        if scored <= 0:
            break
        if depth == 0:
            out = draft(shift_left(input_ids, 1), draft.project(aux_hidden_states), position_ids, kv, extend_base=True)
        else:
            out = draft(mask_ids, mask_hidden, position_ids + depth, kv, extend_base=False)
        predicted = scorable[depth][:, :scored]
        logits = draft.logits(out[:, :scored][predicted]).float()
        target_argmax = target.argmax[:, 1 + depth:][predicted]
        in_vocab = draft.t2d[target_argmax.clamp(min=0)]
        in_loss = in_vocab if drop_out_of_vocab else torch.ones_like(in_vocab)
        if selection is not None:
            in_loss = in_loss & selection[depth][:, :scored][predicted]
        per_position = soft_cross_entropy(logits, target.probs[:, 1 + depth:][predicted])
        loss_sum = torch.where(in_loss, per_position, 0).sum()
        total, count = total + loss_sum, count + in_loss.sum()
        with torch.no_grad():
            hits = draft.to_target_ids(logits.argmax(-1)) == target_argmax
            right = torch.zeros_like(chain)
            right[:, :scored][predicted] = hits
            chain &= right
            stats[depth] = torch.stack([loss_sum.detach().double(), in_loss.sum().double(), hits.sum().double(),
                                        predicted.sum().double(), chain.sum().double(), in_vocab.sum().double()])
    return TTTOutput(loss=total / count.clamp(min=1), stats=stats)


class PEagleObjective(nn.Module):
    """The draft and its P-EAGLE loss as one module (the trainer's objective interface, as `TTTObjective`)."""

    def __init__(self, draft: PEagleDraft, *, depths: int, mask_shift: int, drop_out_of_vocab: bool,
                 cod_ratio: float | None, cod_ratio_min: float, seed: int):
        super().__init__()
        self.draft = draft
        self.depths, self.mask_shift, self.drop_out_of_vocab = depths, mask_shift, drop_out_of_vocab
        self.cod_ratio, self.cod_ratio_min, self.seed = cod_ratio, cod_ratio_min, seed

    def selection(self, loss_mask: torch.Tensor, document_ids: torch.Tensor,
                  input_ids: torch.Tensor) -> list[torch.Tensor] | None:
        """COD selection of this batch, from a generator seeded by runtime.seed and the batch's tokens, so a
        resumed run draws what the interrupted one would have."""
        if self.cod_ratio is None:
            return None
        generator = torch.Generator(device=loss_mask.device)
        generator.manual_seed(self.seed * 1_000_003 + int(input_ids.sum()) + input_ids.numel())
        valid = (predicted_token_mask(loss_mask, 0, self.mask_shift) & same_document(document_ids, 0, self.mask_shift))
        keep = cod_selection(valid.flatten(), document_ids.flatten(), depths=self.depths, ratio=self.cod_ratio,
                             ratio_min=self.cod_ratio_min, generator=generator)
        return [mask.view_as(loss_mask) for mask in keep]

    def forward(self, input_ids: torch.Tensor, loss_mask: torch.Tensor, aux_hidden_states: torch.Tensor,
                target_probs: torch.Tensor, target_argmax: torch.Tensor, position_ids: torch.Tensor,
                document_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = peagle_forward(self.draft, input_ids, loss_mask, aux_hidden_states,
                             TargetDistribution(target_probs, target_argmax), depths=self.depths,
                             mask_shift=self.mask_shift, drop_out_of_vocab=self.drop_out_of_vocab,
                             position_ids=position_ids, document_ids=document_ids,
                             selection=self.selection(loss_mask, document_ids, input_ids))
        return out.loss, out.stats


class PEagleProposer(ChainProposer):
    """vLLM's parallel drafting: draft 0 from the bonus slot, drafts 1..K-1 from the mask slots (module docstring)."""

    def next_input(self, step: int, drafted: list[int], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.draft.mask_inputs(torch.zeros(1, 1, dtype=torch.long, device=self.device))


@dataclass(frozen=True)
class PEagleMethod(EagleMethod):
    model_class: type = PEagleDraft

    def build_config(self, target_config, *, aux_layers, draft_vocab_size, draft):
        config = super().build_config(target_config, aux_layers=aux_layers, draft_vocab_size=draft_vocab_size,
                                      draft=draft)
        mask_token_id = draft.mask_token_id
        config.mask_token_id = int(default_mask_token_id(target_config) if mask_token_id is None else mask_token_id)
        if not 0 <= config.mask_token_id < config.vocab_size:
            raise SpecgenError(f"draft.mask_token_id={config.mask_token_id} is not a token of the target's "
                               f"vocabulary (0..{config.vocab_size - 1})")
        config.parallel_drafting = True
        return config

    def objective(self, model, *, train, draft, seed: int, mask_shift: int) -> nn.Module:
        return PEagleObjective(model, depths=train.ttt_length, mask_shift=mask_shift,
                               drop_out_of_vocab=train.out_of_vocab == "drop", cod_ratio=train.cod_ratio,
                               cod_ratio_min=train.cod_ratio_min, seed=seed)

    def metrics(self, stats: torch.Tensor, *, train, draft) -> dict[str, float]:
        """TTT's metrics (acc_d, cacc_d, accept_len_sim: what parallel drafting would accept), and the loss
        actually optimised: one mean over every scored element."""
        metrics = step_metrics(stats, 1.0)
        stats = stats.double().cpu()
        metrics["loss"] = float(stats[:, 0].sum() / stats[:, 1].sum().clamp(min=1))
        return metrics

    def proposer(self, draft: PEagleDraft) -> PEagleProposer:
        return PEagleProposer(draft)


METHODS = {"p-eagle": PEagleMethod("p-eagle")}
