"""The whole job's progress, the processes' liveness, and the end-of-job rendezvous, in one small exchange.

Each process counts what it finished (source rows, tokens). Every `heartbeat_s` seconds a background thread on
every process all-reduces those counts plus one state slot per process (running / done / failed) over a dedicated
gloo group, so that:

* the main process's progress bar shows the whole job's rows, tokens/s and ETA;
* a process that is done waits for the others without a collective that could time out: a slow rank just means
  more heartbeats (a plain barrier would hit the process group's timeout when ranks finish hours apart, e.g. when a
  resumed job left all the remaining work to one rank);
* a process that fails tells the others at the next heartbeat, and they stop with an error instead of waiting;
  a process that dies (kill -9, a lost node) breaks the exchange and the others stop with an error too.

All processes see the same reduced vector at the same heartbeat, so they all leave the loop at the same one.
With one process there is no thread: counts go straight to the bar.
"""

import logging
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from specgen.ranks import Workers
from specgen.errors import SpecgenError
from specgen.progress import Progress

log = logging.getLogger("specgen.ranks")

RUNNING, DONE, FAILED = 0, 1, 2
# How long a failing process waits for the heartbeat that tells the others, before exiting anyway.
FAIL_NOTICE_HEARTBEATS = 5


class PeerFailure(SpecgenError):
    """Another process failed or vanished; this one stops because of it (its own error is elsewhere)."""


@dataclass
class JobTotals:
    rows: int = 0
    tokens: int = 0


class JobMonitor:
    """Job-wide counts for the progress bar and a failure-aware rendezvous at the end.

    `add` may be called from any thread. `check` raises when another process failed or vanished; call it between
    batches. `finish` blocks until every process is done and returns the job's totals; `fail` tells the others
    that this process is going down.
    """

    def __init__(self, workers: Workers, total_rows: int | None, *, enabled: bool, heartbeat_s: float):
        self.workers = workers
        self.heartbeat_s = heartbeat_s
        self.progress = Progress(total_rows, enabled=enabled and workers.is_main)
        self._lock = threading.Lock()
        self._local = JobTotals()
        self._job = JobTotals()
        self._state = RUNNING
        self._problem: str | None = None
        self._wake = threading.Event()
        self._thread = None
        if workers.world_size > 1:
            # A group of its own: the heartbeat runs beside the main thread's collectives (ZeRO-3 gathers).
            self._group = dist.new_group(backend="gloo")
            self._thread = threading.Thread(target=self._heartbeat, name="specgen-heartbeat", daemon=True)
            self._thread.start()

    def add(self, rows: int = 0, tokens: int = 0) -> None:
        with self._lock:
            self._local.rows += rows
            self._local.tokens += tokens
            if self._thread is None:
                self._job = JobTotals(self._local.rows, self._local.tokens)
                self.progress.update(rows, tokens)

    def check(self) -> None:
        """Raise if another process failed or the exchange with it broke."""
        if self._problem is not None:
            raise PeerFailure(self._problem)

    def finish(self) -> tuple[JobTotals, float]:
        """Wait until every process is done; return the job's totals and the seconds since the monitor started."""
        self._state = DONE
        self._stop()
        seconds = self.progress.close()
        self.check()
        return self._job, seconds

    def fail(self) -> None:
        """This process is going down: tell the others (best effort) so that they stop instead of waiting."""
        if self._state == RUNNING:
            self._state = FAILED
            self._stop(timeout=FAIL_NOTICE_HEARTBEATS * self.heartbeat_s)
            self.progress.close()

    def _stop(self, timeout: float | None = None) -> None:
        if self._thread is None:
            return
        self._wake.set()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            dist.destroy_process_group(self._group)
        self._thread = None

    def _heartbeat(self) -> None:
        world, rank = self.workers.world_size, self.workers.rank
        shown = JobTotals()
        while True:
            self._wake.wait(self.heartbeat_s)
            with self._lock:
                vector = torch.zeros(2 + world, dtype=torch.int64)
                vector[0], vector[1] = self._local.rows, self._local.tokens
                vector[2 + rank] = self._state
            try:
                dist.all_reduce(vector, group=self._group)
            except Exception as error:  # gloo raises when a peer's connection drops
                self._problem = (f"lost contact with the other processes ({error}); one of them died or was "
                                 "stopped: see its error above or the launcher's summary, then re-run the same "
                                 "command to resume")
                return
            self._job = JobTotals(int(vector[0]), int(vector[1]))
            self.progress.update(self._job.rows - shown.rows, self._job.tokens - shown.tokens)
            shown = self._job
            states = vector[2:].tolist()
            if FAILED in states:
                failed = states.index(FAILED)
                if failed != rank:
                    self._problem = (f"process {failed} failed (its error is printed above), so this one stops "
                                     "too; fix the cause and re-run the same command to resume")
                return
            if all(state != RUNNING for state in states):
                return
