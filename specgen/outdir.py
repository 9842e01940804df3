"""The output directory contract: one config per directory, resumable.

`run.json` is written when a run starts and holds the fingerprint of everything that defines the dataset
(model, tokenizer, data, capture, shard size; not performance knobs such as batch size or device). Re-running with
the same fingerprint resumes; a different fingerprint is an error unless `output.overwrite=true`.
"""

import hashlib
import json
import shutil
from pathlib import Path

from specgen.errors import SpecgenError
from specgen.store.commit import write_json_atomic

RUN_FILE = "run.json"


def fingerprint(identity: dict) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()


def changed_keys(previous: dict, identity: dict) -> list[str]:
    """The identity keys whose values differ, sorted; a key holding a dict is named by its changed entries
    (`data.max_length`, `generation.max_new_tokens`), so the error says which setting moved."""
    identity = json.loads(json.dumps(identity, default=str))  # as run.json holds it (tuples as lists)
    changed = []
    for key in sorted(set(previous) | set(identity)):
        before, after = previous.get(key), identity.get(key)
        if before == after:
            continue
        if isinstance(before, dict) and isinstance(after, dict):
            changed += [f"{key}.{sub}" for sub in sorted(set(before) | set(after)) if before.get(sub) != after.get(sub)]
        else:
            changed.append(key)
    return changed


def claim_output_dir(out_dir: Path, identity: dict, *, overwrite: bool) -> bool:
    """Create or re-open `out_dir` for a run with `identity`. Returns True when resuming earlier work."""
    run_file = out_dir / RUN_FILE
    digest = fingerprint(identity)
    if run_file.exists():
        previous = json.loads(run_file.read_text())
        if previous.get("fingerprint") == digest:
            return True
        if not overwrite:
            changed = changed_keys(previous.get("identity", {}), identity)
            raise SpecgenError(
                f"output.dir={out_dir} holds a dataset made with a different configuration (changed: "
                f"{', '.join(changed) or 'unknown'}); pick another output.dir, or pass output.overwrite=true to replace it")
        _clear(out_dir)
    elif out_dir.exists() and any(p.name.startswith("shard-") for p in out_dir.iterdir()):
        if not overwrite:
            raise SpecgenError(f"output.dir={out_dir} has shards but no {RUN_FILE}; pass output.overwrite=true to replace them")
        _clear(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(run_file, {"fingerprint": digest, "identity": identity})
    return False


def _clear(out_dir: Path) -> None:
    for path in out_dir.iterdir():
        if path.name.startswith(".") or path.suffix == ".log":  # the running job's own log is open
            continue
        shutil.rmtree(path) if path.is_dir() else path.unlink()
