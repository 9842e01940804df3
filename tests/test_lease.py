"""The lease on an output directory: one live job per directory, a killed job's lease taken over at once."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from conftest import REPO
from specgen.errors import SpecgenError
from specgen.store.lease import LEASE, LeaseHeld, acquire_lease, hold_lease, read_lease


def write_lease(out_dir, **fields):
    now = time.time()
    info = {"host": socket.gethostname(), "pid": 1, "pid_start": None, "stage": "generate", "started": now,
            "heartbeat": now, "token": "t" * 32, **fields}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / LEASE).write_text(json.dumps(info))


def test_a_second_job_is_refused_in_one_line_naming_the_holder(tmp_path):
    with hold_lease(tmp_path, stage="generate"):
        with pytest.raises(LeaseHeld) as refused:
            acquire_lease(tmp_path, stage="train")
        message = str(refused.value)
        assert "\n" not in message and "in use by generate" in message
        assert f"host {socket.gethostname()}" in message and "pid" in message
    assert not (tmp_path / LEASE).exists()  # released
    with hold_lease(tmp_path, stage="train"):
        pass


def test_heartbeat_refreshes_and_a_live_remote_holder_is_refused(tmp_path):
    with hold_lease(tmp_path / "a", stage="generate", stale_s=0.6) as lease:
        started = read_lease(tmp_path / "a").heartbeat
        time.sleep(0.5)
        assert read_lease(tmp_path / "a").heartbeat > started
        lease.check()
    write_lease(tmp_path / "b", host="other-node", pid=4242)
    with pytest.raises(LeaseHeld, match="other-node"):
        acquire_lease(tmp_path / "b", stage="generate")


def test_a_stale_heartbeat_is_taken_over(tmp_path):
    write_lease(tmp_path, host="other-node", pid=4242, heartbeat=time.time() - 120)
    with hold_lease(tmp_path, stage="generate") as lease:
        assert read_lease(tmp_path).token == lease.info.token


def test_a_lease_left_by_kill_9_is_taken_over_at_once(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom specgen.store.lease import acquire_lease\n"
                               f"acquire_lease({str(tmp_path)!r}, stage='generate')\nprint('held', flush=True)\n"
                               "time.sleep(600)"], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(LeaseHeld):
        acquire_lease(tmp_path, stage="generate")
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert read_lease(tmp_path).pid == holder.pid  # left behind, heartbeat still fresh
    start = time.monotonic()
    with hold_lease(tmp_path, stage="generate") as lease:
        assert read_lease(tmp_path).token == lease.info.token
    assert time.monotonic() - start < 1.0


def test_a_killed_holder_not_yet_reaped_is_gone(tmp_path):
    """kill -9 of a launcher's worker leaves a zombie until someone reaps it: its lease is taken over all the same."""
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom specgen.store.lease import acquire_lease\n"
                               f"acquire_lease({str(tmp_path)!r}, stage='generate')\nprint('held', flush=True)\n"
                               "time.sleep(600)"], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    holder.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 10
    while not open(f"/proc/{holder.pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    try:  # not reaped: os.kill(pid, 0) still succeeds on it
        with hold_lease(tmp_path, stage="generate") as lease:
            assert read_lease(tmp_path).token == lease.info.token
    finally:
        holder.wait()


def test_racing_takeovers_of_a_stale_lease_have_one_winner(tmp_path):
    write_lease(tmp_path, host="other-node", pid=4242, heartbeat=time.time() - 120)
    outcomes, barrier = [], threading.Barrier(8)

    def contend():
        barrier.wait()
        try:
            outcomes.append(acquire_lease(tmp_path, stage="generate"))
        except LeaseHeld:
            outcomes.append(None)

    threads = [threading.Thread(target=contend) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    winners = [lease for lease in outcomes if lease is not None]
    assert len(outcomes) == 8 and len(winners) == 1
    assert read_lease(tmp_path).token == winners[0].info.token
    winners[0].release()


def test_a_job_that_lost_its_lease_stops_before_committing(tmp_path):
    with hold_lease(tmp_path, stage="generate", stale_s=0.3) as lease:
        write_lease(tmp_path, host="other-node", pid=4242, token="x" * 32)  # another job took over
        deadline = time.time() + 5
        while time.time() < deadline:
            try:
                lease.check()
            except SpecgenError as error:
                assert "took over" in str(error) and "other-node" in str(error)
                break
            time.sleep(0.05)
        else:
            pytest.fail("the lost lease was not noticed")
    assert read_lease(tmp_path).host == "other-node"  # the new holder's lease is left alone


def test_an_unreadable_lease_is_taken_over_once_old(tmp_path):
    (tmp_path / LEASE).write_text("")
    past = time.time() - 60
    os.utime(tmp_path / LEASE, (past, past))
    with hold_lease(tmp_path, stage="generate") as lease:
        assert read_lease(tmp_path).token == lease.info.token


HOLDER_WITH_CHILD = """import os, subprocess, sys, time
from specgen.store.lease import acquire_lease, read_lease
lease = acquire_lease(sys.argv[1], stage="generate", stale_s=float(sys.argv[2]))
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=sys.argv[3] == "own")
while sys.argv[3] == "own" and str(child.pid) not in read_lease(sys.argv[1]).children:
    time.sleep(0.05)  # recorded by the next heartbeat
print(child.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("child", ["own", "group"])
def test_taking_over_a_killed_holders_lease_ends_what_it_left_running(tmp_path, child):
    """A holder killed with its watchdog leaves processes reparented to init; the job taking over ends them: the
    recorded descendants (a child in its own session), or the members of the holder's own process group (a child
    started after the last heartbeat)."""
    stale_s = "0.3" if child == "own" else "600"  # "group": no heartbeat records the child
    holder = subprocess.Popen([sys.executable, "-c", HOLDER_WITH_CHILD, str(tmp_path), stale_s, child], cwd=REPO,
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    orphan = int(holder.stdout.readline())
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    try:
        os.kill(orphan, 0)  # still running after its parent's death
        with hold_lease(tmp_path, stage="generate"):
            deadline = time.monotonic() + 10
            while os.path.exists(f"/proc/{orphan}"):
                assert time.monotonic() < deadline, "the holder's leftover is still running"
                time.sleep(0.05)
    finally:
        if os.path.exists(f"/proc/{orphan}"):
            os.kill(orphan, signal.SIGKILL)
