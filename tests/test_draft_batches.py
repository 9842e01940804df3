"""The training batch plan: padded batches of similar lengths, or packs of samples in random order."""

import random

import pytest

from specgen.training.plan import BatchPlan, length_batches, packed_batches

RNG = random.Random(0)
LENGTHS = [RNG.randint(1, 300) for _ in range(200)] + [700]  # one sample longer than the budget


@pytest.mark.parametrize("group", [length_batches, packed_batches])
def test_every_sample_once_within_the_budget(group):
    batches = group(LENGTHS, 512, None, random.Random(3))
    assert sorted(i for batch in batches for i in batch) == list(range(len(LENGTHS)))
    for batch in batches:
        size = sum(LENGTHS[i] for i in batch) if group is packed_batches else len(batch) * max(LENGTHS[i] for i in batch)
        assert size <= 512 or batch == [200]
    assert group(LENGTHS, 512, None, random.Random(3)) == batches  # the seed decides


def test_packs_fill_the_budget_with_mixed_lengths_and_respect_max_batch_size():
    packs = packed_batches(LENGTHS, 512, None, random.Random(0))
    padded = length_batches(LENGTHS, 512, None, random.Random(0))
    # Packing wastes no padding, so the same tokens take fewer batches.
    assert len(packs) < len(padded)
    assert sum(LENGTHS) / (len(packs) * 512) > 0.95
    # Packs are not length-sorted: most hold samples of very different lengths.
    spreads = [max(LENGTHS[i] for i in p) - min(LENGTHS[i] for i in p) for p in packs if len(p) > 1]
    assert sorted(spreads)[len(spreads) // 2] > 100
    assert max(len(p) for p in packed_batches(LENGTHS, 512, 2, random.Random(0))) == 2


def test_plan_packs_when_asked():
    plan = BatchPlan(batch_tokens=512, max_batch_size=None, seed=1, packing=True)
    assert plan.epoch(LENGTHS, 0) == packed_batches(LENGTHS, 512, None, random.Random("1-0"))
    assert plan.epoch(LENGTHS, 1) != plan.epoch(LENGTHS, 0)
