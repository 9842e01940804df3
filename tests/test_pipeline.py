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


def test_background_writer_writes_what_shard_writer_writes(tmp_path):
    committed, tokens = [], []
    with BackgroundWriter(tmp_path, SPEC, depth=2, on_batch=tokens.append, on_commit=committed.append) as writer:
        for unit in range(3):
            writer.begin(unit)
            writer.write(rows(2, first=10 * unit), None)
            writer.write(rows(1, length=5, first=10 * unit + 2), None)
            writer.commit({"samples": 3}, [], 4)
    assert sorted(finished_shards(tmp_path)) == [0, 1, 2]
    assert committed == [4, 4, 4] and tokens == [6, 5] * 3
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


def test_background_writer_errors_reach_the_main_thread_and_leave_no_shard(tmp_path):
    with pytest.raises(OSError, match="disk full"):
        with BackgroundWriter(tmp_path, SPEC, depth=1, on_batch=lambda t: None, on_commit=lambda r: None,
                              shard_writer=BrokenShardWriter) as writer:
            writer.begin(0)
            for i in range(10):
                writer.write(rows(1, first=i), None)
            writer.commit({}, [], 10)
    assert list(tmp_path.iterdir()) == []


def test_background_writer_abandoned_by_an_error_deletes_the_partial_shard(tmp_path):
    with pytest.raises(RuntimeError, match="forward failed"):
        with BackgroundWriter(tmp_path, SPEC, depth=2, on_batch=lambda t: None, on_commit=lambda r: None) as writer:
            writer.begin(0)
            writer.write(rows(2), None)
            raise RuntimeError("forward failed")
    assert list(tmp_path.iterdir()) == []


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
