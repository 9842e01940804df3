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

import hashlib
import json
import logging
import shutil
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch
import transformers
from omegaconf import DictConfig

from specgen.capture import make_capture
from specgen.capture.layers import resolve_aux_layers
from specgen.capture.target import config_hash, load_target
from specgen.config import stage_main, to_container
from specgen.data.prompts import read_prompts
from specgen.data.sources import describe_path
from specgen.data.template import ChatTemplateTokenizer
from specgen.draft.batches import BatchPlan
from specgen.draft.checkpoint import (
    CHECKPOINTS,
    CONFIG,
    TRAINING_STATE,
    WEIGHTS,
    Checkpoints,
    load_draft,
    read_raw_config,
    save_draft,
    specgen_info,
)
from specgen.draft.strategy import DDPStrategy, ZeroStrategy
from specgen.draft import methods
from specgen.draft.model import Eagle3Draft, aux_layers_of
from specgen.draft.offline import OfflineBatches
from specgen.draft.online import OnlineBatches, tokenize_source
from specgen.draft.optim import build_optimizer, describe
from specgen.draft.probe import HELDOUT_SEED, AcceptanceProbe, HeldoutScore, heldout_split
from specgen.draft.speculative import TargetRunner
from specgen.draft.target_head import TargetHead, load_target_weights
from specgen.draft.trainer import METRICS, DraftTrainer, LoopSettings, TrainerState, lr_schedule
from specgen.draft.ttt import MASK_SHIFTS
from specgen.draft.vocab import (
    TARGET_TOKEN_COUNTS,
    TOKEN_COUNTS,
    VocabMapping,
    build_vocab_mapping,
    count_trained_tokens,
    read_token_counts,
    write_token_counts,
)
from specgen.errors import SpecgenError
from specgen.progress import format_table
from specgen.runtime import load_tokenizer, resolve_device, resolve_model_dtype, set_threads, stop_token_ids
from specgen.store.lease import hold_job_lease
from specgen.store.reader import open_shards
from specgen.stream import FileTransport, Spool, StreamBatches, StreamSettings
from specgen.stream.spool import OBJECTS

log = logging.getLogger("specgen.train")

_OUTPUTS = (CONFIG, WEIGHTS, METRICS, TOKEN_COUNTS, TRAINING_STATE, CHECKPOINTS, "tensorboard")


@dataclass
class TrainingData:
    """What the data side fixes: the batches, the target they come from, and the trained-token counts."""

    source: OfflineBatches | OnlineBatches | StreamBatches
    target_path: str
    target_config_hash: str | None
    aux_layers: list[int]
    token_counts: dict[int, int]
    embedding: torch.Tensor  # the target's input embedding (the draft's frozen token embedding)
    lm_head: torch.Tensor  # the target's LM head weight
    target_config: transformers.PretrainedConfig
    description: str
    target_top_counts: dict[int, int] | None = None  # the target's top token at trainable positions (generate)
    target_model: transformers.PreTrainedModel | None = None  # the whole target, when loaded (online)
    target_dtype: str | None = None  # the dtype the whole target runs in and why, when loaded (online, probe)
    heldout: Callable[[], list] | None = None  # the batches of the samples kept out of training (offline)


MODES = ("offline", "online", "disaggregated")


def run(cfg: DictConfig) -> dict:
    if cfg.mode not in MODES:
        raise SpecgenError(f"mode={cfg.mode!r} is unknown; use mode=offline (data.shards), mode=online "
                           "(model.path + data.path) or mode=disaggregated (+ stream.dir, capture servers)")
    if cfg.train.eval_every and cfg.train.eval_prompts is None and not cfg.train.heldout_samples:
        raise SpecgenError(f"train.eval_every={cfg.train.eval_every} scores held-out data: pass "
                           "train.eval_prompts=FILE (decoded, MT-Bench style rows or conversations) and/or "
                           "train.heldout_samples=N (samples of the shards kept out of training)")
    if cfg.train.eval_every and cfg.train.eval_prompts is not None and not Path(cfg.train.eval_prompts).exists():
        raise SpecgenError(f"train.eval_prompts={cfg.train.eval_prompts}: no such file or folder")
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
    set_threads(cfg.runtime.threads)
    accelerator = _accelerator(cfg)
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
        return train_into(cfg, accelerator, out_dir, lease)


