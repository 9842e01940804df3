"""A capture server: claims the requests of a stream folder, runs the target's capture forward, puts the objects.

It holds the target and nothing else: no data, no draft, no optimizer. It runs the capture online training runs
(`specgen.capture.online.capture_samples`: the batch right-padded, one forward, each sample's rows cut out), so a
trainer fed by servers trains on the tensors an online run computes itself. Servers join and leave at any time; a killed
server's claim is taken over by another (`Spool.claim`).
"""

import logging
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from specgen.capture.online import capture_samples
from specgen.capture.target import TargetCapture
from specgen.stream.spool import Spool, process_started
from specgen.stream.transport import FileTransport

log = logging.getLogger("specgen.stream")


@dataclass(frozen=True)
class ServerSettings:
    poll_s: float = 0.05  # seconds between looks at the folder when there is nothing to capture
    exit_when_done: bool = True  # exit once the run this server captured for has finished
    idle_exit_s: float | None = None  # exit after this long with nothing to capture (None: wait)
    server_id: str | None = None  # how the server is named in claims and summaries (None: host-pid-random)


class CaptureServer:
    """Serves one stream folder until its run finishes (or forever). `open_capture(run)` builds the capture for a
    run (its aux layers; it refuses a run whose target is not this server's)."""

    def __init__(self, spool: Spool, transport: FileTransport, open_capture: Callable[[dict], TargetCapture],
                 settings: ServerSettings):
        self.spool, self.transport, self.open_capture, self.settings = spool, transport, open_capture, settings
        self.id = settings.server_id or f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}"
        self.counts = Counter()  # captured, took_over, tokens
        self.claimed: str | None = None
        self._stop = threading.Event()

    def serve(self) -> dict:
        """Capture until a run finishes while this server is up (`exit_when_done`; a run that finished before it
        started is an earlier one: it waits for the next), nothing came for `idle_exit_s`, or the folder is deleted;
        returns the counts."""
        beat = threading.Thread(target=self._beat, daemon=True)
        self.spool.beat(self.id, dict(self.counts), None)
        beat.start()
        identity, capture, idle_since, started = None, None, time.monotonic(), process_started()
        try:
            while True:
                if self.settings.exit_when_done and self.spool.finished(since=started):
                    break
                if not self.spool.exists():
                    log.warning("%s was deleted: nothing left to serve", self.spool.root)
                    break
                run = self.spool.run()
                name = None
                if run is not None and not self.spool.finished():
                    if run["identity"] != identity:
                        capture, identity = self.open_capture(run), run["identity"]
                        log.info("serving run %s (aux layers %s)", identity[:12], run["aux_layers"])
                    name = self._claim_next()
                if name is None:
                    if self.settings.idle_exit_s is not None and \
                            time.monotonic() - idle_since > self.settings.idle_exit_s:
                        break
                    time.sleep(self.settings.poll_s)
                    continue
                self._serve_one(name, capture, identity)
                idle_since = time.monotonic()
        finally:
            self._stop.set()
            beat.join()
            if self.claimed is not None:
                self.spool.release(self.claimed)
            self.spool.leave(self.id)
        return dict(self.counts)

    def _claim_next(self) -> str | None:
        """Claim the first request (in plan order) with no object and no live claim."""
        for name in self.spool.requests():
            if self.transport.has(name):
                continue
            won, took_over = self.spool.claim(name, self.id)
            if won:
                self.claimed = name
                if took_over:
                    self.counts["took_over"] += 1
                    log.warning("took over %s from %s (gone)", name, took_over)
                return name
        return None

    def _serve_one(self, name: str, capture: TargetCapture, identity: str) -> None:
        request = self.spool.read_request(name)
        if request is not None and not self.transport.has(name):  # withdrawn or done meanwhile: nothing to do
            tensors = {key: value.cpu() for key, value in
                       capture_samples(capture, request["input_ids"], request["pad_id"]).items()}
            if self.spool.read_request(name) is not None:  # still wanted (a new run may have cleared the folder)
                # The run's identity goes with the object: one finished after its run was replaced is told apart.
                self.transport.put(name, tensors, {"server": self.id, "run": identity})
                self.counts["captured"] += 1
                self.counts["tokens"] += int(tensors["lengths"].sum())
                if self.spool.read_request(name) is None:
                    # Withdrawn while it was written: the trainer took another server's copy, or the run ended and
                    # cleared the folder between the check above and the put. Nobody will take it: not left behind.
                    self.transport.delete(name)
        self.spool.release(name)
        self.claimed = None

    def _beat(self) -> None:
        while not self._stop.wait(max(0.2, self.spool.stale_s / 6)):
            try:
                self.spool.beat(self.id, dict(self.counts), self.claimed)
            except OSError:  # the folder was deleted: the main loop notices and ends
                pass
