"""The regenerated dataset on disk: one `part-NNNNN.jsonl` of OpenAI-style rows per work unit, written atomically.

`write_part` writes the rows to `part-NNNNN.jsonl.tmp`, fsyncs it, writes the sidecar `part-NNNNN.json` (the
unit's counts and rejected rows), then renames the part into place: the rename is the commit point. A run killed
at any moment leaves at most a `*.tmp` file and an orphan sidecar, which `finished_parts` ignores and
`remove_partial` deletes, so a part that exists under its final name is always complete.
"""

import json
import os
import re
from pathlib import Path

from specgen.errors import SpecgenError
from specgen.store.writer import write_json_atomic

_PART = re.compile(r"part-(\d{5,})\.jsonl")
_SIDECAR = re.compile(r"part-(\d{5,})\.json")


def part_name(unit: int) -> str:
    return f"part-{unit:05d}.jsonl"


def sidecar_name(unit: int) -> str:
    return f"part-{unit:05d}.json"


def write_part(out_dir: Path, unit: int, rows: list[dict], sidecar: dict) -> Path:
    """Write the rows of work unit `unit` and its sidecar; the part appears only once both are on disk."""
    path = out_dir / part_name(unit)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    write_json_atomic(out_dir / sidecar_name(unit), sidecar)
    os.replace(tmp, path)
    _fsync_dir(out_dir)
    return path


def _fsync_dir(path: Path) -> None:
    """Persist the directory entry of a rename, so a crash right after it cannot undo it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _numbered(out_dir: Path, pattern: re.Pattern) -> dict[int, Path]:
    found = {int(match.group(1)): path for path in out_dir.iterdir() if (match := pattern.fullmatch(path.name))}
    return dict(sorted(found.items()))


def finished_parts(out_dir: str | Path) -> dict[int, Path]:
    """Committed parts by unit: the part under its final name and its sidecar both present."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return {}
    return {unit: path for unit, path in _numbered(out_dir, _PART).items() if (out_dir / sidecar_name(unit)).exists()}


def remove_partial(out_dir: str | Path) -> list[Path]:
    """Delete what a killed run left behind (`*.tmp` files, sidecars without their part) and return it."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return []
    finished = finished_parts(out_dir)
    leftovers = sorted(out_dir.glob("*.tmp"))
    leftovers += [path for unit, path in _numbered(out_dir, _SIDECAR).items() if unit not in finished]
    for path in leftovers:
        path.unlink()
    return leftovers


def read_sidecar(out_dir: str | Path, unit: int) -> dict:
    path = Path(out_dir) / sidecar_name(unit)
    if not path.exists():
        raise SpecgenError(f"no sidecar {path}: part {unit} did not finish; re-run the same command to resume")
    return json.loads(path.read_text())
