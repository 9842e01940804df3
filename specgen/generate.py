"""`python -m specgen.generate`: conversations -> tokens + loss mask -> target capture -> Arrow shards.

Read top to bottom: load the tokenizer and target, claim the output directory, then stream the source in work
units of `output.shard_size` rows. Each unit becomes one shard, written atomically; units already finished by an
earlier (possibly killed) run are skipped, so re-running the same command resumes. The manifest is written last.

Under `accelerate launch` each process claims the next unfinished unit whenever it is ready for one
(`specgen.ranks.claims`), so no process waits for a slower one; the main process writes the manifest once
every process is done (`specgen.ranks.monitor`). Within a process,
tokenizing runs ahead of the target and writing behind it (`specgen.pipeline`).
"""

import logging
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import closing
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from omegaconf import DictConfig, OmegaConf

from specgen.capture import TargetCapture, make_capture
from specgen.capture.layers import resolve_aux_layers
from specgen.capture.outputs import SampleOutputs, logprob_statistics
from specgen.capture.outputs import identity as output_identity
from specgen.capture.packed import PackedSegments, PackingUnsupported
from specgen.capture.positions import position_chunks
from specgen.capture.reuse import capture_with_prefix_reuse, resolve_prefix_reuse, reuse_pays
from specgen.capture.target import CaptureOutput, config_hash, load_target
from specgen.config import stage_main, to_container
from specgen.data.batching import packed_batches, pad_right, token_budget_batches
from specgen.data.prefixes import plan_prefixes
from specgen.data.prepare import prepare_rows
from specgen.data.sample import TokenizedSample
from specgen.data.sources import SourceRecord, capped_source, work_units
from specgen.data.template import ChatTemplateTokenizer, chat_template_sha256
from specgen.draft.vocab import TARGET_TOKEN_COUNTS, TOKEN_COUNTS
from specgen.ranks import Workers, init_workers, report_error, slowdown_for_tests
from specgen.ranks.claims import UnitClaims, clear_claims
from specgen.ranks.monitor import JobMonitor, PeerFailure
from specgen.ranks.zero import ZeroCapture, load_zero3_target
from specgen.errors import SpecgenError
from specgen.filters import SampleFilter
from specgen.outdir import claim_output_dir, fingerprint
from specgen.pipeline import BackgroundWriter, copy_to_host, prefetched, to_device
from specgen.progress import format_table, human_bytes
from specgen.runtime import load_tokenizer, resolve_device, resolve_model_dtype, set_threads
from specgen.settings import filter_settings, output_settings, vllm_capture_settings, zero3_settings
from specgen.store.manifest import merge_rejected, shard_checksums, summarize_shards, write_manifest
from specgen.store.prefix_layout import PrefixRefEncoder, bytes_flat
from specgen.store.commit import write_json_atomic
from specgen.store.lease import hold_job_lease
from specgen.store.columns import ShardSpec
from specgen.store.writer import finished_shards, read_sidecar, remove_partial, shard_name

log = logging.getLogger("specgen.generate")

TARGET_TOP = "target_top_tokens"  # the sidecar entry holding one shard's share of TARGET_TOKEN_COUNTS
AUX_LAYER_CONVENTION = ("aux layer i is the output of decoder layer i (0-based) before the final norm, "
                        "i.e. Hugging Face hidden_states[i + 1]")


@dataclass
class Target:
    """The loaded target and what the shards need to know about it."""

    capture: TargetCapture
    spec: ShardSpec
    pad_id: int
    outputs: SampleOutputs  # what each sample stores besides tokens: hidden states (bf16/fp8), logits, ...
    sample_filter: SampleFilter = SampleFilter()
    prefix_reuse: bool = False  # capture.prefix_reuse, where the backend can continue from a KV cache
    prefix_reuse_note: str | None = None  # how capture.prefix_reuse was decided (auto: by device), for the summary
    packing: bool = False  # capture.packing, where the backend packs (turned off, with `packing_note`, if refused)
    packing_note: str | None = None  # why packing is off although capture.packing asked for it

    def stop_packing(self, reason: str) -> None:
        """The model refused to run packed: every later batch is padded, and the summary says why."""
        log.warning("capture.packing: %s; capturing padded batches instead", reason)
        self.packing, self.packing_note = False, reason


