"""DFlash checkpoints: the layout vLLM 0.32's `method="dflash"` reads (written by `specgen.draft.checkpoint.save_draft`
through `DFlashMethod.export`, read by `load_dflash`; the decode is `specgen.methods.dflash.method.DFlashProposer`).

    CKPT/config.json        Qwen3Config of the draft: model_type qwen3, architectures ["DFlashDraftModel"],
                            num_hidden_layers (draft layers), vocab_size (target), draft_vocab_size, target_hidden_size,
                            block_size (training), dflash_config {mask_token_id, target_layer_ids (= specgen aux
                            layers, 0-based layer outputs), causal}, dtype; plus a "specgen" section (method dflash,
                            aux_layers, target, step, the weights' sha256) that loaders ignore
    CKPT/model.safetensors  fc.weight, hidden_norm.weight, layers.{i}.{input_layernorm, self_attn.{q,k,v,o}_proj,
                            self_attn.{q,k}_norm, post_attention_layernorm, mlp.{gate,up,down}_proj}.weight,
                            norm.weight, lm_head.weight [draft_vocab, H], d2t (only when draft_vocab < vocab: vLLM
                            builds draft_id_to_target_id only then), t2d (vLLM skips it)

No embed_tokens: vLLM then shares the target's embedding (`_maybe_share_embeddings`), which is what the draft was
trained with (the mask slots embed `mask_token_id` with it). lm_head is always stored (it covers the draft
vocabulary; with the full vocabulary and a frozen target head it equals the target's and vLLM shares it).
"""

import json
from pathlib import Path

import torch
import transformers

from specgen import methods
from specgen.draft import exports
from specgen.draft.aux import aux_layers_of
from specgen.draft.checkpoint import NOT_STORED
from specgen.errors import SpecgenError
from specgen.methods.dflash.model import METHOD, DFlashDraft
from specgen.store.commit import checksum_problems


def config_dict(config: transformers.Qwen3Config, dtype: str, info: dict | None = None) -> dict:
    """config.json content: the Qwen3 config with the DFlash fields, the weights' dtype and the specgen section."""
    data = config.to_dict()
    data.pop("specgen", None)
    data.pop("torch_dtype", None)
    data["dtype"] = dtype
    rope = dict(data.get("rope_parameters") or {})
    if "rope_theta" in rope:
        data["rope_theta"] = rope["rope_theta"]
    section = {**(info or {}), "method": METHOD, "aux_layers": aux_layers_of(config),
               "aux_layer_convention": exports.AUX_LAYER_CONVENTION,
               "target_layer_ids": "dflash_config.target_layer_ids = 0-based decoder-layer outputs (= aux_layers); "
                                   "vLLM reads them as eagle aux ids + 1"}
    return {**data, "specgen": section}


def read_config(path: str | Path) -> transformers.Qwen3Config:
    folder = Path(path)
    raw = json.loads((folder / exports.CONFIG).read_text())
    if methods.method_of_config(raw) != METHOD:
        raise SpecgenError(f"{folder} is not a DFlash draft (architectures {raw.get('architectures')})")
    raw = {k: v for k, v in raw.items() if k not in ("transformers_version",)}
    config = transformers.Qwen3Config(**{k: v for k, v in raw.items() if k != "specgen"})
    config.specgen = raw.get("specgen") or {}
    return config


def load_dflash(path: str | Path, embedding: torch.Tensor | None = None) -> DFlashDraft:
    """A DFlash checkpoint (as `save_draft` writes it through `DFlashMethod.export`); `embedding` is the target's
    input embedding."""
    folder = Path(path)
    config = read_config(folder)
    damaged = checksum_problems({exports.WEIGHTS: folder / exports.WEIGHTS},
                                (config.specgen or {}).get("checksums") or {})
    if damaged:
        raise SpecgenError(f"{folder}: {damaged[0]}; restore the checkpoint from a copy or train it again")
    draft = DFlashDraft(config)
    state = {name: t.float() if t.is_floating_point() else t for name, t in exports.read_tensors(folder).items()}
    if "d2t" not in state:
        state["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.long)
    state.setdefault("t2d", _t2d(state["d2t"], config.vocab_size))
    missing, unexpected = draft.load_state_dict(state, strict=False)
    missing = [name for name in missing if name not in NOT_STORED]
    if missing or unexpected:
        raise SpecgenError(f"{folder / exports.WEIGHTS} does not match its DFlash config: missing {missing}, "
                           f"unexpected {unexpected}")
    if embedding is not None:
        draft.set_embedding(embedding)
    return draft


def _t2d(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[torch.arange(len(d2t)) + d2t] = True
    return t2d
