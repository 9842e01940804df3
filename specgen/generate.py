"""`python -m specgen.generate`: conversations -> tokens + loss mask -> target capture -> Arrow shards.

Read top to bottom: load the tokenizer and target, claim the output directory, then stream the source in work
units of `output.shard_size` rows. Each unit becomes one shard, written atomically; units already finished by an
earlier (possibly killed) run are skipped, so re-running the same command resumes. The manifest is written last.
"""

import itertools
import json
import logging
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from omegaconf import DictConfig

from specgen.capture import TargetCapture, make_capture
from specgen.capture.layers import default_aux_layers, validate_aux_layers
from specgen.capture.outputs import SampleOutputs, logprob_statistics
from specgen.capture.outputs import identity as output_identity
from specgen.capture.reuse import capture_with_prefix_reuse
from specgen.capture.target import CaptureOutput, config_hash, load_target
from specgen.config import stage_main, to_container
from specgen.data.batching import token_budget_batches
from specgen.data.prefixes import plan_prefixes
from specgen.data.prepare import prepare_rows
from specgen.data.sample import TokenizedSample
from specgen.data.sources import SourceRecord, count_records, iter_records
from specgen.data.template import ChatTemplateTokenizer, chat_template_sha256
from specgen.errors import SpecgenError
from specgen.filters import SampleFilter
from specgen.outdir import claim_output_dir
from specgen.progress import Progress, format_table, human_bytes
from specgen.store.manifest import merge_rejected, summarize_shards, write_manifest
from specgen.store.prefix_layout import PrefixRefEncoder, bytes_flat
from specgen.store.schema import ShardSpec
from specgen.store.writer import ShardWriter, finished_shards, remove_partial, shard_name

log = logging.getLogger("specgen.generate")

AUX_LAYER_CONVENTION = ("aux layer i is the output of decoder layer i (0-based) before the final norm, "
                        "i.e. Hugging Face hidden_states[i + 1]")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise SpecgenError(f"runtime.device={name} but no CUDA device is visible; use runtime.device=cpu")
    return torch.device(name)


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    if not Path(path).is_dir():
        raise SpecgenError(f"tokenizer.path={path} is not a folder; point it at a Hugging Face tokenizer folder "
                           "(it defaults to model.path)")
    tokenizer = AutoTokenizer.from_pretrained(path)
    if not tokenizer.chat_template:
        raise SpecgenError(f"the tokenizer in {path} has no chat template; use an instruct/chat tokenizer or "
                           "add chat_template.jinja to the folder")
    return tokenizer


@dataclass
class Target:
    """The loaded target and what the shards need to know about it."""

    capture: TargetCapture
    spec: ShardSpec
    pad_id: int
    outputs: SampleOutputs  # what each sample stores besides tokens: hidden states (bf16/fp8), logits, ...
    sample_filter: SampleFilter = SampleFilter()
    prefix_reuse: bool = False  # capture.prefix_reuse, where the backend can continue from a KV cache


def load_capture(cfg: DictConfig, tokenizer, device: torch.device) -> Target:
    model = load_target(cfg.model.path, dtype=cfg.model.dtype, device=str(device),
                        attn_implementation=cfg.model.attn_implementation)
    num_layers = model.config.get_text_config().num_hidden_layers
    requested = cfg.capture.aux_layers
    aux_layers = (default_aux_layers(num_layers) if requested is None
                  else validate_aux_layers(list(requested), num_layers))
    capture = make_capture(model, aux_layers)
    dtype = str(capture.dtype).removeprefix("torch.")
    outputs = SampleOutputs.from_config(cfg, capture)
    spec = ShardSpec(hidden_size=capture.hidden_size, num_aux=len(aux_layers), dtype=dtype,
                     store_prefix_once=bool(cfg.output.store_prefix_once), **outputs.spec_fields())
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    if cfg.capture.prefix_reuse and not capture.supports_kv:
        log.warning("capture.prefix_reuse=true, but the %s capture backend with attn_implementation=%s cannot "
                    "continue from a KV cache: every row is computed in full (prefix reuse needs a Llama-family "
                    "model with model.attn_implementation=sdpa or eager)", capture.backend,
                    model.config._attn_implementation)
    return Target(capture=capture, spec=spec, pad_id=pad_id, outputs=outputs,
                  sample_filter=SampleFilter.from_config(cfg),
                  prefix_reuse=bool(cfg.capture.prefix_reuse) and capture.supports_kv)


