"""No orphans (`specgen.runtime.reaper`): after `kill -9` of a job, no process it started is left running.

Real processes throughout: a job script that starts a DataLoader with workers and a child that leaves the job's
process group and session (as vLLM's multiprocessing children may) with a grandchild of its own; the job is
killed with SIGKILL and /proc is checked for every descendant recorded before the kill. vLLM's own processes are
covered by tests/test_vllm.py::test_kill_9_of_a_multiprocess_vllm_job_leaves_no_process.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from specgen.runtime.reaper import INTERVAL_S, descendants, start_time

REPO = Path(__file__).resolve().parents[1]

JOB = textwrap.dedent("""
    import multiprocessing, os, sys, time
    import torch
    from torch.utils.data import DataLoader
    from specgen.runtime.reaper import dataloader_worker_init, guard_job

    def leave_group():  # a child in its own session, with a child of its own
        os.setsid()
        multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,)).start()
        time.sleep(600)

    class Slow(torch.utils.data.Dataset):
        def __len__(self):
            return 1000
        def __getitem__(self, i):
            time.sleep(0.2)
            return i

    if __name__ == "__main__":
        if sys.argv[1] == "guard":
            guard_job()
        multiprocessing.get_context("fork").Process(target=leave_group).start()
        loader = iter(DataLoader(Slow(), num_workers=2, worker_init_fn=dataloader_worker_init))
        next(loader)
        open(sys.argv[2], "w").write("ready")
        time.sleep(600)
""")


def env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def wait_for(predicate, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def alive(recorded: dict[int, str]) -> dict[int, str]:
    return {pid: start for pid, start in recorded.items() if start_time(pid) == start}


def start_job(tmp_path: Path, mode: str) -> tuple[subprocess.Popen, dict[int, str]]:
    """The job script, once its helpers run; returns it and its descendants (pid -> start time)."""
    script, marker = tmp_path / "job.py", tmp_path / "ready"
    script.write_text(JOB)
    job = subprocess.Popen([sys.executable, str(script), mode, str(marker)], env=env(), cwd=tmp_path)
    assert wait_for(marker.exists), "the job did not start its helpers"
    # the setsid child's own child may still be starting
    assert wait_for(lambda: len(descendants([job.pid])) >= 4 + (mode == "guard"))
    time.sleep(3 * INTERVAL_S)  # the watchdog records what runs at its next look (a later start may be missed)
    return job, descendants([job.pid])


def kill_9(job: subprocess.Popen) -> None:
    job.send_signal(signal.SIGKILL)
    job.wait()


def test_kill_9_of_a_guarded_job_leaves_no_process(tmp_path):
    job, recorded = start_job(tmp_path, "guard")
    # DataLoader workers 2, the setsid child and its child, the watchdog
    assert len(recorded) >= 5
    moved = [pid for pid in recorded if os.getsid(pid) != os.getsid(job.pid)]
    assert moved, "a child left the job's session, like vLLM's may"
    kill_9(job)
    try:
        assert wait_for(lambda: not alive(recorded), 30), f"left running: {alive(recorded)}"
    finally:
        for pid in alive(recorded):
            os.kill(pid, signal.SIGKILL)


def test_without_the_watchdog_a_child_in_its_own_session_survives_and_dataloader_workers_do_not(tmp_path):
    """The failure the watchdog fixes, shown on the same job; DataLoader workers end by the parent-death signal."""
    job, recorded = start_job(tmp_path, "bare")
    moved = {pid: start for pid, start in recorded.items() if os.getsid(pid) != os.getsid(job.pid)}
    assert len(moved) == 2 and len(recorded) == 4  # the setsid child and its child; two DataLoader workers
    kill_9(job)
    try:
        assert wait_for(lambda: alive(recorded) == moved, 30)
    finally:
        for pid in alive(recorded):
            os.kill(pid, signal.SIGKILL)


RANK = textwrap.dedent("""
    import os, subprocess, sys, time
    if sys.argv[1] == "launcher":
        env = {**os.environ, "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "test"}
        subprocess.Popen([sys.executable, __file__, "rank", sys.argv[2]], env=env)
        time.sleep(600)
    else:
        from specgen.runtime.reaper import guard_job
        guard_job()
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
        open(sys.argv[2], "w").write("ready")
        time.sleep(600)
""")


def test_kill_9_of_the_launcher_ends_its_ranks_and_theirs(tmp_path):
    """Under accelerate launch / torchrun each rank's watchdog also watches the launcher."""
    script, marker = tmp_path / "launch.py", tmp_path / "ready"
    script.write_text(RANK)
    launcher = subprocess.Popen([sys.executable, str(script), "launcher", str(marker)], env=env(), cwd=tmp_path)
    assert wait_for(marker.exists)
    assert wait_for(lambda: len(descendants([launcher.pid])) >= 3)  # the rank, its watchdog, its child
    time.sleep(3 * INTERVAL_S)
    recorded = descendants([launcher.pid])
    kill_9(launcher)
    try:
        assert wait_for(lambda: not alive(recorded), 30), f"left running: {alive(recorded)}"
    finally:
        for pid in alive(recorded):
            os.kill(pid, signal.SIGKILL)


def test_end_processes_spares_a_reused_pid():
    """A recorded pid whose start time differs is another process now: it is not signalled."""
    from specgen.runtime.reaper import end_processes

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        assert end_processes({sleeper.pid: "1"}) == []
        assert sleeper.poll() is None
        assert end_processes({sleeper.pid: start_time(sleeper.pid)}) == [sleeper.pid]
        assert sleeper.wait(10) != 0
    finally:
        sleeper.kill()
