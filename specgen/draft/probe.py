"""Acceptance length while training: real greedy speculative decoding of the live draft on a few held-out prompts.

The training loss and the simulated acceptance (`specgen.draft.ttt.step_metrics`) are computed on the training
data's own hidden states; this probe runs the draft as a serving engine would, against the target, on prompts the
draft never saw, and counts acceptance as vLLM does (1 + accepted draft tokens / verification rounds). Each prompt
is its first user turn (with its system prompt); every call decodes the same prompts, so successive figures of one
run are comparable, and the figure of the last call equals `specgen.evaluate`'s on the saved checkpoint with
`evaluate.turns=first` and the same prompts, K and max_new_tokens.
"""

import time

from specgen.data.prompts import Prompt, chat_prompt_ids
from specgen.draft.dflash_serving import dflash_generate
from specgen.draft.model import Eagle3Draft
from specgen.draft.speculative import TargetRunner, speculative_generate
from specgen.errors import SpecgenError


class AcceptanceProbe:
    """`probe(draft)` -> {"accept_len", "accept_rounds", "accept_seconds"} over the prompts' first turns."""

    def __init__(self, target: TargetRunner, tokenizer, prompts: list[Prompt], *, num_draft_tokens: int,
                 max_new_tokens: int, eos_ids: set[int]):
        if not prompts:
            raise SpecgenError("the acceptance probe has no prompt: train.eval_prompts holds no usable row")
        self.target = target
        self.prompt_ids = [chat_prompt_ids(tokenizer, prompt.first_turn_messages()) for prompt in prompts]
        self.num_draft_tokens = num_draft_tokens
        self.max_new_tokens = max_new_tokens
        self.eos_ids = eos_ids

    def __call__(self, draft: Eagle3Draft) -> dict:
        start, rounds, accepted = time.perf_counter(), 0, 0
        training = draft.training
        draft.eval()
        try:
            for ids in self.prompt_ids:
                decode = dflash_generate if getattr(draft, "method", None) == "dflash" else speculative_generate
                generation = decode(self.target, draft, ids, num_draft_tokens=self.num_draft_tokens,
                                    max_new_tokens=self.max_new_tokens, eos_ids=self.eos_ids)
                rounds += generation.verification_rounds
                accepted += sum(generation.accepted)
        finally:
            draft.train(training)
        return {"accept_len": 1 + accepted / max(rounds, 1), "accept_rounds": rounds,
                "accept_seconds": time.perf_counter() - start}
