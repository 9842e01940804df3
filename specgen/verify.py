"""`python -m specgen.verify data.shards=DIR`: audit a finished dataset.

Checksums come first: every shard's bytes against the sha256 its commit recorded (sidecar and manifest), which
catches any flipped bit and names every damaged shard. Structural checks read every row (cheap: memory-mapped); the reference check re-runs a few random samples through
the plain Hugging Face forward (`output_hidden_states=True`) of the recorded target and reports the relative error
of every captured tensor. Any failure is listed and the exit status is non-zero.
"""

if __name__ == "__main__":  # a config error or `--cfg job` is answered before torch is imported (specgen.config)
    from specgen.config import check_command_line

    check_command_line("verify")

import hashlib
import logging
import random
import sys
from pathlib import Path

import torch
from omegaconf import DictConfig

from specgen.capture.target import config_hash, load_target
from specgen.config import stage_main
from specgen.errors import SpecgenError
from specgen.runtime import resolve_device, set_threads
from specgen.progress import format_table
from specgen.store.manifest import read_manifest, shard_checksums
from specgen.store.reader import check_dataset_path, open_shards, shard_checksum_problems

log = logging.getLogger("specgen.verify")

DEFAULT_TOLERANCE = {"bfloat16": 2e-2, "float16": 5e-3, "float32": 1e-4,
                     "fp8": 4e-2}  # output.codec=fp8: e4m3 rounding alone is ~2.6% (specgen.store.fp8)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float(), want.float()
    return float((got - want).norm() / want.norm().clamp_min(1e-12))


def check_structure(dataset, manifest: dict) -> tuple[list[str], dict]:
    """Every row: consistent lengths, 0/1 mask, finite values, not stored twice (the same sample_id and tokens;
    replies pooled from one prompt share its id, not its tokens); totals equal the manifest's stats."""
    problems = []
    totals = {"samples": 0, "tokens": 0, "trainable_tokens": 0}
    width_aux = dataset.spec.num_aux * dataset.spec.hidden_size
    seen = {}  # (sample_id, tokens) -> first index: the same row stored twice; pooled replies share only the id
    for i in range(len(dataset)):
        item = dataset[i]
        sid, length = item["sample_id"], len(item["input_ids"])
        where = f"sample {i} ({sid})"
        key = (sid, hashlib.sha256(item["input_ids"].numpy().tobytes()).digest())
        if key in seen:
            problems.append(f"{where}: the same row (sample_id and tokens) as sample {seen[key]}")
        seen.setdefault(key, i)
        if len(item["loss_mask"]) != length:
            problems.append(f"{where}: loss_mask has {len(item['loss_mask'])} entries for {length} tokens")
        if not bool(((item["loss_mask"] == 0) | (item["loss_mask"] == 1)).all()):
            problems.append(f"{where}: loss_mask holds values other than 0/1")
        for name, width in (("aux_hidden_states", width_aux), ("last_hidden_state", dataset.spec.hidden_size)):
            tensor = item[name]
            if tuple(tensor.shape) != (length, width):
                problems.append(f"{where}: {name} has shape {tuple(tensor.shape)}, expected ({length}, {width})")
            elif not bool(torch.isfinite(tensor.float()).all()):
                problems.append(f"{where}: {name} contains NaN or Inf")
        totals["samples"] += 1
        totals["tokens"] += length
        totals["trainable_tokens"] += int(item["loss_mask"].sum())
    for key, value in totals.items():
        recorded = manifest["stats"].get(key)
        if recorded != value:
            problems.append(f"manifest stats.{key}={recorded} but the shards hold {value}")
    for key in ("hidden_size", "num_aux", "dtype"):
        if manifest.get(key) != getattr(dataset.spec, key):
            problems.append(f"manifest {key}={manifest.get(key)} but the shards say {getattr(dataset.spec, key)}")
    return problems, totals


