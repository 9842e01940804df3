"""`runtime.device` -> a torch device, with a one-line error for a device that is not there."""

import torch

from specgen.errors import SpecgenError


def resolve_device(name: str) -> torch.device:
    """`auto` is CUDA when visible, else the CPU; `cuda[:N]` without a visible CUDA device is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise SpecgenError(f"runtime.device={name} but no CUDA device is visible; use runtime.device=cpu")
    return torch.device(name)


def set_threads(threads: int | None) -> None:
    """`runtime.threads`: torch's CPU threads (None keeps torch's default)."""
    if threads:
        torch.set_num_threads(threads)
