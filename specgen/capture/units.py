"""Work units -> shards: each unit's samples captured batch by batch (`specgen.capture.offline`) and handed to the
shard writer (`specgen.pipeline.BackgroundWriter`), one shard per unit, committed with the unit's stats.

Where rows share prefixes, the plan (`specgen.data.prefixes`) either continues them from their KV cache
(`capture.prefix_reuse`) or stores them once (`output.store_prefix_once`), or both.
"""

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from omegaconf import DictConfig

from specgen.capture.offline import Target, capture_batches, with_output_columns
from specgen.capture.reuse import capture_with_prefix_reuse, reuse_pays
from specgen.capture.zero import ZeroCapture
from specgen.data.prefixes import plan_prefixes
from specgen.data.prepare import prepare_rows
from specgen.data.sample import TokenizedSample
from specgen.data.sources import SOURCE_DIGEST, SourceRecord, rows_digest
from specgen.data.template import ChatTemplateTokenizer
from specgen.pipeline import BackgroundWriter
from specgen.ranks.monitor import JobMonitor
from specgen.store.prefix_layout import PrefixRefEncoder

TARGET_TOP = "target_top_tokens"  # the sidecar entry holding one shard's share of TARGET_TOKEN_COUNTS


@dataclass
class PreparedUnit:
    """One work unit, tokenized: what its shard will hold and the stats of its sidecar."""

    index: int
    source_rows: int
    source_digest: str  # rows_digest of its source rows, kept in the sidecar
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
    return PreparedUnit(unit, len(records), rows_digest(records), samples, rejected, stats)


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
        extra = {SOURCE_DIGEST: unit.source_digest}
        if top_counts is not None:  # one device sync per unit
            top_counts = top_counts.cpu()
            extra[TARGET_TOP] = {str(int(i)): int(top_counts[i]) for i in top_counts.nonzero().flatten()}
        writer.commit(stats, unit.rejected, unit.source_rows, extra)
        monitor.check()
    if isinstance(target.capture, ZeroCapture):
        target.capture.drain()


def counts_top_tokens(cfg: DictConfig, target: Target) -> bool:
    """capture.count_target_tokens, where the LM head is whole on this process (not under ZeRO-3, not inside a vLLM
    engine, whose weights this process does not hold)."""
    return (bool(cfg.capture.count_target_tokens) and not isinstance(target.capture, ZeroCapture)
            and not target.capture.lm_head.weight.is_meta)
