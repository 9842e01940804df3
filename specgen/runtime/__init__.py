"""What every stage needs to run, in one place: the device, the tokenizer (more shared runtime lands here)."""

from specgen.runtime.device import resolve_device, set_threads
from specgen.runtime.tokenizer import load_tokenizer

__all__ = ["load_tokenizer", "resolve_device", "set_threads"]
