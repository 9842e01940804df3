"""Overlap within one process: reading and tokenizing run ahead of the target, writing runs behind it.

    prefetch thread   source rows -> this process's unfinished work units, tokenized   (queue: pipeline.prefetch_units)
    main thread       length-bucketed batches -> target forward -> device-to-host copy
    writer thread     rows -> Arrow record batches -> shard, committed per unit         (queue: pipeline.write_queue)

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
    """Writes shards in a thread of its own, fed through a bounded queue; use as a context manager.

    For each unit: `begin(unit)`, `write(rows, ready)` per batch, `commit(stats, rejected, source_rows)`.
    Leaving the context normally waits for everything to be on disk and raises the writer's error if it had one;
    leaving it with an exception stops the thread and deletes the unfinished shard (as `ShardWriter` does).
    `on_batch(tokens)` and `on_commit(source_rows)` report progress from the writer thread.
    """

    def __init__(self, out_dir: str | Path, spec: ShardSpec, *, depth: int, on_batch: Callable[[int], None],
                 on_commit: Callable[[int], None], shard_writer: type = ShardWriter):
        if depth < 1:
            raise ValueError(f"write queue depth must be at least 1, got {depth}")
        self.out_dir, self.spec = Path(out_dir), spec
        self._on_batch, self._on_commit, self._shard_writer = on_batch, on_commit, shard_writer
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stopped = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="specgen-writer", daemon=True)
        self._thread.start()

    def __enter__(self) -> "BackgroundWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self._send(None)
            self._thread.join()
            self._raise_if_failed()
        else:
            self._stopped.set()
            self._thread.join()

    def begin(self, unit: int) -> None:
        self._send(("begin", unit))

    def write(self, rows: list[dict], ready: "torch.cuda.Event | None") -> None:
        self._send(("write", rows, ready))

    def commit(self, stats: dict, rejected: list[dict], source_rows: int, extra: dict | None = None) -> None:
        """Commit the unit's shard; `extra` adds entries to its sidecar."""
        self._send(("commit", stats, rejected, source_rows, extra))

    def _send(self, item) -> None:
        if not _put(self._queue, item, lambda: self._stopped.is_set() or self._error is not None):
            self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        with ExitStack() as open_shard:  # closing it deletes an uncommitted shard's temp file
            try:
                while not self._stopped.is_set():
                    try:
                        item = self._queue.get(timeout=POLL_SECONDS)
                    except queue.Empty:
                        continue
                    if item is None:
                        return
                    kind, *args = item
                    if kind == "begin":
                        shard = open_shard.enter_context(self._shard_writer(self.out_dir, args[0], self.spec))
                    elif kind == "write":
                        rows, ready = args
                        if ready is not None:
                            ready.synchronize()
                        shard.write(rows)
                        self._on_batch(sum(len(row["input_ids"]) for row in rows))
                    else:
                        stats, rejected, source_rows, extra = args
                        shard.commit(stats, rejected, **({"extra": extra} if extra else {}))
                        open_shard.close()
                        self._on_commit(source_rows)
            except BaseException as error:
                self._error = error
