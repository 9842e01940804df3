"""`python -m specgen.regenerate`: rewrite every assistant turn with the target's own completion.

A draft learns the target's distribution best from text the target wrote itself, so this stage replaces the
dataset's assistant turns with the target's completions (see `specgen.regen.turns` for the turn-by-turn rules)
and writes conversations that `python -m specgen.generate data.path=<output.dir>` reads directly.

Read top to bottom: load the tokenizer and target, claim the output directory, then stream the source in work
units of `output.shard_size` rows, exactly as generate does. Each unit becomes one `part-NNNNN.jsonl`, written
atomically; units finished by an earlier (possibly killed) run are skipped, so re-running the same command
resumes. Under `accelerate launch` each process claims the next unfinished unit when it is ready for one
(`specgen.ranks.claims`, as generate does), so a rank with longer rows or slower generation takes fewer units and
nobody waits for it; the main process writes `rejected.jsonl` and `manifest.json` once every part is on disk.
"""

import hashlib
import json
import logging
import time
from pathlib import Path

import torch
from omegaconf import DictConfig

from specgen.capture.target import config_hash, load_target
from specgen.config import stage_main, to_container
from specgen.data.template import chat_template_sha256
from specgen.ranks import Workers, init_workers
from specgen.ranks.claims import UnitClaims, clear_claims
from specgen.errors import SpecgenError
from specgen.data.sources import CappedSource, capped_source, work_units
from specgen.runtime import load_tokenizer, resolve_model_dtype
from specgen.outdir import claim_output_dir
from specgen.progress import Progress, format_table
from specgen.regen.engine import Generator, Sampling
from specgen.regen.parts import finished_parts, part_name, read_sidecar, remove_partial, write_part
from specgen.regen.turns import COUNTS, ConversationRegenerator, TurnPolicy
from specgen.store.commit import HASH_ALGORITHM, write_text_atomic
from specgen.store.lease import hold_job_lease
from specgen.store.manifest import REJECTED, write_manifest

log = logging.getLogger("specgen.regenerate")

FORMAT = "specgen.conversations"
SEEDING = "torch.manual_seed(unit_seed(seed, part index)) before each part, so a part's text does not depend on " \
          "which process made it or on what ran before"
POLL_SECONDS = 2.0


def unit_seed(seed: int, unit: int) -> int:
    """The sampling seed of one work unit, derived from the run's seed and the unit index."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{unit}".encode()).digest()[:8], "little") >> 1


def template_kwargs(cfg: DictConfig, tokenizer) -> dict:
    """data.chat_template_kwargs, with `enable_thinking` set from regenerate.thinking when that is not null."""
    kwargs = to_container(cfg.data)["chat_template_kwargs"] or {}
    thinking = cfg.regenerate.thinking
    if thinking is None:
        return kwargs
    if not isinstance(thinking, bool):
        raise SpecgenError(f"regenerate.thinking must be null, true or false, got {thinking!r}")
    if "enable_thinking" not in json.dumps(tokenizer.chat_template):
        raise SpecgenError(f"regenerate.thinking={str(thinking).lower()} but the chat template of "
                           f"{cfg.tokenizer.path} has no enable_thinking switch; leave regenerate.thinking=null")
    if kwargs.get("enable_thinking", thinking) != thinking:
        raise SpecgenError(f"regenerate.thinking={str(thinking).lower()} contradicts data.chat_template_kwargs."
                           f"enable_thinking={kwargs['enable_thinking']}; set only one of them")
    return {**kwargs, "enable_thinking": thinking}


def load_model(cfg: DictConfig, device: torch.device):
    """The target: loaded with transformers (engine=hf), or its class on the meta device for engine=vllm, whose
    engine loads the weights (`specgen.regen.vllm`)."""
    if cfg.engine.name == "vllm":
        from specgen.capture.vllm import meta_target, require_vllm

        require_vllm()
        return meta_target(cfg.model.path, cfg.model.dtype)
    if cfg.engine.name != "hf":
        raise SpecgenError(f"engine={cfg.engine.name} does not regenerate; use engine=hf (the default) or "
                           "engine=vllm")
    return load_target(cfg.model.path, dtype=cfg.model.dtype, device=str(device),
                       attn_implementation=cfg.model.attn_implementation)


def context_limits(cfg: DictConfig, model) -> tuple[int, int, str]:
    """(longest prompt, sequence length, what sets the prompt limit): a prompt plus regenerate.max_new_tokens fits
    in data.max_length + max_new_tokens, in engine.max_model_len when given, and never beyond the model's positions
    (config.max_position_embeddings). The same for every engine; the sequence length is vLLM's max_model_len."""
    new_tokens = int(cfg.regenerate.max_new_tokens)
    positions = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    asked = to_container(cfg.engine).get("max_model_len")
    if asked and positions and asked > positions:
        raise SpecgenError(f"engine.max_model_len={asked} exceeds the {positions} positions of {cfg.model.path}; "
                           f"pass engine.max_model_len={positions} or less (or null)")
    limits = {f"data.max_length={cfg.data.max_length}": int(cfg.data.max_length) + new_tokens}
    if asked:
        limits[f"engine.max_model_len={asked} - regenerate.max_new_tokens={new_tokens}"] = int(asked)
    if positions:
        limits[f"the model's {positions} positions - regenerate.max_new_tokens={new_tokens}"] = int(positions)
    reason, length = min(limits.items(), key=lambda item: item[1])
    if length - new_tokens < 1:
        raise SpecgenError(f"regenerate.max_new_tokens={new_tokens} leaves no room for a prompt in {length} "
                           f"positions ({reason.split(' - ')[0]}); lower regenerate.max_new_tokens")
    return length - new_tokens, length, reason


