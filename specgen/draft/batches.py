"""Which samples go together, in which order, on which process: one plan for offline and online training.

A plan depends only on the sample lengths, the seed, the epoch and the number of processes, never on timing, so
a resumed run replays exactly the batches the interrupted run would have seen.
"""

import random
from collections.abc import Sequence
from dataclasses import dataclass

from specgen.errors import SpecgenError


def length_batches(lengths: Sequence[int], batch_tokens: int, max_batch_size: int | None,
                   rng: random.Random) -> list[list[int]]:
    """Group sample indices into batches whose padded size (batch size x longest) fits `batch_tokens`.

    Samples are sorted by length (ties broken randomly) and packed greedily, so neighbours have similar lengths
    and little padding is wasted; the batch order is then shuffled. A sample longer than the budget is a batch
    of its own.
    """
    if batch_tokens < 1:
        raise SpecgenError(f"train.batch_tokens must be positive, got {batch_tokens}")
    tiebreak = [rng.random() for _ in lengths]
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], tiebreak[i]))
    batches: list[list[int]] = []
    for index in order:
        if batches:
            batch = batches[-1]
            longest = lengths[batch[0]]
            if (len(batch) + 1) * longest <= batch_tokens and (max_batch_size is None or len(batch) < max_batch_size):
                batch.append(index)
                continue
        batches.append([index])
    rng.shuffle(batches)
    return batches


def epoch_plan(lengths: Sequence[int], *, batch_tokens: int, max_batch_size: int | None, seed: int, epoch: int,
               rank: int, world_size: int) -> list[list[int]]:
    """This process's batches for `epoch`. Every process gets the same number of batches (a few at the end of
    the shuffled order are left out) so data-parallel steps stay in lockstep."""
    batches = length_batches(lengths, batch_tokens, max_batch_size, random.Random(f"{seed}-{epoch}"))
    per_rank = len(batches) // world_size
    if per_rank == 0:
        raise SpecgenError(f"{len(lengths)} samples make {len(batches)} batches, fewer than the {world_size} "
                           "processes; use more data, a smaller train.batch_tokens or fewer processes")
    return batches[rank:per_rank * world_size:world_size]


@dataclass(frozen=True)
class BatchPlan:
    """The batching settings of a run and this process's place in it."""

    batch_tokens: int
    max_batch_size: int | None
    seed: int
    rank: int = 0
    world_size: int = 1

    def epoch(self, lengths: Sequence[int], epoch: int) -> list[list[int]]:
        return epoch_plan(lengths, batch_tokens=self.batch_tokens, max_batch_size=self.max_batch_size,
                          seed=self.seed, epoch=epoch, rank=self.rank, world_size=self.world_size)
