"""What every stage needs to run, in one place: the device and CPU threads, the tokenizer and the tokens that end a turn
(and, in `compat`, the transformers API differences between the versions specgen supports)."""

from specgen.runtime.device import resolve_device, set_threads
from specgen.runtime.tokenizer import load_tokenizer, stop_token_ids

__all__ = ["load_tokenizer", "resolve_device", "set_threads", "stop_token_ids"]
