"""The training seam: `build_training(settings, process, out_dir)` -> `Training` (the trainer, its data, the draft),
from small setup functions over the typed settings (`specgen.schema.settings`). `specgen.train` is this plus the
job around it (output folder, lease, resume, summary); benchmarks build training through it too, so they measure
the loss, optimizer and batches that ship.
"""

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from specgen import methods
from specgen.capture.target import load_target
from specgen.data.prompts import read_prompts
from specgen.draft.aux import aux_layers_of
from specgen.draft.checkpoint import load_draft, save_draft
from specgen.draft.loss import MASK_SHIFTS
from specgen.draft.speculative import TargetRunner
from specgen.draft.target_head import ArgmaxCache, TargetHead
from specgen.draft.vocab import (
    TARGET_TOKEN_COUNTS,
    TOKEN_COUNTS,
    VocabMapping,
    build_vocab_mapping,
    write_token_counts,
)
from specgen.errors import SpecgenError
from specgen.runtime import load_tokenizer, resolve_model_dtype, stop_token_ids
from specgen.training.data import TrainingData, offline_data, online_data, stream_data
from specgen.training.offline import OfflineBatches
from specgen.training.optim import build_optimizer
from specgen.training.plan import BatchPlan
from specgen.training.probe import AcceptanceProbe, HeldoutScore
from specgen.training.strategy import DDPStrategy, ZeroStrategy
from specgen.training.trainer import (
    DraftTrainer,
    LoopSettings,
    TrainerState,
    lr_schedule,
)


@dataclass(frozen=True)
class Process:
    """Where this process trains: its device and its place among the training processes (accelerate's, or a
    process of its own: `Process(torch.device("cpu"))`)."""

    device: torch.device
    rank: int = 0
    world_size: int = 1
    barrier: Callable[[], None] = lambda: None  # wait for every process
    log: Callable | None = None  # the tracker's log (TensorBoard), when one was started

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def of(cls, accelerator, log: Callable | None = None) -> "Process":
        return cls(accelerator.device, accelerator.process_index, accelerator.num_processes,
                   accelerator.wait_for_everyone, log)


@dataclass
class Training:
    """A training run ready to `fit()`: the trainer and what the job reports about it."""

    trainer: DraftTrainer
    data: TrainingData
    draft: nn.Module
    optimizer: torch.optim.Optimizer

    def fit(self) -> dict:
        return self.trainer.fit()

    def close(self) -> None:
        """After fit (or its error): free what holds the process group, before `accelerator.end_training` destroys
        it (`Strategy.close`)."""
        self.trainer.strategy.close()


def build_training(settings, process: Process, out_dir: Path, *, resume_from: Path | None = None,
                   before_save: Callable[[], None] = lambda: None) -> Training:
    """The draft, its objective, optimizer, strategy and the trainer over the data `settings.mode` names, for one
    process of `process.world_size`; checkpoints go to `out_dir` (`before_save` runs first: the job's lease check).
    `resume_from`: the checkpoint whose weights the draft starts from (the trainer's state is restored by
    `Training.trainer.resume`)."""
    if process.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
    data = training_data(settings, process, out_dir)
    torch.manual_seed(settings.runtime.seed)
    draft = build_draft(settings, data, resume_from).to(process.device)
    method = methods.of_model(draft)
    objective = method.objective(draft, train=settings.train, draft=settings.draft, seed=settings.runtime.seed,
                                 mask_shift=mask_shift(settings))
    shift = getattr(objective, "mask_shift", mask_shift(settings))  # DFlash always scores the predicted token (2)
    total_steps = training_steps(settings, data)
    head = TargetHead(data.lm_head.to(process.device), mapping_of(draft),
                      chunk_tokens=settings.capture.lm_head_chunk_tokens,
                      argmax_cache=argmax_cache(settings, data, total_steps))
    optimizer = build_optimizer(draft, name=settings.train.optimizer, lr=settings.train.lr,
                                betas=tuple(settings.train.betas), weight_decay=settings.train.weight_decay,
                                muon_weight_decay=settings.train.muon_weight_decay, device=process.device)
    strategy = make_strategy(settings, objective, optimizer, lr_scheduler(settings, optimizer, total_steps),
                             process.device, process.world_size)
    metrics = lambda stats: method.metrics(stats, train=settings.train, draft=settings.draft)  # noqa: E731
    trainer = DraftTrainer(
        strategy=strategy, head=head, source=data.source, out_dir=out_dir, is_main=process.is_main,
        save_draft=checkpoint_writer(settings, data, draft, before_save),
        settings=LoopSettings(total_steps=total_steps, grad_accum=settings.train.grad_accum,
                              ttt_decay=settings.train.ttt_decay, log_every=settings.train.log_every,
                              save_every=settings.train.save_every,
                              autocast_dtype=autocast_dtype(settings, process.device), mask_shift=shift,
                              eval_every=settings.train.eval_every, keep_checkpoints=settings.train.keep_checkpoints,
                              keep_best=settings.train.keep_best, metrics=metrics),
        log_tracker=process.log, progress=settings.runtime.progress,
        vocab_source="checkpoint" if resume_from or settings.draft.init else settings.draft.vocab_source,
        probe=probe(settings, process, data, draft, objective, head, metrics, shift))
    return Training(trainer, data, draft, optimizer)


