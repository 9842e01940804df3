"""Online capture: one batch of token ids through the target, nothing written to disk.

Training's online batches (`specgen.training.online.OnlineBatches`) and the disaggregated capture server
(`specgen.stream.server`) both capture this way, so a sample's rows are the same wherever the target runs.
"""

import torch

from specgen.capture.target import TargetCapture
from specgen.data.batching import pad_right


def capture_samples(capture: TargetCapture, input_ids: list[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """One batch through the target, right-padded, one forward: `aux` [tokens, aux width] and `last` [tokens, hidden]
    of its samples end to end, and their `lengths`, where the capture put them. The rows are copied out of the
    capture's (inference-mode) tensors into ordinary ones."""
    lengths = torch.tensor([len(ids) for ids in input_ids])
    out = capture(pad_right(input_ids, pad_id), lengths)
    rows = range(len(input_ids))
    return {"aux": torch.cat([out.aux_hidden_states[b, :lengths[b]] for b in rows]),
            "last": torch.cat([out.last_hidden_state[b, :lengths[b]] for b in rows]), "lengths": lengths}
