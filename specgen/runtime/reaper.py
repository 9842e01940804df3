"""No orphans: every process a job starts ends when the job dies, however it dies (`kill -9` included).

A job's helpers are vLLM's engine core and workers (started by vLLM's multiprocessing, which specgen does not
control), DataLoader workers, and under `accelerate launch` the ranks themselves. Linux reparents the children of a
killed process to init, where nothing ends them; so:

- `guard_job()` starts a watchdog: a small stdlib-only process (this file run as a script, in its own session so
  a signal to the job's process group does not reach it first) that every `INTERVAL_S` records the job's
  descendants (pid + start time, from /proc: vLLM's children may change process group, so the group is not
  enough), and once the job is gone (a pidfd wait) ends the recorded ones still alive and their descendants:
  SIGTERM, then SIGKILL after `GRACE_S`. Under a launcher (torchrun / accelerate launch: `LOCAL_RANK` set) it
  also watches the launcher, and when the launcher is gone it ends the rank and its descendants. Idempotent per
  process; it ends itself when the job ends.
- `die_with_parent()` sets the Linux parent-death signal on the calling process (DataLoader workers' init
  function): where specgen starts the child itself, the kernel ends it.
- `descendants()` / `end_processes()` are also what a lease records and what a run taking over a dead holder's
  lease ends (`specgen.store.lease`).

Only processes of the same user whose start time matches the one recorded are signalled (a reused pid is left
alone). A process started less than `INTERVAL_S` before the job was killed may not have been recorded yet.
"""

import os
import select
import signal
import subprocess
import sys
import time

INTERVAL_S = 0.5  # how often the watchdog records the job's descendants
GRACE_S = 3.0  # between SIGTERM and SIGKILL
_PR_SET_PDEATHSIG = 1
_guard: subprocess.Popen | None = None
_guard_pid: int | None = None  # the process that started `_guard` (a forked child needs its own)


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name: [0] state, [1] ppid, [2] pgrp, [19] start time."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_time(pid: int) -> str | None:
    stat = _stat(pid)
    return None if stat is None else stat[19]


def _owned(pid: int) -> bool:
    try:
        return os.stat(f"/proc/{pid}").st_uid == os.getuid()
    except OSError:
        return False


def _table() -> dict[int, list[str]]:
    """Every live process's stat fields, by pid."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _stat(int(entry))) is not None and stat[0] not in ("Z", "X"):
            table[int(entry)] = stat
    return table


def descendants(roots, table: dict[int, list[str]] | None = None) -> dict[int, str]:
    """pid -> start time of every live process below `roots` (children, their children, ...), roots excluded."""
    table = _table() if table is None else table
    children: dict[int, list[int]] = {}
    for pid, stat in table.items():
        children.setdefault(int(stat[1]), []).append(pid)
    found: dict[int, str] = {}
    frontier = list(roots)
    while frontier:
        for child in children.get(frontier.pop(), []):
            if child not in found:
                found[child] = table[child][19]
                frontier.append(child)
    return found


def group_members(pgid: int) -> dict[int, str]:
    """pid -> start time of the live processes of process group `pgid`."""
    return {pid: stat[19] for pid, stat in _table().items() if int(stat[2]) == pgid}


def _alive(recorded: dict[int, str]) -> dict[int, str]:
    """The recorded processes still running (same start time: not a reused pid) and owned by this user."""
    return {pid: start for pid, start in recorded.items()
            if pid != os.getpid() and start_time(pid) == start and _owned(pid)}


def end_processes(recorded: dict[int, str], grace_s: float = GRACE_S) -> list[int]:
    """End the recorded processes still alive and everything below them: SIGTERM, then SIGKILL after `grace_s`.
    Returns the pids signalled."""
    targets = _alive(recorded)
    targets.update(_alive(descendants(targets)))
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        for pid in targets:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + wait_s
        while _alive(targets) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not _alive(targets):
            break
        targets.update(_alive(descendants(_alive(targets))))  # anything they started meanwhile
    return sorted(targets)


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Have the kernel send `sig` to this process when its parent (thread) ends (Linux; elsewhere nothing).
    Usable as a DataLoader `worker_init_fn` (the argument is ignored)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the signal was armed
        os.kill(os.getpid(), sig)


def dataloader_worker_init(_worker_id: int) -> None:
    """DataLoader `worker_init_fn`: the worker dies with the process that iterates the loader."""
    die_with_parent()


def _launcher_pid() -> int | None:
    """The launcher's pid when this process is a rank of torchrun / accelerate launch (its parent), else None."""
    launched = "LOCAL_RANK" in os.environ and "TORCHELASTIC_RUN_ID" in os.environ
    return os.getppid() if launched and os.getppid() > 1 else None


def guard_job() -> None:
    """Start this process's watchdog (once per process; Linux only). See the module docstring."""
    global _guard, _guard_pid
    if not sys.platform.startswith("linux") or (_guard is not None and _guard_pid == os.getpid()):
        return
    launcher = _launcher_pid()
    argv = [sys.executable, "-I", "-S", os.path.abspath(__file__), str(os.getpid()),
            str(launcher) if launcher else "0"]
    # No inherited stdout/stderr: a caller reading the job's output to its end must not wait for the watchdog. Its
    # stdout is a pipe that says when it watches: a job killed before that would not be noticed.
    _guard = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              start_new_session=True, close_fds=True)
    with _guard.stdout:
        _guard.stdout.read(1)  # b"" if it died: the job runs unguarded, as without it
    _guard_pid = os.getpid()


def _wait_gone(pidfds: list[int], timeout_s: float) -> bool:
    """Whether any watched process ended within `timeout_s` (a pidfd becomes readable when its process exits)."""
    poller = select.poll()
    for fd in pidfds:
        poller.register(fd, select.POLLIN)
    return bool(poller.poll(timeout_s * 1000))


def watch(job: int, launcher: int = 0) -> None:
    """The watchdog's loop (see the module docstring); returns once the job is gone and its leftovers ended."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # ended with the job, not before it
    job_start = start_time(job)
    if job_start is None:
        return
    recorded: dict[int, str] = {}
    pidfds, gone, ready = [], False, True
    for pid in (job, launcher):
        try:
            if pid:
                pidfds.append(os.pidfd_open(pid))
        except ProcessLookupError:  # the launcher died before the job started this watchdog
            gone = True
    while True:
        table = _table()
        recorded = {pid: start for pid, start in recorded.items() if table.get(pid, [None] * 20)[19] == start}
        recorded.update(descendants([job], table))
        recorded.pop(os.getpid(), None)
        if ready:  # watching from here on: tell the job
            os.write(1, b"r")
            os.close(1)
            ready = False
        if gone or _wait_gone(pidfds, INTERVAL_S):
            break
    stat = _stat(job)
    if stat is not None and stat[19] == job_start and stat[0] not in ("Z", "X"):  # the launcher went: end the rank
        recorded[job] = job_start
    end_processes(recorded)


if __name__ == "__main__":
    watch(int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 0)
