"""Is speculative decoding lossless? Tell a divergence from the target's greedy output caused by rounding from a bug.

In float32 speculative decoding reproduces greedy decoding exactly. In bfloat16 (every GPU user's dtype) it does
not always: the verification forward over K+1 positions and greedy's one-token forward round differently, and where
the target's two best tokens are nearly tied the argmax can flip, after which the turn goes its own way. A flip is
harmless; a bug (a wrong position, a stale KV-cache entry) also shows as a divergence. At the first token where the
two outputs differ (reference token a, speculative token b) `diagnose` measures:

  - each path's margin: how far its own logits row preferred its token over the other path's
    (reference: l[a] - l[b]; speculative: l[b] - l[a]), from the rows the decodings kept (`Generation.top_logits`);
  - the float32 margin: l[a] - l[b] with the target recomputed in float32 over the same context, and how far each
    path's row departs from that float32 row (the largest change of any kept logit relative to token a);
  - the tolerance: `tolerance` units of the dtype's relative rounding (its machine epsilon) times the float32 row's
    largest |logit| (measured bf16 noise of a margin on the bundled target and SmolLM2-135M: at most 5 such units).

A **near-tie** has every one of those within the tolerance: both paths chose their token by less than rounding can
move a margin, float32 itself puts the two tokens that close, and neither row departs from float32 by more. Anything
else is a **failure**. A near-tie's turn is counted, listed and left out of the verdict; a failure makes it NO.
"""

from collections.abc import Iterable
from contextlib import contextmanager

import torch

from specgen.draft.speculative import Generation


def first_divergence(reference: list[int], speculative: list[int]) -> int | None:
    """The first index where the two token lists differ (a shorter list differs where it ends), or None."""
    for index, (a, b) in enumerate(zip(reference, speculative)):
        if a != b:
            return index
    return None if len(reference) == len(speculative) else min(len(reference), len(speculative))


@contextmanager
def in_float32(model: torch.nn.Module):
    """Run `model` in float32 inside the block: its floating parameters and buffers are swapped for float32 copies
    and the originals put back afterwards (exactly: the very tensors, whatever dtype each had). Needs memory for
    the float32 copies beside the originals."""
    swapped, copies = [], {}  # copies: one float32 copy per tensor (tied weights share theirs)
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for name, tensor in store.items():
                if tensor is not None and tensor.is_floating_point() and tensor.dtype != torch.float32:
                    swapped.append((store, name, tensor))
    try:
        for store, name, tensor in swapped:
            if id(tensor) not in copies:
                copy = tensor.detach().float()
                copies[id(tensor)] = torch.nn.Parameter(copy, requires_grad=False) \
                    if isinstance(tensor, torch.nn.Parameter) else copy
            store[name] = copies[id(tensor)]
        yield model
    finally:
        for store, name, tensor in swapped:
            store[name] = tensor


@torch.inference_mode()
def float32_rows(model: torch.nn.Module, token_ids: list[int], rows: int) -> torch.Tensor:
    """The target's logits [rows, V] for the last `rows` positions of `token_ids` (each row predicts the token after
    its position), computed in float32 in one forward without cache."""
    device = model.get_input_embeddings().weight.device
    with in_float32(model):
        logits = model(input_ids=torch.tensor([token_ids], device=device), use_cache=False,
                       logits_to_keep=rows).logits
    return logits[0, -rows:].float()


def _units(dtype: torch.dtype, row32: torch.Tensor) -> float:
    """One unit of rounding for a logits row: the dtype's epsilon times the float32 row's largest |logit|."""
    return torch.finfo(dtype).eps * float(row32.abs().max())


def _departure(generation: Generation, rows32: torch.Tensor, dtype: torch.dtype) -> float:
    """How far a decoding's kept logits depart from the float32 recomputation, in rounding units: over every token
    up to the divergence and every kept logit j of the row that chose token t, |(l[j] - l[t]) - (l32[j] - l32[t])|
    divided by the row's unit; the largest. A stale cache or a wrong position moves whole rows; rounding does not."""
    largest = 0.0
    for (ids, values), token, row32 in zip(generation.top_logits, generation.tokens, rows32):
        kept = dict(zip(ids, values))
        if token not in kept:  # a token its own row did not rank among its best: not rounding
            return float("inf")
        relative = torch.tensor(values) - kept[token] - (row32[ids].cpu() - row32[token].cpu())
        largest = max(largest, float(relative.abs().max()) / _units(dtype, row32))
    return largest


def _margin(top: tuple[list[int], list[float]], chosen: int, other: int) -> float | None:
    """How far a row preferred `chosen` over `other` in logits, or None when `other` is not among its kept logits
    (then the margin is at least the gap to its lowest kept logit: clear)."""
    kept = dict(zip(*top))
    return kept[chosen] - kept[other] if chosen in kept and other in kept else None


