"""How the draft is replicated and its optimizer stepped: plain/DDP (`distributed=ddp`) or DeepSpeed ZeRO-2
(`distributed=zero2`). Both run under `accelerate launch` (or torchrun): accelerate's `Accelerator` joins the
process group (gloo on CPU, nccl on GPU) and owns the trackers (TensorBoard); the strategy wraps the model.

    accelerate launch --multi_gpu --num_processes 2 -m specgen.train ... distributed=ddp
    accelerate launch --multi_gpu --num_processes 2 -m specgen.train ... distributed=zero2

The trainer only sees `forward`, `backward`, `step`, `save` and `load`; gradient accumulation, clipping and the
learning-rate schedule behave the same in both.
"""

import gc
import logging
import weakref
from abc import ABC, abstractmethod
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from specgen.errors import SpecgenError
from specgen.store.commit import atomic_write

log = logging.getLogger("specgen.train")


class Strategy(ABC):
    """A model + optimizer + scheduler, replicated over the processes of the run."""

    def __init__(self, model: nn.Module, device: torch.device, world_size: int, grad_accum: int, grad_clip: float):
        self.model = model  # the unwrapped module, for saving and metrics
        self.device = device
        self.world_size = world_size
        self.grad_accum = grad_accum
        self.grad_clip = grad_clip

    @abstractmethod
    def forward(self, *args, sync: bool):
        """Run the (wrapped) model; `sync` is False on micro-steps that only accumulate gradients."""

    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None: ...

    @abstractmethod
    def update(self, boundary: bool) -> None:
        """Called after every micro-step's backward; at an accumulation `boundary` it clips the gradients, steps
        the optimizer and the schedule, and zeroes the gradients."""

    @abstractmethod
    def learning_rate(self) -> float: ...

    @abstractmethod
    def save(self, folder: Path) -> None:
        """Optimizer and scheduler state (every process calls it)."""

    @abstractmethod
    def load(self, folder: Path) -> None: ...

    def close(self) -> None:
        """Let go of what holds the process group, before it is destroyed (`accelerator.end_training`): no
        collective runs after this; `model` stays usable."""

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            tensor = tensor.to(self.device)
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor


class DDPStrategy(Strategy):
    """torch DistributedDataParallel (or the bare module in a single process) with a plain optimizer."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, *, device: torch.device,
                 world_size: int, grad_accum: int, grad_clip: float):
        super().__init__(model, device, world_size, grad_accum, grad_clip)
        self.optimizer = optimizer
        self.scheduler = scheduler
        if world_size > 1:
            device_ids = [device.index] if device.type == "cuda" else None
            self.wrapped = nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
        else:
            self.wrapped = model

    def close(self) -> None:
        """Free the DDP wrapper now, while the process group is still registered. Its C++ reducer holds a reference
        to the group and is destroyed holding the GIL: were it the group's last reference (after
        `end_training`), the group's destructor would join gloo's worker threads, one of which may need the GIL
        to free the tensors of the last barrier, and the process would hang at the end of a finished run."""
        if self.wrapped is self.model:
            return
        wrapper = weakref.ref(self.wrapped)
        self.wrapped = self.model
        if wrapper() is not None:  # kept by a reference cycle: collect it now, not at some later moment
            gc.collect()
        if wrapper() is not None:
            log.warning("the DDP wrapper is still referenced after training: if it outlives the process group, "
                        "this process may hang at exit")

    def forward(self, *args, sync: bool):
        no_sync = self.wrapped.no_sync() if not sync and self.world_size > 1 else nullcontext()
        with no_sync:
            return self.wrapped(*args)

    def backward(self, loss: torch.Tensor) -> None:
        # DDP averages gradients over processes; dividing by the accumulation count averages over micro-steps.
        # no_sync only needs the forward inside it: the reducer then skips the all-reduce in this backward.
        (loss / self.grad_accum).backward()

    def update(self, boundary: bool) -> None:
        if not boundary:
            return
        if self.grad_clip:
            torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.requires_grad], self.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def learning_rate(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def save(self, folder: Path) -> None:
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        folder.mkdir(parents=True, exist_ok=True)
        state = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
        atomic_write(folder / "optimizer.pt", lambda tmp: torch.save(state, tmp))

    def load(self, folder: Path) -> None:
        path = folder / "optimizer.pt"
        if not path.exists():
            raise SpecgenError(f"{path} is missing: this checkpoint was not written by distributed=ddp "
                               "(resume with the strategy that wrote it)")
        state = torch.load(path, map_location=self.device, weights_only=True)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])


class ZeroStrategy(Strategy):
    """DeepSpeed engine (ZeRO stage from the config, 2 by default): optimizer state and gradients are partitioned
    over the processes. DeepSpeed steps the scheduler and scales the loss for accumulation itself."""

    TAG = "deepspeed"  # DeepSpeed also writes a file named "latest" beside it

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, *, device: torch.device,
                 world_size: int, grad_accum: int, grad_clip: float, ds_config: dict):
        super().__init__(model, device, world_size, grad_accum, grad_clip)
        import deepspeed

        deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
        config = {**ds_config, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": grad_accum,
                  "gradient_clipping": grad_clip}
        self.engine, _, _, self.scheduler = deepspeed.initialize(model=model, optimizer=optimizer,
                                                                 lr_scheduler=scheduler, config=config)

    def forward(self, *args, sync: bool):
        return self.engine(*args)  # the engine knows the accumulation boundary itself

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def update(self, boundary: bool) -> None:
        # DeepSpeed wants step() after every micro-step and counts the accumulation boundary itself.
        self.engine.step()

    def learning_rate(self) -> float:
        return self.engine.get_lr()[0]

    def save(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.engine.save_checkpoint(str(folder), tag=self.TAG)

    def load(self, folder: Path) -> None:
        if not (folder / self.TAG).is_dir():
            raise SpecgenError(f"{folder / self.TAG} is missing: this checkpoint was not written by "
                               "distributed=zero2 (resume with the strategy that wrote it)")
        self.engine.load_checkpoint(str(folder), tag=self.TAG, load_module_strict=False)