def capture_batches(target: Target, samples: list[TokenizedSample], *, batch_tokens: int, max_batch_size: int,
                    device: torch.device, chunk_tokens: int | None = None) -> Iterator[tuple[list[dict], int]]:
    """Run length-bucketed batches through the target; yield (rows without padding, padded token count)."""
    for batch in token_budget_batches(samples, batch_tokens, max_batch_size):
        longest = max(len(s) for s in batch)
        input_ids = torch.full((len(batch), longest), target.pad_id, dtype=torch.long)
        for b, sample in enumerate(batch):
            input_ids[b, : len(sample)] = torch.tensor(sample.input_ids)
        lengths = torch.tensor([len(s) for s in batch])
        input_ids = input_ids.to(device)
        out = target.capture(input_ids, lengths.to(device), chunk_tokens=chunk_tokens)
        rows = [{
            "sample_id": s.sample_id,
            "source_index": s.source_index,  # not a column: lets a filtered row be listed in rejected.jsonl
            "input_ids": s.input_ids,
            "loss_mask": s.loss_mask,
        } for s in batch]
        target.outputs.add_columns(rows, out, input_ids)  # hidden states (bf16 or fp8) and the optional columns
        yield rows, len(batch) * longest


def with_output_columns(target: Target, rows: list[dict], device: torch.device) -> tuple[list[dict], int]:
    """Rows from the prefix-reuse runner carry full hidden states; re-pad them into a batch so the stored columns
    (fp8 codes, logits, log-probs, pooled vectors) come from the one code path the plain capture uses."""
    rows, padded = rows
    if not rows:
        return rows, padded
    longest = max(len(row["input_ids"]) for row in rows)
    input_ids = torch.full((len(rows), longest), target.pad_id, dtype=torch.long, device=device)
    aux = rows[0]["aux_hidden_states"].new_zeros(len(rows), longest, rows[0]["aux_hidden_states"].shape[-1])
    last = rows[0]["last_hidden_state"].new_zeros(len(rows), longest, target.spec.hidden_size)
    for b, row in enumerate(rows):
        length = len(row["input_ids"])
        input_ids[b, :length] = torch.tensor(row["input_ids"], device=device)
        aux[b, :length], last[b, :length] = row.pop("aux_hidden_states"), row.pop("last_hidden_state")
    target.outputs.add_columns(rows, CaptureOutput(aux_hidden_states=aux, last_hidden_state=last), input_ids)
    return rows, padded


