"""Positions to evaluate the LM head at, a chunk at a time (one implementation for capture and training)."""

from collections.abc import Iterator

import torch


def position_chunks(needed: torch.Tensor, chunk_tokens: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(rows, cols) of the True entries of `needed` [B, T], row-major, at most `chunk_tokens` pairs at a time: the
    LM head then costs [chunk, V] floats whatever the batch, instead of [B, T, V]."""
    rows, cols = needed.nonzero(as_tuple=True)
    for start in range(0, len(rows), chunk_tokens):
        yield rows[start:start + chunk_tokens], cols[start:start + chunk_tokens]
