"""The run-level view of an output directory: aggregated shard stats, the manifest, rejected rows.

`manifest.json` is written last by the pipeline, so its presence means the run finished; the
reader uses its `shards` list (from `summarize_shards`) to know exactly which files belong to it.
"""

import json
from pathlib import Path

from specgen.errors import SpecgenError
from specgen.store.commit import HASH_ALGORITHM, write_json_atomic, write_text_atomic
from specgen.store.writer import finished_shards, read_sidecar

MANIFEST = "manifest.json"
REJECTED = "rejected.jsonl"


def write_manifest(out_dir: str | Path, manifest: dict) -> None:
    write_json_atomic(Path(out_dir) / MANIFEST, manifest)


def read_manifest(out_dir: str | Path) -> dict:
    path = Path(out_dir) / MANIFEST
    if not path.exists():
        raise SpecgenError(f"no {MANIFEST} in {out_dir}: the run did not finish; re-run the same command to resume")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise SpecgenError(f"{path} is not valid JSON ({error}): re-run the same command to rewrite it") from error


def _add_counts(total: dict, counts: dict) -> None:
    for key, value in counts.items():
        total[key] = total.get(key, 0) + value


def summarize_shards(out_dir: str | Path) -> dict:
    """Aggregate the finished shards' sidecar stats.

    Numeric fields are summed and dict fields (count tables such as `rejected`) are merged key by
    key; other values cannot be aggregated and are left out. Adds `num_shards`, `shards` (file
    names in shard order), `bytes_on_disk` (the shard files) and `bytes_per_token`.
    """
    shards = finished_shards(out_dir)
    totals: dict = {}
    for index in shards:
        for key, value in read_sidecar(out_dir, index)["stats"].items():
            if isinstance(value, dict):
                _add_counts(totals.setdefault(key, {}), value)
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                totals[key] = totals.get(key, 0) + value
    bytes_on_disk = sum(path.stat().st_size for path in shards.values())
    tokens = totals.get("tokens", 0)
    return {**totals, "num_shards": len(shards), "shards": [path.name for path in shards.values()],
            "bytes_on_disk": bytes_on_disk, "bytes_per_token": bytes_on_disk / tokens if tokens else None}


def shard_checksums(out_dir: str | Path) -> dict[str, str | None]:
    """Each finished shard's content hash, as its sidecar recorded it at commit (None for shards made before
    checksums existed)."""
    return {path.name: read_sidecar(out_dir, index).get("checksum", {}).get(HASH_ALGORITHM)
            for index, path in finished_shards(out_dir).items()}


def merge_rejected(out_dir: str | Path) -> int:
    """Write `rejected.jsonl` from all finished shards' sidecars in shard order; return the row count."""
    out_dir = Path(out_dir)
    rows = [row for index in finished_shards(out_dir) for row in read_sidecar(out_dir, index)["rejected"]]
    write_text_atomic(out_dir / REJECTED, "".join(json.dumps(row) + "\n" for row in rows))
    return len(rows)
