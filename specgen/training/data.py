"""What the data side of training fixes: the batches (offline from shards, online with the target in the loop,
disaggregated from capture servers), the target they come from, its aux layers and the trained-token counts."""

import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch
import transformers

from specgen.capture import make_capture
from specgen.capture.layers import resolve_aux_layers
from specgen.capture.target import config_hash, load_target
from specgen.data.sources import describe_path
from specgen.data.template import ChatTemplateTokenizer
from specgen.draft.target_head import load_target_weights
from specgen.draft.vocab import (
    TARGET_TOKEN_COUNTS,
    TOKEN_COUNTS,
    count_trained_tokens,
    read_token_counts,
)
from specgen.errors import SpecgenError
from specgen.runtime import load_tokenizer, resolve_model_dtype
from specgen.store.reader import check_dataset_path, open_shards
from specgen.stream import FileTransport, Spool, StreamBatches, StreamSettings
from specgen.stream.spool import OBJECTS
from specgen.training.offline import OfflineBatches
from specgen.training.online import OnlineBatches, tokenize_source
from specgen.training.plan import BatchPlan
from specgen.training.probe import HELDOUT_SEED, heldout_split

log = logging.getLogger("specgen.train")


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


def check_shards_given(shards: str | None) -> None:
    """Offline training's source named and present (checked before a run takes its output.dir)."""
    if shards is None:
        raise SpecgenError("offline training needs data.shards=DIR (a specgen.generate output.dir), or mode=online "
                           "with model.path and data.path")
    check_dataset_path(Path(shards), key="data.shards")


def offline_data(settings, plan: BatchPlan, device: torch.device) -> TrainingData:
    """Shards of `data.shards`; the target (LM head + embedding only) is the manifest's unless model.path is set."""
    check_shards_given(settings.data.shards)
    dataset = open_shards(settings.data.shards)
    manifest = dataset.manifest
    if manifest is None:
        raise SpecgenError(f"{settings.data.shards} has no manifest.json: the generate run did not finish; re-run it "
                           "with the same output.dir to complete it")
    recorded_path = manifest["model"]["path"]
    target_path = settings.model.path or recorded_path
    weights = load_target_weights(target_path, device="cpu")
    text = weights.config.get_text_config()
    recorded_hash = manifest["model"].get("config_hash")
    if settings.model.path and recorded_hash and config_hash(SimpleNamespace(config=weights.config)) != recorded_hash:
        log.warning("model.path=%s has a config that differs from the one the shards were made with (%s)",
                    target_path, recorded_path)
    if manifest["hidden_size"] != text.hidden_size:
        raise SpecgenError(f"the shards hold hidden states of size {manifest['hidden_size']} but the target at "
                           f"{target_path} has hidden_size {text.hidden_size}: point model.path at the shards' target")
    counts_path = Path(settings.data.shards) / TOKEN_COUNTS
    top_path = Path(settings.data.shards) / TARGET_TOKEN_COUNTS
    top_counts = read_token_counts(top_path)[0] if top_path.exists() else None
    trained, held = heldout_split(dataset.sample_ids(), settings.train.heldout_samples)
    if counts_path.exists() and not held:
        counts, _ = read_token_counts(counts_path)
    else:  # held-out samples must not choose the draft vocabulary: count the trained ones only
        counts = count_trained_tokens((dataset[i]["input_ids"].tolist(), dataset[i]["loss_mask"].tolist())
                                      for i in trained)
    if held and top_counts is not None and settings.draft.vocab_source == "target":
        log.warning("draft.vocab_source=target: %s counts the target's top tokens over all %d samples, the %d held "
                    "out by train.heldout_samples included", TARGET_TOKEN_COUNTS, len(dataset), len(held))
    source = OfflineBatches(dataset, plan, num_workers=settings.train.num_workers, pin_memory=device.type == "cuda",
                            indices=trained)
    heldout = None
    if held:  # one process, in order: every call scores the same batches
        scoring = replace(plan, seed=HELDOUT_SEED, rank=0, world_size=1)
        heldout = partial(list, OfflineBatches(dataset, scoring, indices=held).epoch(0))
    kept = f", {len(held)} held out by train.heldout_samples, whole prompts" if held else ""
    return TrainingData(source=source, target_path=str(target_path), target_config_hash=recorded_hash,
                        aux_layers=list(manifest["capture"]["aux_layers"]), token_counts=counts,
                        embedding=weights.embedding, lm_head=weights.lm_head, target_config=weights.config,
                        description=f"shards {Path(settings.data.shards).resolve()} ({len(dataset)} samples{kept})",
                        target_top_counts=top_counts, heldout=heldout)