def load_capture(cfg: DictConfig, tokenizer, device: torch.device) -> Target:
    if cfg.engine.name == "vllm":  # a vLLM engine computes the states (specgen.capture.vllm); imported lazily
        from specgen.capture.vllm import load_vllm_capture

        return target_for(cfg, tokenizer, load_vllm_capture(vllm_capture_settings(cfg)), prefix_reuse=False)
    if cfg.engine.name == "deepspeed":
        model, zero3_config, keepalive = load_zero3_target(zero3_settings(cfg), device)
    elif cfg.engine.name == "hf":
        model = load_target(cfg.model.path, dtype=cfg.model.dtype, device=str(device),
                            attn_implementation=cfg.model.attn_implementation)
    else:
        raise SpecgenError(f"engine={cfg.engine.name} is unknown; use engine=hf (the default), engine=deepspeed "
                           "or engine=vllm")
    aux_layers = resolve_aux_layers(cfg.capture.aux_layers, model.config.get_text_config().num_hidden_layers)
    positions = positions_of(model.config.get_text_config())
    if positions and cfg.data.max_length > positions:
        log.warning("data.max_length=%d is past the target's %d positions (max_position_embeddings): tokens past "
                    "them get states from outside the context it was trained on; lower data.max_length to cut "
                    "such rows there", cfg.data.max_length, positions)
    if cfg.capture.compile and cfg.engine.name != "hf":
        log.warning("capture.compile=true is for engine=hf; engine=%s runs its layers eagerly", cfg.engine.name)
    capture = make_capture(model, aux_layers, compile=bool(cfg.capture.compile) and cfg.engine.name == "hf")
    if cfg.engine.name == "deepspeed":
        capture = ZeroCapture(capture, zero3_config, keepalive)
    reuse, note = resolve_prefix_reuse(cfg.capture.prefix_reuse, device)
    if reuse and not capture.supports_kv:
        log.warning("%s, but the %s capture backend with attn_implementation=%s cannot continue from a KV cache: "
                    "every row is computed in full (prefix reuse needs a Llama-family model with "
                    "model.attn_implementation=sdpa or eager)", note, capture.backend,
                    model.config._attn_implementation)
        note += f"; the {capture.backend} backend cannot continue from a KV cache"
    log.info("prefix reuse %s (%s)", "on" if reuse and capture.supports_kv else "off", note)
    target = target_for(cfg, tokenizer, capture, prefix_reuse=reuse and capture.supports_kv)
    target.prefix_reuse_note = note
    if cfg.capture.packing and not capture.supports_packing:
        target.packing_note = f"the {capture.backend} capture backend does not pack sequences"
        log.warning("capture.packing=true, but %s: batches are padded", target.packing_note)
    return target


def target_for(cfg: DictConfig, tokenizer, capture: TargetCapture, prefix_reuse: bool) -> Target:
    dtype = str(capture.dtype).removeprefix("torch.")
    outputs = SampleOutputs.from_settings(output_settings(cfg), capture)
    spec = ShardSpec(hidden_size=capture.hidden_size, num_aux=len(capture.aux_layers), dtype=dtype,
                     store_prefix_once=bool(cfg.output.store_prefix_once), **outputs.spec_fields())
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return Target(capture=capture, spec=spec, pad_id=pad_id, outputs=outputs,
                  sample_filter=filter_settings(cfg), prefix_reuse=prefix_reuse,
                  packing=bool(cfg.capture.packing) and capture.supports_packing)


def count_top_tokens(counts: torch.Tensor | None, target: Target, last_hidden_state: torch.Tensor,
                     loss_masks: list, chunk_tokens: int, packed: bool = False) -> None:
    """Add the target's top token at every trainable position (t with loss_mask[t+1] = 1) to `counts` [V], on the
    device and without waiting for it (indices are made on the host, `scatter_add_` rather than `bincount`): the
    draft vocabulary of `draft.vocab_source=target`. The LM head runs on those positions only.
    packed: `last_hidden_state` is [1, N], the rows of `loss_masks` end to end."""
    if counts is None:
        return
    needed = torch.zeros(last_hidden_state.shape[:2], dtype=torch.bool)
    start = 0
    for b, mask in enumerate(loss_masks):
        mask = torch.as_tensor(mask, dtype=torch.bool)
        needed[0 if packed else b, start: start + len(mask) - 1] = mask[1:]
        if packed:
            start += len(mask)
    with torch.no_grad():
        for rows, cols in position_chunks(needed, chunk_tokens):  # host indices: no device sync
            device = last_hidden_state.device
            states = last_hidden_state[to_device(rows, device), to_device(cols, device)]
            top = target.capture.lm_head(states.to(counts.device)).argmax(-1)
            counts.scatter_add_(0, top, torch.ones_like(top))


