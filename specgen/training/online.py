"""Online batches: the target runs inside the training loop, nothing is written to disk.

Conversations go through the same data stage as `specgen.generate` (formats, chat template, loss mask) and the
same capture backend, so an online step sees bit-for-bit the tensors an offline step would read from shards made
of the same samples. Tokenizing happens once up front (token ids only, no model forward): it yields the sample
lengths the batch plan needs and the token counts the draft vocabulary is built from.
"""

import logging
from collections import Counter
from collections.abc import Iterator

import torch

from specgen.capture import TargetCapture
from specgen.capture.online import capture_samples
from specgen.data.prepare import prepare_rows
from specgen.data.sample import TokenizedSample
from specgen.data.sources import capped_source
from specgen.data.template import ChatTemplateTokenizer
from specgen.draft.batch import DraftBatch, collate
from specgen.errors import SpecgenError
from specgen.training.plan import BatchPlan

log = logging.getLogger("specgen.draft")


def tokenize_source(path, chat: ChatTemplateTokenizer, *, max_rows: int | None = None,
                    on_bad_row: str = "skip", split: str = "train", subset: str | None = None) -> list[TokenizedSample]:
    """All samples of a conversation file (or hub dataset split, or a list of them: data.path), the first `max_rows`
    rows of each, tokenized and loss-masked; bad rows are skipped and counted."""
    samples, rejected = [], Counter()
    records = capped_source(path, max_rows, split=split, subset=subset).records
    for row in prepare_rows(records, chat, on_bad_row=on_bad_row):
        samples.extend(row.samples)
        rejected.update(rejection.reason for rejection in row.rejections)
    if rejected:
        log.warning("skipped %d rows of %s (%s)", sum(rejected.values()), path,
                    ", ".join(f"{reason}: {count}" for reason, count in sorted(rejected.items())))
    if not samples:
        raise SpecgenError(f"data.path {path} gave no trainable sample; check its format and data.max_length")
    return samples


class OnlineBatches:
    """Batches of tokenized samples (padded or packed, per the plan), each captured by the target when needed."""

    def __init__(self, samples: list[TokenizedSample], capture: TargetCapture, plan: BatchPlan, *, pad_id: int = 0):
        self.samples = samples
        self.capture = capture
        self.plan = plan
        self.pad_id = pad_id
        self.lengths = [len(sample) for sample in samples]

    def batches_per_epoch(self) -> int:
        return len(self.plan.epoch(self.lengths, 0))

    def epoch(self, epoch: int, skip: int = 0) -> Iterator[DraftBatch]:
        for indices in self.plan.epoch(self.lengths, epoch)[skip:]:
            yield self.capture_batch([self.samples[i] for i in indices])

    def capture_batch(self, samples: list[TokenizedSample]) -> DraftBatch:
        captured = capture_samples(self.capture, [sample.input_ids for sample in samples], self.pad_id)
        return collate_captured(samples, captured, self.pad_id, packed=self.plan.packing)


def collate_captured(samples: list[TokenizedSample], captured: dict[str, torch.Tensor], pad_id: int,
                     packed: bool) -> DraftBatch:
    """`capture_samples`' rows beside the samples' ids and masks, laid out as the offline collate lays out shard rows
    (padded or packed)."""
    lengths = captured["lengths"].tolist()
    aux, last = captured["aux"].split(lengths), captured["last"].split(lengths)
    rows = [{"input_ids": sample.input_ids, "loss_mask": sample.loss_mask, "aux_hidden_states": aux[k],
             "last_hidden_state": last[k]} for k, sample in enumerate(samples)]
    return collate(rows, pad_id, packed=packed)