def online_data(settings, plan: BatchPlan, device: torch.device) -> TrainingData:
    """Conversations of `data.path`, tokenized up front, captured by the target (model.path) batch by batch."""

    if settings.model.path is None:
        raise SpecgenError("mode=online runs the target in the loop: pass model.path=TARGET (and data.path=DATA)")
    tokenizer, samples = tokenized(settings)
    dtype = resolve_model_dtype(settings.model.dtype, device, settings.model.path)
    model = load_target(settings.model.path, dtype=dtype.name, device=str(device),
                        attn_implementation=settings.model.attn_implementation)
    capture = make_capture(model, target_aux_layers(settings, model.config), compile=bool(settings.capture.compile))
    counts = count_trained_tokens((sample.input_ids, sample.loss_mask) for sample in samples)
    return TrainingData(source=OnlineBatches(samples, capture, plan, pad_id=pad_token_id(tokenizer)),
                        target_path=str(Path(settings.model.path).resolve()), target_config_hash=config_hash(model),
                        aux_layers=list(capture.aux_layers), token_counts=dict(counts),
                        embedding=model.get_input_embeddings().weight.detach(),
                        lm_head=capture.lm_head.weight.detach(), target_config=model.config,
                        description=f"online {describe_path(settings.data.path)} ({len(samples)} samples)",
                        target_model=model, target_dtype=str(dtype))


def stream_data(settings, plan: BatchPlan, process) -> TrainingData:
    """The online trainer's samples and plan, their hidden states captured by servers on `stream.dir`
    (`specgen.stream`); here only the target's LM head and embedding are loaded, in the dtype online training
    would run the target in (model.dtype on this device), so both train alike."""
    if settings.model.path is None or settings.stream.dir is None:
        raise SpecgenError("mode=disaggregated needs model.path=TARGET (its LM head and embedding, the same folder "
                           "the capture servers load), data.path=DATA and stream.dir=DIR (the folder servers share)")
    tokenizer, samples = tokenized(settings)
    weights = load_target_weights(settings.model.path, device="cpu")
    aux_layers = target_aux_layers(settings, weights.config)
    target_hash = config_hash(SimpleNamespace(config=weights.config))
    pad_id = pad_token_id(tokenizer)
    fingerprint = hashlib.sha256(json.dumps([target_hash, aux_layers, pad_id, plan.batch_tokens, plan.max_batch_size,
                                             plan.packing, plan.seed, plan.world_size]).encode())
    for sample in samples:
        fingerprint.update(torch.tensor(sample.input_ids, dtype=torch.int64).numpy().tobytes() + b"|")
    identity = fingerprint.hexdigest()
    spool = Spool(settings.stream.dir, stale_s=settings.stream.stale_s)
    if process.is_main:
        same = spool.start_run({"identity": identity, "aux_layers": aux_layers,
                                "max_length": settings.data.max_length,
                                "target": {"path": str(Path(settings.model.path).resolve()), "config_hash": target_hash}})
        log.info("stream %s: %s", spool.root, "the folder's run again (a resume)" if same else "a new run")
    process.barrier()
    hidden = weights.config.get_text_config().hidden_size
    dtype = resolve_model_dtype(settings.model.dtype, process.device, settings.model.path)
    stream_settings = StreamSettings(window=settings.stream.window, max_bytes=settings.stream.max_bytes,
                                     poll_s=settings.stream.poll_s, wait_timeout_s=settings.stream.wait_timeout_s)
    source = StreamBatches(samples, plan, spool, FileTransport(spool.root / OBJECTS), stream_settings, pad_id=pad_id,
                           bytes_per_token=(len(aux_layers) + 1) * hidden * 4, identity=identity)
    counts = count_trained_tokens((sample.input_ids, sample.loss_mask) for sample in samples)
    return TrainingData(source=source, target_path=str(Path(settings.model.path).resolve()), target_config_hash=target_hash,
                        aux_layers=aux_layers, token_counts=dict(counts),
                        embedding=weights.embedding.to(dtype.torch_dtype),
                        lm_head=weights.lm_head.to(dtype.torch_dtype), target_config=weights.config,
                        description=f"disaggregated {describe_path(settings.data.path)} ({len(samples)} samples, "
                                    f"captured by servers on {spool.root})")


def tokenized(settings) -> tuple[transformers.PreTrainedTokenizerBase, list]:
    """The tokenizer and the tokenized, loss-masked samples of `data.path` (online and disaggregated)."""
    tokenizer = load_tokenizer(settings.tokenizer.path)
    chat = ChatTemplateTokenizer.from_settings(tokenizer, settings.data)
    return tokenizer, tokenize_source(settings.data.path, chat, max_rows=settings.data.max_rows, on_bad_row=settings.data.on_bad_row,
                                      split=settings.data.split, subset=settings.data.subset)


def target_aux_layers(settings, config: transformers.PretrainedConfig) -> list[int]:
    """`capture.aux_layers`, checked against the target's depth; null: the EAGLE-3 default."""
    return resolve_aux_layers(settings.capture.aux_layers, config.get_text_config().num_hidden_layers)


def pad_token_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
