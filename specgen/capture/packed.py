"""Packed capture: a batch's sequences laid end to end in ONE row, so no padding token is ever forwarded.

    segments = PackedSegments.from_lengths([11, 5, 8])     # row [0, 24): sequences [0, 11), [11, 16), [16, 24)
    out = capture.packed(input_ids, segments)               # input_ids [1, 24]; out.* [1, 24, ...]

Every token gets its position within its own sequence (positions restart at 0 at each segment start), and attention
is block-diagonal causal: query i of segment s sees keys j of the same segment with j <= i (and, on sliding-window
layers, i - j < window, HF's rule). That is exactly what each sequence computes alone, so the states are the ones a
padded batch gives, within the dtype's rounding (other shapes run other kernels).

The attention runs under the attention implementation PACKED_ATTENTION, registered with transformers: the capture
swaps `config._attn_implementation` to it for the duration of the forward (`packed_attention`), which also makes
transformers' mask builders build NO mask (an unregistered mask kind returns None), so no [T, T] mask ever exists.
Per segment it runs:
  CPU                    SDPA's fused flash kernel with `is_causal` (GQA-aware, no mask), one call per segment;
  CUDA, fp16/bf16        one varlen call over the whole row (cu_seqlens): flash-attn's `flash_attn_varlen_func`
                         when installed, else PyTorch's own `torch.nn.attention.varlen.varlen_attn` (torch >= 2.11;
                         neither runs in this project's CI, which has no GPU);
  otherwise              `scaled_dot_product_attention(is_causal=True)` per segment;
and a segment longer than its layer's sliding window gets an explicit [len, len] window mask of its own.

Any module that mixes tokens outside this attention (a convolution, a recurrent layer, ALiBi, softcapping, attention
sinks) would leak across segments: the attention refuses the extras it can see (`PackingUnsupported`), and the
capture counts its calls (one per decoder layer per forward) so a model whose layers do not all attend through it is
refused too. The generic backend also checks its first packed batch against the padded forward once.
"""

import contextvars
import functools
import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import transformers

PACKED_ATTENTION = "specgen_packed"


class PackingUnsupported(RuntimeError):
    """This model cannot run packed: the caller captures with padded batches instead (and says so)."""


@dataclass
class PackedSegments:
    """Where each sequence of a packed row starts and ends: `bounds` = [0, l0, l0 + l1, ..., N] (host ints)."""

    bounds: list[int]
    calls: int = field(default=0, compare=False)  # attention calls made under these segments (one per layer)
    kernel: str = field(default="", compare=False)  # the attention kernel the last call ran (KERNELS)
    _cu_seqlens: dict = field(default_factory=dict, compare=False, repr=False)  # device -> int32 bounds

    @classmethod
    def from_lengths(cls, lengths: list[int]) -> "PackedSegments":
        if not lengths or min(lengths) < 1:
            raise ValueError(f"packed sequences need at least one token each, got lengths {lengths}")
        bounds = [0]
        for length in lengths:
            bounds.append(bounds[-1] + int(length))
        return cls(bounds)

    @property
    def total(self) -> int:
        return self.bounds[-1]

    @property
    def lengths(self) -> list[int]:
        return [hi - lo for lo, hi in self.spans()]

    def spans(self) -> Iterator[tuple[int, int]]:
        return zip(self.bounds, self.bounds[1:])

    def cu_seqlens(self, device: torch.device) -> torch.Tensor:
        """`bounds` as an int32 tensor on `device` (varlen kernels' cu_seqlens), copied there once, not per layer."""
        if device not in self._cu_seqlens:
            self._cu_seqlens[device] = torch.tensor(self.bounds, dtype=torch.int32, device=device)
        return self._cu_seqlens[device]

    def position_ids(self, device: torch.device) -> torch.LongTensor:
        """[1, N]: each token's position within its own sequence."""
        lengths = torch.tensor(self.lengths)
        starts = torch.repeat_interleave(torch.tensor(self.bounds[:-1]), lengths)
        return (torch.arange(self.total) - starts)[None].to(device)


_ACTIVE: contextvars.ContextVar[PackedSegments | None] = contextvars.ContextVar("specgen_packed", default=None)


@contextmanager
def packed_attention(config: transformers.PreTrainedConfig, segments: PackedSegments) -> Iterator[None]:
    """Inside the block, the model whose (text) config is `config` attends block-diagonally over `segments`."""
    configs = {id(c): c for c in (config, config.get_text_config())}.values()  # composite models nest one
    saved = [(c, c._attn_implementation) for c in configs]
    token = _ACTIVE.set(segments)
    try:
        for c, _ in saved:
            c._attn_implementation = PACKED_ATTENTION
        yield
    finally:
        for c, implementation in saved:
            c._attn_implementation = implementation
        _ACTIVE.reset(token)


