"""Scale-out: real `accelerate launch` jobs (gloo on CPU) against the single-process dataset; faults; ZeRO-3.

Every multi-process test launches real processes with `accelerate launch --multi_gpu` (which, on a machine without
GPUs, starts CPU processes joined by gloo) on a tiny model, 24 rows and 4 rows per shard.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import BUNDLED_CHAT, REPO, accelerate_launch, build_tiny_model, run_launched
from specgen import open_shards
from specgen.assets import ASSETS_DIR
from specgen.config import compose
from specgen.generate import run

ROWS, SHARD_SIZE = 24, 4
LAUNCH_TIMEOUT = 300


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("target"), vocab_size=2048,
                            tokenizer_dir=ASSETS_DIR / "tokenizer")


def job_args(model: Path, out_dir: Path, *overrides: str) -> list[str]:
    return [f"model.path={model}", f"data.path={BUNDLED_CHAT}", f"output.dir={out_dir}", "runtime.progress=false",
            f"data.max_rows={ROWS}",
            f"output.shard_size={SHARD_SIZE}", "capture.batch_tokens=256", *overrides]


@pytest.fixture(scope="module")
def reference(target, tmp_path_factory) -> Path:
    """The single-process dataset every multi-process run must reproduce."""
    out_dir = tmp_path_factory.mktemp("reference") / "out"
    run(compose("generate", job_args(target, out_dir)))
    return out_dir


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_cmd(args: list[str], **kwargs) -> list[str]:
    return accelerate_launch("specgen.generate", *args, **kwargs)


def job_env(env: dict | None = None) -> dict:
    """The launched job's environment: this one, this checkout's specgen first, and `env`."""
    return {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}


def start(cmd: list[str], env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=REPO, env=job_env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def launch(args: list[str], env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
    """The launch run to its end (stdout and stderr together, in `.stdout`)."""
    return run_launched(launch_cmd(args, **kwargs), env=job_env(env), timeout=LAUNCH_TIMEOUT,
                        stderr=subprocess.STDOUT)


def worker_pids(launcher: int) -> dict[int, int]:
    """rank -> pid of the processes torchrun started under `launcher` (read from /proc)."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            environ = (stat.parent / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError):
            continue
        rank = next((e[5:] for e in environ if e.startswith(b"RANK=")), None)
        if ppid == launcher and rank is not None:
            found[int(rank)] = int(stat.parent.name)
    return found


# Rank 1 sleeps 2 s before each claim, so a kill after the first shard lands mid-job even when this test process
# is starved of CPU (on a loaded machine it once saw the first shard only after the job had finished).
SLOW_RANK_1 = {"SPECGEN_TEST_SLOW_RANK": "1:2"}


def wait_for_first_shard(out_dir: Path, proc: subprocess.Popen) -> None:
    deadline = time.time() + LAUNCH_TIMEOUT
    while not list(out_dir.glob("shard-*.arrow")):
        assert proc.poll() is None and time.time() < deadline, "the job ended before writing a shard"
        time.sleep(0.01)


