"""The training loop shared by offline and online training: batches in, the method's loss (TTT for EAGLE-3; see
`specgen.methods`), optimizer steps, metrics, saves.

One optimizer step = `grad_accum` micro-steps, each one batch of this process. The loop's position (optimizer
step, epoch, batches of the epoch already trained) is saved with every checkpoint; batch plans are deterministic
(`specgen.training.plan`), so a resumed run continues with exactly the batches the interrupted run would have used.
"""

import json
import logging
import math
import time
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from tqdm.auto import tqdm

from specgen.draft.batch import DraftBatch, batch_target
from specgen.draft.checkpoint import TRAINING_STATE, Checkpoints
from specgen.draft.loss import step_metrics
from specgen.draft.target_head import TargetHead
from specgen.errors import SpecgenError
from specgen.store.commit import write_json_atomic, write_text_atomic
from specgen.training.strategy import Strategy

log = logging.getLogger("specgen.train")

METRICS = "metrics.jsonl"
STATE = "trainer_state.json"


class BatchSource(Protocol):
    """Offline (`OfflineBatches`) or online (`OnlineBatches`) batches of this process."""

    def batches_per_epoch(self) -> int: ...

    def epoch(self, epoch: int, skip: int = 0) -> Iterable[DraftBatch]: ...


@dataclass
class LoopSettings:
    total_steps: int  # optimizer steps to reach
    grad_accum: int
    ttt_decay: float
    log_every: int
    save_every: int | None  # None: save at the end only
    autocast_dtype: torch.dtype | None  # bf16 mixed precision on GPU, None for full precision
    mask_shift: int = 2  # step j at index i is scored where loss_mask[i + mask_shift + j] (specgen.methods.eagle3.ttt)
    eval_every: int = 0  # optimizer steps between probes (which also run at the last step); 0: the last step only
    keep_checkpoints: int = 2  # complete checkpoints kept in out_dir/checkpoints (the newest)
    keep_best: str | None = None  # the probe figure whose highest value picks the published draft; None: the last
    metrics: Callable[[torch.Tensor], dict] | None = None  # the method's metrics of summed stats; None: TTT's


