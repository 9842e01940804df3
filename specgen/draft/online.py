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
from specgen.data.batching import pad_right
from specgen.data.prepare import prepare_rows
from specgen.data.sample import TokenizedSample
from specgen.data.sources import iter_records
from specgen.data.template import ChatTemplateTokenizer
from specgen.draft.batches import BatchPlan
from specgen.draft.ttt import DraftBatch
from specgen.errors import SpecgenError

log = logging.getLogger("specgen.draft")


def tokenize_source(path: str, chat: ChatTemplateTokenizer, *, max_rows: int | None = None,
                    on_bad_row: str = "skip") -> list[TokenizedSample]:
    """All samples of a conversation file, tokenized and loss-masked; bad rows are skipped and counted."""
    samples, rejected = [], Counter()
    for index, row in enumerate(prepare_rows(iter_records(path), chat, on_bad_row=on_bad_row)):
        if max_rows is not None and index >= max_rows:
            break
        samples.extend(row.samples)
        rejected.update(rejection.reason for rejection in row.rejections)
    if rejected:
        log.warning("skipped %d rows of %s (%s)", sum(rejected.values()), path,
                    ", ".join(f"{reason}: {count}" for reason, count in sorted(rejected.items())))
    if not samples:
        raise SpecgenError(f"data.path {path} gave no trainable sample; check its format and data.max_length")
    return samples


class OnlineBatches:
    """Length-bucketed batches of tokenized samples, each captured by the target when it is needed."""

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
        lengths = torch.tensor([len(sample) for sample in samples])
        input_ids = pad_right([sample.input_ids for sample in samples], self.pad_id)
        loss_mask = pad_right([sample.loss_mask for sample in samples], 0)
        out = self.capture(input_ids, lengths)
        # The capture runs in inference mode; its tensors must become ordinary ones before autograd sees them.
        # Padding positions hold unspecified values: zero them, as the offline collate does.
        valid = (torch.arange(input_ids.shape[1]) < lengths[:, None]).to(out.aux_hidden_states.device)[..., None]
        aux = torch.where(valid, out.aux_hidden_states, 0)
        last = torch.where(valid, out.last_hidden_state, 0)
        return DraftBatch(input_ids, loss_mask, aux, last, lengths)