def build_regenerator(cfg: DictConfig, tokenizer, model) -> ConversationRegenerator:
    settings = cfg.regenerate
    sampling = Sampling(temperature=float(settings.temperature), top_p=float(settings.top_p),
                        top_k=int(settings.top_k), max_new_tokens=int(settings.max_new_tokens))
    max_prompt_tokens, max_model_len, prompt_limit = context_limits(cfg, model)
    if cfg.engine.name == "vllm":
        from specgen.regen.vllm import VllmGenerator

        generator = VllmGenerator(cfg.model.path, model, tokenizer, sampling, engine=to_container(cfg.engine),
                                  seed=int(settings.seed), max_model_len=max_model_len)
    else:
        generator = Generator(model, tokenizer, sampling, batch_size=settings.batch_size,
                              batch_tokens=settings.batch_tokens)
    policy = TurnPolicy(turns=settings.turns, on_truncated=settings.on_truncated, on_empty=settings.on_empty,
                        on_loop=settings.on_loop, loop_ngram=int(settings.loop_ngram),
                        loop_repeats=int(settings.loop_repeats), resample_tries=int(settings.resample_tries),
                        user_turns=settings.user_turns)
    return ConversationRegenerator(tokenizer, generator, policy, max_prompt_tokens=max_prompt_tokens,
                                   prompt_limit=prompt_limit,
                                   chat_template_kwargs=template_kwargs(cfg, tokenizer),
                                   on_bad_row=cfg.data.on_bad_row)


def generation_settings(cfg: DictConfig, regenerator: ConversationRegenerator) -> dict:
    """Everything that shaped the generated text, for the manifest (and, minus speed knobs, the identity)."""
    sampling = regenerator.generator.sampling
    return {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
            "max_new_tokens": sampling.max_new_tokens, "seed": cfg.regenerate.seed, "seeding": SEEDING,
            "thinking": cfg.regenerate.thinking, "chat_template_kwargs": regenerator.chat_template_kwargs,
            "turns": regenerator.policy.turns, "user_turns": regenerator.policy.user_turns,
            "on_truncated": regenerator.policy.on_truncated,
            "on_empty": regenerator.policy.on_empty, "on_loop": regenerator.policy.on_loop,
            "loop_ngram": regenerator.policy.loop_ngram, "loop_repeats": regenerator.policy.loop_repeats,
            **resample_settings(regenerator.policy),
            "max_prompt_tokens": regenerator.max_prompt_tokens, "prompt_limit": regenerator.prompt_limit,
            "stop_token_ids": regenerator.generator.stop_token_ids, "split_reasoning": regenerator.split_reasoning,
            "backend": getattr(regenerator.generator, "backend",
                               "transformers generate: left-padded batches, KV cache")}


def resample_settings(policy) -> dict:
    """{"resample_tries": N} where a policy resamples; {} otherwise, so outputs made before it keep their identity."""
    return {"resample_tries": policy.resample_tries} if "resample" in (policy.on_loop, policy.on_empty) else {}


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


def wait_for_parts(out_dir: Path, units: list[int]) -> None:
    """Return once every unit's part is committed, whichever process writes it.

    A file poll rather than a collective barrier: regenerating one unit can take longer than the process group's
    collective timeout (10 minutes on NCCL), and `accelerate launch` stops every process when one fails anyway.
    """
    missing = set(units) - set(finished_parts(out_dir))
    if missing:
        log.info("waiting for %d parts from the other processes", len(missing))
    while missing:
        time.sleep(POLL_SECONDS)
        missing -= set(finished_parts(out_dir))


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


