"""`python -m specgen.train`: train a draft, offline from shards, online with the target in the loop, or
disaggregated with the target on capture servers (`specgen.capture_server`, `specgen.stream`).

    python -m specgen.train data.shards=SHARDS output.dir=CKPT [train.max_steps=N ...]
    python -m specgen.train mode=online model.path=TARGET data.path=CONVERSATIONS output.dir=CKPT
    python -m specgen.train mode=disaggregated stream.dir=STREAM model.path=TARGET data.path=DATA output.dir=CKPT
    accelerate launch --multi_gpu --num_processes 2 -m specgen.train ... [distributed=zero2]

Read top to bottom: join the process group, open the data (which fixes the target, its aux layers and the
trained-token counts), build the vocabulary mapping and the draft, wrap it in the training strategy (DDP or ZeRO-2), run the
loop. output.dir receives config.json + model.safetensors (the latest draft, servable by vLLM/SGLang), metrics.jsonl,
TensorBoard logs and checkpoints/step-NNNNNN/ (written atomically; train.resume=true continues from the newest).
"""

if __name__ == "__main__":  # a config error or `--cfg job` is answered before torch is imported (specgen.config)
    from specgen.config import check_command_line

    check_command_line("train")

import logging
import shutil
import time
from contextlib import closing, nullcontext
from pathlib import Path

from omegaconf import DictConfig

from specgen.config import stage_main
from specgen.draft.checkpoint import (
    CHECKPOINTS,
    CONFIG,
    TRAINING_STATE,
    WEIGHTS,
    Checkpoints,
    read_raw_config,
    specgen_info,
)
from specgen.draft.vocab import TOKEN_COUNTS
from specgen.errors import SpecgenError
from specgen.runtime import resolve_device, set_threads
from specgen.schema import settings as typed_settings
from specgen.store.lease import hold_job_lease
from specgen.stream import StreamBatches
from specgen.training.data import check_shards_given
from specgen.training.optim import describe
from specgen.training.report import print_summary
from specgen.training.setup import Process, build_training
from specgen.training.trainer import METRICS

log = logging.getLogger("specgen.train")

_OUTPUTS = (CONFIG, WEIGHTS, METRICS, TOKEN_COUNTS, TRAINING_STATE, CHECKPOINTS, "tensorboard")



def run(cfg: DictConfig) -> dict:
    """Check what the schema cannot (keys that must agree), take output.dir (and stream.dir), train."""
    if cfg.train.eval_every and cfg.train.eval_prompts is None and not cfg.train.heldout_samples:
        raise SpecgenError(f"train.eval_every={cfg.train.eval_every} scores held-out data: pass "
                           "train.eval_prompts=FILE (decoded, MT-Bench style rows or conversations) and/or "
                           "train.heldout_samples=N (samples of the shards kept out of training)")
    if cfg.train.eval_every and cfg.train.eval_prompts is not None and not Path(cfg.train.eval_prompts).exists():
        raise SpecgenError(f"train.eval_prompts={cfg.train.eval_prompts}: no such file or folder")
    _check_keep_best(cfg.train)
    if cfg.train.heldout_samples and cfg.mode != "offline":
        raise SpecgenError(f"train.heldout_samples={cfg.train.heldout_samples} holds out samples of data.shards "
                           f"(mode=offline); with mode={cfg.mode} use train.eval_prompts")
    if cfg.train.optimizer == "muon" and cfg.distributed.strategy == "deepspeed":
        raise SpecgenError("train.optimizer=muon needs whole matrices, which DeepSpeed's ZeRO partitions; use "
                           "distributed=ddp or train.optimizer=adamw")
    zero_stage = ((cfg.distributed.get("deepspeed") or {}).get("zero_optimization") or {}).get("stage", 0)
    if cfg.distributed.strategy == "deepspeed" and zero_stage == 3:
        raise SpecgenError("distributed.deepspeed.zero_optimization.stage=3 partitions the draft's weights, which "
                           "specgen saves, probes and exports whole; use stage 1 or 2 (distributed=zero2)")
    if cfg.mode == "offline":
        check_shards_given(cfg.data.shards)
    tensorboard = tensorboard_on(cfg.train.tensorboard)  # true without the package: fails here, before anything loads
    set_threads(cfg.runtime.threads)
    accelerator = _accelerator(cfg, tensorboard)
    is_main = accelerator.is_main_process
    out_dir = Path(cfg.output.dir)
    # Before anything else touches output.dir: another live job on it is refused here, in one line.
    # One trainer per stream folder too: a second one would take the first one's batches.
    streaming = cfg.mode == "disaggregated" and cfg.stream.dir is not None
    if streaming and Path(cfg.stream.dir).resolve() == out_dir.resolve():
        raise SpecgenError(f"stream.dir and output.dir are both {out_dir}: give the stream folder its own path")
    with hold_job_lease(out_dir, stage="train", is_main=is_main, broadcast=_broadcaster(accelerator),
                        stale_s=cfg.output.lease_stale_s) as lease, \
            (hold_job_lease(cfg.stream.dir, stage="train", is_main=is_main, broadcast=_broadcaster(accelerator),
                            stale_s=cfg.output.lease_stale_s) if streaming else nullcontext()):
        return train_into(cfg, accelerator, out_dir, lease, tensorboard)


