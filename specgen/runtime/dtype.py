"""`model.dtype` -> the dtype the target runs in, and why: the one rule every stage that loads a target uses.

`auto` is the checkpoint's dtype (`dtype` / `torch_dtype` in config.json; float32 when unrecorded) on an accelerator
(CUDA, ...). On a CPU it is the checkpoint's dtype only where the CPU multiplies that dtype natively (bfloat16:
the `avx512_bf16` or `amx_bf16` flag; float16: `avx512_fp16` or `amx_fp16`); elsewhere half-precision matmuls are
emulated, several times slower than float32, so `auto` is float32 there. An explicit dtype is used as given.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from specgen.errors import SpecgenError

DTYPE_NAMES = ("bfloat16", "float16", "float32")
# CPU flags (/proc/cpuinfo) that mean native matmuls in a half-precision dtype.
NATIVE_CPU_FLAGS = {"bfloat16": ("avx512_bf16", "amx_bf16"), "float16": ("avx512_fp16", "amx_fp16")}


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype a target runs in (`name`: bfloat16 | float16 | float32) and the reason, for a stage's summary."""

    name: str
    reason: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.name)

    def __str__(self) -> str:
        return f"{self.name} ({self.reason})"


def choose_dtype(requested: str, device: str | torch.device, checkpoint: str | None,
                 cpu_flags: frozenset[str] | None = None) -> DtypeChoice:
    """The rule: `requested` (model.dtype) on `device`, for a checkpoint saved in `checkpoint` (None: unrecorded).

    cpu_flags: the CPU's feature flags (None: read from /proc/cpuinfo; only consulted for auto on a CPU)."""
    if requested != "auto":
        if requested not in DTYPE_NAMES:
            raise SpecgenError(f"model.dtype={requested} is not supported; use auto, {', '.join(DTYPE_NAMES)}")
        return DtypeChoice(requested, "model.dtype")
    saved = checkpoint if checkpoint in DTYPE_NAMES else "float32"
    if saved == "float32":
        return DtypeChoice(saved, "model.dtype=auto: the checkpoint's dtype")
    native = native_on(saved, device, cpu_flags)
    if native:
        return DtypeChoice(saved, f"model.dtype=auto: the checkpoint's dtype {native}")
    return DtypeChoice("float32", f"model.dtype=auto: the checkpoint is {saved}, but this CPU has no native {saved} "
                                  f"matmul (no {' or '.join(NATIVE_CPU_FLAGS[saved])}), where float32 is faster; "
                                  f"model.dtype={saved} forces it")


def native_on(name: str, device: str | torch.device, cpu_flags: frozenset[str] | None = None) -> str | None:
    """Where `device` multiplies the half-precision dtype `name` natively, as a phrase ("on cuda", "on this CPU,
    which multiplies bfloat16 natively (amx_bf16)"), or None on a CPU that emulates it. cpu_flags: as
    choose_dtype's."""
    where = torch.device(device).type
    if where != "cpu":
        return f"on {where}"
    flags = read_cpu_flags() if cpu_flags is None else cpu_flags
    native = [flag for flag in NATIVE_CPU_FLAGS[name] if flag in flags]
    return f"on this CPU, which multiplies {name} natively ({native[0]})" if native else None


def resolve_model_dtype(requested: str, device: str | torch.device, model_path: str | Path) -> DtypeChoice:
    """`choose_dtype` for the checkpoint in the folder `model_path`, on this machine."""
    return choose_dtype(requested, device, checkpoint_dtype(model_path) if requested == "auto" else None)


def checkpoint_dtype(model_path: str | Path) -> str | None:
    """The dtype recorded in the folder's config.json (its text config's for composite models), or None."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for section in (config, config.get("text_config") or {}):
        recorded = section.get("dtype") or section.get("torch_dtype")
        if recorded:
            return str(recorded).removeprefix("torch.")
    return None


def read_cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none: then no native half precision)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()