@dataclass
class TrainerState:
    """Where the loop is; saved beside the optimizer state."""

    step: int = 0
    epoch: int = 0
    batches_done: int = 0  # batches of `epoch` already trained
    tokens_seen: int = 0  # real (unpadded) tokens, all processes
    best_step: int = 0  # train.keep_best: the step of the best probed draft so far (0: none yet)
    best_value: float | None = None  # and its figure

    def save(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        write_json_atomic(folder / STATE, asdict(self), indent=None)

    @classmethod
    def load(cls, folder: Path) -> "TrainerState":
        return cls(**json.loads((folder / STATE).read_text()))


def lr_schedule(total_steps: int, warmup_steps: int, min_lr_ratio: float,
                shape: str = "cosine") -> Callable[[int], float]:
    """LR multiplier: linear warmup to 1, then a cosine (`shape="cosine"`) or straight line (`"linear"`, speculators'
    default) down to `min_lr_ratio` at `total_steps`."""

    def multiplier(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        fall = 1 - progress if shape == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
        return min_lr_ratio + (1 - min_lr_ratio) * fall

    return multiplier


@dataclass
class _Window:
    """Statistics accumulated since the last log line."""

    stats: torch.Tensor | None = None
    tokens: int = 0
    start: float = field(default_factory=time.perf_counter)


class DraftTrainer:
    """Runs the loop. `save_draft(state, folder)` writes the draft (main process only), `strategy.save` the optimizer
    (into a step-numbered checkpoint under out_dir/checkpoints, committed atomically: `Checkpoints`);
    `probe()` (main process only, every `settings.eval_every` steps and at the last) returns metrics of the live
    draft, such as `specgen.training.probe.AcceptanceProbe`'s or `HeldoutScore`'s, merged into that step's metrics
    line."""

    def __init__(self, *, strategy: Strategy, head: TargetHead, source: BatchSource, settings: LoopSettings,
                 out_dir: Path, save_draft: Callable[[TrainerState, Path], None], is_main: bool,
                 log_tracker: Callable[[dict, int], None] | None = None, progress: bool = True,
                 vocab_source: str = "data", probe: Callable[[], dict] | None = None):
        self.strategy = strategy
        self.head = head
        self.source = source
        self.settings = settings
        self.out_dir = out_dir
        self.save_draft = save_draft
        self.is_main = is_main
        self.log_tracker = log_tracker
        self.progress = progress
        self.vocab_source = vocab_source  # where the draft vocabulary came from, for the nothing-scored error
        self.probe = probe
        self.state = TrainerState()
        self.checkpoints = Checkpoints(out_dir, settings.keep_checkpoints, publish_best=settings.keep_best is not None)
        self._first_window = True

    def resume(self, checkpoint: Path) -> None:
        """Continue from the complete checkpoint folder `checkpoint` (weights are loaded by the caller before
        wrapping)."""
        self.state = TrainerState.load(checkpoint / TRAINING_STATE)
        self.strategy.load(checkpoint / TRAINING_STATE)
        if self.is_main:
            _truncate_metrics(self.out_dir / METRICS, self.state.step)
        log.info("resumed at step %d (epoch %d, %d batches into it)", self.state.step, self.state.epoch,
                 self.state.batches_done)

    def fit(self) -> dict:
        settings, state = self.settings, self.state
        bar = tqdm(total=settings.total_steps, initial=state.step, desc="train", unit="step",
                   disable=not (self.is_main and self.progress), dynamic_ncols=True)
        window, micro, last_metrics = _Window(), 0, {}
        while state.step < settings.total_steps:
            for batch in self.source.epoch(state.epoch, skip=state.batches_done):
                micro += 1
                boundary = micro % settings.grad_accum == 0
                stats = self.train_batch(batch, boundary=boundary)
                state.batches_done += 1
                window.stats = stats if window.stats is None else window.stats + stats
                window.tokens += batch.num_tokens
                if not boundary:
                    continue
                state.step += 1
                bar.update(1)
                saving = bool(settings.save_every) and state.step % settings.save_every == 0
                # Decided from settings alone, so every process logs (an all-reduce) at the same steps.
                probing = state.step == settings.total_steps or (bool(settings.eval_every)
                                                                 and state.step % settings.eval_every == 0)
                # A checkpoint always follows a log line, so the saved token count includes every trained batch.
                if saving or probing or state.step % settings.log_every == 0 or state.step == settings.total_steps:
                    last_metrics = self._log(window, probing=probing)
                    accept = f" accept_len {last_metrics['accept_len']:.2f}" if "accept_len" in last_metrics else ""
                    bar.set_postfix_str(f"loss {last_metrics['loss']:.3f} acc_0 {last_metrics['acc_0']:.3f} "
                                        f"scored {last_metrics['scored']:.2f}{accept}")
                    window = _Window()
                    if probing:
                        self._keep_if_best(last_metrics)
                if saving:
                    self.checkpoint()
                if state.step >= settings.total_steps:
                    break
            else:  # the epoch ran out before the last step
                state.epoch += 1
                state.batches_done = 0
        bar.close()
        if not (settings.save_every and state.step % settings.save_every == 0):
            self.checkpoint()
        return last_metrics

    def train_batch(self, batch: DraftBatch, boundary: bool = True) -> torch.Tensor:
        """One micro-step: target distribution, TTT forward and backward; an optimizer update at a `boundary`
        (the end of a gradient accumulation). Returns the step statistics (see `specgen.methods.eagle3.ttt`)."""
        loss, stats = forward_batch(self.strategy.forward, self.head, batch, device=self.strategy.device,
                                    mask_shift=self.settings.mask_shift,
                                    autocast_dtype=self.settings.autocast_dtype, sync=boundary)
        self.strategy.backward(loss)
        self.strategy.update(boundary=boundary)
        return stats.detach()

    def _log(self, window: _Window, probing: bool = False) -> dict:
        totals = self.strategy.all_reduce_sum(torch.cat([window.stats.flatten(),
                                                        torch.tensor([float(window.tokens)], dtype=torch.float64,
                                                                     device=window.stats.device)]))
        tokens = int(totals[-1])
        self.state.tokens_seen += tokens
        seconds = time.perf_counter() - window.start
        metrics = {"step": self.state.step, "epoch": self.state.epoch,
                   **self._metrics(totals[:-1].view(window.stats.shape)),
                   "lr": self.strategy.learning_rate(), "tokens_per_s": tokens / max(seconds, 1e-9),
                   "tokens_seen": self.state.tokens_seen}
        if probing and self.is_main and self.probe is not None:
            metrics.update(self.probe())
        if self.is_main:
            with open(self.out_dir / METRICS, "a") as f:
                f.write(json.dumps(metrics) + "\n")
            if self.log_tracker is not None:
                self.log_tracker({k: v for k, v in metrics.items() if k != "step"}, self.state.step)
        if self._first_window:
            self._first_window = False
            self._require_scored(metrics)
        return metrics

    def _keep_if_best(self, metrics: dict) -> None:
        """train.keep_best (main process): the draft of a probe that beats every earlier one goes to
        checkpoints/best and is published to out_dir (in place of the last one) from then on."""
        name = self.settings.keep_best
        if name is None or not self.is_main:
            return
        if name not in metrics:
            raise SpecgenError(f"train.keep_best={name} but the probe at step {self.state.step} gave no {name}")
        value = float(metrics[name])
        if self.state.best_value is not None and value <= self.state.best_value:
            return
        self.state.best_step, self.state.best_value = self.state.step, value
        self.save_draft(self.state, self.checkpoints.begin_best())
        self.checkpoints.commit_best()
        log.info("step %d: best %s so far (%.4f): published to %s", self.state.step, name, value, self.out_dir)

    def _metrics(self, stats: torch.Tensor) -> dict:
        if self.settings.metrics is not None:
            return self.settings.metrics(stats)
        return step_metrics(stats, self.settings.ttt_decay)

    def _require_scored(self, metrics: dict) -> None:
        """Stop a run whose first logging window has no position a draft can get right (the target's top token in
        the draft vocabulary): it would train a draft that accepts nothing."""
        if metrics["scored"] > 0 and metrics["trainable_positions"] > 0:
            return
        if metrics["trainable_positions"] == 0:
            raise SpecgenError(f"no trainable position in the first {self.state.step} steps: the batches carry no "
                               "loss-masked token; check the data's loss mask (data.train_turns)")
        vocab, target_vocab = len(self.head.draft_to_target), self.head.weight.shape[0]
        source = {"data": "the most frequent tokens of the data's responses",
                  "target": "the target's most frequent top tokens"}.get(self.vocab_source, self.vocab_source)
        raise SpecgenError(
            f"no trainable position was scored in the first {self.state.step} steps: at all "
            f"{metrics['trainable_positions']:,} of them the target's top token lies outside the draft vocabulary "
            f"({vocab:,} of {target_vocab:,} tokens: {source}), so no draft token can match it and the draft "
            "would accept nothing; the "
            "responses were not written by this target: regenerate them with it (python -m specgen.regenerate, "
            "then generate), or build the vocabulary from the target's predictions (generate with capture.count_target_tokens=true, "
            "train with draft.vocab_source=target) or "
            "use a larger draft.vocab_size")

    def checkpoint(self) -> None:
        """Into the step's staging folder: draft weights + config (main), optimizer/scheduler (all processes), the
        loop state (main); then the main process commits the folder (one rename) once everything is on disk."""
        distributed = torch.distributed.is_initialized()
        if self.is_main:
            self.checkpoints.begin(self.state.step)
        if distributed:
            torch.distributed.barrier()  # the staging folder exists before any process writes into it
        folder = self.checkpoints.staging(self.state.step)
        if self.is_main:
            self.save_draft(self.state, folder)
        self.strategy.save(folder / TRAINING_STATE)
        if distributed:
            torch.distributed.barrier()
        if self.is_main:
            self.state.save(folder / TRAINING_STATE)
            self.checkpoints.commit(self.state.step)


def forward_batch(forward: Callable, head: TargetHead, batch: DraftBatch, *, device: torch.device,
                  mask_shift: int, autocast_dtype: torch.dtype | None, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch through a method's objective: moved to `device`, the target distributions its scored positions
    need, then `forward(input_ids, loss_mask, aux_hidden_states, target_probs, target_argmax, position_ids,
    document_ids, **kwargs)` under autocast when `autocast_dtype` is set -> (loss, stats). The training step and
    `specgen.training.probe.HeldoutScore` share it, so held-out samples are scored exactly as a batch is trained."""
    batch = batch.to(device)
    target = batch_target(head, batch, mask_shift)
    autocast = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None else nullcontext()
    with autocast:
        return forward(batch.input_ids, batch.loss_mask, batch.aux_hidden_states, target.probs, target.argmax,
                       batch.position_ids, batch.document_ids, **kwargs)


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop metric lines logged after `step` by the interrupted run (they will be logged again)."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
    write_text_atomic(path, "".join(line + "\n" for line in kept))
