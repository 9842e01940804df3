"""The one adapter from a stage's Hydra config to the typed settings its components take.

Components (`specgen.capture.*`, `specgen.filters`, `specgen.ranks.*`) never see a `DictConfig`: each takes a
small frozen dataclass of its own settings, defined next to it, so it can be read, built and tested without Hydra.
A stage builds them with the functions here from its composed config; values are passed as configured (no defaults
added, no conversion that would change a fingerprint), so the mapping from keys to settings lives in one place.
"""

from typing import TYPE_CHECKING

from omegaconf import DictConfig

from specgen.capture.outputs import OutputSettings
from specgen.config import to_container
from specgen.capture.zero import Zero3Settings
from specgen.filters import SampleFilter

if TYPE_CHECKING:
    from specgen.capture.vllm import VllmCaptureSettings


def filter_settings(cfg: DictConfig) -> SampleFilter:
    """`filter.*` -> the sample filter, refused when it needs `capture.token_logprobs` and that is off."""
    return SampleFilter(min_mean_logprob=cfg.filter.min_mean_logprob,
                        max_mean_logprob=cfg.filter.max_mean_logprob).check(bool(cfg.capture.token_logprobs))


def output_settings(cfg: DictConfig) -> OutputSettings:
    """`output.codec` and the `capture.*` output options, as configured."""
    c = cfg.capture
    return OutputSettings(codec=cfg.output.codec, logits=c.logits, topk=c.topk, token_logprobs=c.token_logprobs,
                          logprob_temperature=c.logprob_temperature, pooled=c.pooled, pooled_layer=c.pooled_layer,
                          lm_head_chunk_tokens=c.lm_head_chunk_tokens)


def zero3_settings(cfg: DictConfig) -> Zero3Settings:
    """`model.*` and `engine.*` (engine=deepspeed) for `load_zero3_target`."""
    model, engine = to_container(cfg.model), to_container(cfg.engine)
    return Zero3Settings(path=model["path"], dtype=model["dtype"], attn_implementation=model["attn_implementation"],
                         dist_backend=engine["dist_backend"], config=engine["config"])


def vllm_capture_settings(cfg: DictConfig) -> "VllmCaptureSettings":
    """`model.*`, `engine.*`, `data.max_length`, `runtime.seed` and `capture.*` for `load_vllm_capture` (engine=vllm;
    `specgen.capture.vllm` is imported only then)."""
    from specgen.capture.vllm import VllmCaptureSettings

    c = cfg.capture
    return VllmCaptureSettings(path=cfg.model.path, dtype=cfg.model.dtype, engine=to_container(cfg.engine),
                               max_length=cfg.data.max_length, seed=cfg.runtime.seed,
                               aux_layers=to_container(c).get("aux_layers"), logits=c.logits,
                               token_logprobs=c.token_logprobs, logprob_temperature=c.logprob_temperature,
                               prefill_chunk_tokens=c.prefill_chunk_tokens)