def capture_batches(target: Target, samples: list[TokenizedSample], *, batch_tokens: int, max_batch_size: int,
                    device: torch.device, chunk_tokens: int | None = None, top_counts: torch.Tensor | None = None,
                    lm_head_chunk: int = 1024) -> Iterator[tuple[list[dict], int, None]]:
    """Run batches through the target; yield (rows without padding, tokens forwarded padding included, ready).

    With `target.packing` a batch's samples run end to end in one row (`capture_packed_batches`), else as
    length-bucketed right-padded batches. The rows' tensors may be host tensors still being copied from the device:
    read them after `ready.synchronize()` (`ready` is None on the CPU, and when the output columns were copied
    synchronously).
    """
    if target.packing:
        yield from capture_packed_batches(target, samples, batch_tokens=batch_tokens, max_batch_size=max_batch_size,
                                          device=device, chunk_tokens=chunk_tokens, top_counts=top_counts,
                                          lm_head_chunk=lm_head_chunk)
        return
    for batch in token_budget_batches(samples, batch_tokens, max_batch_size):
        input_ids = pad_right([s.input_ids for s in batch], target.pad_id)
        lengths = torch.tensor([len(s) for s in batch])  # stays on the CPU: checking it must not sync the device
        input_ids = to_device(input_ids, device)
        out = target.capture(input_ids, lengths, chunk_tokens=chunk_tokens)
        count_top_tokens(top_counts, target, out.last_hidden_state, [s.loss_mask for s in batch], lm_head_chunk)
        rows = [{
            "sample_id": s.sample_id,
            "source_index": s.source_index,  # not a column: lets a filtered row be listed in rejected.jsonl
            "input_ids": s.input_ids,
            "loss_mask": s.loss_mask,
        } for s in batch]
        if target.outputs.hidden_states_only:  # copied down on a side stream; the writer waits for `ready`
            out, ready = copy_to_host(out)
            for b, row in enumerate(rows):
                row["aux_hidden_states"] = out.aux_hidden_states[b, : len(row["input_ids"])]
                row["last_hidden_state"] = out.last_hidden_state[b, : len(row["input_ids"])]
        else:  # fp8 codes, LM-head columns and pooled vectors are computed on the device first
            target.outputs.add_columns(rows, out, input_ids)
            ready = None
        yield rows, input_ids.numel(), ready


def capture_packed_batches(target: Target, samples: list[TokenizedSample], *, batch_tokens: int,
                           max_batch_size: int, device: torch.device, chunk_tokens: int | None = None,
                           top_counts: torch.Tensor | None = None, lm_head_chunk: int = 1024):
    """`capture_batches` without padding: samples packed end to end, `batch_tokens` real tokens per forward
    (`specgen.data.batching.packed_batches`). A sample longer than `chunk_tokens` runs alone with chunked prefill
    (a batch of one: no padding either). If the model refuses to run packed, it and every later batch run padded."""
    long = [s for s in samples if chunk_tokens is not None and len(s) > chunk_tokens]
    packs = packed_batches([s for s in samples if chunk_tokens is None or len(s) <= chunk_tokens], batch_tokens,
                           max_batch_size)
    padded = replace(target, packing=False)
    # Long samples first (as in the sorted order), one at a time with chunked prefill: no padding either.
    yield from capture_batches(padded, long, batch_tokens=batch_tokens, max_batch_size=1, device=device,
                               chunk_tokens=chunk_tokens, top_counts=top_counts, lm_head_chunk=lm_head_chunk)
    rest: list[TokenizedSample] = []  # what the padded path captures after a refusal
    for index, batch in enumerate(packs):
        segments = PackedSegments.from_lengths([len(s) for s in batch])
        input_ids = torch.tensor([[token for s in batch for token in s.input_ids]])
        try:
            out = target.capture.packed(to_device(input_ids, device), segments)
        except PackingUnsupported as error:
            target.stop_packing(str(error))
            rest = [s for pack in packs[index:] for s in pack]
            break
        count_top_tokens(top_counts, target, out.last_hidden_state, [s.loss_mask for s in batch], lm_head_chunk,
                         packed=True)
        rows = [{"sample_id": s.sample_id, "source_index": s.source_index, "input_ids": s.input_ids,
                 "loss_mask": s.loss_mask} for s in batch]
        ready = None
        if target.outputs.hidden_states_only:  # copied down on a side stream; the writer waits for `ready`
            out, ready = copy_to_host(out)
        for row, (lo, hi) in zip(rows, segments.spans()):
            row["aux_hidden_states"] = out.aux_hidden_states[0, lo:hi]
            row["last_hidden_state"] = out.last_hidden_state[0, lo:hi]
        if not target.outputs.hidden_states_only:  # the other columns from the padded layout's one code path
            rows, _ = with_output_columns(target, (rows, 0), device)
        yield rows, segments.total, ready
    yield from capture_batches(padded, rest, batch_tokens=batch_tokens, max_batch_size=max_batch_size, device=device,
                               chunk_tokens=chunk_tokens, top_counts=top_counts, lm_head_chunk=lm_head_chunk)


