"""Overlap within one process: reading and tokenizing run ahead of the target, writing runs behind it.

    prefetch thread   source rows -> this process's unfinished work units, tokenized   (queue: pipeline.prefetch_units)
    main thread       length-bucketed batches -> target forward -> device-to-host copy
    writer threads    rows -> Arrow record batches -> shard, committed per unit         (queue: pipeline.write_queue)
                      (pipeline.writers threads take the units in turn; shards still commit in unit order)

Both queues are bounded, so memory stays bounded: at most `write_queue` captured batches wait for the disk, and the
main thread only waits when the disk is slower than the target. On CUDA the captured tensors are copied into pinned
host memory on a side stream (`copy_to_host`), so the copy overlaps the next batch's forward; the writer waits for
that copy, never the main thread. Errors in either thread are re-raised in the main thread.
"""

import functools
import queue
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import fields
from pathlib import Path
from typing import TypeVar

import torch

from specgen.capture.target import CaptureOutput
from specgen.store.columns import ShardSpec
from specgen.store.writer import ShardWriter

T = TypeVar("T")
# How often a blocked producer looks up from a full queue to see whether its consumer gave up.
POLL_SECONDS = 0.1


def _put(q: queue.Queue, item, stop: Callable[[], bool]) -> bool:
    """Put `item` unless `stop()` becomes true while waiting for room; returns whether it was put."""
    while not stop():
        try:
            q.put(item, timeout=POLL_SECONDS)
            return True
        except queue.Full:
            continue
    return False


def prefetched(items: Iterator[T], depth: int, name: str = "specgen-prefetch") -> Iterator[T]:
    """Iterate `items` in a background thread, at most `depth` items ahead; its exceptions are raised here.

    Close the returned generator (or exhaust it) to stop the thread.
    """
    if depth < 1:
        raise ValueError(f"prefetch depth must be at least 1, got {depth}")
    q: queue.Queue = queue.Queue(maxsize=depth)
    stopped = threading.Event()
    end = object()

    def produce() -> None:
        try:
            for item in items:
                if not _put(q, (item, None), stopped.is_set):
                    return
            _put(q, (end, None), stopped.is_set)
        except BaseException as error:  # handed to the consumer, which raises it in its own thread
            _put(q, (end, error), stopped.is_set)

    thread = threading.Thread(target=produce, name=name, daemon=True)
    thread.start()
    try:
        while True:
            item, error = q.get()
            if error is not None:
                raise error
            if item is end:
                return
            yield item
    finally:
        stopped.set()
        thread.join()


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Move a host tensor to `device`; to CUDA through pinned memory without blocking the host, so the main thread
    can queue the next forward while the device still runs the previous one."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


@functools.cache
def _copy_stream(device: torch.device) -> "torch.cuda.Stream":
    return torch.cuda.Stream(device)


def copy_to_host(out: CaptureOutput) -> tuple[CaptureOutput, "torch.cuda.Event | None"]:
    """Start copying a capture's tensors to the host; returns the host tensors and an event set when they are there.

    On the CPU this returns `out` itself and no event. On CUDA the copy runs on a side stream into pinned memory,
    after the forward that made the tensors; `record_stream` keeps the allocator from handing their memory to the
    next batch before the copy has read it. Read the host tensors only after `event.synchronize()`.
    """
    tensors = {field.name: getattr(out, field.name) for field in fields(out)}
    on_device = {name: t for name, t in tensors.items() if isinstance(t, torch.Tensor) and t.is_cuda}
    if not on_device:
        return out, None
    device = next(iter(on_device.values())).device
    stream = _copy_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for name, tensor in on_device.items():
            pinned = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            pinned.copy_(tensor, non_blocking=True)
            tensor.record_stream(stream)
            tensors[name] = pinned
    copied = torch.cuda.Event()
    copied.record(stream)
    return CaptureOutput(**tensors), copied


