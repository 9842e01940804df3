"""fp8 storage of hidden states (`output.codec=fp8`): float8 e4m3 codes with one float32 scale per token per layer.

    codes, scales = encode(x, groups)      # x [T, G*H] -> codes [T, G*H] float8_e4m3fn, scales [T, G] float32
    x_hat = decode(codes, scales, dtype)   # codes.float() * scale, per group, cast to `dtype`

Each token's vector is split into `groups` equal parts (the k aux layers of `aux_hidden_states`; one group for
`last_hidden_state`) and each part is scaled so that its largest magnitude maps to 448, the e4m3 maximum. The
aux layers get a scale each because their magnitudes differ by orders of magnitude in real targets (early layers
are small, later ones carry massive activations on a few channels): one shared scale would push the small
layers into e4m3's subnormal range (see `benchmarks/outputs.py` for both choices measured). A scale is 4 bytes
per token per group against H bytes of codes, so a shard costs about half a bf16 one.

Error: e4m3 keeps 3 mantissa bits, so each decoded value is within 2^-4 of its magnitude (relative), or within
scale * 2^-10 (absolute) in the subnormal range below scale * 2^-6; about 2.6% relative RMS error overall.
A group that is all zeros gets scale 1 and decodes to zeros. Non-finite inputs do not survive (NaN out).
"""

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def encode(hidden: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [..., G*H] -> (codes [..., G*H] float8_e4m3fn, scales [..., G] float32), on hidden's device."""
    parts = hidden.float().unflatten(-1, (groups, -1))
    amax = parts.abs().amax(dim=-1)
    scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    # The clamp guards against a quotient rounding a hair above 448, which e4m3fn cannot hold.
    codes = (parts / scales.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return codes.flatten(-2), scales


def decode(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `encode`: codes [..., G*H] float8_e4m3fn, scales [..., G] -> [..., G*H] in `dtype`."""
    parts = codes.float().unflatten(-1, (scales.shape[-1], -1)) * scales.unsqueeze(-1)
    return parts.flatten(-2).to(dtype)
