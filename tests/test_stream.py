"""Disaggregated training (`specgen.stream`): capture servers in their own processes feed a trainer through a folder.

The reference is online training of the same samples, plan and target: a disaggregated run must end with bit-for-bit
its weights, whichever servers captured which batch, after a server is killed mid-request, and after the trainer is
killed and resumed; the captured batches held in the folder never pass `stream.max_bytes`.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specgen.errors import SpecgenError
from specgen.store.lease import LeaseHeld, acquire_lease
from specgen.stream import FileTransport, Spool
from specgen.stream.spool import CLAIMS, OBJECTS, REQUESTS
from tests.test_train import QUICK, data_overrides, target, train  # noqa: F401 (fixture)

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
FAST = ["stream.poll_s=0.01", "stream.stale_s=5"]
STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def no_process_left():
    """Whatever a test started ends with it, failed or not."""
    yield
    while STARTED:
        process = STARTED.pop()
        if process.poll() is None:
            process.kill()
            process.wait()


def start_server(stream: Path, model: Path, name: str, *extra: str) -> subprocess.Popen:
    return started(subprocess.Popen([sys.executable, "-m", "specgen.capture_server", f"stream.dir={stream}",
                                     f"model.path={model}", f"stream.server_id={name}", "runtime.threads=1", *FAST,
                                     *extra], cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True))


def started(process: subprocess.Popen) -> subprocess.Popen:
    STARTED.append(process)
    return process


def disaggregated(stream: Path, model: Path, out: Path, *extra: str) -> list[str]:
    return ["mode=disaggregated", f"stream.dir={stream}", f"model.path={model}", *data_overrides(), *FAST,
            f"output.dir={out}", *extra]


def start_trainer(overrides: list[str]) -> subprocess.Popen:
    return started(subprocess.Popen([sys.executable, "-m", "specgen.train", *QUICK, *overrides], cwd=REPO, env=ENV,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))


def finish(process: subprocess.Popen, timeout: float = 300) -> str:
    out, _ = process.communicate(timeout=timeout)
    assert process.returncode == 0, out[-3000:]
    return out


def same_weights(a: Path, b: Path) -> bool:
    left, right = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return left.keys() == right.keys() and all(torch.equal(left[name], right[name]) for name in left)


def wait_for(condition, timeout: float = 120.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def claim_of(server: str, stream: Path) -> Path | None:
    for path in (stream / CLAIMS).glob("*.json"):
        try:
            if json.loads(path.read_text() or "{}").get("server") == server:
                return path
        except (OSError, ValueError):
            pass
    return None


def empty(folder: Path) -> bool:
    return not any(folder.iterdir())


@pytest.fixture(scope="module")
def online(target, tmp_path_factory):  # noqa: F811
    """The reference: online training of the same samples for 8 steps (two epochs' worth)."""
    out = tmp_path_factory.mktemp("online")
    train(["mode=online", f"model.path={target}", *data_overrides(), f"output.dir={out}", "train.max_steps=8"])
    return out


def test_two_servers_feed_a_trainer_the_batches_online_training_computes(target, online, tmp_path):  # noqa: F811
    stream = tmp_path / "stream"
    servers = [start_server(stream, target, name) for name in ("a", "b")]
    train(disaggregated(stream, target, tmp_path / "ckpt", "train.max_steps=8"))
    assert same_weights(online, tmp_path / "ckpt")
    outputs = [finish(server, timeout=60) for server in servers]  # they exit once the run is done
    captured = sum(int(out.split("captured")[1].split("batches")[0]) for out in outputs)
    assert captured >= 8
    assert (stream / "done").exists()
    assert all(empty(stream / sub) for sub in (REQUESTS, CLAIMS, OBJECTS))
    # A server started after the run finished waits for the next run (here: until its idle limit), capturing nothing.
    late = finish(start_server(stream, target, "c", "stream.idle_exit_s=2"), timeout=120)
    assert "captured    0 batches" in late


def test_a_server_killed_mid_request_loses_nothing(target, tmp_path):  # noqa: F811
    """Server a is frozen while it holds a claim with no object yet, then killed with -9; server b takes that batch
    over and the run ends with the weights of an online run."""
    stream, steps = tmp_path / "stream", ["train.max_steps=30", "stream.window=1"]
    Spool(stream)  # the folders, before either side has started
    first = start_server(stream, target, "a")
    trainer = start_trainer(disaggregated(stream, target, tmp_path / "ckpt", *steps))
    train(["mode=online", f"model.path={target}", *data_overrides(), f"output.dir={tmp_path / 'online'}", *steps])
    held, deadline = None, time.monotonic() + 120
    while held is None:
        assert time.monotonic() < deadline and trainer.poll() is None, "server a never seen mid-request"
        if not any(name.endswith(".json") for name in os.listdir(stream / CLAIMS)):
            continue
        first.send_signal(signal.SIGSTOP)
        held = claim_of("a", stream)
        if held is None or (stream / OBJECTS / f"{held.stem}.safetensors").exists():
            held = None
            first.send_signal(signal.SIGCONT)
    first.kill()
    first.wait()
    second = start_server(stream, target, "b")
    out = finish(trainer)
    assert "taken over  1 batches" in finish(second, timeout=60)
    assert "b: " in out
    assert same_weights(tmp_path / "online", tmp_path / "ckpt")


def test_a_trainer_killed_and_resumed_ends_with_the_uninterrupted_weights(target, online, tmp_path):  # noqa: F811
    stream, ckpt = tmp_path / "stream", tmp_path / "ckpt"
    server = start_server(stream, target, "a")
    common = disaggregated(stream, target, ckpt, "train.max_steps=8", "train.save_every=2", "stream.window=3")
    trainer = start_trainer(common)
    wait_for(lambda: (ckpt / "checkpoints" / "step-000004").is_dir(), what="the step-4 checkpoint")
    trainer.kill()
    trainer.wait()
    train([*common, "train.resume=true"])
    finish(server, timeout=60)
    assert same_weights(online, ckpt)


def test_the_captured_batches_never_pass_the_byte_cap(target, online, tmp_path, capsys):  # noqa: F811
    """A cap of about two batches (1 KiB per token: 3 aux layers + the last state of 64 floats) with a window of 8:
    the trainer asks for fewer batches ahead, never more bytes."""
    stream, cap = tmp_path / "stream", 600_000
    server = start_server(stream, target, "a")
    transport, peak, stop = FileTransport(stream / OBJECTS), [0], threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], transport.nbytes())
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        train(disaggregated(stream, target, tmp_path / "ckpt", "train.max_steps=8", "stream.window=8",
                            f"stream.max_bytes={cap}"))
    finally:
        stop.set()
        watcher.join()
    finish(server, timeout=60)
    assert 0 < peak[0] <= cap
    assert same_weights(online, tmp_path / "ckpt")
    stream_line = next(line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("stream"))
    assert "cap 0.6 MiB" in stream_line


