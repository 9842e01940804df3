"""Which samples go together, in which order, on which process: one plan for offline and online training.

Two ways to fill a batch of `train.batch_tokens` tokens (`train.packing`):
* padded (default): samples of similar length side by side, right-padded to the longest (`length_batches`);
* packed: samples in random order laid end to end in one sequence (`packed_batches`, speculators' way); the draft
  attends within each sample only (`specgen.draft.batch.collate`, document ids), and no token is padding.

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


def packed_batches(lengths: Sequence[int], batch_tokens: int, max_batch_size: int | None,
                   rng: random.Random, open_packs: int = 64) -> list[list[int]]:
    """Group sample indices into packs whose total length fits `batch_tokens`: samples in random order, each put
    into the first of the last `open_packs` packs with room for it, else into a new pack (first fit over a
    window: dense packs in linear time); a sample longer than the budget is a pack of its own. Packs in random
    order."""
    if batch_tokens < 1:
        raise SpecgenError(f"train.batch_tokens must be positive, got {batch_tokens}")
    order = list(range(len(lengths)))
    rng.shuffle(order)
    packs: list[list[int]] = []
    room: list[int] = []  # free tokens of each pack
    for index in order:
        length = lengths[index]
        window = range(max(0, len(packs) - open_packs), len(packs))
        chosen = next((p for p in window if room[p] >= length
                       and (max_batch_size is None or len(packs[p]) < max_batch_size)), None)
        if chosen is None:
            packs.append([])
            room.append(batch_tokens)
            chosen = len(packs) - 1
        packs[chosen].append(index)
        room[chosen] -= length
    rng.shuffle(packs)
    return packs


def epoch_plan(lengths: Sequence[int], *, batch_tokens: int, max_batch_size: int | None, seed: int, epoch: int,
               rank: int, world_size: int, packing: bool = False) -> list[list[int]]:
    """This process's batches for `epoch`. Every process gets the same number of batches (a few at the end of
    the shuffled order are left out) so data-parallel steps stay in lockstep."""
    group = packed_batches if packing else length_batches
    batches = group(lengths, batch_tokens, max_batch_size, random.Random(f"{seed}-{epoch}"))
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
    packing: bool = False  # each batch is one packed sequence (see the module docstring)

    def epoch(self, lengths: Sequence[int], epoch: int) -> list[list[int]]:
        return epoch_plan(lengths, batch_tokens=self.batch_tokens, max_batch_size=self.max_batch_size,
                          seed=self.seed, epoch=epoch, rank=self.rank, world_size=self.world_size,
                          packing=self.packing)
