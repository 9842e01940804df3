"""Batched generation on vLLM (`engine=vllm` for `specgen.regenerate`): the engine batches and schedules itself.

Same contract as `specgen.regen.engine.Generator`: `submit` queues a request, `collect` returns `Completion`s, their
token ids exactly as the engine generated them (never re-tokenised from text), cut at the first stop token. The
sampling settings are exactly `Sampling` (the checkpoint's generation_config only names the stop tokens).

Requests are continuously batched: `collect` steps the engine only until some request finishes, so the regenerator
submits that conversation's next turn while the others decode, instead of waiting for the slowest turn of a depth.
A request given a `LoopWatch` is aborted at the token that makes it loop (the engine streams every request's new
tokens, `RequestOutputKind.DELTA`): its draw is discarded whatever follows (resampled or its row dropped), so the
tokens it would have generated up to max_new_tokens are not generated. Measured: SmolLM2-135M, 64 rows sampled at
0.7, on_loop=resample, 1.16x the same engine with every draw decoded to its end, the same 138 turns kept (23 draws
stopped, 10% fewer tokens; the looping draws are often a part's slowest).
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
from dataclasses import dataclass, field
from pathlib import Path

from specgen.errors import SpecgenError
from specgen.regen.engine import Completion, LoopWatch, Sampling, stop_token_ids
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
        self.requests: dict[str, _Request] = {}  # in flight, by request id
        self.submitted = 0

    def _params(self, seed: int):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        s = self.sampling
        sampling = {"temperature": 0.0} if s.greedy else {"temperature": s.temperature, "top_p": s.top_p,
                                                          "top_k": s.top_k if s.top_k > 0 else -1, "seed": seed}
        return SamplingParams(max_tokens=s.max_new_tokens, stop_token_ids=self.stop_token_ids, detokenize=False,
                              skip_special_tokens=False, output_kind=RequestOutputKind.DELTA, **sampling)

    def submit(self, key: int, prompt: list[int], seed: int, watch: LoopWatch | None = None) -> None:
        """Hand a request to the engine, which schedules it at its next step; `seed` seeds its sampling, `watch`
        (if given) stops it at the token that makes it loop."""
        request_id = f"{key}.{self.submitted}"  # unique: a redrawn turn's key comes back while its abort is pending
        self.submitted += 1
        self.engine.add_request(request_id, {"prompt_token_ids": list(prompt)}, self._params(seed))
        self.requests[request_id] = _Request(key, watch)

    def collect(self, on_batch: Callable[[int], None] | None = None) -> list[tuple[int, Completion]]:
        """(key, completion) of the requests that finish, or are stopped as looping, at the engine's next steps: at
        least one while any is in flight, [] when none is; `on_batch(tokens generated)` with their tokens."""
        done: list[tuple[int, Completion]] = []
        while self.requests and not done:
            if not self.engine.has_unfinished_requests():
                raise SpecgenError(f"the vLLM engine holds none of the {len(self.requests)} requests in flight; it "
                                   "was used by something else meanwhile")
            looping = []
            for output in self.engine.step():
                request = self.requests[output.request_id]
                new = output.outputs[0].token_ids
                request.tokens += new
                if output.finished:
                    done.append((request.key, self._completion(request.tokens)))
                elif request.watch is not None and request.watch.extend(new):  # no stop token yet: it would finish
                    done.append((request.key, Completion(request.tokens, finished=False, looped=True)))
                    looping.append(output.request_id)
                else:
                    continue
                del self.requests[output.request_id]
            if looping:
                self.engine.abort_request(looping)
        if on_batch is not None and done:
            on_batch(sum(completion.num_generated for _, completion in done))
        return done

    def _completion(self, tokens: list[int]) -> Completion:
        """Cut at the first stop token (vLLM keeps the stop token among the generated ids)."""
        for position, token in enumerate(tokens):
            if token in self.stop_token_ids:
                return Completion(tokens[:position], finished=True)
        return Completion(tokens, finished=False)


@dataclass
class _Request:
    """A request in flight: its regenerator key, loop watch and the tokens generated so far."""

    key: int
    watch: LoopWatch | None
    tokens: list[int] = field(default_factory=list)
