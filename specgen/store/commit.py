"""Atomic commits: the one way specgen puts a file under its final name.

Every output file (shards, their sidecars, regenerated parts, manifests, checkpoints) is written to a temporary
name beside its final one, flushed and fsync'd, renamed into place (`os.replace`, atomic on POSIX), and the
directory is fsync'd so the rename survives a crash. A reader therefore sees either the old file or the complete
new one, never a half-written file under a final name; `*.tmp` leftovers of a killed run are cleaned by the
stages that resume (`remove_partial`).

A write that fails because the disk (or a quota, or a file-size limit) is full becomes a one-line `DiskFull`
error naming the directory and the bytes needed; the temporary file is deleted, so nothing half-written stays.

`content_hash` is the checksum recorded for shards, parts and checkpoint files (sha256 of the bytes);
`HashingFile` computes the same checksum while a file is written, so a large shard is not read back to hash it
(with `background=True` on a helper thread, so hashing and writing run on two cores at once).
"""

import errno
import hashlib
import io
import json
import os
import queue
import re
import shutil
import threading
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from specgen.errors import SpecgenError

TMP_SUFFIX = ".tmp"
HASH_ALGORITHM = "sha256"
_CHUNK = 8 << 20
_SLICE = 4 << 20  # HashingFile(background=True): bytes written and hashed together, a cache-sized piece
_DISK_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_DISK_FULL_TEXT = ("No space left", "Disk quota exceeded", "File too large")


class DiskFull(SpecgenError):
    """A write ran out of disk space (or quota, or hit a file-size limit)."""


def tmp_path(path: Path) -> Path:
    """The temporary name a commit of `path` writes first."""
    return path.with_name(path.name + TMP_SUFFIX)


def fsync_file(path: str | Path) -> None:
    """Flush a file's data to disk (a read-only descriptor suffices on POSIX)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | Path) -> None:
    """Persist a directory's entries (a rename or create in it), so a crash right after cannot undo them."""
    fsync_file(path)


def content_hash(path: str | Path) -> str:
    """The checksum of a file's bytes: hex sha256, read in 8 MiB chunks."""
    digest = hashlib.new(HASH_ALGORITHM)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class HashingFile(io.RawIOBase):
    """A new file opened for writing that hashes its bytes as they are written: `hexdigest()` equals
    `content_hash(path)` of the finished file. Write-only and sequential (no seek), as Arrow's file writer is.

    background=True: the bytes are hashed on a helper thread while this one writes them (both release the GIL), in
    `_SLICE` pieces so that both read a piece while it is still in the CPU cache. The caller must not change a
    buffer it passed to `write` until `drain()` returns (`hexdigest()` and `close()` drain first).
    """

    def __init__(self, path: str | Path, *, background: bool = False):
        super().__init__()
        self._file = open(path, "wb", buffering=0)  # noqa: SIM115 (closed by close())
        self._digest = hashlib.new(HASH_ALGORITHM)
        self._size = 0
        self._pending: queue.SimpleQueue | None = None
        if background:
            self._pending = queue.SimpleQueue()
            self._hasher = threading.Thread(target=self._hash_pending, name="specgen-hash", daemon=True)
            self._hasher.start()

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if self._pending is None:
            self._write_all(view)
            self._digest.update(view)  # releases the GIL for large buffers
        else:
            for start in range(0, len(view), _SLICE):
                piece = view[start:start + _SLICE]
                self._pending.put(piece)  # hashed on the helper thread while this one writes it
                self._write_all(piece)
        self._size += len(view)
        return len(view)

    def _write_all(self, view: memoryview) -> None:
        written = 0
        while written < len(view):  # a raw write may be partial
            written += self._file.write(view[written:])

    def _hash_pending(self) -> None:
        while (item := self._pending.get()) is not None:
            if isinstance(item, threading.Event):
                item.set()
            else:
                self._digest.update(item)

    def drain(self) -> None:
        """Wait until every byte written so far is hashed (then the written buffers may change)."""
        if self._pending is not None and self._hasher.is_alive():
            hashed = threading.Event()
            self._pending.put(hashed)
            hashed.wait()

    def tell(self) -> int:
        return self._size

    def close(self) -> None:
        if not self.closed:
            try:
                self._file.close()
            finally:
                if self._pending is not None and self._hasher.is_alive():
                    self._pending.put(None)  # hashes what is queued, then ends
                    self._hasher.join()
        super().close()

    def hexdigest(self) -> str:
        self.drain()
        return self._digest.hexdigest()


def is_disk_full(error: BaseException) -> bool:
    """True for an OSError that means 'no room': ENOSPC, EDQUOT or EFBIG (also as Arrow reports them)."""
    if not isinstance(error, OSError):
        return False
    return error.errno in _DISK_FULL_ERRNOS or any(text in str(error) for text in _DISK_FULL_TEXT)


def disk_full_error(directory: Path, needed: int, error: BaseException) -> DiskFull:
    """The one-line error for a full disk: where, how many bytes the file needs (so far), how many are free, what
    to do. A file-size limit (`ulimit -f`, EFBIG) reads the same, with the disk's real free space."""
    try:
        free = shutil.disk_usage(directory).free
        free_text = f", {free:,} free"
    except OSError:
        free_text = ""
    return DiskFull(f"out of disk space in {directory}: the file being written needs at least {needed:,} bytes"
                    f"{free_text} ({error}); free space and re-run the same command to resume")


