"""Batched generation on vLLM (`engine=vllm` for `specgen.regenerate`): the engine batches and schedules itself.

Same contract as `specgen.regen.engine.Generator`: `submit` queues a request, `collect` returns `Completion`s, their
token ids exactly as the engine generated them (never re-tokenised from text), cut at the first stop token. The
sampling settings are exactly `Sampling` (the checkpoint's generation_config only names the stop tokens).

Requests are continuously batched: `collect` steps the engine only until some request finishes, so the regenerator
submits that conversation's next turn while the others decode, instead of waiting for the slowest turn of a depth.
Each request carries its own sampling seed, derived from the part's seed and the request's source row, message and
draw (`ConversationRegenerator`), so its seed does not depend on the schedule, on the other rows or on the process
that made the part (its text can, where vLLM's logits differ by float rounding between batch shapes and a near-flat
distribution samples differently). vLLM is imported lazily.

On vLLM's CPU build, sampled generation turns chunked prefill off (`CHUNKED_PREFILL_OFF`): when a prompt's prefill
is split over steps, its worker rewinds the request's seeded generator (`set_offset`), which a CPU generator refuses
("CPU Generator does not use offset"), killing the engine once a part's prompts exceed one step's token budget.
Each prompt then prefills in one step (vLLM keeps max_num_batched_tokens >= max_model_len): a scheduling setting,
the same prompts, seeds and sampling. Measured: SmolLM2-135M, 64 rows of its prompt mix sampled at 0.7, 53 new
tokens/s on 2 cores, 1.13x the same engine driven depth by depth with the same text (`benchmarks/regenerate.py`).
"""

import logging
from collections.abc import Callable
from pathlib import Path

from specgen.errors import SpecgenError
from specgen.regen.engine import Completion, Sampling, stop_token_ids
from specgen.runtime.reaper import guard_job

log = logging.getLogger(__name__)
SEEDING = "each request seeded with derived_seed(unit_seed(seed, part index), source row, message, draw), so a " \
          "turn's seed does not depend on which process made the part, on the other rows or on the engine's schedule"
CHUNKED_PREFILL_OFF = "chunked prefill off (vLLM's CPU worker cannot rewind a seeded request's generator)"


def cpu_seeded_kwargs(sampling: Sampling, engine_args: dict) -> dict:
    """`enable_chunked_prefill=False` where vLLM runs on a CPU and requests carry seeds, unless engine.extra sets it."""
    from vllm.platforms import current_platform

    if sampling.greedy or not current_platform.is_cpu() or "enable_chunked_prefill" in engine_args:
        return {}
    return {"enable_chunked_prefill": False}


class VllmGenerator:
    """Complete many prompts with one vLLM engine (continuous batching; `engine.*` are its settings)."""

    backend = "vllm: continuous batching; token ids taken from the engine"
    seeding = SEEDING

    def __init__(self, path: str | Path, model, tokenizer, sampling: Sampling, *, engine: dict, max_model_len: int,
                 seed: int = 0):
        from specgen.capture.vllm import engine_kwargs, prepare_environment, require_vllm

        require_vllm()
        prepare_environment(engine)
        guard_job()  # vLLM's engine core and workers end with this process, even after kill -9
        from vllm import LLM

        self.sampling = sampling
        self.stop_token_ids = stop_token_ids(model, tokenizer)
        kwargs = engine_kwargs(engine)
        workaround = cpu_seeded_kwargs(sampling, kwargs)
        if workaround:  # scheduling only, so not part of the dataset's identity
            log.warning("regenerate with vLLM on a CPU, sampled: %s", CHUNKED_PREFILL_OFF)
        self.llm = LLM(model=str(path), dtype=str(model.dtype).removeprefix("torch."), max_model_len=max_model_len,
                       seed=seed, generation_config="vllm", **kwargs, **workaround)
        self.engine = self.llm.llm_engine
        self.in_flight = 0

    def _params(self, seed: int):
        from vllm import SamplingParams

        s = self.sampling
        sampling = {"temperature": 0.0} if s.greedy else {"temperature": s.temperature, "top_p": s.top_p,
                                                          "top_k": s.top_k if s.top_k > 0 else -1, "seed": seed}
        return SamplingParams(max_tokens=s.max_new_tokens, stop_token_ids=self.stop_token_ids, detokenize=False,
                              skip_special_tokens=False, **sampling)

    def submit(self, key: int, prompt: list[int], seed: int) -> None:
        """Hand a request to the engine, which schedules it at its next step; `seed` seeds its sampling."""
        self.engine.add_request(str(key), {"prompt_token_ids": list(prompt)}, self._params(seed))
        self.in_flight += 1

    def collect(self, on_batch: Callable[[int], None] | None = None) -> list[tuple[int, Completion]]:
        """(key, completion) of the requests that finish at the engine's next steps: at least one while any is in
        flight, [] when none is; `on_batch(tokens generated)` with their tokens."""
        finished = []
        while self.in_flight and not finished:
            if not self.engine.has_unfinished_requests():
                raise SpecgenError(f"the vLLM engine holds none of the {self.in_flight} requests in flight; it was "
                                   "used by something else meanwhile")
            finished = [output for output in self.engine.step() if output.finished]
            self.in_flight -= len(finished)
        done = [(int(output.request_id), self._completion(list(output.outputs[0].token_ids))) for output in finished]
        if on_batch is not None and done:
            on_batch(sum(completion.num_generated for _, completion in done))
        return done

    def _completion(self, tokens: list[int]) -> Completion:
        """Cut at the first stop token (vLLM keeps the stop token among the generated ids)."""
        for position, token in enumerate(tokens):
            if token in self.stop_token_ids:
                return Completion(tokens[:position], finished=True)
        return Completion(tokens, finished=False)
