"""The EAGLE-3 checkpoint layout (eagle3, eagle3.1 and p-eagle drafts): read through `specgen.draft.exports`
(any of the vllm, sglang, specforge and speculators layouts), weights checked against the recorded checksums."""

from pathlib import Path

import torch
import transformers

from specgen.draft import exports
from specgen.draft.checkpoint import NOT_STORED, read_draft_config, read_raw_config
from specgen.draft.exports import WEIGHTS
from specgen.errors import SpecgenError
from specgen.methods.eagle3.model import Eagle3Draft
from specgen.store.commit import checksum_problems


def load_eagle_family(folder: Path, model_class: type, *, embedding: torch.Tensor | None,
                      target_config: transformers.PretrainedConfig | None, foreign_ids: str) -> Eagle3Draft:
    """An EAGLE-3 layout draft (eagle3, eagle3.1, p-eagle) as `model_class`, weights checked against checksums."""
    config = read_draft_config(folder, target_config=target_config, foreign_ids=foreign_ids)
    recorded = (read_raw_config(folder).get("specgen") or {}).get("checksums") or {}
    damaged = checksum_problems({WEIGHTS: folder / WEIGHTS}, recorded)
    if damaged:
        raise SpecgenError(f"{folder}: {damaged[0]}; restore the checkpoint from a copy or train it again")
    draft = model_class(config)
    state = exports.canonical_tensors(exports.read_tensors(folder), config)
    missing, unexpected = draft.load_state_dict(state, strict=False)
    missing = [name for name in missing if name not in NOT_STORED]
    if missing or unexpected:
        raise SpecgenError(f"{exports.weights_file(folder)} does not match its config: missing {missing}, "
                           f"unexpected {unexpected}; the checkpoint is damaged or has a layout specgen does not "
                           "implement")
    if embedding is not None:
        draft.set_embedding(embedding)
    return draft