def with_output_columns(target: Target, rows: list[dict], device: torch.device, top_counts: torch.Tensor | None = None,
                        lm_head_chunk: int = 1024) -> tuple[list[dict], int]:
    """Rows from the prefix-reuse runner carry full hidden states, which are the stored columns as they are; for
    any other column (fp8 codes, logits, log-probs, pooled vectors) re-pad them into a batch so those come from the
    one code path the plain capture uses."""
    rows, padded = rows
    if not rows:
        return rows, padded
    if target.outputs.hidden_states_only:  # nothing to compute from the states but the target's top tokens
        for row in rows:
            count_top_tokens(top_counts, target, row["last_hidden_state"][None], [row["loss_mask"]], lm_head_chunk)
        return rows, padded
    longest = max(len(row["input_ids"]) for row in rows)
    input_ids = torch.full((len(rows), longest), target.pad_id, dtype=torch.long)  # moved once, below: no copy per row
    aux = rows[0]["aux_hidden_states"].new_zeros(len(rows), longest, rows[0]["aux_hidden_states"].shape[-1])
    last = rows[0]["last_hidden_state"].new_zeros(len(rows), longest, target.spec.hidden_size)
    for b, row in enumerate(rows):
        length = len(row["input_ids"])
        input_ids[b, :length] = torch.as_tensor(row["input_ids"])
        aux[b, :length], last[b, :length] = row.pop("aux_hidden_states"), row.pop("last_hidden_state")
    input_ids = to_device(input_ids, device)
    count_top_tokens(top_counts, target, last, [row["loss_mask"] for row in rows], lm_head_chunk)
    target.outputs.add_columns(rows, CaptureOutput(aux_hidden_states=aux, last_hidden_state=last), input_ids)
    return rows, padded


@dataclass
class PreparedUnit:
    """One work unit, tokenized: what its shard will hold and the stats of its sidecar."""

    index: int
    source_rows: int
    samples: list[TokenizedSample]
    rejected: list[dict]
    stats: dict


def prepare_unit(cfg: DictConfig, unit: int, records: list[SourceRecord], chat: ChatTemplateTokenizer) -> PreparedUnit:
    """Tokenize one work unit and count what it holds (the shard's padded tokens are added as it is captured)."""
    samples, rejected = [], []
    for row in prepare_rows(records, chat, on_bad_row=cfg.data.on_bad_row):
        samples.extend(row.samples)
        rejected.extend(r.to_json() for r in row.rejections)
    stats = {"source_rows": len(records), "samples": len(samples), "tokens": sum(len(s) for s in samples),
             "trainable_tokens": sum(s.num_trainable for s in samples), "padded_tokens": 0}
    return PreparedUnit(unit, len(records), samples, rejected, stats)


def owned_units(cfg: DictConfig, records: Iterable[SourceRecord], chat: ChatTemplateTokenizer, workers: Workers,
                done: set[int], monitor: JobMonitor, claims: UnitClaims) -> Iterator[PreparedUnit]:
    """The unfinished units this process claims, tokenized in order (claimed when the previous one was taken off
    the prefetch queue); finished ones only count towards progress, on the main process."""
    slowdown = slowdown_for_tests(workers.rank)
    for unit, unit_records in work_units(records, cfg.output.shard_size):
        if unit in done:
            if workers.is_main:
                monitor.add(rows=len(unit_records))
            continue
        if slowdown:
            time.sleep(slowdown)
        if claims.claim(unit):
            yield prepare_unit(cfg, unit, unit_records, chat)


def unit_batches(cfg: DictConfig, unit: PreparedUnit, target: Target, plan, device: torch.device,
                 top_counts: torch.Tensor | None = None):
    """The unit's captured batches: computed in full, or (given a plan) continuing shared prefixes from their KV."""
    head_chunk = cfg.capture.lm_head_chunk_tokens
    if plan is None:
        yield from capture_batches(target, unit.samples, batch_tokens=cfg.capture.batch_tokens,
                                   max_batch_size=cfg.capture.max_batch_size, device=device,
                                   chunk_tokens=cfg.capture.prefill_chunk_tokens, top_counts=top_counts,
                                   lm_head_chunk=head_chunk)
        return
    for batch in capture_with_prefix_reuse(target.capture, unit.samples, plan, batch_tokens=cfg.capture.batch_tokens,
                                           max_batch_size=cfg.capture.max_batch_size,
                                           cache_tokens=cfg.capture.prefix_cache_tokens, pad_id=target.pad_id,
                                           device=device):
        yield (*with_output_columns(target, batch, device, top_counts, head_chunk), None)


