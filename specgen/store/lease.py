"""A lease on an output directory: one job writes a directory at a time, and a killed job's lease is taken over.

    with hold_lease(out_dir, stage="generate") as lease:
        ...            # lease.check() raises if another job took the directory over (this job looked dead)

The lease is the file `OUT/.specgen-lease.json`: holder host, pid (and the pid's start time, against pid reuse),
stage, start time, a random token and a heartbeat time that a background thread refreshes every
`stale_s / 6` seconds. It is made with an exclusive create (`O_CREAT | O_EXCL`, atomic on local filesystems and on
NFSv3+/Lustre/GPFS), never with `flock` alone, which shared filesystems do not all honour.

A job that finds a lease:
- refuses to start with a one-line `SpecgenError` naming the holder when the lease is live
  (`output.overwrite=true` included: overwriting a directory another job writes would destroy its work);
- takes it over at once when the holder is on this host and its process is gone (a `kill -9`), or when the
  heartbeat is older than `stale_s` (a lost machine: clocks must agree within a few seconds, as NTP keeps them).
  A holder on this host whose process is gone may have left processes running (vLLM's engine, DataLoader workers,
  where its watchdog was killed with it): the lease records the holder's descendants (refreshed with each
  heartbeat) and its process group, and the job taking over first ends those still alive and owned by the same user
  (`specgen.runtime.reaper`; the group only where the holder led it, so a shell's group is never touched).
Takeovers are serialised by a second exclusive-create file (`.specgen-lease.takeover`), so two jobs that both
find the same stale lease cannot both win; the new lease is written with an atomic rename.

A multi-process job holds one lease, through its main process; the other processes start after the main one
has it (the stages broadcast the main process's claim).
"""

import json
import logging
import os
import socket
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specgen.errors import SpecgenError
from specgen.runtime.reaper import descendants, end_processes, group_members
from specgen.store.commit import fsync_dir

log = logging.getLogger("specgen.lease")

LEASE = ".specgen-lease.json"
TAKEOVER = ".specgen-lease.takeover"
STALE_S = 60.0  # a heartbeat older than this means the holder is gone
_TAKEOVER_STALE_S = 30.0  # a takeover lock older than this was left by a job killed while taking over
_YOUNG_S = 5.0  # an empty lease file younger than this is still being written by its creator


class LeaseHeld(SpecgenError):
    """Another live job holds the output directory."""


