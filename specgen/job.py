"""The job skeleton `specgen.generate` and `specgen.regenerate` share: one output directory, work units, resume.

    run_job             the processes join (`specgen.ranks`), the main one takes the lease on output.dir
                        (`specgen.store.lease`: another live job there is refused in one line)
    claim_for_job       the main process claims output.dir (`specgen.outdir`: one configuration per directory) and
                        clears a killed run's leftovers; every process learns which units are already finished
    reopen_grown_units  a finished short last unit whose source has grown since is redone; a shrunk source refused
    claimed_units       the source in units of `output.shard_size` rows; each process takes the next unfinished
                        unit whenever it is ready for one (`specgen.ranks.claims`), so nobody waits for a slower one;
                        a finished unit whose source rows were edited since is refused (`rows_digest`)

A stage turns each claimed unit into one file committed atomically (a shard, a part), checks the lease before each
commit, and has its main process write the manifest last, once every unit is on disk.
"""

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TypeVar

from omegaconf import DictConfig, OmegaConf

from specgen.data.sources import SOURCE_DIGEST, SourceRecord, rows_digest, unit_rows, work_units
from specgen.errors import SpecgenError
from specgen.outdir import claim_output_dir, fingerprint
from specgen.ranks import Workers, init_workers
from specgen.ranks.claims import UnitClaims, clear_claims
from specgen.store.commit import fsync_dir, read_unit_sidecar
from specgen.store.lease import hold_job_lease

log = logging.getLogger("specgen.job")

T = TypeVar("T")
POLL_SECONDS = 2.0  # how often the main process looks for the units the others are writing


def require_model_folder(cfg: DictConfig) -> None:
    if not Path(cfg.model.path).is_dir():
        raise SpecgenError(f"model.path={cfg.model.path} is not a folder; point it at a local Hugging Face model "
                           "folder (config.json + weights)")


def require_shared_output_dir(cfg: DictConfig, workers: Workers) -> None:
    """With several processes, output.dir must name one directory for all of them (and for the re-run that resumes).

    The default `outputs/<stage>-${now:...}` resolves to each process's own launch time, so it is refused rather
    than agreed on: a job that is meant to be resumed after a failure needs a directory the same command finds again.
    """
    raw = str(OmegaConf.to_container(cfg.output, resolve=False)["dir"])
    if workers.world_size > 1 and "${now:" in raw:
        raise SpecgenError(f"output.dir={raw} depends on each process's launch time, so the {workers.world_size} "
                           "processes would write to different directories; pass an explicit output.dir=DIR on a "
                           "filesystem every process sees (re-running the same command then resumes the job)")


def run_job(cfg: DictConfig, stage: str, job: Callable[[Path, Workers, object], T]) -> T:
    """`job(out_dir, workers, lease)` once the processes have joined and the main one holds the lease on output.dir
    (the job calls `lease.check()` before each commit)."""
    workers = init_workers(cfg.runtime.device)
    require_shared_output_dir(cfg, workers)
    out_dir = Path(cfg.output.dir)
    # Before anything else touches output.dir: another live job on it is refused here, in one line.
    with hold_job_lease(out_dir, stage=stage, is_main=workers.is_main, broadcast=workers.broadcast,
                        stale_s=cfg.output.lease_stale_s) as lease:
        return job(out_dir, workers, lease)


def claim_for_job(cfg: DictConfig, out_dir: Path, identity: dict, workers: Workers, *,
                  finished: Callable[[Path], dict[int, Path]], remove_partial: Callable[[Path], object],
                  sidecar_name: Callable[[int], str], source_rows: int | None,
                  before_claim: Callable[[Path], object] | None = None) -> dict[int, str | None]:
    """The main process claims output.dir and clears a killed run's leftovers (`remove_partial`); every process then
    returns the finished units (`finished`: unit -> its file; `sidecar_name(unit)`: its sidecar), each with the
    digest of the source rows it was made from (its sidecar's SOURCE_DIGEST; None in a sidecar from before it).
    Also checks that every process was launched with the same dataset configuration, and that the finished units
    still match the source (`source_rows`: the rows this run reads, `reopen_grown_units`). `before_claim(out_dir)`: the main
    process's step before the claim, under the lease (regenerate grows a dataset there, `specgen.regen.grow`); its
    `SpecgenError` stops every process."""
    problem = None
    if workers.is_main:
        try:
            if before_claim is not None:
                before_claim(out_dir)
            if claim_output_dir(out_dir, identity, overwrite=cfg.output.overwrite):
                log.info("resuming in %s", out_dir)
            remove_partial(out_dir)
            reopen_grown_units(out_dir, finished(out_dir), sidecar_name, shard_size=cfg.output.shard_size,
                               source_rows=source_rows)
            clear_claims(out_dir)  # an earlier job's claims: its unfinished units are anyone's again
        except SpecgenError as error:
            problem = str(error)
    main_problem, main_fingerprint = workers.broadcast((problem, fingerprint(identity)))
    if main_problem is not None:
        raise SpecgenError(main_problem)
    if main_fingerprint != fingerprint(identity):
        raise SpecgenError(f"process {workers.rank} was launched with a dataset configuration that differs from "
                           "process 0's (model, tokenizer, data, layers or shard size); launch every machine with "
                           "the same command")
    done = {unit: read_unit_sidecar(out_dir / sidecar_name(unit), f"unit {unit}").get(SOURCE_DIGEST)
            for unit in finished(out_dir)}
    if done:
        log.info("%d units already finished in %s", len(done), out_dir)
    return done


