"""`python -m specgen.regenerate`: rewrite every assistant turn with the target's own completion.

A draft learns the target's distribution best from text the target wrote itself, so this stage replaces the
dataset's assistant turns with the target's completions (see `specgen.regen.turns` for the turn-by-turn rules)
and writes conversations that `python -m specgen.generate data.path=<output.dir>` reads directly.

Read top to bottom: load the tokenizer and target, claim the output directory, then stream the source in work
units of `output.shard_size` rows, exactly as generate does (`specgen.job`). Each unit becomes one
`part-NNNNN.jsonl`, written atomically; units finished by an earlier (possibly killed) run are skipped, so
re-running the same command resumes, and re-running it with a larger `data.max_rows` grows the dataset
(`specgen.regen.grow`). Under `accelerate launch` each process claims the next unfinished unit when it
is ready for one (`specgen.ranks.claims`, as generate does), so a rank with longer rows or slower generation takes
fewer units and nobody waits for it; the main process writes `rejected.jsonl` and `manifest.json` once every part
is on disk. What the stage builds from its config is `specgen.regen.setup`; what it writes besides the parts,
`specgen.regen.manifest`.
"""

if __name__ == "__main__":  # a config error or `--cfg job` is answered before torch is imported (specgen.config)
    from specgen.config import check_command_line

    check_command_line("regenerate")

import logging
from pathlib import Path

import torch
from omegaconf import DictConfig

from specgen.capture.target import config_hash
from specgen.config import stage_main
from specgen.data.sources import SOURCE_DIGEST, CappedSource, capped_source, rows_digest, source_paths
from specgen.data.template import chat_template_sha256
from specgen.job import claim_for_job, claimed_units, require_model_folder, run_job, wait_for_units
from specgen.progress import Progress
from specgen.ranks import Workers
from specgen.ranks.claims import UnitClaims, clear_claims
from specgen.regen.grow import describe_growth, grow_if_asked
from specgen.regen.manifest import dataset_identity, print_summary, write_dataset_manifest
from specgen.regen.parts import finished_parts, remove_partial, sidecar_name, write_part
from specgen.regen.setup import build_regenerator, generation_settings, load_model, unit_seed
from specgen.regen.turns import ConversationRegenerator
from specgen.runtime import load_tokenizer, resolve_model_dtype

log = logging.getLogger("specgen.regenerate")


def run(cfg: DictConfig) -> dict | None:
    """Regenerate the dataset; returns the manifest on the main process and None on the others."""
    require_model_folder(cfg)
    # A wrong data.path fails here, before the model loads and the output directory is claimed.
    source = capped_source(cfg.data.path, cfg.data.max_rows, split=cfg.data.split, subset=cfg.data.subset)
    return run_job(cfg, "regenerate",
                   lambda out_dir, workers, lease: regenerate_into(cfg, out_dir, workers, lease, source))


def regenerate_into(cfg: DictConfig, out_dir: Path, workers: Workers, lease, source: CappedSource) -> dict | None:
    """The job once its main process holds the lease on `out_dir` (`lease.check()` before each commit)."""
    tokenizer = load_tokenizer(cfg.tokenizer.path)
    dtype = resolve_model_dtype(cfg.model.dtype, workers.device, cfg.model.path)
    cfg.model.dtype = dtype.name  # one concrete dtype for either engine and the manifest
    model = load_model(cfg, workers.device)
    regenerator = build_regenerator(cfg, tokenizer, model)
    identity = dataset_identity(cfg, config_hash(model), chat_template_sha256(tokenizer),
                                generation_settings(cfg, regenerator), str(model.dtype).removeprefix("torch."))
    done = claim_for_job(cfg, out_dir, identity, workers, finished=finished_parts, remove_partial=remove_partial,
                         sidecar_name=sidecar_name, source_rows=source.expected_rows,
                         before_claim=lambda out: grow_if_asked(
                             out, identity, shard_size=cfg.output.shard_size, file_rows=source.file_rows,
                             sources=len(source_paths(cfg.data.path)), overwrite=cfg.output.overwrite))
    claims = UnitClaims(out_dir, workers.rank, workers.world_size)

    # The main process's bar: the whole job with one process; its own rows (no total) when units are claimed.
    progress = Progress(source.expected_rows if workers.world_size == 1 else None, desc="regenerate",
                        enabled=cfg.runtime.progress and workers.is_main)
    units, new_tokens, rows = regenerate_units(cfg, source, regenerator, out_dir, workers, done, claims, progress,
                                               lease)
    seconds = progress.close()
    if not workers.is_main:
        return None

    wait_for_units(out_dir, units, finished_parts)
    lease.check()
    manifest = write_dataset_manifest(
        cfg, out_dir, units, model, identity,
        last_run={"new_tokens": new_tokens, "seconds": seconds, "engine": cfg.engine.name, "dtype": str(dtype),
                  "new_tokens_per_second": new_tokens / max(seconds, 1e-9),
                  "units_by_process": claims.by_process()})
    clear_claims(out_dir)
    if manifest["last_run"].get("grown"):
        log.info("%s: %s", out_dir, describe_growth(manifest["last_run"]["grown"]))
    print_summary(manifest, out_dir, new_tokens, rows, seconds, source.describe(manifest["stats"]["source_rows"]))
    return manifest


def regenerate_units(cfg: DictConfig, source: CappedSource, regenerator: ConversationRegenerator, out_dir: Path,
                     workers: Workers, done: dict[int, str | None], claims: UnitClaims, progress: Progress,
                     lease) -> tuple[list[int], int, int]:
    """Regenerate every unit this process claims into its part; returns (every unit's index, new tokens, rows)."""
    units, new_tokens, rows = [], 0, 0
    on_finished = (lambda unit_records: progress.update(len(unit_records), 0)) if workers.world_size == 1 else None
    for unit, unit_records in claimed_units(source.records, cfg.output.shard_size, done, claims,
                                            on_finished=on_finished, every_unit=units):
        seed = unit_seed(cfg.regenerate.seed, unit)
        torch.manual_seed(seed)  # engine=hf samples from torch's RNG; vLLM seeds each request from `seed`
        shown = []  # rows already counted on the bar as their chunk finished
        result = regenerator.regenerate(unit_records, on_batch=lambda tokens: progress.update(0, tokens),
                                        on_rows=lambda n: (shown.append(n), progress.update(n, 0)),
                                        chunk_rows=None if cfg.engine.name == "vllm" else cfg.regenerate.batch_size,
                                        seed=seed)
        lease.check()
        write_part(out_dir, unit, result.rows,
                   {"stats": result.stats, "rejected": [rejection.to_json() for rejection in result.rejections],
                    SOURCE_DIGEST: rows_digest(unit_records)})
        progress.update(len(unit_records) - sum(shown), 0)  # rows rejected before any generation
        new_tokens += result.stats["new_tokens"]
        rows += len(unit_records)
    return units, new_tokens, rows


main = stage_main("regenerate")(run)

if __name__ == "__main__":
    main()