def check_against_reference(dataset, manifest: dict, cfg: DictConfig) -> tuple[list[str], list[tuple[str, str]]]:
    """Re-run random samples through the HF forward and compare each captured tensor."""
    problems, rows = [], []
    model_path = cfg.model.path or manifest["model"]["path"]
    if not Path(model_path).is_dir():
        raise SpecgenError(f"the recorded target {model_path} is not there; pass model.path=DIR "
                           "or verify.samples=0 to skip the reference check")
    device = resolve_device(cfg.runtime.device)
    model = load_target(model_path, dtype=manifest["dtype"], device=str(device), attn_implementation="eager")
    if config_hash(model) != manifest["model"]["config_hash"]:
        problems.append(f"{model_path} has a different config than the one recorded in the manifest")
    num_layers = manifest["model"]["num_layers"]
    hidden = manifest["hidden_size"]
    tolerance = cfg.verify.tolerance or DEFAULT_TOLERANCE[manifest.get("codec", manifest["dtype"])]
    picks = random.Random(cfg.runtime.seed).sample(range(len(dataset)), min(cfg.verify.samples, len(dataset)))
    for index in picks:
        item = dataset[index]
        with torch.inference_mode():
            out = model(item["input_ids"][None].to(device), output_hidden_states=True)
        reference = {"last_hidden_state": out.hidden_states[-1][0]}
        for slot, layer in enumerate(manifest["capture"]["aux_layers"]):
            if layer < num_layers - 1:  # HF's entry for the last layer is post-norm; ours is the raw layer output
                reference[f"aux_hidden_states[layer {layer}]"] = (out.hidden_states[layer + 1][0], slot)
        for name, ref in reference.items():
            if isinstance(ref, tuple):
                ref, slot = ref
                got = item["aux_hidden_states"][:, slot * hidden:(slot + 1) * hidden]
            else:
                got = item[name]
            error = relative_error(got.to(device), ref)
            ok = error <= tolerance
            rows.append((f"{item['sample_id']} {name}", f"rel. error {error:.2e} {'ok' if ok else 'TOO LARGE'}"))
            if not ok:
                problems.append(f"sample {item['sample_id']}: {name} differs from the HF forward "
                                f"(relative error {error:.2e} > {tolerance:.0e})")
    return problems, rows


def check_checksums(out_dir: Path, manifest: dict) -> tuple[list[str], str]:
    """Every shard's bytes against the checksum its commit recorded in the manifest and in its sidecar."""
    shards = [out_dir / name for name in manifest.get("shards", [])]
    recorded = manifest.get("checksums") or {}
    if not recorded:
        return [], "not recorded (dataset made before checksums)"
    problems = shard_checksum_problems(shards, manifest)
    for name, checksum in shard_checksums(out_dir).items():
        if name in recorded and checksum is not None and checksum != recorded[name]:
            problems.append(f"{name}: its sidecar and the manifest record different checksums")
    damaged = {problem.split(":")[0] for problem in problems}
    return problems, f"{len(shards) - len(damaged)} of {len(shards)} shards intact"


def run(cfg: DictConfig) -> None:
    set_threads(cfg.runtime.threads)
    out_dir = Path(cfg.data.shards)
    check_dataset_path(out_dir, key="data.shards")  # not there: say so (read_manifest would call it unfinished)
    manifest = read_manifest(out_dir)
    problems, checksum_row = check_checksums(out_dir, manifest)  # fast, and names every damaged shard
    rows = [("dataset", str(out_dir)), ("checksums", checksum_row)]
    try:
        dataset = open_shards(out_dir)
    except SpecgenError as error:
        _report(rows, [*problems, str(error)])
    structure_problems, totals = check_structure(dataset, manifest)
    problems += structure_problems
    rows += [("samples", f"{totals['samples']:,}"), ("tokens", f"{totals['tokens']:,}")]
    if cfg.verify.samples > 0 and len(dataset):
        reference_problems, reference_rows = check_against_reference(dataset, manifest, cfg)
        problems += reference_problems
        rows += reference_rows
    _report(rows, problems)


def _report(rows: list[tuple[str, str]], problems: list[str]) -> None:
    """Print the table; list the problems and exit non-zero when there are any."""
    print(format_table(rows))
    if problems:
        print(f"FAILED: {len(problems)} problem(s)", file=sys.stderr)
        for problem in problems:
            print(f"  - {problem}", file=sys.stderr)
        sys.exit(1)
    print("OK: the dataset is consistent and matches the reference forward")


main = stage_main("verify")(run)

if __name__ == "__main__":
    main()
