"""Batched generation on vLLM (`engine=vllm` for `specgen.regenerate`): the engine batches and schedules itself.

Same contract as `specgen.regen.engine.Generator`: `complete(prompts)` returns one `Completion` per prompt, its
token ids exactly as the engine generated them (never re-tokenised from text), cut at the first stop token. The
sampling settings are exactly `Sampling` (the checkpoint's generation_config only names the stop tokens). Each
request carries its own sampling seed drawn from torch's RNG, which `specgen.regenerate` seeds per part, so a
part's seeds do not depend on batching or on the process that made it (its text can, where vLLM's logits differ by
float rounding between schedules and a near-flat distribution samples differently). vLLM is imported lazily.

On vLLM's CPU build, sampled generation turns chunked prefill off (`CHUNKED_PREFILL_OFF`): when a prompt's prefill
is split over steps, its worker rewinds the request's seeded generator (`set_offset`), which a CPU generator refuses
("CPU Generator does not use offset"), killing the engine once a part's prompts exceed one step's token budget.
Each prompt then prefills in one step (vLLM keeps max_num_batched_tokens >= max_model_len): a scheduling setting,
the same prompts, seeds and sampling. Measured: SmolLM2-135M, 200 rows in one part, 56 new tokens/s on 2 cores.
"""

import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from specgen.regen.engine import Completion, Sampling, stop_token_ids
from specgen.runtime.reaper import guard_job

log = logging.getLogger(__name__)
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

    def _params(self):
        from vllm import SamplingParams

        s = self.sampling
        sampling = {"temperature": 0.0} if s.greedy else {"temperature": s.temperature, "top_p": s.top_p,
                                                          "top_k": s.top_k if s.top_k > 0 else -1}
        if not s.greedy:  # from the part's seeded RNG (specgen.regenerate)
            sampling["seed"] = int(torch.randint(0, 2**62, (1,)).item())
        return SamplingParams(max_tokens=s.max_new_tokens, stop_token_ids=self.stop_token_ids, detokenize=False,
                              skip_special_tokens=False, **sampling)

    def complete(self, prompts: Sequence[list[int]],
                 on_batch: Callable[[int], None] | None = None) -> list[Completion]:
        """One completion per prompt, in the order given; `on_batch(tokens generated)` once all are done."""
        if not prompts:
            return []
        params = [self._params() for _ in prompts]
        outputs = self.llm.generate([{"prompt_token_ids": list(prompt)} for prompt in prompts], params,
                                    use_tqdm=False)
        completions = [self._completion(list(output.outputs[0].token_ids)) for output in outputs]
        if on_batch is not None:
            on_batch(sum(completion.num_generated for completion in completions))
        return completions

    def _completion(self, tokens: list[int]) -> Completion:
        """Cut at the first stop token (vLLM keeps the stop token among the generated ids)."""
        for position, token in enumerate(tokens):
            if token in self.stop_token_ids:
                return Completion(tokens[:position], finished=True)
        return Completion(tokens, finished=False)
