"""What `specgen.regenerate` writes besides the parts: the dataset identity, `rejected.jsonl` and the manifest
(gathered from every part's sidecar, with the growths of the dataset, `specgen.regen.grow`), and the summary printed
at the end."""

import json
from pathlib import Path

from omegaconf import DictConfig

from specgen.config import job_recipe, to_container
from specgen.progress import format_table
from specgen.regen.grow import describe_growth, history_for_manifest
from specgen.regen.parts import part_name, read_sidecar
from specgen.regen.turns import COUNTS
from specgen.store.commit import HASH_ALGORITHM, write_text_atomic
from specgen.store.manifest import REJECTED, write_manifest

FORMAT = "specgen.conversations"


def dataset_identity(cfg: DictConfig, model_config_hash: str, template_sha: str, generation: dict,
                     dtype: str) -> dict:
    """Everything that changes the dataset's content (and nothing that only changes speed, such as batch size):
    the engine, attention kernel and the dtype model.dtype resolved to among them."""
    data = to_container(cfg.data)
    return {"model.path": str(Path(cfg.model.path).resolve()), "model.config_hash": model_config_hash,
            "model.dtype": dtype, "engine.name": cfg.engine.name,
            "model.attn_implementation": cfg.model.attn_implementation,
            "tokenizer.path": str(Path(cfg.tokenizer.path).resolve()),
            "chat_template_sha256": template_sha,
            "data": {key: data[key] for key in ("path", "split", "subset", "max_length", "max_rows", "on_bad_row")},
            "generation": generation, "output.shard_size": cfg.output.shard_size}


def sum_stats(sidecars: list[dict]) -> dict:
    """Add the units' counts; count tables (`dropped`, `rejected`) are merged key by key."""
    totals: dict = {key: 0 for key in COUNTS} | {"dropped": {}, "rejected": {}}
    for sidecar in sidecars:
        for key, value in sidecar["stats"].items():
            if isinstance(value, dict):
                for reason, count in value.items():
                    totals[key][reason] = totals[key].get(reason, 0) + count
            else:
                totals[key] = totals.get(key, 0) + value
    return totals


def write_dataset_manifest(cfg: DictConfig, out_dir: Path, units: list[int], model, identity: dict,
           last_run: dict | None = None) -> dict:
    """Main process: gather every part's sidecar into rejected.jsonl and the manifest (written last)."""
    sidecars = [read_sidecar(out_dir, unit) for unit in units]
    stats = sum_stats(sidecars)
    extensions, grown = history_for_manifest(out_dir, stats["source_rows"], len(units))
    write_text_atomic(out_dir / REJECTED,
                      "".join(json.dumps(row) + "\n" for sidecar in sidecars for row in sidecar["rejected"]))
    manifest = {
        "format": FORMAT, "format_version": 1,
        "parts": [part_name(unit) for unit in units],
        "checksums": {part_name(unit): sidecar.get("checksum", {}).get(HASH_ALGORITHM)
                      for unit, sidecar in zip(units, sidecars)},
        "model": {"path": identity["model.path"], "config_hash": identity["model.config_hash"],
                  "architecture": type(model).__name__, "dtype": str(model.dtype).removeprefix("torch.")},
        "tokenizer": {"path": identity["tokenizer.path"], "chat_template_sha256": identity["chat_template_sha256"]},
        "generation": identity["generation"],
        "stats": stats,
        "config": to_container(cfg),
        "recipe": job_recipe(),  # recipe=NAME of the run that wrote this manifest (None: none), for the next stage
        # each time a re-run with a larger data.max_rows grew the dataset (specgen.regen.grow), oldest first
        "extensions": extensions,
        # this process's new tokens and seconds (after the model loaded), the engine, and the growth it finished
        "last_run": {**(last_run or {}), "grown": grown},
    }
    write_manifest(out_dir, manifest)
    return manifest


def print_summary(manifest: dict, out_dir: Path, new_tokens: int, rows: int, seconds: float,
                  source_rows: str = "") -> None:
    stats, generation = manifest["stats"], manifest["generation"]
    template_overrides = ",".join(f"{key}:{json.dumps(value)}" for key, value in generation["chat_template_kwargs"].items())

    def table(counts: dict) -> str:
        return f"{sum(counts.values()):,}" + (f" ({', '.join(f'{k}: {v}' for k, v in sorted(counts.items()))}; "
                                              f"see {REJECTED})" if counts else "")

    print(format_table([
        ("output", str(out_dir)),
        ("source", source_rows),
        *([("grown", describe_growth(grown))] if (grown := (manifest.get("last_run") or {}).get("grown")) else []),
        ("target dtype", (manifest.get("last_run") or {}).get("dtype", manifest["model"]["dtype"])),
        ("rows", f"{stats['rows']:,} of {stats['source_rows']:,} source rows in {len(manifest['parts'])} parts"),
        ("regenerated turns", f"{stats['regenerated_turns']:,} ({stats['new_tokens']:,} new tokens; "
                              f"{stats['kept_tool_call_turns']:,} tool-call turns kept verbatim)"),
        *([("synthesized turns", f"{stats['synthesized_user_turns']:,} user turns written by the target "
                                 "(regenerate.user_turns=synthesize)")] if generation.get("user_turns") == "synthesize"
          else []),
        ("truncated turns", f"{stats['truncated_turns']:,} reached max_new_tokens={generation['max_new_tokens']} "
                            f"(on_truncated={generation['on_truncated']})"),
        ("empty turns", f"{stats['empty_turns']:,} (on_empty={generation['on_empty']})"),
        ("looping turns", f"{stats.get('loop_turns', 0):,} repeat a run of {generation.get('loop_ngram')} tokens more "
                          f"than {generation.get('loop_repeats')} times (on_loop={generation.get('on_loop')})"
                          + (f"; {stopped:,} stopped by the engine at the token that made them loop"
                             if (stopped := stats.get("loop_stopped_turns", 0)) else "")),
        *([("resampled turns", f"{stats.get('resampled_turns', 0):,} draws discarded and drawn again (up to "
                               f"{generation['resample_tries']} more per turn; the counts above include them)")]
          if "resample_tries" in generation else []),
        ("dropped rows", table(stats["dropped"])),
        ("cut rows", f"{stats['cut_rows']:,} ended before a turn whose prompt exceeds {generation['max_prompt_tokens']:,} "
                     f"tokens ({generation.get('prompt_limit', 'data.max_length')}); rows whose first such prompt is "
                     "too long are rejected (prompt_too_long)"),
        ("rejected rows", table(stats["rejected"])),
        ("throughput", f"{new_tokens / max(seconds, 1e-9):,.0f} new tokens/s, {rows / max(seconds, 1e-9):,.2f} "
                       f"rows/s in this process ({seconds:.1f}s)" if new_tokens else
                       "nothing left to generate: every part was already finished"),
        ("next", " ".join(["python -m specgen.generate",
                           *([f"recipe={manifest['recipe']}"] if manifest.get("recipe") else []),
                           f"model.path={manifest['model']['path']} data.path={out_dir}",
                           *([f"'data.chat_template_kwargs={{{template_overrides}}}'"] if template_overrides else [])])),
    ]))