def _broadcaster(accelerator):
    """The main process's value on every process (a barrier too)."""

    def broadcast(value):
        if accelerator.num_processes == 1:
            return value
        from accelerate.utils import broadcast_object_list

        return broadcast_object_list([value], from_process=0)[0]

    return broadcast


def train_into(cfg: DictConfig, accelerator, out_dir: Path, lease) -> dict:
    """The training job once its main process holds the lease on `out_dir` (checked before each save)."""
    device, is_main = accelerator.device, accelerator.is_main_process
    resume = bool(cfg.train.resume)
    if is_main:
        _claim_output_dir(out_dir, resume=resume, overwrite=cfg.output.overwrite)
    accelerator.wait_for_everyone()
    resume_from = _resume_checkpoint(out_dir) if resume else None

    plan = BatchPlan(batch_tokens=cfg.train.batch_tokens, max_batch_size=cfg.train.max_batch_size,
                     seed=cfg.runtime.seed, rank=accelerator.process_index, world_size=accelerator.num_processes,
                     packing=cfg.train.packing)
    data = {"online": lambda: online_data(cfg, plan, device), "offline": lambda: offline_data(cfg, plan, device),
            "disaggregated": lambda: stream_data(cfg, plan, accelerator)}[cfg.mode]()
    if cfg.mode != "offline" and is_main:
        write_token_counts(out_dir / TOKEN_COUNTS, data.token_counts, data.target_config.get_text_config().vocab_size)

    torch.manual_seed(cfg.runtime.seed)
    draft = build_draft(cfg, data, resume_from).to(device)
    mask_shift = _mask_shift(cfg)
    method = methods.of_model(draft)
    train_cfg = {**to_container(cfg.train), "seed": cfg.runtime.seed, "draft": to_container(cfg.draft)}
    objective = method.objective(draft, train_cfg=train_cfg, mask_shift=mask_shift)
    mask_shift = getattr(objective, "mask_shift", mask_shift)  # DFlash always scores the predicted token (2)
    head = TargetHead(data.lm_head.to(device), _mapping_of(draft), chunk_tokens=cfg.capture.lm_head_chunk_tokens)

    steps_per_epoch = data.source.batches_per_epoch() // cfg.train.grad_accum
    total_steps = cfg.train.max_steps or cfg.train.epochs * steps_per_epoch
    if total_steps < 1:
        raise SpecgenError(f"nothing to train: {data.source.batches_per_epoch()} batches per epoch on each process "
                           f"and train.grad_accum={cfg.train.grad_accum}; lower train.batch_tokens or grad_accum")
    optimizer = build_optimizer(draft, name=cfg.train.optimizer, lr=cfg.train.lr, betas=tuple(cfg.train.betas),
                                weight_decay=cfg.train.weight_decay, muon_weight_decay=cfg.train.muon_weight_decay,
                                device=device)
    schedule_steps = cfg.train.schedule_steps or total_steps
    warmup_steps = schedule_steps // 100 if cfg.train.warmup_steps is None else cfg.train.warmup_steps  # null: 1%
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(
        schedule_steps, warmup_steps, cfg.train.min_lr_ratio, cfg.train.schedule))
    strategy = make_strategy(cfg, objective, optimizer, scheduler, device, accelerator.num_processes)

    info = {"target": {"path": data.target_path, "config_hash": data.target_config_hash},
            "mode": cfg.mode,
            "data": data.description, "ttt_length": cfg.train.ttt_length, "specgen_config": to_container(cfg)}

    def save(state: TrainerState, folder: Path) -> None:
        lease.check()
        save_draft(draft, folder, {**info, "step": state.step, "epoch": state.epoch})

    probes = []
    if is_main and cfg.train.eval_every and cfg.train.eval_prompts is not None:
        decoding = acceptance_probe(cfg, data, device)
        probes.append(lambda: decoding(draft))
    if is_main and data.heldout is not None:
        probes.append(HeldoutScore(objective, head, data.heldout, lambda stats: method.metrics(stats, train_cfg),
                                   mask_shift=mask_shift, device=device, autocast_dtype=_autocast_dtype(cfg, device)))
    if cfg.train.tensorboard:
        accelerator.init_trackers("tensorboard")
    trainer = DraftTrainer(
        strategy=strategy, head=head, source=data.source, out_dir=out_dir, save_draft=save, is_main=is_main,
        settings=LoopSettings(total_steps=total_steps, grad_accum=cfg.train.grad_accum,
                              ttt_decay=cfg.train.ttt_decay, log_every=cfg.train.log_every,
                              save_every=cfg.train.save_every, autocast_dtype=_autocast_dtype(cfg, device),
                              mask_shift=mask_shift, eval_every=cfg.train.eval_every,
                              keep_checkpoints=cfg.train.keep_checkpoints,
                              metrics=lambda stats: method.metrics(stats, train_cfg)),
        log_tracker=accelerator.log if cfg.train.tensorboard else None, progress=cfg.runtime.progress,
        vocab_source="checkpoint" if resume or cfg.draft.init else cfg.draft.vocab_source,
        probe=(lambda: {key: value for probe in probes for key, value in probe().items()}) if probes else None)
    if resume:
        trainer.resume(resume_from)
        weights_step = specgen_info(read_raw_config(resume_from)).get("step")
        if weights_step != trainer.state.step:  # only a checkpoint of the layout before checkpoints/ can differ
            raise SpecgenError(f"{resume_from} holds weights of step {weights_step} but training state of step "
                               f"{trainer.state.step}: the run was killed while saving; restart without "
                               "train.resume (output.overwrite=true) or from a copy of an intact checkpoint")
    start = time.perf_counter()
    metrics = trainer.fit()
    if isinstance(data.source, StreamBatches):
        accelerator.wait_for_everyone()  # (before end_training, which ends the process group)
        if is_main:
            data.source.spool.finish()  # the capture servers that served this run exit
    accelerator.end_training()
    if is_main:
        _print_summary(out_dir, data, draft, trainer.state, metrics, time.perf_counter() - start, describe(optimizer),
                       "checkpoint" if resume or cfg.draft.init else cfg.draft.vocab_source,
                       None if resume or cfg.draft.init else cfg.draft.vocab_size)
    return metrics


