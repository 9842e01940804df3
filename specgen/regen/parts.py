"""The regenerated dataset on disk: one `part-NNNNN.jsonl` of OpenAI-style rows per work unit, written atomically.

`write_part` writes the rows to `part-NNNNN.jsonl.tmp`, fsyncs it, writes the sidecar `part-NNNNN.json` (the
unit's counts, rejected rows and the part's checksum), then renames the part into place: the rename is the commit
point (`specgen.store.commit.commit_unit`, the protocol shards share). A run killed
at any moment leaves at most a `*.tmp` file and an orphan sidecar, which `finished_parts` ignores and
`remove_partial` deletes, so a part that exists under its final name is always complete. A part that counts as
finished (part and sidecar) always holds what its sidecar describes: a part being replaced (a grown dataset's short
last part, `specgen.job.reopen_grown_units`) is renamed over the old one before its new sidecar is written.
"""

import json
import re
from pathlib import Path

from specgen.store.commit import (commit_unit, disk_errors, numbered_files, read_unit_sidecar, remove_unfinished,
                                  tmp_path)

_PART = re.compile(r"part-(\d{5,})\.jsonl")
_SIDECAR = re.compile(r"part-(\d{5,})\.json")


def part_name(unit: int) -> str:
    return f"part-{unit:05d}.jsonl"


def sidecar_name(unit: int) -> str:
    return f"part-{unit:05d}.json"


def write_part(out_dir: Path, unit: int, rows: list[dict], sidecar: dict) -> Path:
    """Write the rows of work unit `unit` and its sidecar; the part appears only once both are on disk."""
    path = out_dir / part_name(unit)
    tmp = tmp_path(path)
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode("utf-8")
    try:
        with disk_errors(out_dir, len(text)):
            tmp.write_bytes(text)
            commit_unit(tmp, path, out_dir / sidecar_name(unit), sidecar)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def finished_parts(out_dir: str | Path) -> dict[int, Path]:
    """Committed parts by unit: the part under its final name and its sidecar both present."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return {}
    return {unit: path for unit, path in numbered_files(out_dir, _PART).items() if (out_dir / sidecar_name(unit)).exists()}


def remove_partial(out_dir: str | Path) -> list[Path]:
    """Delete what a killed run left behind (`*.tmp` files, sidecars without their part) and return it."""
    out_dir = Path(out_dir)
    return remove_unfinished(out_dir, _SIDECAR, finished_parts(out_dir)) if out_dir.is_dir() else []


def read_sidecar(out_dir: str | Path, unit: int) -> dict:
    return read_unit_sidecar(Path(out_dir) / sidecar_name(unit), f"part {unit}")