@contextmanager
def disk_errors(directory: str | Path, needed: Callable[[], int] | int):
    """Turn a 'disk full' OSError raised inside into `DiskFull` (other errors pass through unchanged)."""
    try:
        yield
    except OSError as error:
        if not is_disk_full(error) or isinstance(error, DiskFull):
            raise
        raise disk_full_error(Path(directory), needed() if callable(needed) else needed, error) from error


def commit_file(tmp: str | Path, path: str | Path) -> Path:
    """Make the complete file `tmp` appear as `path`: fsync it, rename it into place, fsync the directory. A `tmp`
    that is a hard link to the file `path` already names is unlinked instead (POSIX rename leaves both names then)."""
    tmp, path = Path(tmp), Path(path)
    fsync_file(tmp)
    os.replace(tmp, path)
    if os.path.lexists(tmp):  # `tmp` and `path` were links to one file: the rename did nothing
        tmp.unlink()
    fsync_dir(path.parent)
    return path


def atomic_write(path: str | Path, produce: Callable[[Path], None], *, size_hint: int = 0) -> Path:
    """Write `path` atomically: `produce(tmp)` writes the whole content to the temporary path, then it is committed.

    On any failure the temporary file is deleted and `path` keeps its previous content (or stays absent); a full
    disk is reported as `DiskFull` (size_hint: bytes the content needs, for the message).
    """
    path = Path(path)
    tmp = tmp_path(path)
    try:
        with disk_errors(path.parent, lambda: max(size_hint, _size(tmp))):
            produce(tmp)
            return commit_file(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_bytes_atomic(path: str | Path, data: bytes) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_bytes(data), size_hint=len(data))


def write_text_atomic(path: str | Path, text: str) -> Path:
    return write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: str | Path, obj: Any, *, indent: int | None = 2) -> Path:
    """JSON so that `path` holds either the old content or the complete new one."""
    return write_text_atomic(path, json.dumps(obj, indent=indent, default=str))


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


# --- work units: a data file plus its sidecar, committed together (shards, regenerated parts) -----------------

def numbered_files(directory: Path, pattern: re.Pattern) -> dict[int, Path]:
    """Files of `directory` whose name fully matches `pattern` (group 1: the number), by number."""
    found = {int(match.group(1)): path for path in directory.iterdir() if (match := pattern.fullmatch(path.name))}
    return dict(sorted(found.items()))


def remove_unfinished(directory: Path, sidecar_pattern: re.Pattern, finished: dict[int, Path],
                      damaged: Iterable[Path] = ()) -> list[Path]:
    """Delete what a killed run left in `directory` and return it: `*.tmp` files, the sidecars (`sidecar_pattern`)
    of units not in `finished`, and the `damaged` files the caller found."""
    leftovers = sorted(directory.glob("*" + TMP_SUFFIX))
    leftovers += [path for unit, path in numbered_files(directory, sidecar_pattern).items() if unit not in finished]
    leftovers += damaged
    for path in leftovers:
        path.unlink()
    return leftovers


def read_unit_sidecar(path: Path, unit: str) -> dict:
    """A finished unit's sidecar at `path`; `unit` names the unit ("shard 3") in the error when it is missing."""
    if not path.exists():
        raise SpecgenError(f"no sidecar {path}: {unit} did not finish; re-run the same command to resume")
    return json.loads(path.read_text())


def commit_unit(tmp: Path, path: Path, sidecar_path: Path, sidecar: dict, checksum: str | None = None) -> dict:
    """Commit a work unit's file: its checksum (`checksum`, e.g. a `HashingFile`'s, or computed from `tmp`) goes
    into the sidecar, the sidecar is written atomically, then the file is renamed into place (the commit point).
    Returns the sidecar as written.

    A kill at any moment leaves either `tmp` (and possibly an orphan sidecar) or the finished unit; a unit counts
    as finished only when both its file and its sidecar exist under their final names.

    A unit being redone whose old file is still under the final name without its sidecar (`specgen.job.
    reopen_grown_units` killed between its two removals) gets the file renamed over the old one first, then the
    sidecar (the commit point): in the usual order a kill between the two steps would pair the new sidecar with the
    old file, which would count as finished.
    """
    file_first = path.exists()
    fsync_file(tmp)
    sidecar = {**sidecar, "checksum": {HASH_ALGORITHM: checksum or content_hash(tmp), "bytes": tmp.stat().st_size}}
    if file_first:
        commit_file(tmp, path)
    write_json_atomic(sidecar_path, sidecar)
    if not file_first:
        commit_file(tmp, path)
    return sidecar


def checksum_problems(files: dict[str, Path], expected: dict[str, str | None]) -> list[str]:
    """One line per file whose content hash differs from `expected[name]` (names without a record are skipped)."""
    problems = []
    for name, path in files.items():
        want = expected.get(name)
        if want is None:
            continue
        if not path.exists():
            problems.append(f"{name}: missing")
            continue
        got = content_hash(path)
        if got != want:
            problems.append(f"{name}: checksum mismatch ({HASH_ALGORITHM} {got[:12]}..., recorded {want[:12]}...): "
                            "the file is damaged")
    return problems
