"""Offline capture: batches of tokenized samples through the target, rows out for the shard writer.

`capture_batches` runs length-bucketed right-padded batches, or with `Target.packing` the samples end to end in one
row (`capture_packed_batches`); `with_output_columns` gives rows captured elsewhere (the prefix-reuse runner) the
same stored columns. The work-unit loop around them is `specgen.capture.units`; the ZeRO-3 forward that keeps the
processes in lockstep is `specgen.capture.zero`; online capture (training, capture servers) is
`specgen.capture.online`.
"""

import logging
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from specgen.capture.outputs import SampleOutputs
from specgen.capture.packed import PackedSegments, PackingUnsupported
from specgen.capture.positions import position_chunks
from specgen.capture.target import CaptureOutput, TargetCapture
from specgen.data.batching import packed_batches, pad_right, token_budget_batches
from specgen.data.sample import TokenizedSample
from specgen.filters import SampleFilter
from specgen.pipeline import copy_to_host, to_device
from specgen.store.columns import ShardSpec

log = logging.getLogger("specgen.generate")


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


def token_rows(batch: list[TokenizedSample]) -> list[dict]:
    """A batch's rows before capture: the samples' token columns (and where each came from)."""
    return [{
        "sample_id": s.sample_id,
        "source_index": s.source_index,  # not a column: lets a filtered row be listed in rejected.jsonl
        "input_ids": s.input_ids,
        "loss_mask": s.loss_mask,
    } for s in batch]


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
        rows = token_rows(batch)
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
        rows = token_rows(batch)
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
