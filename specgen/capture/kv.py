"""Continuing a batch from earlier tokens' keys and values (a KV cache), for shared-prefix reuse.

A capture call normally starts every row at position 0. With `past`, row b continues `past.lengths[b]` earlier
tokens whose keys and values (as HF attention layers cache them: after RoPE, one entry per KV head) come from an
earlier capture with `keep_kv=True`. Rows may continue pasts of different lengths, so the past is right-padded and
nothing here relies on a kernel's implicit causal mask: with q_len != kv_len, SDPA's `is_causal` aligns the
triangle top-left (wrong for a cache) and HF's mask builders assume one past length for the whole batch. Instead
every continuation gets an explicit mask over [past | new] keys:

    query i of row b (absolute position lengths[b] + i) sees past key j   iff j < lengths[b]
                                                        and new key s    iff s <= i
    and, on sliding-window layers, only keys less than `window` positions back (HF: kv_idx > q_idx - window).

Eager attention adds the mask (0 or the dtype's minimum), SDPA takes it as booleans; any other attention
implementation (flash attention ignores such masks) is refused by `supports_kv`.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

# Attention implementations that apply an explicit [B, 1, q, kv] mask exactly as given.
EXPLICIT_MASK_ATTENTION = ("eager", "sdpa")

LayerKV = tuple[torch.Tensor, torch.Tensor]  # keys, values: [B, kv_heads, T, head_dim]


@dataclass
class PastKV:
    """Earlier tokens a batch continues from: row b has `lengths[b]` of them (right-padded to lengths.max()).

    `layer(i)` returns decoder layer i's past keys and values, [B, kv_heads, lengths.max(), head_dim]; it is called
    once per layer during the forward, so a caller can assemble the past lazily, one layer at a time.
    """

    lengths: torch.LongTensor
    layer: Callable[[int], LayerKV]

    @classmethod
    def stacked(cls, kv: list[LayerKV], lengths: torch.LongTensor) -> "PastKV":
        """The past held by `CaptureOutput.kv` of an earlier call whose rows had `lengths` real tokens."""
        return cls(lengths=lengths, layer=lambda index: kv[index])


class KVRecorder:
    """What the HF attention layers see as `past_key_values`: they call `update(keys, values, layer_idx)` with the
    new tokens' keys and values and attend to what it returns (the past followed by the new ones).
    With `keep=True` the new keys and values are kept per layer for a later continuation."""

    def __init__(self, past: PastKV | None, keep: bool):
        self.past = past
        self.kept: dict[int, LayerKV] | None = {} if keep else None

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args, **kwargs) -> LayerKV:
        if self.kept is not None:
            self.kept[layer_idx] = (keys, values)
        if self.past is None:
            return keys, values
        past_keys, past_values = self.past.layer(layer_idx)
        return torch.cat([past_keys, keys], dim=2), torch.cat([past_values, values], dim=2)

    def kept_layers(self, num_layers: int) -> list[LayerKV] | None:
        return None if self.kept is None else [self.kept[layer] for layer in range(num_layers)]


def continuation_mask(past_lengths: torch.LongTensor, seq_len: int, *, window: int | None,
                      attn_implementation: str, dtype: torch.dtype) -> torch.Tensor:
    """The [B, 1, seq_len, past + seq_len] attention mask of a batch continuing `past_lengths` tokens (module doc)."""
    device = past_lengths.device
    batch, past = len(past_lengths), int(past_lengths.max())
    new = torch.arange(seq_len, device=device)
    past_keys = torch.arange(past, device=device)
    sees_past = (past_keys[None, :] < past_lengths[:, None])[:, None, :].expand(batch, seq_len, past)
    sees_new = (new[None, :] <= new[:, None])[None].expand(batch, seq_len, seq_len)
    allowed = torch.cat([sees_past, sees_new], dim=-1)
    if window is not None:
        query_position = past_lengths[:, None] + new[None, :]                                    # [B, q]
        key_position = torch.cat([past_keys[None, :].expand(batch, past), query_position], dim=1)  # [B, kv]
        allowed = allowed & (query_position[:, :, None] - key_position[:, None, :] < window)
    allowed = allowed[:, None]
    if attn_implementation == "sdpa":
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
