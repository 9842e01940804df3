"""Dynamic assignment of work units: a process claims the next unfinished unit when it is ready for another one.

A claim is the file `OUT/.specgen-claims/unit-NNNNNN` holding the claimer's rank, made with an exclusive create (the
lease's `O_CREAT | O_EXCL`, atomic on local filesystems and on NFSv3+/Lustre/GPFS), so exactly one process gets each
unit, whichever asks first: a slow rank, or one whose units hold longer rows, simply claims fewer and nobody waits for
it. A process claims a unit just before tokenizing it, so it holds at most `pipeline.prefetch_units + 2` claimed units
not yet captured. Claims belong to one job: the main process clears them when the job starts (a killed job's
unfinished shards are removed too, so its claims mean nothing) and when it ends. The shard of unit k depends on k
alone, so which process captured it does not change the dataset, and a job resumes on any number of processes.
"""

import shutil
from collections import Counter
from pathlib import Path

from specgen.store.lease import _create_exclusive

CLAIMS = ".specgen-claims"


class UnitClaims:
    """This process's claims on `out_dir`'s work units (with one process every unit is its own, no files)."""

    def __init__(self, out_dir: str | Path, rank: int, world_size: int):
        self.dir, self.rank, self.world_size = Path(out_dir) / CLAIMS, rank, world_size
        if world_size > 1:
            self.dir.mkdir(parents=True, exist_ok=True)

    def claim(self, unit: int) -> bool:
        """True when this process now owns `unit` (nobody claimed it before)."""
        if self.world_size == 1:
            return True
        return _create_exclusive(self.dir / f"unit-{unit:06d}", str(self.rank).encode())

    def by_process(self) -> dict[int, int]:
        """How many units each rank claimed in this job (read by the main process once every process is done)."""
        if self.world_size == 1:
            return {}
        counts = Counter(int(path.read_text() or -1) for path in self.dir.glob("unit-*"))
        return {rank: counts.get(rank, 0) for rank in range(self.world_size)}


def clear_claims(out_dir: str | Path) -> None:
    """Forget every claim (the main process, at the start and the end of a job)."""
    shutil.rmtree(Path(out_dir) / CLAIMS, ignore_errors=True)
