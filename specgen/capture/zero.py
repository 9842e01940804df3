"""`engine=deepspeed`: DeepSpeed ZeRO-3 partitions the target's parameters across the processes of the job.

For a target larger than one device. The checkpoint is loaded straight into partitions (transformers' `zero.Init`
path, switched on by a live `HfDeepSpeedConfig`), so no process ever holds the whole model; during a forward,
DeepSpeed's hooks gather each submodule's parameters just before it runs and release them after. Our capture
backends call the decoder layers, embeddings and norm directly, so the whole capture forward runs as the `forward`
of one wrapper module handed to `deepspeed.initialize`: DeepSpeed hooks every submodule, and its per-forward
bookkeeping (parameter prefetch trace) starts and ends with that wrapper.

ZeRO-3 gathers with collectives inside every forward, so all processes must run the same number of forwards.
Work per process is uneven (units differ in length, a resumed job may leave all the remaining work to one rank),
so each forward is preceded by a one-integer all-reduce "does anyone still have a batch?", and a process without
batches runs a one-token dummy forward for as long as another one still has real ones (`drain`).
"""

import logging
import os
import warnings
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from specgen.capture.packed import PackedSegments
from specgen.capture.target import DTYPES, CaptureOutput, TargetCapture, load_target
from specgen.errors import SpecgenError
from specgen.runtime.dtype import resolve_model_dtype

log = logging.getLogger("specgen.ranks")


def checkpoint_dtype(model_path: str, requested: str, device: torch.device) -> torch.dtype:
    """The dtype the target is loaded in: model.dtype, `auto` by `specgen.runtime.dtype`'s rule on `device`."""
    if requested != "auto" and requested not in DTYPES:
        raise SpecgenError(f"model.dtype {requested!r} is not supported; use auto, {', '.join(DTYPES)}")
    return DTYPES[resolve_model_dtype(requested, device, model_path).name]


def deepspeed_config(config: dict, dtype: torch.dtype) -> dict:
    """The engine config with its precision section set from the target's dtype.

    ZeRO-3 materialises partitions in the dtype its config names (fp32 when neither bf16 nor fp16 is enabled), so
    this must follow model.dtype or a bf16 checkpoint would silently run in fp32.
    """
    stage = config.get("zero_optimization", {}).get("stage")
    if stage != 3:
        raise SpecgenError(f"engine=deepspeed needs engine.config.zero_optimization.stage=3 (parameter "
                           f"partitioning), got {stage!r}")
    config = {**config, "bf16": {"enabled": dtype == torch.bfloat16}, "fp16": {"enabled": dtype == torch.float16}}
    return config


def init_deepspeed(backend: str, device: torch.device) -> None:
    """Join (or, for a single process, create) the process group DeepSpeed uses."""
    import deepspeed

    # DeepSpeed's ZeRO-3 gathers call a collective torch deprecates, once per layer per forward.
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*", category=FutureWarning)
    if not dist.is_initialized():
        # A plain single-process run (no launcher): ZeRO-3 still needs a process group, of one.
        for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0",
                           "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
            os.environ.setdefault(key, value)
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    deepspeed.init_distributed(dist_backend=backend)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _CaptureForward(torch.nn.Module):
    """The capture backend's forward as one module, so DeepSpeed sees (and hooks) the target as its submodule."""

    def __init__(self, capture: TargetCapture):
        super().__init__()
        self.target = capture.model
        self._capture = capture

    def forward(self, input_ids: torch.LongTensor, segments: PackedSegments | None = None) -> tuple[torch.Tensor, ...]:
        # A tuple, not the CaptureOutput dataclass: DeepSpeed's module hooks look for tensors in the outputs.
        out = (self._capture._forward(input_ids) if segments is None
               else self._capture._forward_packed(input_ids, segments))
        return tuple(getattr(out, field.name) for field in fields(out))


class ZeroCapture(TargetCapture):
    """A capture backend whose forward runs under a ZeRO-3 engine, in lockstep with the other processes."""

    def __init__(self, inner: TargetCapture, config: dict, hf_deepspeed_config):
        import deepspeed

        super().__init__(inner.model, inner.aux_layers)
        self.backend = f"{inner.backend}+deepspeed-zero3"
        self._module = _CaptureForward(inner)
        self._engine = deepspeed.initialize(model=self._module, config=config)[0]
        self._engine.module.eval()
        held = sum(p.ds_tensor.numel() for p in self.model.parameters())
        total = sum(p.ds_numel for p in self.model.parameters())
        log.info("ZeRO-3: this process holds %d of the target's %d parameters (%.0f%%)", held, total,
                 100 * held / total)
        # transformers reads ZeRO-3 settings through a weak reference to this object: keep it alive with the model.
        self._hf_deepspeed_config = hf_deepspeed_config
        self._inner = inner

    @property
    def supports_packing(self) -> bool:
        """The llama backend only: the generic one checks its first packed batch with an extra padded forward,
        which the other processes would not run in lockstep."""
        return self._inner.backend == "llama"

    def _forward_packed(self, input_ids: torch.LongTensor, segments: PackedSegments) -> CaptureOutput:
        self._anyone_has_a_batch(True)
        return CaptureOutput(*self._module(input_ids, segments))

    def __call__(self, input_ids: torch.LongTensor, lengths: torch.LongTensor, chunk_tokens: int | None = None,
                 **kv_options) -> CaptureOutput:
        if chunk_tokens is not None or any(value for value in kv_options.values()):
            raise SpecgenError("engine=deepspeed runs whole sequences only: unset capture.prefill_chunk_tokens "
                               "(prefix reuse turns itself off under ZeRO-3)")
        self._anyone_has_a_batch(True)
        return super().__call__(input_ids, lengths)

    def drain(self) -> None:
        """Call once this process has no batches left: keeps the others' forwards company until they are done."""
        dummy, forwards = torch.zeros(1, 1, dtype=torch.long), 0
        while self._anyone_has_a_batch(False):
            super().__call__(dummy, torch.ones(1, dtype=torch.long))
            forwards += 1
        if forwards:
            log.info("ZeRO-3: ran %d dummy forwards while the other processes finished their batches", forwards)

    def _forward(self, input_ids: torch.LongTensor) -> CaptureOutput:
        return CaptureOutput(*self._module(input_ids))

    def _anyone_has_a_batch(self, mine: bool) -> bool:
        flag = torch.tensor([int(mine)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


@dataclass(frozen=True)
class Zero3Settings:
    """What `load_zero3_target` needs: the target (`model.path`, `model.dtype`, `model.attn_implementation`) and
    the engine's (`engine.dist_backend`, `engine.config`: DeepSpeed's config as a plain dict)."""

    path: str
    dtype: str
    attn_implementation: str
    dist_backend: str
    config: dict


def load_zero3_target(settings: Zero3Settings, device: torch.device):
    """Load the target partitioned across the job's processes; returns (model, finished DeepSpeed config, keepalive).

    The keepalive (transformers' `HfDeepSpeedConfig`) must outlive the model: pass it to `ZeroCapture`.
    """
    from transformers.integrations import HfDeepSpeedConfig

    init_deepspeed(settings.dist_backend, device)
    config = deepspeed_config(settings.config, checkpoint_dtype(settings.path, settings.dtype, device))
    keepalive = HfDeepSpeedConfig(config)  # while alive, from_pretrained loads straight into ZeRO-3 partitions
    # device_map=None: DeepSpeed places the partitions (transformers refuses a device_map under ZeRO-3).
    model = load_target(settings.path, dtype=settings.dtype, device=None,
                        attn_implementation=settings.attn_implementation)
    return model, config, keepalive