def capture_units(cfg: DictConfig, units: Iterable[PreparedUnit], target: Target, writer: BackgroundWriter,
                  monitor: JobMonitor, device: torch.device, lease=None) -> None:
    """The main thread's loop: capture every unit's batches and hand them to the writer, one shard per unit."""
    for unit in units:
        stats, sequences = unit.stats, [s.input_ids for s in unit.samples]
        plan = (plan_prefixes(sequences, cfg.capture.prefix_min_tokens)
                if target.prefix_reuse or target.spec.store_prefix_once else None)
        stats["tokens_emitted"] = stats["tokens"]
        reuse = target.prefix_reuse and reuse_pays(plan)  # else the plain path is the faster one (measured)
        stats["tokens_computed"] = plan.tokens_computed if reuse else stats["tokens"]
        encoder = PrefixRefEncoder(plan, sequences, target.spec) if target.spec.store_prefix_once else None
        writer.begin(unit.index)
        top_counts = (torch.zeros(target.capture.lm_head.weight.shape[0], dtype=torch.long, device=device)
                      if counts_top_tokens(cfg, target) else None)
        cached_before = getattr(target.capture, "tokens_cached", 0)  # engine=vllm: tokens its prefix cache held
        for rows, padded, ready in unit_batches(cfg, unit, target, plan if reuse else None, device, top_counts):
            rows, rejections = target.sample_filter.apply(rows, stats)
            unit.rejected.extend(rejections)
            writer.write(encoder.encode(rows) if encoder else rows, ready)
            stats["padded_tokens"] += padded
            monitor.check()
        stats["tokens_computed"] -= getattr(target.capture, "tokens_cached", 0) - cached_before
        stats["tokens_stored"] = encoder.tokens_stored if encoder else stats["tokens"]
        stats["rejected"] = dict(Counter(r["reason"] for r in unit.rejected))
        if lease is not None:
            lease.check()  # a job that lost output.dir to another commits nothing more
        extra = None
        if top_counts is not None:  # one device sync per unit
            top_counts = top_counts.cpu()
            extra = {TARGET_TOP: {str(int(i)): int(top_counts[i]) for i in top_counts.nonzero().flatten()}}
        writer.commit(stats, unit.rejected, unit.source_rows, extra)
        monitor.check()
    if isinstance(target.capture, ZeroCapture):
        target.capture.drain()


def counts_top_tokens(cfg: DictConfig, target: Target) -> bool:
    """capture.count_target_tokens, where the LM head is whole on this process (not under ZeRO-3, not inside a vLLM
    engine, whose weights this process does not hold)."""
    return (bool(cfg.capture.count_target_tokens) and not isinstance(target.capture, ZeroCapture)
            and not target.capture.lm_head.weight.is_meta)


def target_token_counts(out_dir: Path, shards: list[str]) -> dict[int, int] | None:
    """The target's top tokens at trainable positions, summed over the shards' sidecars (None when a shard was
    made without counting them)."""
    total: Counter = Counter()
    for name in shards:
        counts = read_sidecar(out_dir, int(name.split("-")[1].split(".")[0])).get(TARGET_TOP)
        if counts is None:
            return None
        total.update({int(token): count for token, count in counts.items()})
    return dict(total)


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


def dataset_identity(cfg: DictConfig, model_config_hash: str, template_sha: str, target: Target) -> dict:
    """Everything that changes the bytes of the dataset (and nothing that only changes speed): besides the inputs,
    what computes the numbers (engine, attention kernel, the dtype model.dtype resolved to, the capture backend),
    so a dataset started with one never resumes with another and the manifest's backend holds for every shard."""
    return {"model.path": str(Path(cfg.model.path).resolve()), "model.config_hash": model_config_hash,
            "model.dtype": target.spec.dtype, "engine.name": cfg.engine.name,
            "model.attn_implementation": cfg.model.attn_implementation, "capture.backend": target.capture.backend,
            "tokenizer.path": str(Path(cfg.tokenizer.path).resolve()),
            "chat_template_sha256": template_sha, "data": to_container(cfg.data),
            "capture.aux_layers": to_container(cfg.capture).get("aux_layers"),
            "output.shard_size": cfg.output.shard_size, "output.store_prefix_once": cfg.output.store_prefix_once,
            **output_identity(output_settings(cfg), target.sample_filter)}


