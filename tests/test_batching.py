"""Token-budget batching: every sample once, budgets kept, deterministic, little padding."""

import random

import pytest

from specgen.data import TokenizedSample, padding_efficiency, token_budget_batches
from specgen.errors import SpecgenError


def samples_of_lengths(lengths: list[int]) -> list[TokenizedSample]:
    return [TokenizedSample(f"s{i}", i, [7] * n, [1] * n) for i, n in enumerate(lengths)]


def test_small_example_by_hand():
    samples = samples_of_lengths([2, 10, 1, 9])
    batches = token_budget_batches(samples, max_tokens=20)

    assert [[s.sample_id for s in batch] for batch in batches] == [["s1", "s3"], ["s0", "s2"]]
    assert padding_efficiency(batches) == pytest.approx((10 + 9 + 2 + 1) / (2 * 10 + 2 * 2))


@pytest.mark.parametrize("max_batch_size", [None, 3])
def test_random_lengths_keep_the_budget_and_every_sample_once(max_batch_size):
    rng = random.Random(0)
    lengths = [rng.randint(1, 600) for _ in range(500)]
    lengths += [700, 700, 2000]  # ties and one sample over the budget
    samples = samples_of_lengths(lengths)
    batches = token_budget_batches(samples, max_tokens=1024, max_batch_size=max_batch_size)

    assert sorted(s.source_index for batch in batches for s in batch) == list(range(len(samples)))
    for batch in batches:
        assert len(batch) == 1 or len(batch) * max(len(s) for s in batch) <= 1024
        assert max_batch_size is None or len(batch) <= max_batch_size
    assert [[s.sample_id for s in b] for b in batches if len(b[0]) == 2000] == [["s502"]]
    flat = [s for batch in batches for s in batch]
    assert flat == sorted(samples, key=lambda s: (-len(s), s.source_index))  # longest first, ties in input order
    assert batches == token_budget_batches(list(samples), max_tokens=1024, max_batch_size=max_batch_size)


def test_sorting_wastes_less_padding_than_input_order():
    rng = random.Random(1)
    samples = samples_of_lengths([rng.randint(1, 1000) for _ in range(400)])
    sorted_batches = token_budget_batches(samples, max_tokens=4096)
    size = max(1, len(samples) // len(sorted_batches))  # the same number of batches, in input order
    input_order = [samples[i:i + size] for i in range(0, len(samples), size)]

    assert padding_efficiency(sorted_batches) > 0.9 > padding_efficiency(input_order)


def test_edge_cases():
    assert token_budget_batches([], max_tokens=10) == [] and padding_efficiency([]) == 1.0
    with pytest.raises(SpecgenError):
        token_budget_batches(samples_of_lengths([1]), max_tokens=0)
    with pytest.raises(SpecgenError):
        token_budget_batches(samples_of_lengths([1]), max_tokens=10, max_batch_size=0)
