"""Growing a regenerated dataset: the same command with a larger `data.max_rows` (or null: every row) on the same
output.dir adds rows to what is there.

Unit k of the source always holds rows [k*S, (k+1)*S) (S: output.shard_size) and is sampled with
`unit_seed(regenerate.seed, k)`, so a unit's text depends only on its rows and the settings: the parts an earlier,
smaller run finished are exactly the parts a run of the larger size makes. Growing keeps them as they are and
generates the units after them; the result is, part for part and byte for byte, the run of the larger size made
from scratch. An earlier last unit that stopped short at the old `data.max_rows` (max_rows not a multiple of S)
holds fewer rows than the same unit of the larger run, so it is regenerated with its full rows, as every stage
redoes a short last unit whose source has grown (`specgen.job.reopen_grown_units`, right after this step); a kill at
any moment leaves a folder the same command completes.

What is refused, in one line, before the model's first token:
- a smaller `data.max_rows` than the folder was made with: a dataset only grows here; `specgen generate
  data.max_rows=N` trains on the first N rows of it;
- growing a `data.path` that lists several sources: `data.max_rows` caps each of them, so a larger value moves the
  later sources' rows into other units;
- any other change (`specgen.outdir`: the error names the changed keys).

`run.json` records each growth (`extensions`, written with the new identity in one atomic write); the manifest
copies them, completed with the rows and units the finished dataset holds (`history_for_manifest`).
"""

import json
import logging
import math
import time
from pathlib import Path

from specgen.data.sources import unit_rows
from specgen.errors import SpecgenError
from specgen.outdir import RUN_FILE, fingerprint
from specgen.regen.parts import finished_parts, read_sidecar, sidecar_name
from specgen.store.commit import fsync_dir, write_json_atomic
from specgen.store.manifest import MANIFEST

log = logging.getLogger("specgen.regenerate")


def _without_max_rows(identity: dict) -> dict:
    return {**identity, "data": {key: value for key, value in (identity.get("data") or {}).items()
                                 if key != "max_rows"}}


def _cap(max_rows: int | None) -> float:
    return math.inf if max_rows is None else int(max_rows)


def _show(max_rows: int | None) -> str:
    return "null" if max_rows is None else str(max_rows)


def grow_if_asked(out_dir: Path, identity: dict, *, shard_size: int, file_rows: int | None, sources: int,
                  overwrite: bool) -> dict | None:
    """Main process, under the lease, before the claim (`specgen.job.claim_for_job`): when `out_dir` holds a dataset
    whose identity differs from `identity` only in data.max_rows, grow it (or refuse a smaller size) and return the
    growth recorded in run.json; None when there is nothing to grow (`specgen.outdir` resumes, starts or refuses)."""
    run_file = out_dir / RUN_FILE
    if overwrite or not run_file.exists():
        return None
    previous = json.loads(run_file.read_text())
    before = previous.get("identity") or {}
    if previous.get("fingerprint") == fingerprint(identity) or \
            fingerprint(_without_max_rows(before)) != fingerprint(_without_max_rows(identity)):
        return None
    old, new = before["data"].get("max_rows"), identity["data"]["max_rows"]
    finished = finished_parts(out_dir)
    held = {unit: read_sidecar(out_dir, unit)["stats"]["source_rows"] for unit in finished}
    if _cap(new) < _cap(old):
        raise SpecgenError(
            f"output.dir={out_dir} holds {sum(held.values()):,} source rows regenerated with data.max_rows="
            f"{_show(old)}, and a dataset here only grows, so data.max_rows={_show(new)} is refused; to train on "
            f"fewer rows pass data.max_rows={_show(new)} to specgen generate (it reads the first rows), or "
            "regenerate into another output.dir")
    if sources > 1:
        raise SpecgenError(
            f"output.dir={out_dir} was made with data.max_rows={_show(old)} from a data.path of {sources} sources; "
            "data.max_rows caps each source, so a larger value moves the later sources' rows into other parts and the "
            "dataset cannot grow in place; regenerate into another output.dir")
    rows = min(_cap(new), math.inf if file_rows is None else file_rows)
    stale = sorted(unit for unit, held_rows in held.items() if unit_rows(unit, shard_size, rows) > held_rows)
    growth = {"from_max_rows": old, "to_max_rows": new, "from_rows": sum(held.values()),
              "units_kept": len(held) - len(stale), "units_regenerated": stale,
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if stale and rows == math.inf:  # a source of unknown size, read to its end: the claim cannot see these grow
        for unit in stale:
            (out_dir / sidecar_name(unit)).unlink()
        fsync_dir(out_dir)
    # The new identity and the record of this growth in one atomic write; the claim then redoes the stale units
    # (`specgen.job.reopen_grown_units`). A kill before it leaves the old identity over a folder either size completes.
    write_json_atomic(run_file, {**previous, "fingerprint": fingerprint(identity), "identity": identity,
                                 "extensions": [*previous.get("extensions", []), growth]})
    log.info("growing %s from data.max_rows=%s (%d source rows) to data.max_rows=%s: %d finished units kept%s",
             out_dir, _show(old), growth["from_rows"], _show(new), growth["units_kept"],
             f", unit {stale[0]} regenerated with its full rows" if stale else "")
    return growth


def history_for_manifest(out_dir: Path, source_rows: int, units: int) -> tuple[list[dict], dict | None]:
    """(the manifest's `extensions`, the growth this run completed or None): the growths run.json records, those the
    previous manifest already lists as they were, the newer ones completed with the rows and units now held."""
    run_file, manifest = out_dir / RUN_FILE, out_dir / MANIFEST
    recorded = json.loads(run_file.read_text()).get("extensions", []) if run_file.exists() else []
    listed = json.loads(manifest.read_text()).get("extensions", []) if manifest.exists() else []
    listed = listed[:len(recorded)]
    completed = [{**growth, "to_rows": source_rows, "units": units, "units_new": units - growth["units_kept"]}
                 for growth in recorded[len(listed):]]
    return [*listed, *completed], (completed[-1] if completed else None)


def describe_growth(growth: dict) -> str:
    """'extended from N to M rows (K units kept, J new)', with the data.max_rows it went between."""
    kept = growth["units_kept"]
    return (f"extended from {growth['from_rows']:,} to {growth['to_rows']:,} rows ({kept} unit{'s' * (kept != 1)} "
            f"kept, {growth['units_new']} new; data.max_rows={_show(growth['from_max_rows'])} -> "
            f"{_show(growth['to_max_rows'])})")