def _broadcaster(accelerator):
    """The main process's value on every process (a barrier too)."""

    def broadcast(value):
        if accelerator.num_processes == 1:
            return value
        from accelerate.utils import broadcast_object_list

        return broadcast_object_list([value], from_process=0)[0]

    return broadcast


def train_into(cfg: DictConfig, accelerator, out_dir: Path, lease, tensorboard: bool) -> dict:
    """The training job once its main process holds the lease on `out_dir` (checked before each save); `tensorboard`:
    train.tensorboard resolved (`tensorboard_on`)."""
    settings = typed_settings(cfg)
    resume = settings.train.resume
    if accelerator.is_main_process:
        _claim_output_dir(out_dir, resume=resume, overwrite=settings.output.overwrite)
    accelerator.wait_for_everyone()
    resume_from = _resume_checkpoint(out_dir) if resume else None
    if tensorboard:
        accelerator.init_trackers("tensorboard")
    process = Process.of(accelerator, log=accelerator.log if tensorboard else None)
    # closing: the DDP wrapper must not outlive the process group that end_training destroys (a hang at exit)
    with closing(build_training(settings, process, out_dir, resume_from=resume_from,
                                before_save=lease.check)) as training:
        if resume:
            _resume(training.trainer, resume_from)
        start = time.perf_counter()
        metrics = training.fit()
        data = training.data
        if isinstance(data.source, StreamBatches):
            accelerator.wait_for_everyone()  # (before end_training, which ends the process group)
            if process.is_main:
                data.source.spool.finish()  # the capture servers that served this run exit
    accelerator.end_training()
    if process.is_main:
        fresh = not (resume or settings.draft.init)
        cache = training.trainer.head.argmax_cache
        print_summary(out_dir, data, training.draft, training.trainer.state, metrics, time.perf_counter() - start,
                      describe(training.optimizer), settings.draft.vocab_source if fresh else "checkpoint",
                      settings.draft.vocab_size if fresh else None, keep_best=settings.train.keep_best,
                      ttt_length=settings.train.ttt_length, target_head=cache.describe() if cache else None,
                      tensorboard=_tensorboard_line(out_dir, settings.train.tensorboard, tensorboard))
    return metrics


def _check_keep_best(train) -> None:
    """train.keep_best picks among the drafts probed every train.eval_every steps, on the figure it names."""
    best = train.keep_best
    if best is None:
        return
    if not train.eval_every:
        raise SpecgenError(f"train.keep_best={best} picks among the drafts probed every train.eval_every steps; "
                           "set train.eval_every=N")
    if best.startswith("heldout_") and not train.heldout_samples:
        raise SpecgenError(f"train.keep_best={best} is a figure of the held-out samples: set "
                           "train.heldout_samples=N")
    if best == "accept_len" and train.eval_prompts is None:
        raise SpecgenError("train.keep_best=accept_len is the decoded acceptance on train.eval_prompts: set "
                           "train.eval_prompts=FILE")


