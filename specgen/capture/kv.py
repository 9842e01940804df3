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


# --- grouped pasts: the fast continuation path of shared-prefix reuse ------------------------------------------------

GROUPED_ATTENTION = "specgen_grouped_past"  # the attention implementation name a grouped continuation runs under


@dataclass
class GroupedPast:
    """A batch whose rows are grouped by the past they continue (shared-prefix reuse's own layout).

    Rows [bounds[g], bounds[g + 1]) continue the same `lengths[g]` earlier tokens, whose keys and values for decoder
    layer i are `kv[g][i]`, each [kv_heads, lengths[g], head_dim]: ONE copy per group, kept in that layout by the
    caller, never gathered or padded per row. A group with length 0 (kv None) starts at position 0.

    Attention then splits exactly into two parts that both run on SDPA's fused CPU kernel (no mask tensor):
      new tokens   every row against its own new keys, `is_causal` (q_len == kv_len, so the triangle is right);
      past tokens  every group's queries, folded into one long query sequence, against the group's past keys,
                   no mask at all (every new token sees the whole past);
    and the two softmax halves are merged by their log-sum-exps: out = o_new + sigmoid(lse_past - lse_new) *
    (o_past - o_new), in float32. On other devices, or on sliding-window layers whose window is shorter than a
    group's span, a group falls back to one SDPA call with an explicit [T, past + T] mask shared by its rows.
    """

    bounds: list[int]
    lengths: list[int]
    kv: list[list[LayerKV] | None]
    kept: dict[int, LayerKV] | None = None  # if a dict: the attention leaves each layer's NEW keys/values here

    def row_lengths(self, device: torch.device) -> torch.LongTensor:
        """Each row's past length, [B]."""
        counts = [hi - lo for lo, hi in zip(self.bounds, self.bounds[1:])]
        return torch.repeat_interleave(torch.tensor(self.lengths), torch.tensor(counts)).to(device)


def _fused_cpu(query, key, value, causal: bool, scale: float):
    """SDPA's fused CPU kernel (flash-style, GQA-aware): (out [B, H, q, d], log-sum-exp [B, H, q] float32)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, causal, scale=scale)


def _masked_group(query, key, value, past_keys, past_values, scale: float, window: int | None) -> torch.Tensor:
    """One group's attention over [past ; new] with an explicit mask (fallback): [n, H, T, d]."""
    n, _, seq_len, _ = query.shape
    past = past_keys.shape[1] if past_keys is not None else 0
    if past:
        key = torch.cat([past_keys[None].expand(n, -1, -1, -1), key], dim=2)
        value = torch.cat([past_values[None].expand(n, -1, -1, -1), value], dim=2)
    query_position = past + torch.arange(seq_len, device=query.device)
    key_position = torch.arange(past + seq_len, device=query.device)
    allowed = key_position[None, :] <= query_position[:, None]
    if window is not None:
        allowed &= query_position[:, None] - key_position[None, :] < window
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=allowed[None, None],
                                                            scale=scale, enable_gqa=True)


@torch.compiler.disable  # under capture.compile the decoder layer's other ops compile around this call
def grouped_past_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask, scaling: float | None = None, dropout: float = 0.0,
                           grouped_past: GroupedPast | None = None, sliding_window: int | None = None,
                           **kwargs) -> tuple[torch.Tensor, None]:
    """HF attention interface (registered as GROUPED_ATTENTION): query [B, H, T, d]; key/value [B, kv_heads, T, d]
    of the NEW tokens only; the past comes from `grouped_past` (see `GroupedPast`), and the new keys/values are left
    in `grouped_past.kept` when it is a dict (the layer gets no cache object: under torch.compile a cache's
    `update(..., layer_idx)` would specialize every layer's graph). Returns ([B, T, H, d], None)."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    seq_len, layer = query.shape[2], module.layer_idx
    if grouped_past.kept is not None:
        grouped_past.kept[layer] = (key, value)
    fused = query.device.type == "cpu"
    window = sliding_window if sliding_window is not None and sliding_window < max(grouped_past.lengths) + seq_len \
        else None
    if fused and window is None:
        out, new_lse = _fused_cpu(query, key, value, True, scale)
    else:
        out = torch.empty_like(query)
    for g, (lo, hi) in enumerate(zip(grouped_past.bounds, grouped_past.bounds[1:])):
        past_keys, past_values = grouped_past.kv[g][layer] if grouped_past.kv[g] is not None else (None, None)
        if not (fused and window is None):
            out[lo:hi] = _masked_group(query[lo:hi], key[lo:hi], value[lo:hi], past_keys, past_values, scale, window)
            continue
        if past_keys is None:
            continue
        n, heads, _, dim = query[lo:hi].shape
        folded = query[lo:hi].transpose(0, 1).reshape(1, heads, n * seq_len, dim)
        past_out, past_lse = _fused_cpu(folded, past_keys[None], past_values[None], False, scale)
        past_out = past_out.view(heads, n, seq_len, dim).transpose(0, 1)
        past_lse = past_lse.view(heads, n, seq_len).transpose(0, 1)
        weight = torch.sigmoid(past_lse - new_lse[lo:hi]).unsqueeze(-1)
        new_out = out[lo:hi].float()
        out[lo:hi] = new_out.add_(weight * (past_out.float() - new_out))
    return out.transpose(1, 2).contiguous(), None
