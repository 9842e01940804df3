"""Process-group glue for `accelerate launch` (torch.distributed): who am I, and the collectives the stages share.

Work is split into units numbered from the data (unit k = source rows [k*S, (k+1)*S)), never from the world size:
generate's and regenerate's ranks claim unfinished units as they get to them (`specgen.ranks.claims`). A run started
on 4 processes can therefore be resumed on 2, and a rank that died can be re-run alone, without changing any
shard's content.
"""

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from specgen.runtime import resolve_device


@dataclass(frozen=True)
class Workers:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def broadcast(self, value: Any) -> Any:
        """The main process's `value` on every process (any picklable object); also a barrier."""
        if self.world_size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def init_workers(device: str = "auto") -> Workers:
    """Join the process group `accelerate launch` set up (gloo on CPU, nccl on GPU); a plain run is world size 1."""
    from accelerate import PartialState

    state = PartialState(cpu=resolve_device(device).type == "cpu")
    if device in ("auto", "cpu") or state.num_processes > 1:
        resolved = state.device
    else:
        resolved = torch.device(device)
    return Workers(rank=state.process_index, world_size=state.num_processes,
                   local_rank=state.local_process_index, device=resolved)


SLOW_RANK_ENV = "SPECGEN_TEST_SLOW_RANK"


def slowdown_for_tests(rank: int) -> float:
    """Seconds this rank sleeps before claiming each work unit: SPECGEN_TEST_SLOW_RANK=RANK:SECONDS slows one rank
    down (a test hook for dynamic assignment; 0 when unset or naming another rank)."""
    value = os.environ.get(SLOW_RANK_ENV)
    if not value:
        return 0.0
    slow_rank, _, seconds = value.partition(":")
    return float(seconds) if int(slow_rank) == rank else 0.0


def report_error(message: str) -> None:
    """Hand this process's error to torchrun's elastic agent (what `accelerate launch` runs), so that its end-of-job
    failure summary shows the message instead of `error_file: <N/A>`. Does nothing outside torchrun."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        Path(path).write_text(json.dumps({"message": message, "timestamp": int(time.time())}))
