"""The in-process overlap machinery: the prefetch thread, the background writer, the job monitor, host copies."""

import threading
import time

import pytest
import torch

from specgen.capture.target import CaptureOutput
from specgen.ranks import Workers
from specgen.ranks.monitor import JobMonitor
from specgen.pipeline import BackgroundWriter, copy_to_host, prefetched
from specgen.store.reader import open_shards
from specgen.store.columns import ShardSpec
from specgen.store.writer import ShardWriter, finished_shards

SPEC = ShardSpec(hidden_size=4, num_aux=2, dtype="float32")


def rows(count: int, length: int = 3, first: int = 0) -> list[dict]:
    return [{"sample_id": f"s{first + i}", "input_ids": list(range(length)), "loss_mask": [0] + [1] * (length - 1),
             "aux_hidden_states": torch.full((length, 8), float(first + i)),
             "last_hidden_state": torch.full((length, 4), -float(first + i))} for i in range(count)]


def test_prefetched_runs_ahead_by_at_most_depth_and_keeps_order():
    produced = []

    def items():
        for i in range(10):
            produced.append(i)
            yield i

    stream = prefetched(items(), depth=2)
    assert next(stream) == 0
    time.sleep(0.2)
    assert len(produced) <= 1 + 2 + 1  # the one handed out, `depth` queued, one waiting for room
    assert list(stream) == list(range(1, 10))


def test_prefetched_raises_the_producer_error_in_order_and_stops_on_close():
    def failing():
        yield 1
        raise ValueError("row 7 is bad")

    stream = prefetched(failing(), depth=4)
    assert next(stream) == 1
    with pytest.raises(ValueError, match="row 7"):
        next(stream)

    endless = prefetched(iter(range(10**9)), depth=1, name="endless")
    next(endless)
    endless.close()
    assert not any(thread.name == "endless" for thread in threading.enumerate())


@pytest.mark.parametrize("writers", [1, 2])
def test_background_writer_writes_what_shard_writer_writes(tmp_path, writers):
    committed, tokens = [], []
    with BackgroundWriter(tmp_path, SPEC, depth=2, on_batch=tokens.append, on_commit=committed.append,
                          writers=writers) as writer:
        for unit in range(3):
            writer.begin(unit)
            writer.write(rows(2, first=10 * unit), None)
            writer.write(rows(1, length=5, first=10 * unit + 2), None)
            writer.commit({"samples": 3}, [], 4)
    assert sorted(finished_shards(tmp_path)) == [0, 1, 2]
    # commits come in unit order; batches are reported as each writer thread writes them (units interleave)
    assert committed == [4, 4, 4] and sorted(tokens) == sorted([6, 5] * 3)
    if writers == 1:
        assert tokens == [6, 5] * 3
    dataset = open_shards(tmp_path)
    assert [dataset[i]["sample_id"] for i in range(len(dataset))] == ["s0", "s1", "s2", "s10", "s11", "s12",
                                                                       "s20", "s21", "s22"]
    assert torch.equal(dataset[4]["aux_hidden_states"], torch.full((3, 8), 11.0))


class SlowShardWriter(ShardWriter):
    """A disk that takes 0.2 s per record batch."""

    def write(self, rows: list[dict]) -> None:
        time.sleep(0.2)
        super().write(rows)


def test_background_writer_lets_compute_run_ahead_until_the_queue_is_full(tmp_path):
    with BackgroundWriter(tmp_path, SPEC, depth=3, on_batch=lambda t: None, on_commit=lambda r: None,
                          shard_writer=SlowShardWriter) as writer:
        writer.begin(0)
        started = time.perf_counter()
        for i in range(3):
            writer.write(rows(1, first=i), None)
        queued = time.perf_counter() - started  # the disk is busy with the first batch; these only wait in line
        for i in range(3, 6):
            writer.write(rows(1, first=i), None)
        blocked = time.perf_counter() - started  # the queue was full: compute waited for the disk
        writer.commit({}, [], 6)
    assert queued < 0.15 and blocked > 0.3
    assert len(open_shards(tmp_path)) == 6


class BrokenShardWriter(ShardWriter):
    def write(self, rows: list[dict]) -> None:
        raise OSError("disk full")