def build_manifest(cfg: DictConfig, out_dir: Path, target: Target, tokenizer, identity: dict) -> dict:
    shards = [shard_name(i) for i in sorted(finished_shards(out_dir))]
    capture = target.capture
    text_config = capture.model.config.get_text_config()
    counts = count_trainable_token_ids(out_dir, shards, text_config.vocab_size)
    stats = summarize_shards(out_dir)
    write_json_atomic(out_dir / TOKEN_COUNTS, {"vocab_size": int(text_config.vocab_size), "counts": {
        str(i): int(c) for i in np.flatnonzero(counts) for c in [counts[i]]}}, indent=None)
    top = target_token_counts(out_dir, shards)
    if top is not None:
        write_json_atomic(out_dir / TARGET_TOKEN_COUNTS, {"vocab_size": int(text_config.vocab_size), "counts": {
            str(token): count for token, count in sorted(top.items())}}, indent=None)
    else:
        (out_dir / TARGET_TOKEN_COUNTS).unlink(missing_ok=True)
    return {
        "format": "specgen.shards", "format_version": 1,
        "model": {"path": identity["model.path"], "config_hash": identity["model.config_hash"],
                  "architecture": type(capture.model).__name__, "num_layers": capture.num_layers,
                  "hidden_size": capture.hidden_size, "vocab_size": int(text_config.vocab_size)},
        "tokenizer": {"path": identity["tokenizer.path"], "chat_template_sha256": identity["chat_template_sha256"],
                      "vocab_size": len(tokenizer)},
        "capture": {"aux_layers": list(capture.aux_layers), "aux_layer_convention": AUX_LAYER_CONVENTION,
                    "last_hidden_state": "post_norm: output of the final norm, the input of lm_head",
                    "backend": capture.backend, "compiled": capture.compiled,
                    "max_positions": positions_of(text_config)},
        "dtype": target.spec.dtype, "hidden_size": target.spec.hidden_size, "num_aux": target.spec.num_aux,
        "codec": "fp8" if target.spec.codec == "fp8" else target.spec.dtype,
        "outputs": {**target.outputs.describe(), "filter": target.sample_filter.describe()},
        "shards": shards,
        "checksums": {name: checksum for name, checksum in shard_checksums(out_dir).items() if name in shards},
        "stats": {**stats,
                  **({"logprobs": logprob_statistics([out_dir / name for name in shards])}
                     if target.spec.token_logprobs else {})},
        "layout": "prefix_refs" if target.spec.store_prefix_once else "flat",
        "prefix_reuse": prefix_reuse_report(cfg, target, stats),
        "padding": padding_report(target, stats),
        "config": to_container(cfg),
    }


def prefix_reuse_report(cfg: DictConfig, target: Target, stats: dict) -> dict:
    """Tokens run through the target against tokens emitted, bytes stored against a flat layout's."""
    return {"enabled": target.prefix_reuse or bool(getattr(target.capture, "prefix_caching", False)),
            "setting": cfg.capture.prefix_reuse, "decided": target.prefix_reuse_note,
            "min_tokens": cfg.capture.prefix_min_tokens,
            "store_prefix_once": target.spec.store_prefix_once,
            "tokens_computed": stats.get("tokens_computed", 0), "tokens_emitted": stats.get("tokens_emitted", 0),
            "bytes_stored": stats["bytes_on_disk"],
            "bytes_flat": bytes_flat(stats, target.spec) if stats["num_shards"] else 0}


def padding_report(target: Target, stats: dict) -> dict:
    """Tokens the target forwarded, padding included, against the real tokens it computed (every shard so far)."""
    forwarded, real = stats.get("padded_tokens", 0), stats.get("tokens_computed", 0)
    return {"packing": target.packing, "packing_off_because": target.packing_note,
            "forwarded_tokens": forwarded, "real_tokens": real, "ratio": round(forwarded / real, 4) if real else None}


def padding_summary(report: dict) -> str:
    how = "packed" if report["packing"] else f"padded ({report['packing_off_because'] or 'capture.packing=false'})"
    ratio = f" ({report['ratio']:.2f}x)" if report["ratio"] is not None else ""
    return f"{report['forwarded_tokens']:,} tokens forwarded for {report['real_tokens']:,} real{ratio}; {how}"