def diagnose(model: torch.nn.Module, prompt_ids: list[int], reference: Generation, speculative: Generation,
             dtype: torch.dtype) -> dict | None:
    """The first divergence of `speculative` from `reference` (both decoded from `prompt_ids`), measured as the
    module docstring says, or None when the two outputs are equal. The record holds numbers only (margins in
    logits, departures in rounding units); `classify` turns it into near-tie or failure for a tolerance."""
    position = first_divergence(reference.tokens, speculative.tokens)
    if position is None:
        return None
    if position >= min(len(reference.tokens), len(speculative.tokens)):
        return {"position": position, "reference_token": None, "speculative_token": None,
                "reason": "one output is a prefix of the other"}
    a, b = reference.tokens[position], speculative.tokens[position]
    rows32 = float32_rows(model, list(prompt_ids) + reference.tokens[:position], position + 1)
    row32 = rows32[-1]
    cut = {"tokens": position + 1}
    return {"position": position, "reference_token": a, "speculative_token": b,
            "reference_margin": _margin(reference.top_logits[position], a, b),
            "speculative_margin": _margin(speculative.top_logits[position], b, a),
            "float32_margin": float(row32[a] - row32[b]), "float32_choice": int(row32.argmax()),
            "unit": _units(dtype, row32),
            "reference_departure": _departure(_upto(reference, **cut), rows32, dtype),
            "speculative_departure": _departure(_upto(speculative, **cut), rows32, dtype),
            "dtype": str(dtype).removeprefix("torch.")}


def _upto(generation: Generation, tokens: int) -> Generation:
    return Generation(tokens=generation.tokens[:tokens], top_logits=generation.top_logits[:tokens])


def classify(divergence: dict, tolerance: float) -> tuple[bool, float | None]:
    """(near-tie?, the largest of its margins and departures in rounding units; None where one is unbounded).

    A near-tie: both paths chose their own token, and every margin at the divergence (each path's and float32's)
    and both paths' departures from float32 are within `tolerance` units."""
    if divergence.get("reference_token") is None:
        return False, None
    margins = [divergence[key] for key in ("reference_margin", "speculative_margin")]
    if any(value is None or value < 0 for value in margins):  # a token its own row does not prefer: never rounding
        return False, None
    unit = max(divergence["unit"], torch.finfo(torch.float32).tiny)
    measured = [abs(value) / unit for value in (*margins, divergence["float32_margin"])]
    measured += [divergence["reference_departure"], divergence["speculative_departure"]]
    largest = max(measured)
    return largest <= tolerance, largest


def failure_line(turn: str, divergence: dict) -> str:
    """One line for a failed turn: where, both tokens, and every margin."""
    if divergence.get("reference_token") is None:
        return f"{turn}: {divergence['reason']} (token {divergence['position']})"

    def fmt(key):
        value = divergence[key]
        return "not among its best logits" if value is None else f"{value:+.4f}"

    return (f"{turn}: token {divergence['position']}, greedy {divergence['reference_token']} (margin "
            f"{fmt('reference_margin')}) vs speculative {divergence['speculative_token']} (margin "
            f"{fmt('speculative_margin')}), float32 margin {divergence['float32_margin']:+.4f}; departure from "
            f"float32 {divergence['reference_departure']:.1f} / {divergence['speculative_departure']:.1f} units "
            f"of {divergence['unit']:.4f} (greedy / speculative; tolerance {divergence['tolerance']:g})")


def verdict(samples: Iterable[dict], tolerance: float) -> dict:
    """The losslessness verdict over evaluated turns (each with "id", "turn", "matches_target_greedy" and the
    "divergence" record of `diagnose`): lossless unless some turn diverges at a clear margin."""
    near_ties, failures, largest = [], [], 0.0
    for sample in samples:
        if sample["matches_target_greedy"]:
            continue
        turn = f"{sample['id']}#{sample['turn']}"
        divergence = dict(sample.get("divergence") or {"position": None, "reference_token": None,
                                                        "reason": "not diagnosed (an earlier version's journal)"})
        near_tie, measured = classify(divergence, tolerance)
        divergence["tolerance"] = tolerance
        if near_tie:
            near_ties.append(turn)
            largest = max(largest, measured)
        else:
            failures.append(failure_line(turn, divergence))
    dtypes = sorted({s["divergence"]["dtype"] for s in samples
                     if not s["matches_target_greedy"] and (s.get("divergence") or {}).get("dtype")})
    if failures:
        line = f"NO: {len(failures)} turns diverge at a clear margin; first: {failures[0]}"
    elif near_ties:
        line = (f"yes ({len(near_ties)} turns diverge at near-ties, {'/'.join(dtypes)}; largest "
                f"{largest:.1f} of {tolerance:g} rounding units; those turns are left out of the verdict)")
    else:
        line = "yes: identical to the target's greedy output"
    return {"lossless": not failures, "near_tie_turns": near_ties, "failed_turns": failures,
            "largest_near_tie_margin": largest if near_ties else None, "near_tie_tolerance": tolerance,
            "lossless_line": line}