def assert_same_dataset(got_dir: Path, want_dir: Path) -> None:
    got, want = open_shards(got_dir), open_shards(want_dir)
    assert [got[i]["sample_id"] for i in range(len(got))] == [want[i]["sample_id"] for i in range(len(want))]
    for i in range(len(want)):
        a, b = got[i], want[i]
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        torch.testing.assert_close(a["aux_hidden_states"], b["aux_hidden_states"], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(a["last_hidden_state"], b["last_hidden_state"], rtol=1e-4, atol=1e-5)
    stats = [json.loads((out / "manifest.json").read_text())["stats"] for out in (got_dir, want_dir)]
    assert stats[0] == stats[1]


@pytest.mark.slow
def test_two_processes_equal_one(target, reference, tmp_path):
    out_dir = tmp_path / "out"
    args = job_args(target, out_dir)
    args[args.index("runtime.progress=false")] = "runtime.progress=true"
    done = launch(args)
    assert done.returncode == 0, done.stdout[-3000:]
    assert_same_dataset(out_dir, reference)
    manifest = json.loads((out_dir / "manifest.json").read_text())
    assert manifest["last_run"]["processes"] == 2
    assert manifest["last_run"]["computed_tokens"] == manifest["stats"]["tokens"]  # both ranks' tokens, summed
    assert done.stdout.count("bytes on disk") == 1  # one summary, from the main process
    bar = [line for line in done.stdout.replace("\r", "\n").splitlines() if line.startswith("generate:")]
    assert bar and all("/24 " in line for line in bar)  # one bar, counting the whole job's rows (not 12 per rank)
    assert "24/24 " in bar[-1]


@pytest.mark.slow
def test_two_machines_on_localhost_equal_one(target, reference, tmp_path):
    out_dir, port = tmp_path / "out", free_port()
    machines = [start(launch_cmd(job_args(target, out_dir), machines=2, machine_rank=rank, port=port))
                for rank in (0, 1)]
    outputs = [proc.communicate(timeout=LAUNCH_TIMEOUT)[0] for proc in machines]
    assert [proc.returncode for proc in machines] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    assert_same_dataset(out_dir, reference)
    assert "bytes on disk" in outputs[0] and "bytes on disk" not in outputs[1]


@pytest.mark.slow
def test_a_dead_machine_stops_the_other_with_an_error(target, tmp_path):
    """No torchrun agent watches both machines: the survivor must notice by itself, and not wait forever. Rank 1
    (machine 1) sleeps before each claim, so the job is still running when it is killed, however loaded the machine
    (without it, a busy machine could finish all 24 rows before the kill)."""
    out_dir, port = tmp_path / "out", free_port()
    machines = [start(launch_cmd(job_args(target, out_dir), machines=2, machine_rank=rank, port=port), env=SLOW_RANK_1)
                for rank in (0, 1)]
    wait_for_first_shard(out_dir, machines[0])
    os.kill(worker_pids(machines[1].pid)[1], signal.SIGKILL)
    outputs = [proc.communicate(timeout=LAUNCH_TIMEOUT)[0] for proc in machines]
    assert machines[0].returncode != 0 and machines[1].returncode != 0
    assert "error: process 0 of 2: lost contact with the other processes" in outputs[0]
    assert not (out_dir / "manifest.json").exists()


@pytest.mark.slow
def test_resume_on_another_world_size(target, reference, tmp_path):
    """Start on 2 processes, kill -9 the whole job, finish on 1: the dataset is the uninterrupted one."""
    out_dir = tmp_path / "out"
    proc = start(launch_cmd(job_args(target, out_dir)), env=SLOW_RANK_1)
    wait_for_first_shard(out_dir, proc)
    for pid in [*worker_pids(proc.pid).values(), proc.pid]:
        os.kill(pid, signal.SIGKILL)
    proc.communicate()
    assert not (out_dir / "manifest.json").exists()
    finished_before = len(list(out_dir.glob("shard-*.arrow")))
    manifest = run(compose("generate", job_args(target, out_dir)))
    assert manifest["last_run"]["processes"] == 1
    assert_same_dataset(out_dir, reference)
    if finished_before:  # those shards were kept, not recomputed
        assert manifest["last_run"]["computed_tokens"] < manifest["stats"]["tokens"]


@pytest.mark.slow
def test_kill_9_of_one_rank_then_rerun(target, reference, tmp_path):
    out_dir = tmp_path / "out"
    proc = start(launch_cmd(job_args(target, out_dir)), env=SLOW_RANK_1)
    wait_for_first_shard(out_dir, proc)
    os.kill(worker_pids(proc.pid)[1], signal.SIGKILL)
    output, _ = proc.communicate(timeout=LAUNCH_TIMEOUT)
    assert proc.returncode != 0 and "SIGKILL" in output  # the launcher stops the job and names the dead rank
    assert not (out_dir / "manifest.json").exists()
    again = launch(job_args(target, out_dir))
    assert again.returncode == 0, again.stdout[-3000:]
    assert_same_dataset(out_dir, reference)


@pytest.mark.slow
def test_zero3_two_processes_equal_one(target, tmp_path):
    """ZeRO-3 partitions the target across 2 processes; rank 1 is slowed down (SPECGEN_TEST_SLOW_RANK) so that it
    claims fewer of the 5 units and runs dummy forwards while rank 0 finishes."""
    rows = "data.max_rows=20"
    reference = tmp_path / "reference"
    run(compose("generate", job_args(target, reference, rows)))
    out_dir = tmp_path / "out"
    done = launch(job_args(target, out_dir, rows, "engine=deepspeed",
                           "engine.config.zero_optimization.stage3_param_persistence_threshold=0"),
                  env={"SPECGEN_TEST_SLOW_RANK": "1:2"})
    assert done.returncode == 0, done.stdout[-3000:]
    assert done.stdout.count("(50%)") == 2  # each process holds half of the parameters
    assert "dummy forwards" in done.stdout  # the rank with fewer batches kept the other's gathers company
    assert_same_dataset(out_dir, reference)
    assert json.loads((out_dir / "manifest.json").read_text())["capture"]["backend"] == "llama+deepspeed-zero3"


@pytest.mark.slow
def test_failing_rank_ends_the_job_with_its_error(target, tmp_path):
    """A bad row in unit 3 with data.on_bad_row=fail: the job exits non-zero, naming it and the rank that claimed it."""
    rows = [json.loads(line) for line in (ASSETS_DIR / "chat" / "train.jsonl").read_text().splitlines()[:ROWS]]
    lines = [json.dumps(row) for row in rows]
    lines[13] = "{not json"
    data = tmp_path / "bad.jsonl"
    data.write_text("\n".join(lines) + "\n")
    started = time.time()
    done = launch(job_args(target, tmp_path / "out", f"data.path={data}", "data.on_bad_row=fail"))
    assert done.returncode != 0
    assert re.search(r"error: process [01] of 2: row 13", done.stdout)
    assert "Root Cause" in done.stdout and "SpecgenError: row 13" in done.stdout  # the launcher's summary
    assert time.time() - started < LAUNCH_TIMEOUT
    assert not (tmp_path / "out" / "manifest.json").exists()


@pytest.mark.slow
def test_a_slow_rank_claims_fewer_units_and_the_dataset_is_unchanged(target, tmp_path):
    """Rank 1 sleeps 2 s before each claim (SPECGEN_TEST_SLOW_RANK): rank 0 claims the units rank 1 does not get to."""
    one_row_units = ("output.shard_size=1", "pipeline.prefetch_units=1")
    reference = tmp_path / "reference"
    run(compose("generate", [*job_args(target, reference), *one_row_units]))
    out_dir = tmp_path / "out"
    done = launch([*job_args(target, out_dir), *one_row_units], env={"SPECGEN_TEST_SLOW_RANK": "1:2"})
    assert done.returncode == 0, done.stdout[-3000:]
    assert_same_dataset(out_dir, reference)
    units = json.loads((out_dir / "manifest.json").read_text())["last_run"]["units_by_process"]
    assert units["0"] + units["1"] == ROWS and units["0"] > 2 * units["1"]
    assert not (out_dir / ".specgen-claims").exists()  # claims last one job


def test_output_dir_must_not_depend_on_launch_time(target, tmp_path):
    from specgen.ranks import Workers
    from specgen.errors import SpecgenError
    from specgen.job import require_shared_output_dir

    cfg = compose("generate", [f"model.path={target}", f"data.path={BUNDLED_CHAT}"])
    two = Workers(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"))
    with pytest.raises(SpecgenError, match="explicit output.dir"):
        require_shared_output_dir(cfg, two)
    require_shared_output_dir(cfg, Workers(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")))
    require_shared_output_dir(compose("generate", [f"output.dir={tmp_path}"]), two)


def test_unknown_engine_is_a_one_line_error(target, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "specgen.generate", f"model.path={target}",
                           f"data.path={BUNDLED_CHAT}", "engine.name=nope", f"output.dir={tmp_path / 'out'}"],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert [line for line in proc.stderr.splitlines() if line.startswith("error:")] == [
        "error: engine.name=nope is not one of hf | deepspeed | vllm"]
