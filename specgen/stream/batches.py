"""Stream batches: the trainer's side of disaggregated training, a batch source like the offline and online ones.

The samples and the batch plan are the online trainer's; a batch's hidden states come from capture servers. The
source posts requests for the batches it will need next, across epoch ends (at most `window`, and at most
`max_bytes` of them counted at float32 size, so the objects never exceed the cap), takes each object in plan order
when the trainer asks for the batch, withdraws the request and frees the object, and posts the next one. Resuming
with `skip` posts again from the first untrained batch.
"""

import logging
import time
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from specgen.data.sample import TokenizedSample
from specgen.draft.batch import DraftBatch
from specgen.errors import SpecgenError
from specgen.stream.spool import Spool, batch_name
from specgen.stream.transport import FileTransport, UnreadableObject
from specgen.training.online import collate_captured
from specgen.training.plan import BatchPlan

log = logging.getLogger("specgen.stream")

_HEADER_BYTES = 4096  # allowance for an object's safetensors header and metadata
_SAY_WAITING_S = 30.0  # log a line when one batch has been waited for this long


@dataclass(frozen=True)
class StreamSettings:
    window: int = 4  # requests this trainer process keeps outstanding
    max_bytes: int = 8 << 30  # cap on all trainer processes' outstanding objects together (float32 bound)
    poll_s: float = 0.05  # seconds between looks for an object being waited for
    wait_timeout_s: float = 900.0  # fail when the batch needed next has not come for this long