def test_a_cap_below_one_batch_and_a_run_without_servers_fail_in_one_line(target, tmp_path):  # noqa: F811
    with pytest.raises(SpecgenError, match="stream.max_bytes=1,000 .* raise stream.max_bytes"):
        train(disaggregated(tmp_path / "s1", target, tmp_path / "c1", "stream.max_bytes=1000"))
    with pytest.raises(SpecgenError, match=r"no capture server delivered batch .* specgen.capture_server"):
        train(disaggregated(tmp_path / "s2", target, tmp_path / "c2", "stream.wait_timeout_s=0.5"))
    with pytest.raises(SpecgenError, match="stream.dir"):
        train(["mode=disaggregated", f"model.path={target}", *data_overrides(), f"output.dir={tmp_path / 'c3'}"])
    with pytest.raises(SpecgenError, match="stream.dir and output.dir are both"):
        train(disaggregated(tmp_path / "same", target, tmp_path / "same"))
    lease = acquire_lease(tmp_path / "s4", stage="train")  # another trainer on the same stream folder
    try:
        with pytest.raises(LeaseHeld, match="s4"):
            train(disaggregated(tmp_path / "s4", target, tmp_path / "c4"))
    finally:
        lease.release()


def test_a_server_refuses_a_run_of_another_target(target, tmp_path):  # noqa: F811
    stream = tmp_path / "stream"
    Spool(stream).start_run({"identity": "x", "aux_layers": [0, 1],
                             "target": {"path": "/elsewhere/target", "config_hash": "not-this-one"}})
    server = start_server(stream, target, "a")
    out, _ = server.communicate(timeout=120)
    assert server.returncode == 2
    assert "error: the run on" in out and "/elsewhere/target" in out and "start the server with the trainer's" in out