def _accelerator(cfg: DictConfig):
    """The process group (gloo on CPU, nccl on GPU) and TensorBoard tracker, via accelerate."""
    from accelerate import Accelerator

    use_cpu = resolve_device(cfg.runtime.device).type == "cpu"
    return Accelerator(cpu=use_cpu, log_with="tensorboard" if cfg.train.tensorboard else None,
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


def offline_data(cfg: DictConfig, plan: BatchPlan, device: torch.device) -> TrainingData:
    """Shards of `data.shards`; the target (LM head + embedding only) is the manifest's unless model.path is set."""
    if cfg.data.shards is None:
        raise SpecgenError("offline training needs data.shards=DIR (a specgen.generate output.dir), or mode=online "
                           "with model.path and data.path")
    dataset = open_shards(cfg.data.shards)
    manifest = dataset.manifest
    if manifest is None:
        raise SpecgenError(f"{cfg.data.shards} has no manifest.json: the generate run did not finish; re-run it "
                           "with the same output.dir to complete it")
    recorded_path = manifest["model"]["path"]
    target_path = cfg.model.path or recorded_path
    weights = load_target_weights(target_path, device="cpu")
    text = weights.config.get_text_config()
    recorded_hash = manifest["model"].get("config_hash")
    if cfg.model.path and recorded_hash and config_hash(SimpleNamespace(config=weights.config)) != recorded_hash:
        log.warning("model.path=%s has a config that differs from the one the shards were made with (%s)",
                    target_path, recorded_path)
    if manifest["hidden_size"] != text.hidden_size:
        raise SpecgenError(f"the shards hold hidden states of size {manifest['hidden_size']} but the target at "
                           f"{target_path} has hidden_size {text.hidden_size}: point model.path at the shards' target")
    counts_path = Path(cfg.data.shards) / TOKEN_COUNTS
    top_path = Path(cfg.data.shards) / TARGET_TOKEN_COUNTS
    top_counts = read_token_counts(top_path)[0] if top_path.exists() else None
    trained, held = heldout_split(len(dataset), cfg.train.heldout_samples)
    if counts_path.exists() and not held:
        counts, _ = read_token_counts(counts_path)
    else:  # held-out samples must not choose the draft vocabulary: count the trained ones only
        counts = count_trained_tokens((dataset[i]["input_ids"].tolist(), dataset[i]["loss_mask"].tolist())
                                      for i in trained)
    if held and top_counts is not None and cfg.draft.vocab_source == "target":
        log.warning("draft.vocab_source=target: %s counts the target's top tokens over all %d samples, the %d held "
                    "out by train.heldout_samples included", TARGET_TOKEN_COUNTS, len(dataset), len(held))
    source = OfflineBatches(dataset, plan, num_workers=cfg.train.num_workers, pin_memory=device.type == "cuda",
                            indices=trained)
    heldout = None
    if held:  # one process, in order: every call scores the same batches
        scoring = replace(plan, seed=HELDOUT_SEED, rank=0, world_size=1)
        heldout = partial(list, OfflineBatches(dataset, scoring, indices=held).epoch(0))
    kept = f", {len(held)} held out by train.heldout_samples" if held else ""
    return TrainingData(source=source, target_path=str(target_path), target_config_hash=recorded_hash,
                        aux_layers=list(manifest["capture"]["aux_layers"]), token_counts=counts,
                        embedding=weights.embedding, lm_head=weights.lm_head, target_config=weights.config,
                        description=f"shards {Path(cfg.data.shards).resolve()} ({len(dataset)} samples{kept})",
                        target_top_counts=top_counts, heldout=heldout)


def online_data(cfg: DictConfig, plan: BatchPlan, device: torch.device) -> TrainingData:
    """Conversations of `data.path`, tokenized up front, captured by the target (model.path) batch by batch."""

    if cfg.model.path is None:
        raise SpecgenError("mode=online runs the target in the loop: pass model.path=TARGET (and data.path=DATA)")
    tokenizer, samples = _tokenized(cfg)
    dtype = resolve_model_dtype(cfg.model.dtype, device, cfg.model.path)
    model = load_target(cfg.model.path, dtype=dtype.name, device=str(device),
                        attn_implementation=cfg.model.attn_implementation)
    capture = make_capture(model, _aux_layers(cfg, model.config), compile=bool(cfg.capture.compile))
    counts = count_trained_tokens((sample.input_ids, sample.loss_mask) for sample in samples)
    return TrainingData(source=OnlineBatches(samples, capture, plan, pad_id=_pad_id(tokenizer)),
                        target_path=str(Path(cfg.model.path).resolve()), target_config_hash=config_hash(model),
                        aux_layers=list(capture.aux_layers), token_counts=dict(counts),
                        embedding=model.get_input_embeddings().weight.detach(),
                        lm_head=capture.lm_head.weight.detach(), target_config=model.config,
                        description=f"online {describe_path(cfg.data.path)} ({len(samples)} samples)",
                        target_model=model, target_dtype=str(dtype))


def stream_data(cfg: DictConfig, plan: BatchPlan, accelerator) -> TrainingData:
    """The online trainer's samples and plan, their hidden states captured by servers on `stream.dir`
    (`specgen.stream`); here only the target's LM head and embedding are loaded, in the dtype online training
    would run the target in (model.dtype on this device), so both train alike."""
    if cfg.model.path is None or cfg.stream.dir is None:
        raise SpecgenError("mode=disaggregated needs model.path=TARGET (its LM head and embedding, the same folder "
                           "the capture servers load), data.path=DATA and stream.dir=DIR (the folder servers share)")
    tokenizer, samples = _tokenized(cfg)
    weights = load_target_weights(cfg.model.path, device="cpu")
    aux_layers = _aux_layers(cfg, weights.config)
    target_hash = config_hash(SimpleNamespace(config=weights.config))
    pad_id = _pad_id(tokenizer)
    fingerprint = hashlib.sha256(json.dumps([target_hash, aux_layers, pad_id, plan.batch_tokens, plan.max_batch_size,
                                             plan.packing, plan.seed, plan.world_size]).encode())
    for sample in samples:
        fingerprint.update(torch.tensor(sample.input_ids, dtype=torch.int64).numpy().tobytes() + b"|")
    identity = fingerprint.hexdigest()
    spool = Spool(cfg.stream.dir, stale_s=cfg.stream.stale_s)
    if accelerator.is_main_process:
        same = spool.start_run({"identity": identity, "aux_layers": aux_layers,
                                "max_length": cfg.data.max_length,
                                "target": {"path": str(Path(cfg.model.path).resolve()), "config_hash": target_hash}})
        log.info("stream %s: %s", spool.root, "the folder's run again (a resume)" if same else "a new run")
    accelerator.wait_for_everyone()
    hidden = weights.config.get_text_config().hidden_size
    dtype = resolve_model_dtype(cfg.model.dtype, accelerator.device, cfg.model.path)
    settings = StreamSettings(window=cfg.stream.window, max_bytes=cfg.stream.max_bytes, poll_s=cfg.stream.poll_s,
                              wait_timeout_s=cfg.stream.wait_timeout_s)
    source = StreamBatches(samples, plan, spool, FileTransport(spool.root / OBJECTS), settings, pad_id=pad_id,
                           bytes_per_token=(len(aux_layers) + 1) * hidden * 4, identity=identity)
    counts = count_trained_tokens((sample.input_ids, sample.loss_mask) for sample in samples)
    return TrainingData(source=source, target_path=str(Path(cfg.model.path).resolve()), target_config_hash=target_hash,
                        aux_layers=aux_layers, token_counts=dict(counts),
                        embedding=weights.embedding.to(dtype.torch_dtype),
                        lm_head=weights.lm_head.to(dtype.torch_dtype), target_config=weights.config,
                        description=f"disaggregated {describe_path(cfg.data.path)} ({len(samples)} samples, "
                                    f"captured by servers on {spool.root})")


def _tokenized(cfg: DictConfig) -> tuple[transformers.PreTrainedTokenizerBase, list]:
    """The tokenizer and the tokenized, loss-masked samples of `data.path` (online and disaggregated)."""
    tokenizer = load_tokenizer(cfg.tokenizer.path)
    chat = ChatTemplateTokenizer(tokenizer, max_length=cfg.data.max_length, train_turns=cfg.data.train_turns,
                                 mask_empty_think=cfg.data.mask_empty_think,
                                 chat_template_kwargs=to_container(cfg.data)["chat_template_kwargs"])
    return tokenizer, tokenize_source(cfg.data.path, chat, max_rows=cfg.data.max_rows, on_bad_row=cfg.data.on_bad_row,
                                      split=cfg.data.split, subset=cfg.data.subset)


def _aux_layers(cfg: DictConfig, config: transformers.PretrainedConfig) -> list[int]:
    """`capture.aux_layers`, checked against the target's depth; null: the EAGLE-3 default."""
    return resolve_aux_layers(cfg.capture.aux_layers, config.get_text_config().num_hidden_layers)


def _pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0


def acceptance_probe(cfg: DictConfig, data: TrainingData, device: torch.device) -> AcceptanceProbe:
    """Speculative decoding of the live draft on train.eval_prompts (main process): offline, the whole target is
    loaded for it (in model.dtype); online, the target in the loop serves."""
    prompts = list(read_prompts(cfg.train.eval_prompts, cfg.train.eval_max_prompts))
    tokenizer = load_tokenizer(cfg.tokenizer.path or data.target_path)
    model = data.target_model
    if model is None:
        dtype = resolve_model_dtype(cfg.model.dtype, device, data.target_path)
        data.target_dtype = str(dtype)
        model = load_target(data.target_path, dtype=dtype.name, device=str(device),
                            attn_implementation=cfg.model.attn_implementation)
    return AcceptanceProbe(TargetRunner(model, data.aux_layers), tokenizer, prompts,
                           num_draft_tokens=cfg.evaluate.num_draft_tokens, max_new_tokens=cfg.evaluate.max_new_tokens,
                           eos_ids=set(stop_token_ids(model, tokenizer)))


LM_HEAD_INITS = ("target", "random")


def build_draft(cfg: DictConfig, data: TrainingData, resume_from: Path | None) -> Eagle3Draft:
    """A fresh draft, or the weights and vocabulary of `draft.init` (fine-tuning) or of the run being resumed;
    its LM head frozen when `draft.freeze_lm_head`."""
    if cfg.draft.init_lm_head not in LM_HEAD_INITS:
        raise SpecgenError(f"draft.init_lm_head={cfg.draft.init_lm_head!r}; use target (the target's LM head rows "
                           "of the draft vocabulary) or random")
    start_from = resume_from or cfg.draft.init
    if start_from is not None:
        draft = load_draft(start_from, embedding=data.embedding, target_config=data.target_config,
                           foreign_ids=cfg.draft.foreign_aux_ids, method=cfg.draft.method)
        recorded = aux_layers_of(draft.config)
        if recorded != data.aux_layers:
            raise SpecgenError(f"the draft at {start_from} reads aux layers {recorded} (0-based layer outputs) but "
                               f"the data has {data.aux_layers}; regenerate the data with capture.aux_layers="
                               f"{recorded}")
        if draft.config.target_hidden_size != data.target_config.get_text_config().hidden_size:
            raise SpecgenError(f"the draft at {start_from} reads target hidden states of size "
                               f"{draft.config.target_hidden_size}, not the target's; it was trained for another target")
    else:
        draft = _fresh_draft(cfg, data)
    draft.lm_head.weight.requires_grad_(not cfg.draft.freeze_lm_head)
    return draft


def _fresh_draft(cfg: DictConfig, data: TrainingData) -> Eagle3Draft:
    """A new draft of draft.method (null: eagle3): vocabulary from the token counts, then the method's own
    initialisation (`specgen.draft.methods.DraftMethod.new_draft`)."""
    vocab_size = data.target_config.get_text_config().vocab_size
    mapping = build_vocab_mapping(vocab_counts(cfg, data), vocab_size, cfg.draft.vocab_size,
                                  counted={"target": "the target's top tokens at trainable positions"}.get(
                                      cfg.draft.vocab_source, "the trained tokens"))
    method = methods.get(cfg.draft.method or methods.DEFAULT)
    return method.new_draft(data.target_config, aux_layers=data.aux_layers, mapping=mapping,
                            embedding=data.embedding, lm_head=data.lm_head, draft_cfg=to_container(cfg.draft))


def vocab_counts(cfg: DictConfig, data: TrainingData) -> dict[int, int]:
    """The token counts the draft vocabulary is chosen from (draft.vocab_source)."""
    source = cfg.draft.vocab_source
    if source == "data":
        return data.token_counts
    if source != "target":
        raise SpecgenError(f"draft.vocab_source={source!r} is unknown; use data (the data's trained tokens) or "
                           "target (the target's top tokens at trainable positions, counted by specgen.generate)")
    if data.target_top_counts is None:
        raise SpecgenError(f"draft.vocab_source=target needs {TARGET_TOKEN_COUNTS} beside the shards, which "
                           "specgen.generate writes (capture.count_target_tokens=true) in offline mode; generate the "
                           "shards again with this version, or use draft.vocab_source=data")
    return data.target_top_counts


def vocab_coverage(draft: Eagle3Draft, data: TrainingData) -> str:
    """How much of the data's trained tokens and of the target's top tokens the draft vocabulary covers."""
    in_vocab = set(_mapping_of(draft).draft_to_target.tolist())
    parts = []
    for name, counts in (("of the trained tokens", data.token_counts),
                         ("of the target's top tokens at trainable positions", data.target_top_counts)):
        if counts:
            share = sum(n for token, n in counts.items() if token in in_vocab) / max(1, sum(counts.values()))
            parts.append(f"{100 * share:.1f}% {name}")
    return "covers " + ", ".join(parts) if parts else "coverage unknown"


def _mapping_of(draft: Eagle3Draft) -> VocabMapping:
    return VocabMapping.from_d2t(draft.d2t, draft.config.vocab_size)


def make_strategy(cfg: DictConfig, objective: torch.nn.Module, optimizer, scheduler, device: torch.device,
                 world_size: int) -> DDPStrategy | ZeroStrategy:
    common = dict(device=device, world_size=world_size, grad_accum=cfg.train.grad_accum,
                  grad_clip=cfg.train.grad_clip)
    if cfg.distributed.strategy == "ddp":
        return DDPStrategy(objective, optimizer, scheduler, **common)
    if cfg.distributed.strategy == "deepspeed":
        return ZeroStrategy(objective, optimizer, scheduler, **common,
                                ds_config=to_container(cfg.distributed.deepspeed))
    raise SpecgenError(f"distributed.strategy={cfg.distributed.strategy!r} is unknown; use distributed=ddp or "
                       "distributed=zero2")


def _mask_shift(cfg: DictConfig) -> int:
    if cfg.train.loss_mask not in MASK_SHIFTS:
        raise SpecgenError(f"train.loss_mask={cfg.train.loss_mask!r}; use predicted (score a step where the token "
                           "it predicts is trained) or input (where its input token is trained, as speculators)")
    return MASK_SHIFTS[cfg.train.loss_mask]


def _autocast_dtype(cfg: DictConfig, device: torch.device) -> torch.dtype | None:
    precision = cfg.train.precision
    if precision not in ("auto", "fp32", "bf16"):
        raise SpecgenError(f"train.precision={precision!r}; use auto, fp32 or bf16")
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None


def _vocab_clipped(asked: int | None, draft: Eagle3Draft) -> str:
    """'; draft.vocab_size=N asked, only M distinct ...' when the vocabulary came out smaller than asked."""
    got = draft.config.draft_vocab_size
    if asked is None or got >= asked:
        return ""
    return f"; draft.vocab_size={asked:,} asked, only {got:,} distinct tokens seen, so {got:,} used"


def _print_summary(out_dir: Path, data: TrainingData, draft: Eagle3Draft, state: TrainerState, metrics: dict,
                   seconds: float, optimizer: str, vocab_source: str = "data", vocab_asked: int | None = None) -> None:
    accuracies = " ".join(f"{metrics[k]:.2f}" for k in sorted((k for k in metrics if k.startswith("acc_")),
                                                              key=lambda k: int(k.split("_")[1])))
    print(format_table([
        ("checkpoint", f"{out_dir} (config.json + model.safetensors, servable as {draft.config.architectures[0]})"),
        ("data", data.description),
        *([("target dtype", data.target_dtype)] if data.target_dtype else []),
        ("draft", f"{sum(p.numel() for p in draft.trainable_parameters()) / 1e6:.2f}M trainable parameters, "
                  f"vocabulary {draft.config.draft_vocab_size} of {draft.config.vocab_size}"),
        ("vocabulary", f"from {vocab_source}: {vocab_coverage(draft, data)}{_vocab_clipped(vocab_asked, draft)}"),
        ("optimizer", optimizer),
        ("steps", f"{state.step} ({state.tokens_seen:,} tokens, {seconds:.1f}s in this run)"),
        ("last loss", f"{metrics.get('loss', float('nan')):.4f}"),
        ("accuracy per TTT step", accuracies or "n/a"),
        ("scored positions", f"{100 * metrics.get('scored', 0):.1f}% of the trainable positions (last logging "
                             "window; the rest have the target's top token outside the draft vocabulary)"),
        ("simulated acceptance", f"{metrics.get('accept_len_sim', float('nan')):.2f} (chain of "
                                 f"{sum(k.startswith('acc_') for k in metrics)} drafts, greedy, last logging window)"),
        *([("held-out samples", f"loss {metrics['heldout_loss']:.4f}, accuracy per TTT step " + " ".join(
            f"{metrics[k]:.2f}" for k in sorted((k for k in metrics if k.startswith("heldout_acc_")),
                                                key=lambda k: int(k.rsplit("_", 1)[1]))) +
            (f", simulated acceptance {metrics['heldout_accept_len_sim']:.2f}"
             if "heldout_accept_len_sim" in metrics else "") + " (train.heldout_samples, last step; the lines "
            "above are on training samples)")] if "heldout_loss" in metrics else []),
        *([("acceptance (decoded)", f"{metrics['accept_len']:.2f} = 1 + accepted / rounds over "
                                    f"{metrics['accept_rounds']} rounds of real speculative decoding on the "
                                    "train.eval_prompts, last step; lossless in "
                                    f"{metrics['accept_lossless']:.0%} of them")] if "accept_len" in metrics else []),
        ("throughput", f"{metrics.get('tokens_per_s', 0):,.0f} tokens/s (last logging window)"),
        *([("stream", f"this process: {data.source.report()}")] if isinstance(data.source, StreamBatches) else []),
        ("metrics", str(out_dir / METRICS)),
    ]))


main = stage_main("train")(run)

if __name__ == "__main__":
    main()