def prefix_reuse_summary(report: dict) -> str:
    computed, emitted = report["tokens_computed"], report["tokens_emitted"]
    stored, flat = report["bytes_stored"], report["bytes_flat"]
    compute = (f"{computed:,} tokens computed for {emitted:,} emitted ({emitted / max(computed, 1):.2f}x fewer)"
               if report["enabled"] else "off: every row computed in full")
    if report.get("decided"):  # how capture.prefix_reuse was decided (auto: by device)
        compute += f" ({report['decided']})"
    storage = (f"{human_bytes(stored)} stored vs {human_bytes(flat)} flat ({flat / max(stored, 1):.2f}x smaller)"
               if report["store_prefix_once"] else "flat layout")
    return f"{compute}; {storage}"


def positions_of(text_config) -> int | None:
    """The target's trained context in tokens (max_position_embeddings), if its config says."""
    positions = getattr(text_config, "max_position_embeddings", None)
    return int(positions) if positions else None


def beyond_positions(manifest: dict) -> bool:
    positions = manifest["capture"].get("max_positions")
    return bool(positions) and manifest["config"]["data"]["max_length"] > positions


def print_summary(manifest: dict, out_dir: Path, computed_tokens: int, seconds: float, processes: int = 1,
                  source_rows: str = "") -> None:
    stats = manifest["stats"]
    rejected = stats.get("rejected", {})
    rejected_text = f"{sum(rejected.values()):,}" + (
        f" ({', '.join(f'{k}: {v}' for k, v in sorted(rejected.items()))}; see rejected.jsonl)" if rejected else "")
    print(format_table([
        ("output", str(out_dir)),
        ("source", source_rows),
        ("target dtype", manifest.get("last_run", {}).get("dtype", manifest["dtype"])),
        ("samples", f"{stats['samples']:,} in {len(manifest['shards'])} shards"),
        ("tokens", f"{stats['tokens']:,} ({stats['trainable_tokens']:,} trainable)"),
        ("rejected rows", rejected_text),
        ("bytes on disk", f"{human_bytes(stats['bytes_on_disk'])} ({stats['bytes_per_token'] or 0:,.0f} B/token)"),
        ("prefix reuse", prefix_reuse_summary(manifest["prefix_reuse"])),
        ("padding", padding_summary(manifest["padding"])),
        *([("context", f"data.max_length={manifest['config']['data']['max_length']:,} is past the target's "
                       f"{manifest['capture']['max_positions']:,} positions: longer rows got states from outside "
                       "its trained context")]
          if beyond_positions(manifest) else []),
        ("throughput", f"{computed_tokens / max(seconds, 1e-9):,.0f} tokens/s over {computed_tokens:,} tokens "
                       f"captured in this run ({seconds:.1f}s, {processes} process{'es' * (processes > 1)}"
                       f"{'; decoder layers compiled' if manifest['capture'].get('compiled') else ''})"
                       if computed_tokens else
                       "nothing captured in this run (every unit already finished, or every row rejected)"),
    ]))


def require_shared_output_dir(cfg: DictConfig, workers: Workers) -> None:
    """With several processes, output.dir must name one directory for all of them (and for the re-run that resumes).

    The default `outputs/generate-${now:...}` resolves to each process's own launch time, so it is refused rather
    than agreed on: a job that is meant to be resumed after a failure needs a directory the same command finds again.
    """
    raw = str(OmegaConf.to_container(cfg.output, resolve=False)["dir"])
    if workers.world_size > 1 and "${now:" in raw:
        raise SpecgenError(f"output.dir={raw} depends on each process's launch time, so the {workers.world_size} "
                           "processes would write to different directories; pass an explicit output.dir=DIR on a "
                           "filesystem every process sees (re-running the same command then resumes the job)")


def claim_for_job(cfg: DictConfig, out_dir: Path, identity: dict, workers: Workers) -> set[int]:
    """The main process claims output.dir and clears a killed run's leftovers; every process then returns the
    finished units. Also checks that every process was launched with the same dataset configuration."""
    problem = None
    if workers.is_main:
        try:
            if claim_output_dir(out_dir, identity, overwrite=cfg.output.overwrite):
                log.info("resuming in %s", out_dir)
            remove_partial(out_dir)
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
    done = set(finished_shards(out_dir))
    if done:
        log.info("%d shards already finished in %s", len(done), out_dir)
    return done