@pytest.mark.parametrize("writers", [1, 2])
def test_background_writer_errors_reach_the_main_thread_and_leave_no_shard(tmp_path, writers):
    with pytest.raises(OSError, match="disk full"):
        with BackgroundWriter(tmp_path, SPEC, depth=1, on_batch=lambda t: None, on_commit=lambda r: None,
                              shard_writer=BrokenShardWriter, writers=writers) as writer:
            writer.begin(0)
            for i in range(10):
                writer.write(rows(1, first=i), None)
            writer.commit({}, [], 10)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("writers", [1, 2])
def test_background_writer_abandoned_by_an_error_deletes_the_partial_shard(tmp_path, writers):
    with pytest.raises(RuntimeError, match="forward failed"):
        with BackgroundWriter(tmp_path, SPEC, depth=2, on_batch=lambda t: None, on_commit=lambda r: None,
                              writers=writers) as writer:
            writer.begin(0)
            writer.write(rows(2), None)
            writer.begin(1)
            writer.write(rows(2), None)
            raise RuntimeError("forward failed")
    assert list(tmp_path.iterdir()) == []


BF16 = ShardSpec(hidden_size=16, num_aux=3, dtype="bfloat16")


def captured_rows(unit: int, lengths: list[int], layout: str) -> list[dict]:
    """Rows as the capture hands them over: slices of one packed [1, sum(T), H] output, of one right-padded
    [B, max(T), H] output, or (`packed-filtered`) a packed output whose second row the sample filter dropped."""
    generator = torch.Generator().manual_seed(unit)
    total, longest = sum(lengths), max(lengths)
    shape = (1, total) if layout.startswith("packed") else (len(lengths), longest)
    aux = torch.randn(*shape, 3 * 16, generator=generator).to(torch.bfloat16)
    last = torch.randn(*shape, 16, generator=generator).to(torch.bfloat16)
    result, lo = [], 0
    for i, length in enumerate(lengths):
        ids = torch.randint(0, 128_000, (length,), generator=generator)  # int64, cast to int32 by the writer
        row = {"sample_id": f"u{unit}-{layout}-{i}", "source_index": i, "input_ids": ids if i % 2 else ids.tolist(),
               "loss_mask": [0] + [1] * (length - 1)}
        if layout.startswith("packed"):
            row["aux_hidden_states"], row["last_hidden_state"] = aux[0, lo:lo + length], last[0, lo:lo + length]
        else:
            row["aux_hidden_states"], row["last_hidden_state"] = aux[i, :length], last[i, :length]
        lo += length
        result.append(row)
    return [row for i, row in enumerate(result) if not (layout == "packed-filtered" and i == 1)]


def write_units(out_dir, writers: int, shard_writer=ShardWriter) -> list[int]:
    committed = []
    with BackgroundWriter(out_dir, BF16, depth=2, on_batch=lambda t: None, on_commit=committed.append,
                          shard_writer=shard_writer, writers=writers) as writer:
        for unit in range(5):
            writer.begin(unit)
            for layout in ("packed", "padded", "packed-filtered", "packed"):
                writer.write(captured_rows(unit, [5 + unit, 1, 9, 3], layout), None)
            writer.write(captured_rows(unit, [7], "packed"), None)  # a batch of one row
            writer.commit({"unit": unit}, [], 100 + unit, extra={"top": {"1": unit}})
    return committed