def test_a_claim_is_taken_over_only_from_a_server_that_is_gone(tmp_path):
    spool = Spool(tmp_path, stale_s=5)
    assert spool.claim("e0000-b0000000-r0000", "a") == (True, None)
    assert spool.claim("e0000-b0000000-r0000", "b") == (False, None)  # a (this process) is alive
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    claim = tmp_path / CLAIMS / "e0000-b0000001-r0000.json"
    claim.write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "pid_start": None, "server": "x"}))
    assert spool.claim("e0000-b0000001-r0000", "b") == (True, "x")  # killed: taken over at once
    other = tmp_path / CLAIMS / "e0000-b0000002-r0000.json"
    other.write_text(json.dumps({"host": "another-machine", "pid": 1, "server": "y"}))
    assert spool.claim("e0000-b0000002-r0000", "b") == (False, None)  # heartbeat fresh
    os.utime(other, (time.time() - 60, time.time() - 60))
    assert spool.claim("e0000-b0000002-r0000", "b") == (True, "y")  # heartbeat older than stale_s
    assert json.loads(other.read_text())["server"] == "b"


@pytest.mark.slow
def test_two_trainer_processes_share_two_servers(target, tmp_path):  # noqa: F811
    """accelerate launch with 2 processes (gloo): each posts its own batches; the step equals one process
    accumulating the same 2 batches online (as tests/test_train_distributed.py checks for offline and online)."""
    from tests.test_train_distributed import launch_two

    stream, steps = tmp_path / "stream", ["train.max_steps=3", "train.schedule_steps=3"]
    servers = [start_server(stream, target, name) for name in ("a", "b")]
    launch_two(disaggregated(stream, target, tmp_path / "two", *steps))
    train(["mode=online", f"model.path={target}", *data_overrides(), f"output.dir={tmp_path / 'one'}",
           "train.grad_accum=2", *steps])
    two, one = load_file(tmp_path / "two" / "model.safetensors"), load_file(tmp_path / "one" / "model.safetensors")
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-4, atol=1e-6, msg=name)
    for server in servers:
        finish(server, timeout=60)
    assert all(empty(stream / sub) for sub in (REQUESTS, CLAIMS, OBJECTS))


def test_an_object_of_an_earlier_run_is_captured_again(tmp_path):
    """An object a server finished for the run the folder held before (same name, another identity) is not
    trained on: the trainer deletes it and takes the one captured for its own run."""
    from specgen.data.sample import TokenizedSample
    from specgen.stream import StreamBatches, StreamSettings
    from specgen.stream.spool import batch_name
    from specgen.training.plan import BatchPlan

    samples = [TokenizedSample(f"s{i}", i, list(range(1, 4 + i)), [0, 1, 1] + [1] * i) for i in range(2)]
    spool, transport = Spool(tmp_path), FileTransport(tmp_path / OBJECTS)
    source = StreamBatches(samples, BatchPlan(batch_tokens=64, max_batch_size=None, seed=0), spool, transport,
                           StreamSettings(poll_s=0.01, wait_timeout_s=30), pad_id=0, bytes_per_token=64,
                           identity="mine")
    name = batch_name(0, 0, 0)

    def captured(lengths: list[int], value: float) -> dict:
        return {"aux": torch.full((sum(lengths), 6), value), "last": torch.full((sum(lengths), 2), value),
                "lengths": torch.tensor(lengths)}

    lengths = [len(samples[i]) for i in source.plan.epoch(source.lengths, 0)[0]]
    transport.put(name, captured(lengths, -1.0), {"server": "old", "run": "earlier"})

    def serve():  # a server of this run: captures the request once the stale object is gone
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (spool.read_request(name) and not transport.has(name)):
            time.sleep(0.01)
        transport.put(name, captured(lengths, 1.0), {"server": "new", "run": "mine"})

    server = threading.Thread(target=serve)
    server.start()
    batch = next(iter(source.epoch(0)))
    server.join()
    assert source.foreign == 1 and dict(source.by_server) == {"new": 1}
    assert torch.all(batch.aux_hidden_states[batch.document_ids >= 0] == 1.0)
    assert "1 objects of an earlier run captured again" in source.report()


