"""Group samples into length-sorted batches under a token budget, to keep padding low."""

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from specgen.data.sample import TokenizedSample
from specgen.errors import SpecgenError

T = TypeVar("T")


def token_budget_batches(samples: Sequence[T], max_tokens: int, max_batch_size: int | None = None, *,
                         length: Callable[[T], int] = len) -> list[list[T]]:
    """Batches whose padded size (batch size x longest sample) stays within `max_tokens`.

    `length(item)` is what an item costs in a batch (its token count by default; regeneration counts the tokens a
    prompt may grow to).

    Samples are sorted longest first (ties keep their input order, so the result is deterministic)
    and filled greedily: neighbours in that order have similar lengths, so little padding is wasted.
    A sample longer than the budget forms a batch of its own.
    """
    if max_tokens < 1:
        raise SpecgenError(f"the token budget must be positive, got max_tokens={max_tokens}")
    if max_batch_size is not None and max_batch_size < 1:
        raise SpecgenError(f"max_batch_size must be positive or unset, got {max_batch_size}")
    order = sorted(range(len(samples)), key=lambda i: (-length(samples[i]), i))
    batches: list[list[T]] = []
    for i in order:
        sample = samples[i]
        if batches:
            batch = batches[-1]
            longest = length(batch[0])  # longest first, so the batch's first sample sets its padded length
            fits_budget = (len(batch) + 1) * longest <= max_tokens
            fits_size = max_batch_size is None or len(batch) < max_batch_size
            if fits_budget and fits_size:
                batch.append(sample)
                continue
        batches.append([sample])
    return batches


def packed_batches(samples: Sequence[T], max_tokens: int, max_batch_size: int | None = None, *,
                   length: Callable[[T], int] = len) -> list[list[T]]:
    """Batches to lay end to end in one row (no padding): each batch's TOTAL length stays within `max_tokens`.

    Samples longest first (ties in input order), filled in that order: the concatenated batches list the samples
    in the same order as `token_budget_batches`' whatever the budget, so a shard's row order does not depend on
    capture.batch_tokens or on packing. A sample longer than the budget forms a batch of its own.
    """
    if max_tokens < 1:
        raise SpecgenError(f"the token budget must be positive, got max_tokens={max_tokens}")
    if max_batch_size is not None and max_batch_size < 1:
        raise SpecgenError(f"max_batch_size must be positive or unset, got {max_batch_size}")
    batches: list[list[T]] = []
    total = 0
    for i in sorted(range(len(samples)), key=lambda i: (-length(samples[i]), i)):
        cost = length(samples[i])
        if batches and total + cost <= max_tokens and (max_batch_size is None or len(batches[-1]) < max_batch_size):
            batches[-1].append(samples[i])
            total += cost
            continue
        batches.append([samples[i]])
        total = cost
    return batches


def padding_efficiency(batches: Sequence[Sequence[TokenizedSample]]) -> float:
    """Real tokens / padded tokens over all batches (1.0 means no padding)."""
    real = sum(len(sample) for batch in batches for sample in batch)
    padded = sum(len(batch) * max(len(sample) for sample in batch) for batch in batches if batch)
    return real / padded if padded else 1.0


def pad_right(sequences: Sequence[Sequence[int]], pad_id: int, device: torch.device | str | None = None
              ) -> torch.LongTensor:
    """[len(sequences), longest] token ids, each row left-aligned and filled with `pad_id` after its end."""
    longest = max(len(sequence) for sequence in sequences)
    input_ids = torch.full((len(sequences), longest), pad_id, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        input_ids[row, : len(sequence)] = torch.as_tensor(sequence, dtype=torch.long)
    return input_ids if device is None else input_ids.to(device)