class BackgroundWriter:
    """Writes shards on threads of their own, fed through a bounded queue; use as a context manager.

    For each unit: `begin(unit)`, `write(rows, ready)` per batch, `commit(stats, rejected, source_rows)`.
    Leaving the context normally waits for everything to be on disk and raises the writer's error if it had one;
    leaving it with an exception stops the threads and deletes the unfinished shards (as `ShardWriter` does).
    `on_batch(tokens)` and `on_commit(source_rows)` report progress from the writer threads, one call at a time.

    writers=N: N threads take the units in turn (the k-th unit begun goes to thread k % N), so one shard's last
    batches and its commit (the fsync) overlap the next shard's first batches. Shards are still committed, and
    `on_commit` called, in the order their units were begun: a unit waits for the one before it, and after an error
    none is committed, so a kill or a failure leaves the same finished shards as with one thread. At most `depth`
    items wait in the queues of all threads together; each thread holds one more, the batch it is writing.
    """

    def __init__(self, out_dir: str | Path, spec: ShardSpec, *, depth: int, on_batch: Callable[[int], None],
                 on_commit: Callable[[int], None], shard_writer: Callable[..., ShardWriter] = ShardWriter,
                 writers: int = 1):
        if depth < 1:
            raise ValueError(f"write queue depth must be at least 1, got {depth}")
        if writers < 1:
            raise ValueError(f"the number of writer threads must be at least 1, got {writers}")
        self.out_dir, self.spec = Path(out_dir), spec
        self._on_batch, self._on_commit, self._shard_writer = on_batch, on_commit, shard_writer
        self._slots = threading.Semaphore(depth)  # places left in the queues, taken by `_send`, freed when taken off
        self._queues: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(writers)]
        self._stopped = threading.Event()
        self._error: BaseException | None = None
        self._reporting = threading.Lock()  # the callbacks run one at a time
        self._turn = threading.Condition()  # guards the commit order below
        self._next_commit, self._settled = 0, set()  # the unit (in begin order) whose turn it is; later ones done
        self._begun, self._open = 0, None  # units begun so far; the one begun and not yet committed (main thread)
        names = ["specgen-writer"] if writers == 1 else [f"specgen-writer-{i}" for i in range(writers)]
        self._threads = [threading.Thread(target=self._run, args=(q,), name=name, daemon=True)
                         for q, name in zip(self._queues, names, strict=True)]
        for thread in self._threads:
            thread.start()

    def __enter__(self) -> "BackgroundWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            for q in self._queues:
                q.put(None)
            for thread in self._threads:
                thread.join()
            self._raise_if_failed()
        else:
            self._stopped.set()
            for thread in self._threads:
                thread.join()

    def begin(self, unit: int) -> None:
        if self._open is not None:  # the previous unit was never committed: its thread drops its partial shard
            self._send(("drop",))
        self._open, self._begun = self._begun, self._begun + 1
        self._send(("begin", unit, self._open))

    def write(self, rows: list[dict], ready: "torch.cuda.Event | None") -> None:
        self._send(("write", rows, ready))

    def commit(self, stats: dict, rejected: list[dict], source_rows: int, extra: dict | None = None) -> None:
        """Commit the unit's shard; `extra` adds entries to its sidecar."""
        self._send(("commit", stats, rejected, source_rows, extra))
        self._open = None

    def _send(self, item) -> None:
        """Queue `item` for the thread of the open unit, waiting for a place unless a thread failed or we stop."""
        if self._open is None:
            raise RuntimeError("BackgroundWriter: begin(unit) before writing or committing")
        while not self._slots.acquire(timeout=POLL_SECONDS):
            if self._stopped.is_set() or self._error is not None:
                self._raise_if_failed()
                return
        self._queues[self._open % len(self._queues)].put(item)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self, items: queue.SimpleQueue) -> None:
        with ExitStack() as open_shard:  # closing it deletes an uncommitted shard's temp file
            try:
                while not self._stopped.is_set() and self._error is None:
                    try:
                        item = items.get(timeout=POLL_SECONDS)
                    except queue.Empty:
                        continue
                    if item is None:
                        return
                    self._slots.release()
                    kind, *args = item
                    if kind == "begin":
                        unit, order = args
                        shard = open_shard.enter_context(self._shard_writer(self.out_dir, unit, self.spec))
                    elif kind == "write":
                        rows, ready = args
                        if ready is not None:
                            ready.synchronize()
                        shard.write(rows)
                        with self._reporting:
                            self._on_batch(sum(len(row["input_ids"]) for row in rows))
                    elif kind == "commit":
                        stats, rejected, source_rows, extra = args
                        if not self._wait_for_turn(order):
                            return  # an earlier unit failed or the job stops: this one is not committed
                        shard.commit(stats, rejected, **({"extra": extra} if extra else {}))
                        open_shard.close()
                        with self._reporting:
                            self._on_commit(source_rows)
                        self._settle(order)
                    else:  # "drop"
                        open_shard.close()
                        self._settle(order)
            except BaseException as error:
                with self._turn:
                    if self._error is None:
                        self._error = error
                    self._turn.notify_all()

    def _wait_for_turn(self, order: int) -> bool:
        """Wait until every unit begun before this one is committed (or dropped); False if that will not happen."""
        with self._turn:
            while self._next_commit != order:
                if self._stopped.is_set() or self._error is not None:
                    return False
                self._turn.wait(POLL_SECONDS)
        return True

    def _settle(self, order: int) -> None:
        with self._turn:
            self._settled.add(order)
            while self._next_commit in self._settled:
                self._settled.remove(self._next_commit)
                self._next_commit += 1
            self._turn.notify_all()
