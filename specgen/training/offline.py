"""Offline batches: samples read from shards (`specgen.open_shards`), batched per the plan, loaded by a DataLoader."""

from collections.abc import Iterable, Sequence
from functools import partial

from torch.utils.data import DataLoader, Dataset

from specgen.draft.batch import DraftBatch, collate
from specgen.runtime.reaper import dataloader_worker_init
from specgen.store.reader import ShardDataset
from specgen.training.plan import BatchPlan


class OfflineBatches:
    """Batches of a shard dataset (padded or packed, per the plan), of the samples `indices` (default: all).
    Worker processes re-open the memory maps themselves, and die with the process that iterates the loader
    (parent-death signal), even by `kill -9`."""

    def __init__(self, dataset: ShardDataset, plan: BatchPlan, *, num_workers: int = 0, pin_memory: bool = False,
                 indices: Sequence[int] | None = None):
        self.dataset = dataset
        self.plan = plan
        lengths = dataset.lengths()
        self.indices = list(range(len(lengths))) if indices is None else list(indices)
        self.lengths = [lengths[i] for i in self.indices]
        self.num_workers = num_workers
        self.pin_memory = pin_memory

    def batches_per_epoch(self) -> int:
        return len(self.plan.epoch(self.lengths, 0))

    def epoch(self, epoch: int, skip: int = 0) -> Iterable[DraftBatch]:
        """The batches of `epoch`, leaving out the first `skip` (already trained before a resume)."""
        batches = [[self.indices[i] for i in batch] for batch in self.plan.epoch(self.lengths, epoch)[skip:]]
        if not batches:
            return []
        return DataLoader(Indexed(self.dataset), batch_sampler=batches,
                          collate_fn=partial(collate, packed=self.plan.packing), num_workers=self.num_workers,
                          pin_memory=self.pin_memory, persistent_workers=False, worker_init_fn=dataloader_worker_init,
                          prefetch_factor=4 if self.num_workers else None)


class Indexed(Dataset):
    """A dataset's rows with their index as `sample_index`: batches then say which samples they hold, which the
    target head's `ArgmaxCache` keys on."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict:
        return {**self.dataset[index], "sample_index": index}