def finish(cfg: DictConfig, out_dir: Path, units: list[int], model, identity: dict,
           last_run: dict | None = None) -> dict:
    """Main process: gather every part's sidecar into rejected.jsonl and the manifest (written last)."""
    sidecars = [read_sidecar(out_dir, unit) for unit in units]
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
        "stats": sum_stats(sidecars),
        "config": to_container(cfg),
        "last_run": last_run,  # this process's new tokens and seconds (after the model loaded), and the engine
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
                          f"than {generation.get('loop_repeats')} times (on_loop={generation.get('on_loop')})"),
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
        ("next", " ".join([f"python -m specgen.generate model.path={manifest['model']['path']} data.path={out_dir}",
                           *([f"'data.chat_template_kwargs={{{template_overrides}}}'"] if template_overrides else [])])),
    ]))


def run(cfg: DictConfig) -> dict | None:
    """Regenerate the dataset; returns the manifest on the main process and None on the others."""
    if not Path(cfg.model.path).is_dir():
        raise SpecgenError(f"model.path={cfg.model.path} is not a folder; point it at a local Hugging Face model "
                           "folder (config.json + weights)")
    # A wrong data.path fails here, before the model loads and the output directory is claimed.
    source = capped_source(cfg.data.path, cfg.data.max_rows, split=cfg.data.split, subset=cfg.data.subset)
    workers = init_workers(cfg.runtime.device)
    out_dir = Path(cfg.output.dir)
    # Before anything else touches output.dir: another live job on it is refused here, in one line.
    with hold_job_lease(out_dir, stage="regenerate", is_main=workers.is_main, broadcast=workers.broadcast,
                        stale_s=cfg.output.lease_stale_s) as lease:
        return regenerate_into(cfg, out_dir, workers, lease, source)


def regenerate_into(cfg: DictConfig, out_dir: Path, workers: Workers, lease, source: CappedSource) -> dict | None:
    """The job once its main process holds the lease on `out_dir` (`lease.check()` before each commit)."""
    tokenizer = load_tokenizer(cfg.tokenizer.path)
    dtype = resolve_model_dtype(cfg.model.dtype, workers.device, cfg.model.path)
    cfg.model.dtype = dtype.name  # one concrete dtype for either engine and the manifest
    model = load_model(cfg, workers.device)
    regenerator = build_regenerator(cfg, tokenizer, model)
    identity = dataset_identity(cfg, config_hash(model), chat_template_sha256(tokenizer),
                                generation_settings(cfg, regenerator), str(model.dtype).removeprefix("torch."))

    if workers.is_main:
        if claim_output_dir(out_dir, identity, overwrite=cfg.output.overwrite):
            log.info("resuming in %s", out_dir)
        remove_partial(out_dir)
        clear_claims(out_dir)  # a killed job's claims: its unfinished units are anyone's again
    workers.barrier()  # the others start once the directory is claimed (and cleared on overwrite)
    done = finished_parts(out_dir)
    claims = UnitClaims(out_dir, workers.rank, workers.world_size)

    # The main process's bar: the whole job with one process; its own rows (no total) when units are claimed.
    progress = Progress(source.expected_rows if workers.world_size == 1 else None, desc="regenerate",
                        enabled=cfg.runtime.progress and workers.is_main)
    units, new_tokens, rows = [], 0, 0
    for unit, unit_records in work_units(source.records, cfg.output.shard_size):
        units.append(unit)
        if unit in done:
            if workers.world_size == 1:
                progress.update(len(unit_records), 0)
            continue
        if not claims.claim(unit):
            continue  # another process has it
        torch.manual_seed(unit_seed(cfg.regenerate.seed, unit))
        shown = []  # rows already counted on the bar as their chunk finished
        result = regenerator.regenerate(unit_records, on_batch=lambda tokens: progress.update(0, tokens),
                                        on_rows=lambda n: (shown.append(n), progress.update(n, 0)),
                                        chunk_rows=None if cfg.engine.name == "vllm" else cfg.regenerate.batch_size)
        lease.check()
        write_part(out_dir, unit, result.rows,
                   {"stats": result.stats, "rejected": [rejection.to_json() for rejection in result.rejections]})
        progress.update(len(unit_records) - sum(shown), 0)  # rows rejected before any generation
        new_tokens += result.stats["new_tokens"]
        rows += len(unit_records)
    seconds = progress.close()
    if not workers.is_main:
        return None

    wait_for_parts(out_dir, units)
    lease.check()
    manifest = finish(cfg, out_dir, units, model, identity,
                      last_run={"new_tokens": new_tokens, "seconds": seconds, "engine": cfg.engine.name, "dtype": str(dtype),
                                "new_tokens_per_second": new_tokens / max(seconds, 1e-9),
                                "units_by_process": claims.by_process()})
    clear_claims(out_dir)
    print_summary(manifest, out_dir, new_tokens, rows, seconds, source.describe(manifest["stats"]["source_rows"]))
    return manifest


main = stage_main("regenerate")(run)

if __name__ == "__main__":
    main()
