"""Drop captured samples by their per-sample statistics, listing every drop like a rejected row.

A sample whose trained tokens the target finds very unlikely (low `mean_logprob`) is text the target would not
generate: a draft trained to imitate the target learns little from it. `filter.min_mean_logprob` drops such
samples after capture; `filter.max_mean_logprob` drops the other end (boilerplate the target predicts almost
surely). Dropped samples are never silently lost: each becomes a `rejected.jsonl` entry (source row, sample id,
reason, its value) and is counted by reason in the shard's and the manifest's `rejected` statistics.
A sample with no trainable position has a NaN `mean_logprob` and is never dropped by these bounds.
"""

import math
from dataclasses import dataclass

from specgen.data.prepare import Rejection
from specgen.errors import SpecgenError


@dataclass(frozen=True)
class SampleFilter:
    """The `filter.*` settings (values as configured) and the code that applies them; no Hydra needed."""

    min_mean_logprob: float | None = None
    max_mean_logprob: float | None = None

    def check(self, token_logprobs: bool) -> "SampleFilter":
        """This filter, refused in one line when it has a bound but `capture.token_logprobs` (which computes
        `mean_logprob`) is off."""
        if self.active and not token_logprobs:
            raise SpecgenError("filter.min_mean_logprob / filter.max_mean_logprob need the per-sample mean log-prob: "
                               "add capture.token_logprobs=true")
        return self

    @property
    def active(self) -> bool:
        return self.min_mean_logprob is not None or self.max_mean_logprob is not None

    def describe(self) -> dict:
        return {"min_mean_logprob": self.min_mean_logprob, "max_mean_logprob": self.max_mean_logprob}

    def apply(self, rows: list[dict], stats: dict) -> tuple[list[dict], list[dict]]:
        """(rows kept, rejected.jsonl entries of the rows dropped); rows carry `source_index` and `mean_logprob`.

        A dropped row leaves the shard's `samples`, `tokens` and `trainable_tokens` counts and is added to
        `filtered_samples` / `filtered_tokens` (captured, so the compute was spent, but not stored).
        """
        if not self.active:
            return rows, []
        kept, rejections = [], []
        for row in rows:
            reason = self._reason(float(row["mean_logprob"]))
            if reason is None:
                kept.append(row)
                continue
            rejections.append(Rejection(row["source_index"], row["sample_id"], *reason).to_json())
            stats["samples"] -= 1
            stats["tokens"] -= len(row["input_ids"])
            stats["trainable_tokens"] -= sum(row["loss_mask"])
            stats["filtered_samples"] = stats.get("filtered_samples", 0) + 1
            stats["filtered_tokens"] = stats.get("filtered_tokens", 0) + len(row["input_ids"])
        return kept, rejections

    def _reason(self, value: float) -> tuple[str, str] | None:
        if math.isnan(value):
            return None
        if self.min_mean_logprob is not None and value < self.min_mean_logprob:
            return ("mean_logprob_below_min", f"mean log-prob {value:.4f} of the trained tokens is below "
                    f"filter.min_mean_logprob={self.min_mean_logprob}")
        if self.max_mean_logprob is not None and value > self.max_mean_logprob:
            return ("mean_logprob_above_max", f"mean log-prob {value:.4f} of the trained tokens is above "
                    f"filter.max_mean_logprob={self.max_mean_logprob}")
        return None