def test_a_batch_withdrawn_while_its_object_is_written_is_not_left_behind(target, tmp_path):  # noqa: F811
    """The race CI met: the run ends (spool.finish clears the folder) after the server checked that the request is
    still wanted and before its put. The object must not stay in the folder once the server has exited."""
    from specgen.capture import make_capture
    from specgen.capture.target import load_target
    from specgen.stream import CaptureServer, ServerSettings

    spool, transport = Spool(tmp_path), FileTransport(tmp_path / OBJECTS)
    spool.start_run({"identity": "run", "aux_layers": [0, 1, 2]})
    spool.post("e0000-b0000000-r0000", {"input_ids": [[5, 6, 7, 8], [9, 10]], "pad_id": 0})
    model = load_target(str(target), dtype="float32", device="cpu")
    put = transport.put

    def finish_then_put(name, tensors, meta):
        spool.finish()  # the trainer's last step lands here
        return put(name, tensors, meta)

    transport.put = finish_then_put
    server = CaptureServer(spool, transport, lambda run: make_capture(model, list(run["aux_layers"])),
                           ServerSettings(poll_s=0.01, exit_when_done=True, idle_exit_s=30))
    counts = server.serve()
    assert counts["captured"] == 1 and spool.finished()  # it captured, then the run's end reached it
    assert all(empty(tmp_path / sub) for sub in (REQUESTS, CLAIMS, OBJECTS))


def test_a_put_whose_object_is_taken_at_once_still_returns_its_size(tmp_path, monkeypatch):
    """A trainer may take and delete an object the moment it appears: the server's put still succeeds and returns
    the size (a put that measured the published file after the rename raised FileNotFoundError in the server)."""
    transport, replace = FileTransport(tmp_path / OBJECTS), os.replace

    def publish_then_take(src, dst):
        replace(src, dst)
        assert transport.get("b") is not None  # the trainer reads it whole ...
        transport.delete("b")  # ... and frees it before put returns

    monkeypatch.setattr(os, "replace", publish_then_take)
    size = transport.put("b", {"aux": torch.ones(4, 3)}, {"run": "r"})
    assert size > 4 * 3 * 4 and not transport.has("b") and list((tmp_path / OBJECTS).iterdir()) == []


def test_requests_run_ahead_across_the_end_of_an_epoch(tmp_path):
    """While the last batch of epoch 0 trains, the first batches of epoch 1 are already asked for (servers never idle
    at an epoch boundary), and epoch 1 then continues that stream in plan order."""
    from specgen.data.sample import TokenizedSample
    from specgen.stream import StreamBatches, StreamSettings
    from specgen.training.plan import BatchPlan

    samples = [TokenizedSample(f"s{i}", i, list(range(1, 4 + i)), [0] + [1] * (2 + i)) for i in range(4)]
    spool, transport, stop = Spool(tmp_path), FileTransport(tmp_path / OBJECTS), threading.Event()
    source = StreamBatches(samples, BatchPlan(batch_tokens=7, max_batch_size=None, seed=0), spool, transport,
                           StreamSettings(window=3, poll_s=0.005, wait_timeout_s=60), pad_id=0, bytes_per_token=64,
                           identity="run")

    def serve():  # a server in a thread: puts an object (rows filled with the sample index) for every request
        while not stop.is_set():
            for name in spool.requests():
                request = spool.read_request(name)
                if request and not transport.has(name):
                    lengths = [len(ids) for ids in request["input_ids"]]
                    rows = torch.cat([torch.full((n, 1), float(ids[-1])) for n, ids in zip(lengths,
                                                                                           request["input_ids"])])
                    transport.put(name, {"aux": rows.repeat(1, 3), "last": rows, "lengths": torch.tensor(lengths)},
                                  {"server": "t", "run": "run"})
            time.sleep(0.005)

    server = threading.Thread(target=serve)
    server.start()
    try:
        per_epoch, seen = source.batches_per_epoch(), {}
        assert per_epoch >= 2
        for epoch in (0, 1):
            for index, batch in enumerate(source.epoch(epoch)):
                if (epoch, index) == (0, per_epoch - 1):
                    seen["ahead"] = [name for name in spool.requests() if name.startswith("e0001")]
                plan = source.plan.epoch(source.lengths, epoch)[index]
                assert batch.last_hidden_state[batch.document_ids >= 0].squeeze(-1).tolist() == [
                    float(samples[i].input_ids[-1]) for i in plan for _ in range(len(samples[i]))]
    finally:
        stop.set()
        server.join()
    assert seen["ahead"], "epoch 1 was not asked for while epoch 0's last batch trained"
    assert sum(source.by_server.values()) == 2 * per_epoch