class StreamBatches:
    """Batches of tokenized samples whose hidden states capture servers provide through `spool` and `transport`."""

    def __init__(self, samples: list[TokenizedSample], plan: BatchPlan, spool: Spool, transport: FileTransport,
                 settings: StreamSettings, *, pad_id: int, bytes_per_token: int, identity: str):
        self.samples, self.plan, self.spool, self.transport = samples, plan, spool, transport
        self.identity = identity  # the run's, which servers put in each object's metadata
        self.settings, self.pad_id, self.bytes_per_token = settings, pad_id, bytes_per_token
        self.lengths = [len(sample) for sample in samples]
        self.budget = settings.max_bytes // plan.world_size
        largest = max(plan.batch_tokens, max(self.lengths))
        if self._bound(largest) > self.budget:
            raise SpecgenError(f"stream.max_bytes={settings.max_bytes:,} leaves {self.budget:,} bytes to each of "
                               f"{plan.world_size} trainer processes, less than one batch of up to {largest:,} "
                               f"tokens ({self._bound(largest):,} bytes at float32): raise stream.max_bytes or "
                               "lower train.batch_tokens")
        self.by_server: Counter = Counter()
        self.unreadable = 0  # objects that could not be read, captured again
        self.foreign = 0  # objects of an earlier run on the folder (finished after it was replaced), captured again
        self.wait_s = 0.0
        self.peak_bound = 0  # the most bytes this process had outstanding, at float32
        self._pending: deque[tuple[int, int, str, list[int], int]] = deque()  # posted: epoch, index, name, ..., bound
        self._following = (0, 0)  # the next (epoch, batch) to post
        self._plans: dict[int, list[list[int]]] = {}

    def batches_per_epoch(self) -> int:
        return len(self.plan.epoch(self.lengths, 0))

    def epoch(self, epoch: int, skip: int = 0) -> Iterator[DraftBatch]:
        """The batches of `epoch` from batch `skip` on. Requests run ahead across the end of the epoch into the
        next one, so servers never idle at an epoch boundary; a call that does not continue where the posted ones
        begin (a first call, a resume) starts the stream afresh from (epoch, skip)."""
        if not self._pending or self._pending[0][:2] != (epoch, skip):
            self._restart(epoch, skip)
        for index in range(skip, len(self._plan(epoch))):
            self._post_ahead()
            posted_epoch, posted_index, name, indices, _ = self._pending.popleft()
            assert (posted_epoch, posted_index) == (epoch, index), "stream requests out of plan order"
            tensors = self._take(name, indices)
            self._post_ahead()  # captured while this one trains
            yield self._batch(indices, tensors)

    def _restart(self, epoch: int, skip: int) -> None:
        for *_, name, _, _ in self._pending:
            self.spool.withdraw(name)
            self.transport.delete(name)
        self._pending.clear()
        self._following = (epoch, skip)

    def _plan(self, epoch: int) -> list[list[int]]:
        """This process's batches of `epoch` (the current and the next epoch's are kept)."""
        if epoch not in self._plans:
            self._plans = {e: batches for e, batches in self._plans.items() if e >= epoch - 1}
            self._plans[epoch] = self.plan.epoch(self.lengths, epoch)
        return self._plans[epoch]

    def _post_ahead(self) -> None:
        """Post requests, in plan order across epochs, until `window` are outstanding or the next would pass this
        process's byte budget (one is always allowed: no batch exceeds the budget)."""
        while len(self._pending) < self.settings.window:
            epoch, index = self._following
            batches = self._plan(epoch)
            if index >= len(batches):
                self._following = (epoch + 1, 0)
                continue
            indices = batches[index]
            bound = self._bound(sum(self.lengths[i] for i in indices))
            outstanding = sum(entry[-1] for entry in self._pending)
            if self._pending and outstanding + bound > self.budget:
                return
            name = batch_name(epoch, index, self.plan.rank)
            self.spool.post(name, self._request(indices))
            self._pending.append((epoch, index, name, indices, bound))
            self.peak_bound = max(self.peak_bound, outstanding + bound)
            self._following = (epoch, index + 1)

    def _request(self, indices: list[int]) -> dict:
        return {"input_ids": [self.samples[i].input_ids for i in indices], "pad_id": self.pad_id}

    def _take(self, name: str, indices: list[int]) -> dict[str, torch.Tensor]:
        """Wait for the object of batch `name`, then withdraw the request and free the object."""
        start = said = time.monotonic()
        while True:
            try:
                got = self.transport.get(name)
            except UnreadableObject as error:
                log.warning("%s; captured again", error)
                self.unreadable += 1
                self.transport.delete(name)
                got = None
            if got is not None and got[1].get("run") != self.identity:
                self.foreign += 1
                self.transport.delete(name)
                got = None
            if got is not None:
                break
            now = time.monotonic()
            if self.spool.read_request(name) is None:  # cleared under us (a new run on the folder): ask again
                self.spool.post(name, self._request(indices))
            if now - start > self.settings.wait_timeout_s:
                raise SpecgenError(f"no capture server delivered batch {name} in {self.settings.wait_timeout_s:.0f}s "
                                   f"({len(self.spool.live_servers())} live servers on {self.spool.root}); start "
                                   f"one: python -m specgen.capture_server stream.dir={self.spool.root} "
                                   "model.path=TARGET, or raise stream.wait_timeout_s")
            if now - said > _SAY_WAITING_S:
                log.warning("waiting %.0fs for batch %s (%d live capture servers)", now - start, name,
                            len(self.spool.live_servers()))
                said = now
            time.sleep(self.settings.poll_s)
        self.wait_s += time.monotonic() - start
        tensors, meta = got
        self.spool.withdraw(name)
        self.transport.delete(name)
        self.by_server[meta.get("server", "unknown")] += 1
        return tensors

    def _batch(self, indices: list[int], tensors: dict[str, torch.Tensor]) -> DraftBatch:
        """The object's rows beside the samples' ids and masks, laid out as online and offline batches are."""
        lengths = tensors["lengths"].tolist()
        if lengths != [self.lengths[i] for i in indices]:
            raise SpecgenError(f"a capture server returned lengths {lengths} for samples of lengths "
                               f"{[self.lengths[i] for i in indices]}: it serves another run on {self.spool.root}")
        return collate_captured([self.samples[i] for i in indices], tensors, self.pad_id, packed=self.plan.packing)

    def _bound(self, tokens: int) -> int:
        return tokens * self.bytes_per_token + _HEADER_BYTES

    def report(self) -> str:
        """What this process received, for the summary."""
        servers = ", ".join(f"{server}: {count}" for server, count in sorted(self.by_server.items()))
        return (f"{sum(self.by_server.values())} batches from {len(self.by_server)} capture servers ({servers}); "
                f"waited {self.wait_s:.1f}s for data; at most {self.peak_bound / 2**20:,.1f} MiB outstanding "
                f"(cap {self.budget / 2**20:,.1f} MiB per process)"
                + (f"; {self.unreadable} unreadable objects captured again" if self.unreadable else "")
                + (f"; {self.foreign} objects of an earlier run captured again" if self.foreign else ""))