# What packed_attention_forward may run: one varlen call over the row, or one SDPA call per segment.
KERNELS = ("flash-attn varlen", "torch varlen", "sdpa per segment")


@functools.cache  # looked up once per process: a failed import is retried from disk on every call otherwise
def _flash_varlen():
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


@functools.cache
def _torch_varlen():
    """PyTorch's varlen attention when this build takes `window_size` and `scale` (torch >= 2.11; 2.9's first
    version took only is_causal); None otherwise."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn if {"window_size", "scale"} <= _parameters(varlen_attn) else None


@functools.cache
def _parameters(function) -> frozenset[str]:
    return frozenset(inspect.signature(function).parameters)


def _window_mask(length: int, window: int, device: torch.device) -> torch.Tensor:
    """[length, length] bool: causal, and at most `window - 1` positions back (HF: kv_idx > q_idx - window)."""
    position = torch.arange(length, device=device)
    distance = position[:, None] - position[None, :]
    return (distance >= 0) & (distance < window)


@torch.compiler.disable  # under capture.compile: one graph break here, not a graph per set of segment bounds
def packed_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask, scaling: float | None = None, dropout: float = 0.0,
                             sliding_window: int | None = None, softcap: float | None = None,
                             s_aux: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """HF attention interface (registered as PACKED_ATTENTION): query [1, H, N, d], key/value [1, kv_heads, N, d]
    of one packed row; returns ([1, N, H, d], None). The segments come from the enclosing `packed_attention`."""
    segments = _ACTIVE.get()
    if segments is None:
        raise PackingUnsupported("the packed attention ran outside a packed capture")
    if softcap is not None or s_aux is not None or attention_mask is not None:
        raise PackingUnsupported("this model's attention uses softcapping, sinks or its own mask")
    if query.shape[0] != 1 or query.shape[2] != segments.total or key.shape[2] != segments.total:
        raise PackingUnsupported(f"expected one packed row of {segments.total} tokens, got query "
                                 f"{tuple(query.shape)} and key {tuple(key.shape)}")
    segments.calls += 1
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16):
        flash, native = _flash_varlen(), _torch_varlen()
        if flash is not None:
            segments.kernel = KERNELS[0]
            return _flash_varlen_forward(flash, query, key, value, segments, scale, sliding_window), None
        if native is not None:
            segments.kernel = KERNELS[1]
            return _torch_varlen_forward(native, query, key, value, segments, scale, sliding_window), None
    segments.kernel = KERNELS[2]
    out = torch.empty_like(query)
    for lo, hi in segments.spans():
        q, k, v = query[:, :, lo:hi], key[:, :, lo:hi], value[:, :, lo:hi]
        if sliding_window is not None and sliding_window < hi - lo:
            mask = _window_mask(hi - lo, sliding_window, query.device)
            out[:, :, lo:hi] = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        elif query.device.type == "cpu":  # the fused CPU kernel, as the reuse path runs it
            out[:, :, lo:hi] = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, True, scale=scale)[0]
        else:
            out[:, :, lo:hi] = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                                                enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def _flash_varlen_forward(flash, query, key, value, segments: PackedSegments, scale: float,
                          sliding_window: int | None) -> torch.Tensor:
    """One flash-attn varlen call over the whole packed row: [1, N, H, d]. flash-attn takes [N, heads, d] and
    handles GQA itself; window_size=(w - 1, 0) with causal=True is HF's window rule."""
    cu_seqlens = segments.cu_seqlens(query.device)
    longest = max(segments.lengths)
    window = (sliding_window - 1, 0) if sliding_window is not None and sliding_window < longest else (-1, -1)
    out = flash(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), cu_seqlens, cu_seqlens,
                longest, longest, dropout_p=0.0, softmax_scale=scale, causal=True, window_size=window)
    return out[None]


def _torch_varlen_forward(varlen_attn, query, key, value, segments: PackedSegments, scale: float,
                          sliding_window: int | None) -> torch.Tensor:
    """One `torch.nn.attention.varlen.varlen_attn` call over the whole packed row: [1, N, H, d]. It takes
    [N, heads, d]; window_size=(-1, 0) is causal, (w - 1, 0) HF's window rule as for flash-attn. A build without
    `enable_gqa` (torch 2.11) gets the key/value heads repeated for grouped-query attention."""
    cu_seqlens = segments.cu_seqlens(query.device)
    longest = max(segments.lengths)
    window = (sliding_window - 1, 0) if sliding_window is not None and sliding_window < longest else (-1, 0)
    groups = query.shape[1] // key.shape[1]
    gqa = {}
    if groups > 1 and "enable_gqa" in _parameters(varlen_attn):
        gqa = {"enable_gqa": True}
    elif groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = varlen_attn(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), cu_seqlens,
                      cu_seqlens, longest, longest, scale=scale, window_size=window, **gqa)
    return out[None]


transformers.AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)
