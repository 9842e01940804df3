"""Draft checkpoints in the layout vLLM's and SGLang's EAGLE-3 Llama loaders read.

    CKPT/config.json         LlamaConfig of the draft: architectures ["LlamaForCausalLMEagle3"], num_hidden_layers 1,
                             vocab_size (target), draft_vocab_size, target_hidden_size,
                             eagle_config.eagle_aux_hidden_state_layer_ids, plus a "specgen" section (target
                             path and config hash, aux layer convention, training step, the weights' sha256
                             in `checksums`, checked by load_draft) that loaders ignore
    CKPT/model.safetensors   fc.weight, midlayer.*, norm.weight, lm_head.weight, d2t (int64), t2d (bool)
    CKPT/training_state/     optimizer, scheduler and data position, to resume training exactly

The token embedding is the target's and is not stored (as in the published EAGLE-3 drafts): both serving
engines, and `load_draft` here, take it from the target. Weights are stored in the training dtype (float32 master
weights) so resuming is exact; `config.json` names the target's dtype for serving.
"""

import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file

from specgen.draft.model import Eagle3Draft
from specgen.errors import SpecgenError
from specgen.store.commit import atomic_write, checksum_problems, content_hash

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
TRAINING_STATE = "training_state"
_NOT_STORED = ("embed_tokens.weight",)


_write_atomic = atomic_write  # write(tmp) produces the file; fsync'd and renamed into place


def serving_config(config: transformers.LlamaConfig, specgen_info: dict) -> dict:
    """config.json content: the draft config plus the legacy rope keys older loaders read."""
    data = config.to_dict()
    rope = dict(data.get("rope_parameters") or {})
    if "rope_theta" in rope:
        data["rope_theta"] = rope["rope_theta"]
    if rope.get("rope_type", "default") != "default":
        data["rope_scaling"] = {key: value for key, value in rope.items() if key != "rope_theta"}
    data["specgen"] = specgen_info
    return data


def save_draft(draft: Eagle3Draft, out_dir: str | Path, specgen_info: dict) -> None:
    """Write config.json and model.safetensors (each atomically: a reader never sees a half-written file)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in draft.state_dict().items()
               if name not in _NOT_STORED}
    _write_atomic(out_dir / WEIGHTS, lambda path: save_file(tensors, str(path), metadata={"format": "pt"}))
    checksums = {WEIGHTS: content_hash(out_dir / WEIGHTS)}  # checked by load_draft
    config = serving_config(draft.config, {**specgen_info, "checksums": checksums})
    _write_atomic(out_dir / CONFIG, lambda path: path.write_text(json.dumps(config, indent=2)))


def read_draft_config(path: str | Path) -> transformers.LlamaConfig:
    folder = Path(path)
    if not (folder / CONFIG).is_file() or not (folder / WEIGHTS).is_file():
        raise SpecgenError(f"draft.path {str(path)!r} is not a draft checkpoint (needs {CONFIG} and {WEIGHTS}); "
                           "point it at the output.dir of specgen.train")
    config = transformers.LlamaConfig.from_dict(json.loads((folder / CONFIG).read_text()))
    if not _is_eagle3_config(config):
        raise SpecgenError(f"{folder / CONFIG} does not describe an EAGLE-3 draft (no draft_vocab_size / "
                           "eagle_config); point draft.path at a checkpoint written by specgen.train")
    return config


def _is_eagle3_config(config: transformers.PretrainedConfig) -> bool:
    return getattr(config, "draft_vocab_size", None) is not None and getattr(config, "eagle_config", None) is not None


def load_draft(path: str | Path, embedding: torch.Tensor | None = None) -> Eagle3Draft:
    """Load a draft checkpoint; `embedding` is the target's input embedding (not stored in the checkpoint)."""
    folder = Path(path)
    config = read_draft_config(folder)
    damaged = checksum_problems({WEIGHTS: folder / WEIGHTS}, specgen_info(config).get("checksums") or {})
    if damaged:
        raise SpecgenError(f"{folder}: {damaged[0]}; restore the checkpoint from a copy or train it again")
    draft = Eagle3Draft(config)
    state = load_file(str(folder / WEIGHTS))
    missing, unexpected = draft.load_state_dict(state, strict=False)
    missing = [name for name in missing if name not in _NOT_STORED]
    if missing or unexpected:
        raise SpecgenError(f"{folder / WEIGHTS} does not match its config: missing {missing}, unexpected "
                           f"{unexpected}; the checkpoint is damaged or from another tool")
    if embedding is not None:
        set_embedding(draft, embedding)
    return draft


def set_embedding(draft: Eagle3Draft, embedding: torch.Tensor) -> None:
    """Copy the target's input embedding into the draft (its frozen token embedding)."""
    expected = tuple(draft.embed_tokens.weight.shape)
    if tuple(embedding.shape) != expected:
        raise SpecgenError(f"the target's embedding is {tuple(embedding.shape)} but the draft expects {expected}: "
                           "the draft was trained for another target")
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(embedding)


def specgen_info(config: transformers.PretrainedConfig) -> dict:
    return dict(getattr(config, "specgen", None) or {})