@dataclass
class LeaseInfo:
    host: str
    pid: int
    pid_start: str | None  # the process's start time in clock ticks (Linux), to tell a reused pid apart
    stage: str
    started: float
    heartbeat: float
    token: str
    pgid: int | None = None  # the holder's process group
    children: dict[str, str] = field(default_factory=dict)  # the holder's descendants: pid -> start time

    def describe(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return (f"{self.stage} (host {self.host}, pid {self.pid}, started {started}, "
                f"heartbeat {max(0.0, time.time() - self.heartbeat):.0f}s ago)")


def _pid_stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (None where /proc does not say)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _pid_start(pid: int) -> str | None:
    stat = _pid_stat(pid)
    return None if stat is None else stat[19]  # field 22: starttime


def _pid_alive(pid: int, pid_start: str | None) -> bool:
    """Whether the holder still runs: a killed process that nobody has reaped yet (a zombie) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, another user's
    stat = _pid_stat(pid)
    if stat is not None and stat[0] in ("Z", "X"):  # field 3: state; dead, awaiting its parent
        return False
    return pid_start is None or _pid_start(pid) in (None, pid_start)


def stale_reason(info: LeaseInfo, stale_s: float) -> str | None:
    """Why the lease's holder is gone (None: it looks alive)."""
    if info.host == socket.gethostname() and not _pid_alive(info.pid, info.pid_start):
        return f"its process {info.pid} on this host is gone"
    age = time.time() - info.heartbeat
    if age > stale_s:
        return f"its heartbeat is {age:.0f}s old (> {stale_s:.0f}s)"
    return None


def read_lease(out_dir: str | Path) -> LeaseInfo | None:
    """The lease in `out_dir`, or None when there is none (or it is unreadable: a creator killed mid-write)."""
    try:
        return LeaseInfo(**json.loads((Path(out_dir) / LEASE).read_text()))
    except (OSError, ValueError, TypeError):
        return None


class Lease:
    """A held lease; `release()` (or leaving `hold_lease`) gives it back."""

    def __init__(self, out_dir: Path, info: LeaseInfo, stale_s: float):
        self.out_dir, self.info, self.stale_s = out_dir, info, stale_s
        self.path = out_dir / LEASE
        self._stop = threading.Event()
        self._lost: str | None = None
        self._thread = threading.Thread(target=self._beat, name="specgen-lease", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        interval = max(0.05, self.stale_s / 6)
        while not self._stop.wait(interval):
            current = read_lease(self.out_dir)
            if current is None or current.token != self.info.token:
                self._lost = (f"another job took over output.dir {self.out_dir} "
                              f"({current.describe() if current else 'its lease is gone'})")
                log.error("%s; this job stops at its next commit", self._lost)
                return
            self.info.heartbeat = time.time()
            self.info.children = {str(pid): start for pid, start in descendants([self.info.pid]).items()}
            try:
                _write(self.path, self.info)
            except OSError as error:  # a full disk or a network hiccup: try again next beat
                log.warning("could not refresh the lease on %s: %s", self.out_dir, error)

    def check(self) -> None:
        """Raise when this job lost the directory to another (it looked dead to it); call before committing."""
        if self._lost:
            raise SpecgenError(f"{self._lost}; this job stopped so the two do not write the same files")

    def release(self) -> None:
        self._stop.set()
        self._thread.join()
        current = read_lease(self.out_dir)
        if current is not None and current.token == self.info.token:
            self.path.unlink(missing_ok=True)


def _write(path: Path, info: LeaseInfo) -> None:
    """Replace the lease file atomically (a temp name of this holder's own, then rename)."""
    tmp = path.with_name(f"{path.name}.{info.token}.new")
    tmp.write_text(json.dumps(asdict(info)))
    os.replace(tmp, path)


def _create_exclusive(path: Path, payload: bytes) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    try:
        os.write(fd, payload)
        os.fsync(fd)
    finally:
        os.close(fd)
    return True


def _age(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return 0.0


def acquire_lease(out_dir: str | Path, *, stage: str, stale_s: float = STALE_S) -> Lease:
    """Hold `out_dir` for this job (creating the directory), or raise `LeaseHeld` naming the live holder."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    now = time.time()
    info = LeaseInfo(host=socket.gethostname(), pid=os.getpid(), pid_start=_pid_start(os.getpid()), stage=stage,
                     started=now, heartbeat=now, token=uuid.uuid4().hex, pgid=os.getpgid(0),
                     children={str(pid): start for pid, start in descendants([os.getpid()]).items()})
    path = out_dir / LEASE
    for _ in range(200):
        if _create_exclusive(path, json.dumps(asdict(info)).encode()):
            fsync_dir(out_dir)
            return Lease(out_dir, info, stale_s)
        holder = read_lease(out_dir)
        if holder is None and _age(path) < _YOUNG_S:
            time.sleep(0.05)  # its creator is writing it
            continue
        reason = "it is unreadable" if holder is None else stale_reason(holder, stale_s)
        if reason is None:
            raise LeaseHeld(f"output.dir {out_dir} is in use by {holder.describe()}; wait for that job to end or "
                            "stop it (a killed job's lease is taken over automatically), or use another output.dir")
        if _take_over(out_dir, holder, info):
            log.warning("took over output.dir %s from %s: %s", out_dir,
                        holder.describe() if holder else "an unreadable lease", reason)
            return Lease(out_dir, info, stale_s)
        time.sleep(0.05)
    raise SpecgenError(f"could not take the lease on output.dir {out_dir}: other jobs keep racing for it; "
                       "start one job per output.dir")


def _take_over(out_dir: Path, stale: LeaseInfo | None, info: LeaseInfo) -> bool:
    """Replace the stale lease with ours, under the takeover lock; False when another job got there first."""
    lock = out_dir / TAKEOVER
    if not _create_exclusive(lock, info.token.encode()):
        if _age(lock) > _TAKEOVER_STALE_S:
            lock.unlink(missing_ok=True)  # left by a job killed while taking over
        return False
    try:
        current = read_lease(out_dir)
        if (current.token if current else None) != (stale.token if stale else None):
            return False  # the lease changed since we read it: someone else took over (or it was released)
        if stale is not None:
            end_leftovers(stale)
        for leftover in out_dir.glob(f"{LEASE}.*.new"):
            leftover.unlink(missing_ok=True)
        _write(out_dir / LEASE, info)
        fsync_dir(out_dir)
        return True
    finally:
        lock.unlink(missing_ok=True)


def end_leftovers(holder: LeaseInfo) -> list[int]:
    """End what a dead holder on this host left running: its recorded descendants and, where it led its process
    group, the group's members (same user only). Nothing for a holder on another host or still alive."""
    if holder.host != socket.gethostname() or _pid_alive(holder.pid, holder.pid_start):
        return []
    leftovers = {int(pid): start for pid, start in holder.children.items()}
    if holder.pgid is not None and holder.pgid == holder.pid:
        leftovers.update(group_members(holder.pgid))
    ended = end_processes(leftovers)
    if ended:
        log.warning("ended %d processes left running by the dead holder (pid %d): %s", len(ended), holder.pid,
                    " ".join(map(str, ended)))
    return ended


@contextmanager
def hold_lease(out_dir: str | Path, *, stage: str, stale_s: float = STALE_S):
    """Hold the lease on `out_dir` for the duration of the block (see the module docstring)."""
    lease = acquire_lease(out_dir, stage=stage, stale_s=stale_s)
    try:
        yield lease
    finally:
        lease.release()


class _NoLease:
    """What the processes other than the main one hold: nothing to check."""

    def check(self) -> None:
        pass


@contextmanager
def hold_job_lease(out_dir: str | Path, *, stage: str, is_main: bool = True, broadcast=lambda value: value,
                   stale_s: float = STALE_S):
    """A job's lease: the main process holds it; every process raises the main process's refusal.

    `broadcast(value)` returns the main process's `value` on every process (`Workers.broadcast`); with one
    process it is the identity.
    """
    lease, problem = None, None
    if is_main:
        try:
            lease = acquire_lease(out_dir, stage=stage, stale_s=stale_s)
        except SpecgenError as error:
            problem = str(error)
    problem = broadcast(problem)
    if problem is not None:
        if lease is not None:
            lease.release()
        raise LeaseHeld(problem)
    try:
        yield lease or _NoLease()
    finally:
        if lease is not None:
            lease.release()