def test_shards_are_byte_identical_whatever_the_write_path(tmp_path):
    """The path before issue #40 (torch.cat, sha256 between the writes, one thread) and today's (rows of a packed
    batch handed over without a copy, hashing on a helper thread, several writer threads) write the same bytes and
    record the same checksums."""
    import functools
    import hashlib

    from specgen.store.writer import read_sidecar

    before = functools.partial(ShardWriter, overlap_hash=False, fewer_copies=False)
    assert write_units(tmp_path / "before", 1, before) == [100, 101, 102, 103, 104]
    assert write_units(tmp_path / "after", 3) == [100, 101, 102, 103, 104]  # on_commit in unit order
    for unit, path in finished_shards(tmp_path / "before").items():
        after = tmp_path / "after" / path.name
        assert after.read_bytes() == path.read_bytes()
        sidecar = read_sidecar(tmp_path / "after", unit)
        assert sidecar == read_sidecar(tmp_path / "before", unit)
        assert sidecar["checksum"]["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert sorted(finished_shards(tmp_path / "after")) == [0, 1, 2, 3, 4]
    dataset = open_shards(tmp_path / "after")
    row = captured_rows(2, [7, 1, 9, 3], "padded")[2]
    item = next(dataset[i] for i in range(len(dataset)) if dataset[i]["sample_id"] == "u2-padded-2")
    assert torch.equal(item["aux_hidden_states"].view(torch.int16), row["aux_hidden_states"].view(torch.int16))


class TimedShardWriter(ShardWriter):
    """Unit 0 writes slowly; every unit logs when it starts writing and when its commit is done."""

    log: list = []

    def write(self, rows: list[dict]) -> None:
        self.log.append(("write", self.index))
        if self.index == 0:
            time.sleep(0.3)
        super().write(rows)

    def commit(self, *args, **kwargs):
        path = super().commit(*args, **kwargs)
        self.log.append(("committed", self.index))
        return path


def test_writer_threads_overlap_units_and_commit_them_in_order(tmp_path):
    TimedShardWriter.log = []
    committed = []
    with BackgroundWriter(tmp_path, SPEC, depth=4, on_batch=lambda t: None, on_commit=committed.append,
                          shard_writer=TimedShardWriter, writers=2) as writer:
        for unit in range(4):
            writer.begin(unit)
            writer.write(rows(2, first=10 * unit), None)
            writer.commit({}, [], unit)
    log = TimedShardWriter.log
    assert log.index(("write", 1)) < log.index(("committed", 0))  # unit 1 was written while unit 0 was
    assert [entry for entry in log if entry[0] == "committed"] == [("committed", unit) for unit in range(4)]
    assert committed == [0, 1, 2, 3]
    assert sorted(finished_shards(tmp_path)) == [0, 1, 2, 3]


class FailingCommitShardWriter(ShardWriter):
    def commit(self, *args, **kwargs):
        if self.index == 1:
            raise OSError("disk full")
        return super().commit(*args, **kwargs)


def test_a_failed_unit_stops_the_units_after_it_on_other_writer_threads(tmp_path):
    """Unit 2 is written by the other thread while unit 1 fails: it is not committed, as with one thread."""
    committed = []
    with pytest.raises(OSError, match="disk full"):
        with BackgroundWriter(tmp_path, SPEC, depth=2, on_batch=lambda t: None, on_commit=committed.append,
                              shard_writer=FailingCommitShardWriter, writers=2) as writer:
            for unit in range(3):
                writer.begin(unit)
                writer.write(rows(1, first=unit), None)
                writer.commit({}, [], unit)
    assert committed == [0]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["shard-00000.arrow", "shard-00000.json"]


def test_a_unit_begun_again_without_a_commit_is_dropped(tmp_path):
    with BackgroundWriter(tmp_path, SPEC, depth=2, on_batch=lambda t: None, on_commit=lambda r: None,
                          writers=2) as writer:
        writer.begin(0)
        writer.write(rows(1), None)
        writer.begin(1)  # unit 0 abandoned: its thread deletes the partial shard, unit 1 may still commit
        writer.write(rows(1), None)
        writer.commit({}, [], 1)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["shard-00001.arrow", "shard-00001.json"]


def test_single_process_monitor_counts_the_job():
    monitor = JobMonitor(Workers(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")), 10,
                         enabled=False, heartbeat_s=2.0)
    monitor.add(rows=4)
    monitor.add(tokens=100)
    monitor.check()
    totals, seconds = monitor.finish()
    assert (totals.rows, totals.tokens) == (4, 100) and seconds >= 0


def test_copy_to_host_is_the_identity_on_cpu():
    out = CaptureOutput(torch.ones(2, 3, 8), torch.zeros(2, 3, 4))
    host, ready = copy_to_host(out)
    assert host is out and ready is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_copy_to_host_overlaps_and_is_exact_on_cuda():
    out = CaptureOutput(torch.randn(4, 64, 96, device="cuda"), torch.randn(4, 64, 32, device="cuda"))
    host, ready = copy_to_host(out)
    ready.synchronize()
    assert host.aux_hidden_states.is_pinned() and host.last_hidden_state.is_pinned()
    assert torch.equal(host.aux_hidden_states, out.aux_hidden_states.cpu())
    assert torch.equal(host.last_hidden_state, out.last_hidden_state.cpu())