def _resume(trainer, checkpoint: Path) -> None:
    """The trainer's state (optimizer, scheduler, data position) from `checkpoint`, whose weights the draft has."""
    trainer.resume(checkpoint)
    weights_step = specgen_info(read_raw_config(checkpoint)).get("step")
    if weights_step != trainer.state.step:  # only a checkpoint of the layout before checkpoints/ can differ
        raise SpecgenError(f"{checkpoint} holds weights of step {weights_step} but training state of step "
                           f"{trainer.state.step}: the run was killed while saving; restart without "
                           "train.resume (output.overwrite=true) or from a copy of an intact checkpoint")


def tensorboard_on(setting: bool | str) -> bool:
    """train.tensorboard resolved: `auto` logs when accelerate finds a TensorBoard writer installed (the `dev` extra
    has one, the plain install not); `true` without one is an error rather than a run that logs nothing."""
    from accelerate.utils import is_tensorboard_available

    if setting == "auto":
        return is_tensorboard_available()
    if setting and not is_tensorboard_available():
        raise SpecgenError("train.tensorboard=true needs the tensorboard package: pip install tensorboard, or set "
                           "train.tensorboard=auto (logs when it is installed) or false")
    return bool(setting)


def _tensorboard_line(out_dir: Path, setting: bool | str, on: bool) -> str:
    if on:
        return str(out_dir / "tensorboard")
    return ("off (train.tensorboard=auto: the tensorboard package is not installed; pip install tensorboard)"
            if setting == "auto" else "off (train.tensorboard=false)")


def _accelerator(cfg: DictConfig, tensorboard: bool):
    """The process group (gloo on CPU, nccl on GPU) and TensorBoard tracker, via accelerate."""
    from accelerate import Accelerator

    use_cpu = resolve_device(cfg.runtime.device).type == "cpu"
    return Accelerator(cpu=use_cpu, log_with="tensorboard" if tensorboard else None,
                       project_dir=cfg.output.dir)


def _claim_output_dir(out_dir: Path, *, resume: bool, overwrite: bool) -> None:
    """Resume needs a complete checkpoint; a fresh run refuses to replace one unless told to, and clears what a run
    killed before its first checkpoint left behind (metrics, logs). Both delete checkpoints half-written by a kill."""
    if (out_dir / "manifest.json").exists():
        raise SpecgenError(f"output.dir {out_dir} holds a generated dataset (manifest.json); give the draft "
                           "checkpoint its own output.dir")
    checkpoints = Checkpoints(out_dir)
    checkpoints.remove_partial()
    if resume:
        if _resume_checkpoint(out_dir) is None:
            raise SpecgenError(f"train.resume=true but {out_dir} holds no complete checkpoint in {CHECKPOINTS}/ to "
                               "resume from (a run killed during its first save leaves none); drop train.resume or "
                               "point output.dir at an earlier run's output.dir")
        return
    state = out_dir / TRAINING_STATE  # the layout before checkpoints/
    if ((out_dir / WEIGHTS).exists() or state.exists() or checkpoints.root.exists()) and not overwrite:
        raise SpecgenError(f"{out_dir} already holds a draft checkpoint; pass train.resume=true to continue "
                           "it, output.overwrite=true to replace it, or another output.dir")
    for name in _OUTPUTS:
        path = out_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    out_dir.mkdir(parents=True, exist_ok=True)


def _resume_checkpoint(out_dir: Path) -> Path | None:
    """The newest complete checkpoint of out_dir; output.dir itself where an earlier specgen wrote training_state/
    there (the layout before checkpoints/); None when there is none."""
    latest = Checkpoints(out_dir).latest()
    if latest is None and (out_dir / TRAINING_STATE).is_dir():
        return out_dir
    return latest


main = stage_main("train")(run)

if __name__ == "__main__":
    main()
