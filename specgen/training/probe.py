"""Held-out figures while training: real greedy speculative decoding of the live draft on a few held-out prompts
(`AcceptanceProbe`), and the training step's own metrics on samples kept out of training (`HeldoutScore`).

The training loss and the simulated acceptance (`specgen.draft.loss.step_metrics`) are computed on the training
data's own hidden states; this probe runs the draft as a serving engine would, against the target, on prompts the
draft never saw, and counts acceptance as vLLM does (1 + accepted draft tokens / verification rounds). Each prompt
is its first user turn (with its system prompt); every call decodes the same prompts, so successive figures of one
run are comparable, and the figure of the last call equals `specgen.evaluate`'s on the saved checkpoint with
`evaluate.turns=first` and the same prompts, K and max_new_tokens.
"""

import re
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from specgen.data.prompts import Prompt, chat_prompt_ids
from specgen.draft.speculative import (
    TargetRunner,
    replayed_greedy,
    speculative_generate,
)
from specgen.draft.target_head import TargetHead
from specgen.errors import SpecgenError
from specgen.training.trainer import forward_batch

HELDOUT_SEED = 0  # the held-out samples do not depend on runtime.seed, so every seed of a run scores the same ones


def prompt_key(sample_id: str) -> str:
    """The prompt a sample was made from: its id without the `#k` of a per-turn row (`data.turns=each`). Replies
    regenerated from one prompt keep its id, so pooled replies (`data.path=[reply0,reply1]`) share a key."""
    return re.sub(r"#\d+$", "", sample_id)


def heldout_split(sample_ids: Sequence[str], heldout: int) -> tuple[list[int], list[int]]:
    """(training indices, held-out indices): whole prompts, drawn by a fixed seed, until at least `heldout` samples
    are held out; the rest kept in order. Every sample of a held-out prompt (`prompt_key`) is held out, so no reply
    or turn of it is trained on; with one sample per prompt this is exactly `heldout` samples."""
    if heldout <= 0:
        return list(range(len(sample_ids))), []
    groups: dict[str, list[int]] = {}
    for index, sample_id in enumerate(sample_ids):
        groups.setdefault(prompt_key(sample_id), []).append(index)
    order = list(groups.values())
    held: list[int] = []
    for group in torch.randperm(len(order), generator=torch.Generator().manual_seed(HELDOUT_SEED)).tolist():
        if len(held) >= heldout:
            break
        held.extend(order[group])
    if len(held) >= len(sample_ids):
        raise SpecgenError(f"train.heldout_samples={heldout} leaves nothing to train on {len(sample_ids)} samples "
                           f"of {len(order)} prompts; hold out fewer")
    kept = set(held)
    return [i for i in range(len(sample_ids)) if i not in kept], sorted(held)


class AcceptanceProbe:
    """`probe(draft)` -> {"accept_len", "accept_rounds", "accept_seconds", "accept_lossless"} over the prompts' first
    turns. accept_lossless is the share of prompts whose output equals the target's greedy choices replayed in the
    decoding's own forward shapes (`replayed_greedy`, evaluate.reference=replay): exact in any dtype, so 1.0 unless
    the decoding is broken; it costs one target forward per round more."""

    def __init__(self, target: TargetRunner, tokenizer, prompts: list[Prompt], *, num_draft_tokens: int,
                 max_new_tokens: int, eos_ids: set[int]):
        if not prompts:
            raise SpecgenError("the acceptance probe has no prompt: train.eval_prompts holds no usable row")
        self.target = target
        self.prompt_ids = [chat_prompt_ids(tokenizer, prompt.first_turn_messages()) for prompt in prompts]
        self.num_draft_tokens = num_draft_tokens
        self.max_new_tokens = max_new_tokens
        self.eos_ids = eos_ids

    def __call__(self, draft: nn.Module) -> dict:
        start, rounds, accepted, lossless = time.perf_counter(), 0, 0, 0
        training = draft.training
        draft.eval()
        try:
            for ids in self.prompt_ids:
                generation = speculative_generate(self.target, draft, ids, num_draft_tokens=self.num_draft_tokens,
                                                  max_new_tokens=self.max_new_tokens, eos_ids=self.eos_ids)
                rounds += generation.verification_rounds
                accepted += sum(generation.accepted)
                replayed = replayed_greedy(self.target, ids, generation.drafted, max_new_tokens=self.max_new_tokens,
                                           eos_ids=self.eos_ids)
                lossless += replayed.tokens == generation.tokens
        finally:
            draft.train(training)
        return {"accept_len": 1 + accepted / max(rounds, 1), "accept_rounds": rounds,
                "accept_seconds": time.perf_counter() - start, "accept_lossless": lossless / len(self.prompt_ids)}


class HeldoutScore:
    """Called with no argument: the method's training metrics (loss, acc_j, accept_len_sim, ...) of the live draft
    on samples kept out of training, each key prefixed `heldout_`. The same objective, target distributions and
    autocast as a training step (`specgen.training.trainer.forward_batch`), without gradients, on the unwrapped
    objective (main process only, as the acceptance probe).

    The training metrics are in-sample: after a few epochs over a small corpus a draft can score much higher there
    than on anything else (SmolLM2-135M, 999 samples, 4 epochs: step-0 accuracy 0.63 on its training samples,
    0.38 on held-out ones). These figures are what it learned to generalise."""

    def __init__(self, objective: torch.nn.Module, head: TargetHead, batches: Callable[[], Sequence],
                 metrics: Callable[[torch.Tensor], dict], *, mask_shift: int, device: torch.device,
                 autocast_dtype: torch.dtype | None = None):
        self.objective, self.head, self.batches, self.metrics = objective, head, batches, metrics
        self.mask_shift, self.device, self.autocast_dtype = mask_shift, device, autocast_dtype

    @torch.no_grad()
    def __call__(self) -> dict:
        training = self.objective.training
        self.objective.eval()
        total = None
        try:
            for batch in self.batches():
                _, stats = forward_batch(self.objective, self.head, batch, device=self.device,
                                         mask_shift=self.mask_shift, autocast_dtype=self.autocast_dtype)
                total = stats.detach() if total is None else total + stats.detach()
        finally:
            self.objective.train(training)
        if total is None:
            return {}
        return {f"heldout_{key}": value for key, value in self.metrics(total).items()}