def training_data(settings, process: Process, out_dir: Path) -> TrainingData:
    """The data of `settings.mode` for this process's share of the batch plan; the trained-token counts written
    beside the checkpoint where no shards hold them (online, disaggregated)."""
    plan = BatchPlan(batch_tokens=settings.train.batch_tokens, max_batch_size=settings.train.max_batch_size,
                     seed=settings.runtime.seed, rank=process.rank, world_size=process.world_size,
                     packing=settings.train.packing)
    if settings.mode == "offline":
        return offline_data(settings, plan, process.device)
    data = (online_data(settings, plan, process.device) if settings.mode == "online"
            else stream_data(settings, plan, process))
    if process.is_main:
        write_token_counts(out_dir / TOKEN_COUNTS, data.token_counts, data.target_config.get_text_config().vocab_size)
    return data


def training_steps(settings, data: TrainingData) -> int:
    """train.max_steps, else train.epochs passes over this process's batches; none is a one-line error."""
    steps_per_epoch = data.source.batches_per_epoch() // settings.train.grad_accum
    total_steps = settings.train.max_steps or settings.train.epochs * steps_per_epoch
    if total_steps < 1:
        raise SpecgenError(f"nothing to train: {data.source.batches_per_epoch()} batches per epoch on each process "
                           f"and train.grad_accum={settings.train.grad_accum}; lower train.batch_tokens or grad_accum")
    return total_steps


def argmax_cache(settings, data: TrainingData, total_steps: int) -> ArgmaxCache | None:
    """train.cache_target_argmax: offline, the target's full-vocabulary argmax kept per sample after its first batch
    (auto: where the run trains more than one epoch, so that some sample comes back)."""
    wanted = settings.train.cache_target_argmax
    if not isinstance(data.source, OfflineBatches) or wanted is False:
        return None
    if wanted == "auto" and total_steps * settings.train.grad_accum <= data.source.batches_per_epoch():
        return None
    return ArgmaxCache(data.source.dataset.lengths())


def lr_scheduler(settings, optimizer: torch.optim.Optimizer, total_steps: int):
    """Warmup then decay over train.schedule_steps (null: the run's steps); warmup null: 1% of the schedule."""
    schedule_steps = settings.train.schedule_steps or total_steps
    warmup = schedule_steps // 100 if settings.train.warmup_steps is None else settings.train.warmup_steps
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(schedule_steps, warmup,
                                                                    settings.train.min_lr_ratio,
                                                                    settings.train.schedule))


def checkpoint_writer(settings, data: TrainingData, draft: nn.Module, before_save: Callable[[], None]):
    """What the trainer calls to save the draft: the vllm layout with the run's record in config.json."""
    info = {"target": {"path": data.target_path, "config_hash": data.target_config_hash}, "mode": settings.mode,
            "data": data.description, "ttt_length": settings.train.ttt_length, "specgen_config": asdict(settings)}

    def save(state: TrainerState, folder: Path) -> None:
        before_save()
        save_draft(draft, folder, {**info, "step": state.step, "epoch": state.epoch})

    return save


def probe(settings, process: Process, data: TrainingData, draft: nn.Module, objective: nn.Module, head: TargetHead,
          metrics: Callable, shift: int) -> Callable[[], dict] | None:
    """The held-out figures every train.eval_every steps (main process): decoding of train.eval_prompts and the
    score of train.heldout_samples; None when neither is asked for."""
    probes = []
    if process.is_main and settings.train.eval_every and settings.train.eval_prompts is not None:
        decoding = acceptance_probe(settings, data, process.device)
        probes.append(lambda: decoding(draft))
    if process.is_main and data.heldout is not None:
        probes.append(HeldoutScore(objective, head, data.heldout, metrics, mask_shift=shift, device=process.device,
                                   autocast_dtype=autocast_dtype(settings, process.device)))
    if not probes:
        return None
    return lambda: {key: value for each in probes for key, value in each().items()}


