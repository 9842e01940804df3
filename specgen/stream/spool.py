"""The control plane of a stream folder: the run, its requests, the servers' claims and heartbeats, the end mark.

    stream.dir/
      run.json                   the trainer's run: identity, target config hash, aux layers (its main process)
      requests/NAME.json         a batch to capture: token ids and pad id (posted by the trainer process that needs it)
      claims/NAME.json           the server capturing NAME (host, pid, id); its mtime is the claim's heartbeat
      servers/ID.json            each server's counts; its mtime is the server's heartbeat
      objects/NAME.safetensors   the captured batch (`specgen.stream.transport.FileTransport`)
      done                       the trainer finished: servers that served it exit

A batch's NAME is `e{epoch}-b{index}-r{rank}`, zero-padded, so sorted names are plan order and servers capture the
batch needed first. Every file appears atomically: requests and run.json by rename, claims by exclusive create.
A claim is stale when its holder runs on this host and is gone (`kill -9`), or its heartbeat is older than
`stale_s` (a lost machine); the next server takes it over. Capturing a batch twice is harmless (objects are
renamed into place and a capture is deterministic), so a race between two takeovers costs time, never data.
"""

import json
import os
import socket
import time
import uuid
from pathlib import Path

from specgen.store.lease import _create_exclusive, _pid_alive, _pid_start

RUN, DONE = "run.json", "done"
REQUESTS, CLAIMS, SERVERS, OBJECTS = "requests", "claims", "servers", "objects"


def batch_name(epoch: int, index: int, rank: int) -> str:
    """The name of batch `index` of `epoch` on trainer process `rank` (sorted names follow the plan)."""
    return f"e{epoch:04d}-b{index:07d}-r{rank:04d}"


def _write_json(path: Path, obj: dict) -> None:
    """Replace `path` atomically (a temporary name of this process's own, then rename)."""
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex}.tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _age(path: Path) -> float | None:
    """Seconds since `path` was last modified; None when it is gone."""
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return None


def holder() -> dict:
    """This process as a claim or heartbeat records it."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": _pid_start(os.getpid())}


def process_started() -> float:
    """When this process started (seconds since the epoch; now where /proc does not say)."""
    try:
        ticks = int(_pid_start(os.getpid()))
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (TypeError, ValueError, OSError, StopIteration):
        return time.time()


def gone(record: dict | None, age: float | None, stale_s: float) -> bool:
    """Whether the process a claim or heartbeat names is gone: dead on this host, or silent for `stale_s`."""
    if age is None:
        return True
    if record and record.get("host") == socket.gethostname() and not _pid_alive(record["pid"], record.get("pid_start")):
        return True
    return age > stale_s


class Spool:
    """One stream folder's control files (see the module docstring); every method is safe to call from any number
    of trainer processes and servers at once."""

    def __init__(self, root: str | Path, stale_s: float = 30.0):
        self.root, self.stale_s = Path(root), stale_s
        for sub in (REQUESTS, CLAIMS, SERVERS, OBJECTS):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    # The trainer's side.

    def start_run(self, run: dict) -> bool:
        """Make `run` (with an `identity`) the folder's run (the trainer's main process), deleting every request,
        claim and object left in the folder: a run killed earlier may have left up to its window of them, which
        would count against the byte cap beside the new run's (a resume captures those batches again). Returns
        whether the folder's run was the same one (a resume)."""
        current = self.run()
        self._clear(REQUESTS, CLAIMS, OBJECTS)
        (self.root / DONE).unlink(missing_ok=True)
        _write_json(self.root / RUN, run)
        return current is not None and current.get("identity") == run["identity"]

    def post(self, name: str, request: dict) -> None:
        """Ask for batch `name` (servers capture it once it is here)."""
        _write_json(self._request(name), request)

    def withdraw(self, name: str) -> None:
        """Batch `name` is no longer needed (taken by its trainer)."""
        self._request(name).unlink(missing_ok=True)

    def finish(self) -> None:
        """The run is over: its requests, claims and the objects posted ahead of its last step go; servers that
        served it exit."""
        self._clear(REQUESTS, CLAIMS, OBJECTS)
        _write_json(self.root / DONE, {"finished": time.time()})

    def live_servers(self) -> list[str]:
        """Ids of the servers whose heartbeat is fresh."""
        return sorted(path.stem for path in (self.root / SERVERS).glob("*.json")
                      if not gone(_read_json(path), _age(path), self.stale_s))

    # The servers' side.

    def run(self) -> dict | None:
        return _read_json(self.root / RUN)

    def finished(self, since: float | None = None) -> bool:
        """Whether the folder's run has finished (`since`: finished after that time)."""
        done = _read_json(self.root / DONE)
        return done is not None and (since is None or done.get("finished", 0) >= since)

    def exists(self) -> bool:
        return self.root.is_dir()

    def requests(self) -> list[str]:
        """Names of the posted requests, in plan order."""
        return sorted(path.name[: -len(".json")] for path in (self.root / REQUESTS).glob("*.json"))

    def read_request(self, name: str) -> dict | None:
        """The request, or None once it was withdrawn."""
        return _read_json(self._request(name))

    def claim(self, name: str, server: str) -> tuple[bool, str | None]:
        """(whether this server now holds `name`, the server it took the claim over from, if any)."""
        path = self._claim(name)
        record = {**holder(), "server": server}
        if _create_exclusive(path, json.dumps(record).encode()):
            return True, None
        previous = _read_json(path)
        if not gone(previous, _age(path), self.stale_s):
            return False, None
        try:  # one taker renames the stale claim away; the others find it gone and retry the exclusive create
            os.replace(path, path.with_name(f"{path.name}.{uuid.uuid4().hex}.stale"))
        except FileNotFoundError:
            pass
        for stale in path.parent.glob(f"{path.name}.*.stale"):
            stale.unlink(missing_ok=True)
        if _create_exclusive(path, json.dumps(record).encode()):
            return True, (previous or {}).get("server", "an unknown server")
        return False, None

    def release(self, name: str) -> None:
        self._claim(name).unlink(missing_ok=True)

    def beat(self, server: str, counts: dict, claimed: str | None) -> None:
        """The server's heartbeat (and its current claim's)."""
        _write_json(self.root / SERVERS / f"{server}.json", {**holder(), "server": server, **counts})
        if claimed is not None:
            try:
                os.utime(self._claim(claimed))
            except FileNotFoundError:
                pass

    def leave(self, server: str) -> None:
        (self.root / SERVERS / f"{server}.json").unlink(missing_ok=True)

    def _clear(self, *subs: str) -> None:
        """Delete the files of these folders (the folders stay: servers are creating files in them)."""
        for sub in subs:
            for path in (self.root / sub).iterdir():
                path.unlink(missing_ok=True)

    def _request(self, name: str) -> Path:
        return self.root / REQUESTS / f"{name}.json"

    def _claim(self, name: str) -> Path:
        return self.root / CLAIMS / f"{name}.json"
