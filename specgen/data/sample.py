"""The unit that flows from the data stage to capture: one tokenized, loss-masked sample."""

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenizedSample:
    """One training row.

    `sample_id` is the source row's `id` when it has one, else `row-<index>`; rows expanded per
    assistant turn append `#<turn>` (0-based ordinal among the assistant turns).
    `loss_mask[t]` is 1 where token t is an assistant token the draft is trained to predict.
    """

    sample_id: str
    source_index: int
    input_ids: list[int]
    loss_mask: list[int]

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_trainable(self) -> int:
        return sum(self.loss_mask)