def reopen_grown_units(out_dir: Path, units: dict[int, Path], sidecar_name: Callable[[int], str], *,
                       shard_size: int, source_rows: int | None) -> list[int]:
    """Main process, before the claim: compare each finished unit's source rows (its sidecar's stats.source_rows)
    with the rows the source gives that unit now (unit k holds rows [k*S, (k+1)*S) of the `source_rows` this run
    reads; None: unknown, nothing is checked), and return the units made unfinished again.

    A short last unit whose source has grown since (rows appended to data.path, or a larger data.max_rows) is
    removed, sidecar first, so the run redoes it with its full rows: the result is what a run on the grown source
    makes from scratch. A kill between the two removals leaves the old file without its sidecar: unfinished, and
    replaced when the unit is redone (`specgen.store.commit.commit_unit`). A unit the source now gives fewer rows,
    or none, is refused in one line: the source shrank or changed, and the folder's units no longer describe it."""
    if source_rows is None:
        return []
    reopened = []
    for unit, path in sorted(units.items()):
        sidecar = out_dir / sidecar_name(unit)
        held = read_unit_sidecar(sidecar, f"unit {unit}")["stats"]["source_rows"]
        now = unit_rows(unit, shard_size, source_rows)
        if held > now:
            raise SpecgenError(
                f"output.dir={out_dir} holds unit {unit} ({path.name}) made from {held:,} source rows, but data.path now "
                f"gives it {now:,} (the source shrank or changed since); pass output.overwrite=true to start again, or "
                "pick another output.dir")
        if held < now:
            log.warning("the source has grown since unit %d (%s) was made from %d source rows: it now gives %d "
                        "(rows added to data.path, or a larger data.max_rows), so the unit is redone with them",
                        unit, path.name, held, now)
            sidecar.unlink()
            path.unlink()
            reopened.append(unit)
    if reopened:
        fsync_dir(out_dir)
    return reopened


def claimed_units(records: Iterable[SourceRecord], shard_size: int, done: dict[int, str | None], claims: UnitClaims,
                  *, on_finished: Callable[[list[SourceRecord]], None] | None = None, slowdown: float = 0.0,
                  every_unit: list[int] | None = None) -> Iterator[tuple[int, list[SourceRecord]]]:
    """(unit, its records) for each unfinished unit this process claims, in order; a unit is claimed when the
    previous one was taken. Finished units (`done`: unit -> the digest of the rows it was made from) are checked
    against the rows the source gives them now, a changed one refused in one line, and go to `on_finished`
    (progress); every unit's index goes to `every_unit`. slowdown: seconds to sleep before each claim
    (`specgen.ranks.slowdown_for_tests`)."""
    for unit, unit_records in work_units(records, shard_size):
        if every_unit is not None:
            every_unit.append(unit)
        if unit in done:
            if done[unit] is not None and done[unit] != rows_digest(unit_records):
                raise SpecgenError(
                    f"unit {unit} of output.dir (source rows {unit_records[0].index:,}-{unit_records[-1].index:,}) "
                    "was made from rows that data.path no longer holds as they were (edited since); pass "
                    "output.overwrite=true to start again, or pick another output.dir")
            if on_finished is not None:
                on_finished(unit_records)
            continue
        if slowdown:
            time.sleep(slowdown)
        if claims.claim(unit):
            yield unit, unit_records


def wait_for_units(out_dir: Path, units: list[int], finished: Callable[[Path], Iterable[int]]) -> None:
    """Return once every unit is committed (`finished(out_dir)`), whichever process writes it.

    A file poll rather than a collective barrier: one unit can take longer than the process group's collective
    timeout (10 minutes on NCCL), and `accelerate launch` stops every process when one fails anyway.
    """
    missing = set(units) - set(finished(out_dir))
    if missing:
        log.info("waiting for %d units from the other processes", len(missing))
    while missing:
        time.sleep(POLL_SECONDS)
        missing -= set(finished(out_dir))