def run(cfg: DictConfig) -> dict | None:
    """Generate the dataset; returns the manifest on the main process and None on the others."""
    if not Path(cfg.model.path).is_dir():
        raise SpecgenError(f"model.path={cfg.model.path} is not a folder; point it at a local Hugging Face model "
                           "folder (config.json + weights)")
    resolve_device(cfg.runtime.device)  # a one-line error for a device that is not there
    set_threads(cfg.runtime.threads)
    workers = init_workers(cfg.runtime.device)
    require_shared_output_dir(cfg, workers)
    out_dir = Path(cfg.output.dir)
    # Before anything else touches output.dir: another live job on it is refused here, in one line.
    with hold_job_lease(out_dir, stage="generate", is_main=workers.is_main, broadcast=workers.broadcast,
                        stale_s=cfg.output.lease_stale_s) as lease:
        return generate_into(cfg, out_dir, workers, lease)


def generate_into(cfg: DictConfig, out_dir: Path, workers: Workers, lease) -> dict | None:
    """The job once its main process holds the lease on `out_dir` (`lease.check()` before each commit)."""
    device = workers.device
    tokenizer = load_tokenizer(cfg.tokenizer.path)
    chat = ChatTemplateTokenizer(tokenizer, max_length=cfg.data.max_length, train_turns=cfg.data.train_turns,
                                 mask_empty_think=cfg.data.mask_empty_think,
                                 chat_template_kwargs=to_container(cfg.data)["chat_template_kwargs"])
    dtype = resolve_model_dtype(cfg.model.dtype, device, cfg.model.path)
    cfg.model.dtype = dtype.name  # one concrete dtype for every loader (hf, deepspeed, vllm) and the manifest
    target = load_capture(cfg, tokenizer, device)
    identity = dataset_identity(cfg, config_hash(target.capture.model), chat_template_sha256(tokenizer), target)
    done = claim_for_job(cfg, out_dir, identity, workers)
    if cfg.capture.count_target_tokens and not counts_top_tokens(cfg, target):
        log.warning("capture.count_target_tokens: the target's LM head is not whole in this process (engine=%s), so "
                    "target_token_counts.json is not written; draft.vocab_source=target needs engine=hf",
                    cfg.engine.name)

    source = capped_source(cfg.data.path, cfg.data.max_rows, split=cfg.data.split, subset=cfg.data.subset)
    records = source.records
    monitor = JobMonitor(workers, source.expected_rows, enabled=cfg.runtime.progress,
                         heartbeat_s=cfg.pipeline.heartbeat_s)
    claims = UnitClaims(out_dir, workers.rank, workers.world_size)
    try:
        units = prefetched(owned_units(cfg, records, chat, workers, done, monitor, claims),
                           cfg.pipeline.prefetch_units)
        with closing(units), BackgroundWriter(out_dir, target.spec, depth=cfg.pipeline.write_queue,
                                              on_batch=lambda tokens: monitor.add(tokens=tokens),
                                              on_commit=lambda rows: monitor.add(rows=rows),
                                              writers=cfg.pipeline.writers) as writer:
            capture_units(cfg, units, target, writer, monitor, device, lease)
        job, seconds = monitor.finish()
    except BaseException as error:
        monitor.fail()
        if workers.world_size > 1 and not isinstance(error, PeerFailure):
            report_error(f"{type(error).__name__}: {error}")
        if workers.world_size > 1 and isinstance(error, SpecgenError):
            raise SpecgenError(f"process {workers.rank} of {workers.world_size}: {error}") from None
        raise
    if not workers.is_main:
        return None

    lease.check()
    manifest = build_manifest(cfg, out_dir, target, tokenizer, identity)
    manifest["last_run"] = {"computed_tokens": job.tokens, "seconds": seconds,
                            "tokens_per_second": job.tokens / max(seconds, 1e-9), "device": str(device),
                            "processes": workers.world_size, "engine": cfg.engine.name, "dtype": str(dtype),
                            "units_by_process": claims.by_process()}
    clear_claims(out_dir)
    merge_rejected(out_dir)
    write_manifest(out_dir, manifest)
    print_summary(manifest, out_dir, job.tokens, seconds, workers.world_size,
                  source.describe(manifest["stats"].get("source_rows", 0)))
    require_samples(manifest, out_dir)
    return manifest


def require_samples(manifest: dict, out_dir: Path) -> None:
    """A dataset without a single sample is a failed run (a one-line error), not an empty success: the manifest and
    rejected.jsonl stay on disk to say why."""
    stats = manifest["stats"]
    if stats.get("samples", 0) == 0:
        rejected = stats.get("rejected", {})
        reasons = ", ".join(f"{reason}: {count}" for reason, count in sorted(rejected.items())) or "none rejected"
        raise SpecgenError(f"no usable sample in {out_dir}: {sum(rejected.values())} rows rejected ({reasons}); "
                           f"see {out_dir / 'rejected.jsonl'} for each row and its reason")


main = stage_main("generate")(run)

if __name__ == "__main__":
    main()