def work_units(records: Iterable[SourceRecord], shard_size: int) -> Iterator[tuple[int, list[SourceRecord]]]:
    """Split the stream into units of `shard_size` source rows; unit k always holds rows [k*S, (k+1)*S)."""
    for unit, group in itertools.groupby(records, key=lambda r: r.index // shard_size):
        yield unit, list(group)


def write_unit(cfg: DictConfig, out_dir: Path, unit: int, records: list[SourceRecord], chat: ChatTemplateTokenizer,
               target: Target, device: torch.device) -> dict:
    """Tokenize, capture and write one work unit as one shard; returns its stats."""
    samples, rejected = [], []
    for row in prepare_rows(records, chat, on_bad_row=cfg.data.on_bad_row):
        samples.extend(row.samples)
        rejected.extend(r.to_json() for r in row.rejections)
    stats = {"source_rows": len(records), "samples": len(samples), "tokens": sum(len(s) for s in samples),
             "trainable_tokens": sum(s.num_trainable for s in samples), "padded_tokens": 0}
    sequences = [s.input_ids for s in samples]
    plan = (plan_prefixes(sequences, cfg.capture.prefix_min_tokens)
            if target.prefix_reuse or target.spec.store_prefix_once else None)
    stats["tokens_emitted"] = stats["tokens"]
    stats["tokens_computed"] = plan.tokens_computed if target.prefix_reuse else stats["tokens"]
    if target.prefix_reuse:
        batches = (with_output_columns(target, rows, device) for rows in capture_with_prefix_reuse(
            target.capture, samples, plan, batch_tokens=cfg.capture.batch_tokens,
            max_batch_size=cfg.capture.max_batch_size, cache_tokens=cfg.capture.prefix_cache_tokens,
            pad_id=target.pad_id, device=device))
    else:
        batches = capture_batches(target, samples, batch_tokens=cfg.capture.batch_tokens,
                                  max_batch_size=cfg.capture.max_batch_size, device=device,
                                  chunk_tokens=cfg.capture.prefill_chunk_tokens)
    encoder = PrefixRefEncoder(plan, sequences, target.spec) if target.spec.store_prefix_once else None
    with ShardWriter(out_dir, unit, target.spec) as writer:
        for rows, padded in batches:
            rows, rejections = target.sample_filter.apply(rows, stats)
            rejected.extend(rejections)
            writer.write(encoder.encode(rows) if encoder else rows)
            stats["padded_tokens"] += padded
        stats["tokens_stored"] = encoder.tokens_stored if encoder else stats["tokens"]
        stats["rejected"] = dict(Counter(r["reason"] for r in rejected))
        writer.commit(stats, rejected)
    return stats


def count_trainable_token_ids(out_dir: Path, shards: list[str], vocab_size: int) -> np.ndarray:
    """How often each token id carries loss, read from the shards' token columns only (for the draft vocab)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for name in shards:
        with pa.memory_map(str(out_dir / name)) as source:
            table = pa.ipc.open_file(source).read_all().select(["input_ids", "loss_mask"])
        ids = table.column("input_ids").combine_chunks().flatten().to_numpy()
        mask = table.column("loss_mask").combine_chunks().flatten().to_numpy().astype(bool)
        counts += np.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
    return counts


def dataset_identity(cfg: DictConfig, model_config_hash: str, template_sha: str) -> dict:
    """Everything that changes the bytes of the dataset (and nothing that only changes speed)."""
    return {"model.path": str(Path(cfg.model.path).resolve()), "model.config_hash": model_config_hash,
            "model.dtype": cfg.model.dtype, "tokenizer.path": str(Path(cfg.tokenizer.path).resolve()),
            "chat_template_sha256": template_sha, "data": to_container(cfg.data),
            "capture.aux_layers": to_container(cfg.capture).get("aux_layers"),
            "output.shard_size": cfg.output.shard_size, "output.store_prefix_once": cfg.output.store_prefix_once,
            **output_identity(cfg)}


def build_manifest(cfg: DictConfig, out_dir: Path, target: Target, tokenizer, identity: dict) -> dict:
    shards = [shard_name(i) for i in sorted(finished_shards(out_dir))]
    capture = target.capture
    text_config = capture.model.config.get_text_config()
    counts = count_trainable_token_ids(out_dir, shards, text_config.vocab_size)
    stats = summarize_shards(out_dir)
    (out_dir / "token_counts.json").write_text(json.dumps(
        {"vocab_size": int(text_config.vocab_size),
         "counts": {str(i): int(c) for i in np.flatnonzero(counts) for c in [counts[i]]}}))
    return {
        "format": "specgen.shards", "format_version": 1,
        "model": {"path": identity["model.path"], "config_hash": identity["model.config_hash"],
                  "architecture": type(capture.model).__name__, "num_layers": capture.num_layers,
                  "hidden_size": capture.hidden_size, "vocab_size": int(text_config.vocab_size)},
        "tokenizer": {"path": identity["tokenizer.path"], "chat_template_sha256": identity["chat_template_sha256"],
                      "vocab_size": len(tokenizer)},
        "capture": {"aux_layers": list(capture.aux_layers), "aux_layer_convention": AUX_LAYER_CONVENTION,
                    "last_hidden_state": "post_norm: output of the final norm, the input of lm_head",
                    "backend": capture.backend},
        "dtype": target.spec.dtype, "hidden_size": target.spec.hidden_size, "num_aux": target.spec.num_aux,
        "codec": "fp8" if target.spec.codec == "fp8" else target.spec.dtype,
        "outputs": {**target.outputs.describe(), "filter": target.sample_filter.describe()},
        "shards": shards,
        "stats": {**stats,
                  **({"logprobs": logprob_statistics([out_dir / name for name in shards])}
                     if target.spec.token_logprobs else {})},
        "layout": "prefix_refs" if target.spec.store_prefix_once else "flat",
        "prefix_reuse": prefix_reuse_report(cfg, target, stats),
        "config": to_container(cfg),
    }


def prefix_reuse_report(cfg: DictConfig, target: Target, stats: dict) -> dict:
    """Tokens run through the target against tokens emitted, bytes stored against a flat layout's."""
    return {"enabled": target.prefix_reuse, "min_tokens": cfg.capture.prefix_min_tokens,
            "store_prefix_once": target.spec.store_prefix_once,
            "tokens_computed": stats.get("tokens_computed", 0), "tokens_emitted": stats.get("tokens_emitted", 0),
            "bytes_stored": stats["bytes_on_disk"],
            "bytes_flat": bytes_flat(stats, target.spec) if stats["num_shards"] else 0}


def prefix_reuse_summary(report: dict) -> str:
    computed, emitted = report["tokens_computed"], report["tokens_emitted"]
    stored, flat = report["bytes_stored"], report["bytes_flat"]
    compute = (f"{computed:,} tokens computed for {emitted:,} emitted ({emitted / max(computed, 1):.2f}x fewer)"
               if report["enabled"] else "off: every row computed in full")
    storage = (f"{human_bytes(stored)} stored vs {human_bytes(flat)} flat ({flat / max(stored, 1):.2f}x smaller)"
               if report["store_prefix_once"] else "flat layout")
    return f"{compute}; {storage}"


def print_summary(manifest: dict, out_dir: Path, computed_tokens: int, seconds: float) -> None:
    stats = manifest["stats"]
    rejected = stats.get("rejected", {})
    rejected_text = f"{sum(rejected.values()):,}" + (
        f" ({', '.join(f'{k}: {v}' for k, v in sorted(rejected.items()))}; see rejected.jsonl)" if rejected else "")
    print(format_table([
        ("output", str(out_dir)),
        ("samples", f"{stats['samples']:,} in {len(manifest['shards'])} shards"),
        ("tokens", f"{stats['tokens']:,} ({stats['trainable_tokens']:,} trainable)"),
        ("rejected rows", rejected_text),
        ("bytes on disk", f"{human_bytes(stats['bytes_on_disk'])} ({stats['bytes_per_token'] or 0:,.0f} B/token)"),
        ("prefix reuse", prefix_reuse_summary(manifest["prefix_reuse"])),
        ("throughput", f"{computed_tokens / max(seconds, 1e-9):,.0f} tokens/s over {computed_tokens:,} tokens "
                       f"captured in this run ({seconds:.1f}s)" if computed_tokens else
                       "nothing left to compute: every shard was already finished"),
    ]))


def run(cfg: DictConfig) -> dict:
    if not Path(cfg.model.path).is_dir():
        raise SpecgenError(f"model.path={cfg.model.path} is not a folder; point it at a local Hugging Face model "
                           "folder (config.json + weights)")
    device = resolve_device(cfg.runtime.device)
    tokenizer = load_tokenizer(cfg.tokenizer.path)
    chat = ChatTemplateTokenizer(tokenizer, max_length=cfg.data.max_length, train_turns=cfg.data.train_turns,
                                 mask_empty_think=cfg.data.mask_empty_think,
                                 chat_template_kwargs=to_container(cfg.data)["chat_template_kwargs"])
    target = load_capture(cfg, tokenizer, device)
    identity = dataset_identity(cfg, config_hash(target.capture.model), chat_template_sha256(tokenizer))

    out_dir = Path(cfg.output.dir)
    resumed = claim_output_dir(out_dir, identity, overwrite=cfg.output.overwrite)
    remove_partial(out_dir)
    done = finished_shards(out_dir)
    if resumed:
        log.info("resuming in %s: %d shards already finished", out_dir, len(done))

    records = iter_records(cfg.data.path)
    total = count_records(cfg.data.path)
    if cfg.data.max_rows is not None:
        records = itertools.islice(records, cfg.data.max_rows)
        total = min(total, cfg.data.max_rows) if total is not None else cfg.data.max_rows
    progress = Progress(total, enabled=cfg.runtime.progress)
    computed_tokens = 0
    for unit, unit_records in work_units(records, cfg.output.shard_size):
        if unit in done:
            progress.update(len(unit_records), 0)
            continue
        stats = write_unit(cfg, out_dir, unit, unit_records, chat, target, device)
        unit_tokens = stats["tokens"] + stats.get("filtered_tokens", 0)
        computed_tokens += unit_tokens
        progress.update(len(unit_records), unit_tokens)
    seconds = progress.close()

    manifest = build_manifest(cfg, out_dir, target, tokenizer, identity)
    manifest["last_run"] = {"computed_tokens": computed_tokens, "seconds": seconds,
                            "tokens_per_second": computed_tokens / max(seconds, 1e-9), "device": str(device)}
    merge_rejected(out_dir)
    write_manifest(out_dir, manifest)
    print_summary(manifest, out_dir, computed_tokens, seconds)
    return manifest


main = stage_main("generate")(run)

if __name__ == "__main__":
    main()