def acceptance_probe(settings, data: TrainingData, device: torch.device) -> AcceptanceProbe:
    """Speculative decoding of the live draft on train.eval_prompts (main process): offline, the whole target is
    loaded for it (in model.dtype); online, the target in the loop serves."""
    prompts = list(read_prompts(settings.train.eval_prompts, settings.train.eval_max_prompts))
    tokenizer = load_tokenizer(settings.tokenizer.path or data.target_path)
    model = data.target_model
    if model is None:
        dtype = resolve_model_dtype(settings.model.dtype, device, data.target_path)
        data.target_dtype = str(dtype)
        model = load_target(data.target_path, dtype=dtype.name, device=str(device),
                            attn_implementation=settings.model.attn_implementation)
    return AcceptanceProbe(TargetRunner(model, data.aux_layers), tokenizer, prompts,
                           num_draft_tokens=settings.evaluate.num_draft_tokens, max_new_tokens=settings.evaluate.max_new_tokens,
                           eos_ids=set(stop_token_ids(model, tokenizer)))


def build_draft(settings, data: TrainingData, resume_from: Path | None) -> nn.Module:
    """A fresh draft, or the weights and vocabulary of `draft.init` (fine-tuning) or of the run being resumed;
    its LM head frozen when `draft.freeze_lm_head`."""
    start_from = resume_from or settings.draft.init
    if start_from is not None:
        draft = load_draft(start_from, embedding=data.embedding, target_config=data.target_config,
                           foreign_ids=settings.draft.foreign_aux_ids, method=settings.draft.method)
        recorded = aux_layers_of(draft.config)
        if recorded != data.aux_layers:
            raise SpecgenError(f"the draft at {start_from} reads aux layers {recorded} (0-based layer outputs) but "
                               f"the data has {data.aux_layers}; regenerate the data with capture.aux_layers="
                               f"{recorded}")
        if draft.config.target_hidden_size != data.target_config.get_text_config().hidden_size:
            raise SpecgenError(f"the draft at {start_from} reads target hidden states of size "
                               f"{draft.config.target_hidden_size}, not the target's; it was trained for another target")
    else:
        draft = fresh_draft(settings, data)
    draft.lm_head.weight.requires_grad_(not settings.draft.freeze_lm_head)
    return draft


def fresh_draft(settings, data: TrainingData) -> nn.Module:
    """A new draft of draft.method (null: eagle3): vocabulary from the token counts, then the method's own
    initialisation (`specgen.methods.DraftMethod.new_draft`)."""
    vocab_size = data.target_config.get_text_config().vocab_size
    mapping = build_vocab_mapping(vocab_counts(settings, data), vocab_size, settings.draft.vocab_size,
                                  counted={"target": "the target's top tokens at trainable positions"}.get(
                                      settings.draft.vocab_source, "the trained tokens"))
    method = methods.get(settings.draft.method or methods.DEFAULT)
    return method.new_draft(data.target_config, aux_layers=data.aux_layers, mapping=mapping,
                            embedding=data.embedding, lm_head=data.lm_head, draft=settings.draft)


def vocab_counts(settings, data: TrainingData) -> dict[int, int]:
    """The token counts the draft vocabulary is chosen from (draft.vocab_source)."""
    source = settings.draft.vocab_source
    if source == "data":
        return data.token_counts
    if data.target_top_counts is None:
        raise SpecgenError(f"draft.vocab_source=target needs {TARGET_TOKEN_COUNTS} beside the shards, which "
                           "specgen.generate writes (capture.count_target_tokens=true) in offline mode; generate the "
                           "shards again with this version, or use draft.vocab_source=data")
    return data.target_top_counts


def mapping_of(draft: nn.Module) -> VocabMapping:
    """The vocabulary mapping a draft carries (its d2t buffer)."""
    return VocabMapping.from_d2t(draft.d2t, draft.config.vocab_size)


def make_strategy(settings, objective: torch.nn.Module, optimizer, scheduler, device: torch.device,
                  world_size: int) -> DDPStrategy | ZeroStrategy:
    """distributed.strategy: DDP, or DeepSpeed ZeRO (stage 1 or 2) with distributed.deepspeed's config."""
    common = dict(device=device, world_size=world_size, grad_accum=settings.train.grad_accum,
                  grad_clip=settings.train.grad_clip)
    if settings.distributed.strategy == "deepspeed":
        return ZeroStrategy(objective, optimizer, scheduler, **common, ds_config=settings.distributed.deepspeed)
    return DDPStrategy(objective, optimizer, scheduler, **common)


def mask_shift(settings) -> int:
    """train.loss_mask as the objective's shift (`specgen.draft.loss.MASK_SHIFTS`)."""
    return MASK_SHIFTS[settings.train.loss_mask]


def autocast_dtype(settings, device: torch.device) -> torch.dtype | None:
    """train.precision: bf16 autocast (auto: on CUDA), else None (fp32)."""
    precision = settings.train.precision
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None
