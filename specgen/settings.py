"""The one adapter from a stage's Hydra config to the typed settings its components take.

Components (`specgen.capture.*`, `specgen.filters`, `specgen.distributed.*`) never see a `DictConfig`: each takes a
small frozen dataclass of its own settings, defined next to it, so it can be read, built and tested without Hydra.
A stage builds those settings here, once, from its composed config; values are passed as configured (no defaults
added, no conversion that would change a fingerprint), so the mapping from keys to settings lives in one place.
"""

from omegaconf import DictConfig

from specgen.filters import SampleFilter


def filter_settings(cfg: DictConfig) -> SampleFilter:
    """`filter.*` -> the sample filter, refused when it needs `capture.token_logprobs` and that is off."""
    return SampleFilter(min_mean_logprob=cfg.filter.min_mean_logprob,
                        max_mean_logprob=cfg.filter.max_mean_logprob).check(bool(cfg.capture.token_logprobs))
