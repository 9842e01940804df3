"""What every stage needs to run, in one place: the device and CPU threads, the dtype of the target, the tokenizer and the tokens that end a turn
(and, in `compat`, the transformers API differences between the versions specgen supports).

The names below are imported from their modules on first use (`specgen.lazy`): `specgen.runtime.reaper` runs before
a job's config is checked, and importing it must not import torch."""

from specgen.lazy import lazy_exports

_WHERE = {"resolve_device": "device", "set_threads": "device", "DtypeChoice": "dtype", "resolve_model_dtype": "dtype",
          "load_tokenizer": "tokenizer", "stop_token_ids": "tokenizer"}
__getattr__ = lazy_exports(__name__, _WHERE)
__all__ = sorted(_WHERE)
