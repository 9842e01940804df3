"""The transformers API differences specgen spans (transformers 4.56 to the newest 5.x), answered in one place."""

import inspect
from functools import cache


@cache
def cache_keyword() -> str:
    """The keyword HF forwards, decoder layers and mask builders take the KV cache by: `cache` from transformers
    5.24 on (`past_key_values` still works there, with a FutureWarning per call), `past_key_values` before."""
    from transformers.masking_utils import create_causal_mask

    return "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"


def cache_kwarg(kv_cache) -> dict:
    """{keyword: kv_cache} for an HF forward, a decoder layer or a mask builder (see `cache_keyword`)."""
    return {cache_keyword(): kv_cache}
