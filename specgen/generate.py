"""`python -m specgen.generate`: conversations -> tokens + loss mask -> target capture -> Arrow shards.

Read top to bottom: load the tokenizer and target, claim the output directory, then stream the source in work
units of `output.shard_size` rows. Each unit becomes one shard, written atomically; units already finished by an
earlier (possibly killed) run are skipped, so re-running the same command resumes. The manifest is written last.

Under `accelerate launch` each process claims the next unfinished unit whenever it is ready for one
(`specgen.job`, `specgen.ranks.claims`), so no process waits for a slower one; the main process writes the manifest
once every process is done (`specgen.ranks.monitor`). Within a process, tokenizing runs ahead of the target and
writing behind it (`specgen.pipeline`). The capture itself is `specgen.capture`: the target loaded for its engine
(`loading`), batches through it (`offline`), units to shards (`units`), the manifest and summary (`manifest`).
"""

if __name__ == "__main__":  # a config error or `--cfg job` is answered before torch is imported (specgen.config)
    from specgen.config import check_command_line

    check_command_line("generate")

import logging
from collections.abc import Iterable, Iterator
from contextlib import closing
from pathlib import Path

from omegaconf import DictConfig

from specgen.capture.loading import load_capture
from specgen.capture.manifest import build_manifest, dataset_identity, print_summary, require_samples
from specgen.capture.offline import Target
from specgen.capture.target import config_hash
from specgen.capture.units import PreparedUnit, capture_units, counts_top_tokens, prepare_unit
from specgen.config import stage_main
from specgen.data.sources import SourceRecord, capped_source
from specgen.data.template import ChatTemplateTokenizer, chat_template_sha256
from specgen.errors import SpecgenError
from specgen.job import claim_for_job, claimed_units, require_model_folder, run_job
from specgen.pipeline import BackgroundWriter, prefetched
from specgen.ranks import Workers, report_error, slowdown_for_tests
from specgen.ranks.claims import UnitClaims, clear_claims
from specgen.ranks.monitor import JobMonitor, PeerFailure
from specgen.runtime import load_tokenizer, resolve_device, resolve_model_dtype, set_threads
from specgen.schema import settings
from specgen.store.manifest import merge_rejected, write_manifest
from specgen.store.writer import finished_shards, remove_partial, sidecar_name

log = logging.getLogger("specgen.generate")


def run(cfg: DictConfig) -> dict | None:
    """Generate the dataset; returns the manifest on the main process and None on the others."""
    require_model_folder(cfg)
    resolve_device(cfg.runtime.device)  # a one-line error for a device that is not there
    set_threads(cfg.runtime.threads)
    return run_job(cfg, "generate", lambda out_dir, workers, lease: generate_into(cfg, out_dir, workers, lease))


def generate_into(cfg: DictConfig, out_dir: Path, workers: Workers, lease) -> dict | None:
    """The job once its main process holds the lease on `out_dir` (`lease.check()` before each commit)."""
    device = workers.device
    source = capped_source(cfg.data.path, cfg.data.max_rows, split=cfg.data.split, subset=cfg.data.subset)
    tokenizer = load_tokenizer(cfg.tokenizer.path)
    chat = ChatTemplateTokenizer.from_settings(tokenizer, settings(cfg, "data"))
    dtype = resolve_model_dtype(cfg.model.dtype, device, cfg.model.path)
    cfg.model.dtype = dtype.name  # one concrete dtype for every loader (hf, deepspeed, vllm) and the manifest
    target = load_capture(cfg, tokenizer, device)
    identity = dataset_identity(cfg, config_hash(target.capture.model), chat_template_sha256(tokenizer), target)
    done = claim_for_job(cfg, out_dir, identity, workers, finished=finished_shards, remove_partial=remove_partial,
                         sidecar_name=sidecar_name, source_rows=source.expected_rows)
    if cfg.capture.count_target_tokens and not counts_top_tokens(cfg, target):
        log.warning("capture.count_target_tokens: the target's LM head is not whole in this process (engine=%s), so "
                    "target_token_counts.json is not written; draft.vocab_source=target needs engine=hf",
                    cfg.engine.name)

    monitor = JobMonitor(workers, source.expected_rows, enabled=cfg.runtime.progress,
                         heartbeat_s=cfg.pipeline.heartbeat_s)
    claims = UnitClaims(out_dir, workers.rank, workers.world_size)
    job, seconds = capture_job(cfg, owned_units(cfg, source.records, chat, workers, done, monitor, claims), target,
                               out_dir, workers, monitor, lease)
    if not workers.is_main:
        return None

    lease.check()
    manifest = build_manifest(cfg, out_dir, target, tokenizer, identity)
    manifest["last_run"] = {"computed_tokens": job.tokens, "seconds": seconds,
                            "tokens_per_second": job.tokens / max(seconds, 1e-9), "device": str(device),
                            "processes": workers.world_size, "engine": cfg.engine.name, "dtype": str(dtype),
                            "units_by_process": claims.by_process()}
    clear_claims(out_dir)
    merge_rejected(out_dir)
    write_manifest(out_dir, manifest)
    print_summary(manifest, out_dir, job.tokens, seconds, workers.world_size,
                  source.describe(manifest["stats"].get("source_rows", 0)))
    require_samples(manifest, out_dir)
    return manifest


def owned_units(cfg: DictConfig, records: Iterable[SourceRecord], chat: ChatTemplateTokenizer, workers: Workers,
                done: dict[int, str | None], monitor: JobMonitor, claims: UnitClaims) -> Iterator[PreparedUnit]:
    """The unfinished units this process claims, tokenized in order (claimed when the previous one was taken off
    the prefetch queue); finished ones only count towards progress, on the main process."""
    on_finished = (lambda unit_records: monitor.add(rows=len(unit_records))) if workers.is_main else None
    for unit, unit_records in claimed_units(records, cfg.output.shard_size, done, claims, on_finished=on_finished,
                                            slowdown=slowdown_for_tests(workers.rank)):
        yield prepare_unit(cfg, unit, unit_records, chat)


def capture_job(cfg: DictConfig, units: Iterator[PreparedUnit], target: Target, out_dir: Path, workers: Workers,
                monitor: JobMonitor, lease):
    """Capture this process's units into shards: tokenizing ahead in a thread, writing behind in others; returns
    the monitor's (job totals, seconds). A failure is reported to the other processes before it is raised."""
    try:
        units = prefetched(units, cfg.pipeline.prefetch_units)
        with closing(units), BackgroundWriter(out_dir, target.spec, depth=cfg.pipeline.write_queue,
                                              on_batch=lambda tokens: monitor.add(tokens=tokens),
                                              on_commit=lambda rows: monitor.add(rows=rows),
                                              writers=cfg.pipeline.writers) as writer:
            capture_units(cfg, units, target, writer, monitor, workers.device, lease)
        return monitor.finish()
    except BaseException as error:
        monitor.fail()
        if workers.world_size > 1 and not isinstance(error, PeerFailure):
            report_error(f"{type(error).__name__}: {error}")
        if workers.world_size > 1 and isinstance(error, SpecgenError):
            raise SpecgenError(f"process {workers.rank} of {workers.world_size}: {error}") from None
        raise


main = stage_main("generate")(run)

if __name__ == "__main__":
    main()
