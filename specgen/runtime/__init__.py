"""What every stage needs to run, in one place: the device and CPU threads, the dtype of the target, the tokenizer and the tokens that end a turn
(and, in `compat`, the transformers API differences between the versions specgen supports)."""

from specgen.runtime.device import resolve_device, set_threads
from specgen.runtime.dtype import DtypeChoice, resolve_model_dtype
from specgen.runtime.tokenizer import load_tokenizer, stop_token_ids

__all__ = ["DtypeChoice", "load_tokenizer", "resolve_device", "resolve_model_dtype", "set_threads", "stop_token_ids"]
