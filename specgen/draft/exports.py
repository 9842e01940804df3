"""Draft checkpoint formats at the boundary with serving engines and other trainers: export and import.

specgen's own convention, everywhere inside specgen (capture.aux_layers, the shards' manifest, the "specgen" section
of a draft's config.json): aux layer i is the output of decoder layer i, 0-based (Hugging Face hidden_states[i + 1]).
What each tool means by `eagle_aux_hidden_state_layer_ids`, read from its code:

    tool (version read)    where the ids are                         an id k means             specgen aux i
    vLLM 0.32              eagle_config.* (or top level)             hidden_states[k] (input   k = i + 1
                           (llama.py `_maybe_add_hidden_state`)      of layer k)
    speculators 0.9        top level (range [0, num_layers])         hidden_states[k]          k = i + 1
    SGLang 0.5.23          eagle_config.* (llama.py                  output of layer k         k = i
                           `set_eagle3_layers_to_capture` adds 1)
    SpecForge 0.2.0        eagle_config.* (captures via SGLang);     output of layer k         k = i
                           absent: [1, n//2 - 1, n - 4]
    EAGLE-3 (published)    absent; EAGLE's code captures the inputs of layers [2, n//2, n - 3] = outputs [1, n//2 - 1, n - 4]

One file cannot serve vLLM and SGLang as trained, hence the formats (`FORMATS`):
    vllm         what specgen.train writes: LlamaForCausalLMEagle3, eagle_config ids = aux + 1
    sglang       the same files with eagle_config ids = aux (SGLang adds 1 itself); not for vLLM
    specforge    the sglang layout for SpecForge's loader, which hard-codes 3 aux layers
    speculators  the speculators_config layout (weights `layers.0.*`) that `vllm serve DIR` loads with no method
                 flag; top-level ids = aux + 1; speculators_config.verifier names the target
Every format records the aux layers unambiguously in its "specgen" section (`specgen_section`).

Import (`canonical_config`, `canonical_tensors`) turns any of these, and SpecForge's and the published EAGLE-3
checkpoints, into the in-memory form `specgen.methods.eagle3.model` uses (the vllm format). A field that would change the
forward in a way specgen does not implement is a one-line `SpecgenError`, never ignored.
"""

import json
import logging
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file

from specgen.draft.aux import aux_layers_of, serving_layer_ids
from specgen.errors import SpecgenError
from specgen.store.commit import atomic_write, content_hash, write_json_atomic

log = logging.getLogger("specgen.draft.exports")

FORMATS = ("vllm", "sglang", "specforge", "speculators")
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
ARCHITECTURE = "LlamaForCausalLMEagle3"  # the EAGLE-3 draft class vLLM and SGLang register
LEGACY_WEIGHTS = "pytorch_model.bin"  # the published EAGLE-3 drafts
AUX_LAYER_CONVENTION = "layer_outputs_0based"  # aux layer i = output of decoder layer i = HF hidden_states[i + 1]
ID_MEANING = {  # what the format's eagle_aux_hidden_state_layer_ids hold, recorded next to them
    "vllm": "hidden_states_index (= aux_layers + 1): vLLM and speculators read the input of layer k",
    "sglang": "layer_outputs_0based (= aux_layers): SGLang adds 1 itself; vLLM would read them one layer early",
    "specforge": "layer_outputs_0based (= aux_layers): SpecForge captures through SGLang",
    "speculators": "hidden_states_index (= aux_layers + 1), top-level eagle_aux_hidden_state_layer_ids",
}
FOREIGN_IDS = ("layer_outputs", "hidden_states")  # how to read the ids of a plain checkpoint specgen did not write
_DROPPED = ("embed_tokens.weight", "verifier_norm.weight", "verifier_lm_head.weight")  # the target's, not stored
_SPECULATORS_VERSION = "0.9.0"  # the speculators release whose config layout the export follows


VLLM_METHODS = {"eagle3": "eagle3", "eagle3.1": "eagle3", "p-eagle": "eagle3", "dflash": "dflash"}  # -> vLLM's method


def trained_draft_tokens(method: str, config: transformers.PretrainedConfig, ttt_length: int) -> int:
    """How many draft positions a draft was trained to propose: DFlash's `dflash_block_positions`, every other
    method its TTT chain (train.ttt_length)."""
    return dflash_block_positions(config) if method == "dflash" else int(ttt_length)


def dflash_block_positions(config: transformers.PretrainedConfig) -> int:
    """The draft positions a DFlash draft trained: its block less the bonus slot (block_size - 1). Asked for more
    drafts per round, it runs blocks longer than any it trained (vLLM allows it; on SmolLM2 block 4 accepted less at
    K=5/7 than at K=3)."""
    return int(config.block_size) - 1


def vllm_speculative_config(method: str, path: str | Path, num_speculative_tokens: int) -> dict:
    """The `speculative_config` with which vLLM 0.32 serves a draft of `method` as specgen.train wrote it (the vllm
    format): `LLM(model=TARGET, speculative_config=...)`, or `vllm serve TARGET --speculative-config JSON`."""
    if method not in VLLM_METHODS:
        raise SpecgenError(f"no vLLM method for draft.method={method!r}; known: {list(VLLM_METHODS)}")
    spec = {"method": VLLM_METHODS[method], "model": str(path), "num_speculative_tokens": int(num_speculative_tokens)}
    if method == "p-eagle":
        spec["parallel_drafting"] = True
    return spec


# ---------------------------------------------------------------- files

def write_files(out_dir: str | Path, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    """config.json and model.safetensors, each written atomically (a reader never sees a half-written file); the
    weights' sha256 goes into config.json's `specgen.checksums` (checked by `load_draft`) when it has that section."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in tensors.items()}
    atomic_write(out_dir / WEIGHTS, lambda path: save_file(tensors, str(path), metadata={"format": "pt"}))
    if isinstance(config.get("specgen"), dict):
        config = {**config, "specgen": {**config["specgen"], "checksums": {WEIGHTS: content_hash(out_dir / WEIGHTS)}}}
    write_json_atomic(out_dir / CONFIG, config)


def weights_file(folder: Path) -> Path | None:
    for name in (WEIGHTS, LEGACY_WEIGHTS):
        if (folder / name).is_file():
            return folder / name
    return None


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    path = weights_file(folder)
    if path.name == WEIGHTS:
        return load_file(str(path))
    return torch.load(path, map_location="cpu", weights_only=True)


def stored_dtype(tensors: dict[str, torch.Tensor]) -> str:
    """The dtype of the floating-point weights, as config.json names it ("float32", "bfloat16", ...)."""
    dtypes = {tensor.dtype for tensor in tensors.values() if tensor.is_floating_point()}
    if len(dtypes) != 1:
        raise SpecgenError(f"the draft's weights mix dtypes {sorted(map(str, dtypes))}; cast them to one dtype")
    return str(dtypes.pop()).removeprefix("torch.")


# ---------------------------------------------------------------- export

def specgen_section(config: transformers.PretrainedConfig, fmt: str, info: dict | None = None) -> dict:
    """The "specgen" section: aux layers in specgen's convention, and what this format's ids mean."""
    return {**(info or {}), "aux_layers": aux_layers_of(config), "aux_layer_convention": AUX_LAYER_CONVENTION,
            "format": fmt, "eagle_aux_hidden_state_layer_ids": ID_MEANING[fmt]}


def llama_config_dict(config: transformers.PretrainedConfig, dtype: str) -> dict:
    """The draft's LlamaConfig as JSON, with the legacy rope keys older loaders read and the weights' dtype."""
    data = config.to_dict()
    data.pop("specgen", None)
    rope = dict(data.get("rope_parameters") or {})
    if "rope_theta" in rope:
        data["rope_theta"] = rope["rope_theta"]
    if rope.get("rope_type", "default") != "default":
        data["rope_scaling"] = {key: value for key, value in rope.items() if key != "rope_theta"}
    data["dtype"] = dtype
    data.pop("torch_dtype", None)
    data["norm_before_residual"] = bool(getattr(config, "norm_before_residual", False))
    return data


def export_files(config: transformers.PretrainedConfig, tensors: dict[str, torch.Tensor], fmt: str, *,
                 info: dict | None = None, speculative_tokens: int = 3,
                 verifier: str | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json content, tensors) of a draft in format `fmt`; `config` and `tensors` are in specgen's form."""
    if fmt not in FORMATS:
        raise SpecgenError(f"export.format={fmt!r} is unknown; use one of {list(FORMATS)}")
    _check_exportable(config, fmt)
    tensors = {name: tensor for name, tensor in tensors.items() if name not in _DROPPED}
    dtype = stored_dtype(tensors)
    layer = llama_config_dict(config, dtype)
    section = specgen_section(config, fmt, info)
    if fmt == "speculators":
        return _speculators_config(config, layer, section, speculative_tokens, verifier), {
            name.replace("midlayer.", "layers.0.", 1): tensor for name, tensor in tensors.items()}
    layer["architectures"] = [ARCHITECTURE]
    if fmt in ("sglang", "specforge"):
        layer["eagle_config"] = {**layer["eagle_config"], "eagle_aux_hidden_state_layer_ids": aux_layers_of(config)}
    return {**layer, "specgen": section}, dict(tensors)


def _check_exportable(config: transformers.PretrainedConfig, fmt: str) -> None:
    k = len(aux_layers_of(config))
    before = bool(getattr(config, "norm_before_residual", False))
    if fmt == "specforge" and k != 3:
        raise SpecgenError(f"the draft reads {k} aux layers but SpecForge's LlamaForCausalLMEagle3 hard-codes 3 "
                           "(fc = 3 x hidden); export it as sglang or vllm, or train with 3 capture.aux_layers")
    if fmt in ("sglang", "specforge") and getattr(config, "parallel_drafting", False):
        raise SpecgenError(f"the draft is a P-EAGLE (parallel drafting) draft, which the {fmt} EAGLE-3 layout does "
                           "not carry; export it as vllm or speculators")
    if fmt == "speculators" and getattr(config, "parallel_drafting", False) and getattr(config, "fc_norm", False):
        raise SpecgenError("vLLM 0.32 reads a speculators P-EAGLE config without fc_norm (update_peagle drops it); "
                           "export this P-EAGLE draft with fc_norm as vllm")
    if fmt == "speculators" and getattr(config, "fc_norm", False) and getattr(config, "norm_before_fc", False):
        raise SpecgenError("speculators 0.9 refuses fc_norm together with norm_before_fc (vLLM runs both); export "
                           "this draft as vllm, or train it with one of draft.fc_norm / draft.norm_before_fc")
    flags = [flag for flag in EAGLE31_FLAGS if getattr(config, flag, False)]
    if fmt in ("sglang", "specforge") and flags:
        raise SpecgenError(f"the draft uses EAGLE-3.1's {', '.join(flags)}, which the {fmt} layout does not carry as "
                           "vLLM reads it (SpecForge's norm_output means the opposite); export it as vllm or "
                           "speculators")
    if fmt in ("sglang", "specforge") and before:
        raise SpecgenError(f"the draft uses norm_before_residual, which the {fmt} EAGLE-3 Llama loader does not "
                           "implement (it would serve other logits); export it as vllm or speculators")
    if fmt == "speculators" and config.target_hidden_size != config.hidden_size:
        raise SpecgenError("speculators sizes fc from the draft's hidden_size, but this draft's target_hidden_size "
                           f"{config.target_hidden_size} differs from hidden_size {config.hidden_size}")


def _speculators_config(config, layer: dict, section: dict, speculative_tokens: int, verifier: str | None) -> dict:
    """speculators' Eagle3SpeculatorConfig as JSON (what vLLM's `maybe_override_with_speculators` reads)."""
    if verifier is None:
        raise SpecgenError("the speculators format names the target (verifier): the draft records none, pass "
                           "model.path=TARGET")
    for key in ("architectures", "eagle_config", "draft_vocab_size", "target_hidden_size", "norm_before_residual",
                "specgen", "mask_token_id", "parallel_drafting", *EAGLE31_FLAGS):
        layer.pop(key, None)
    layer["model_type"] = "llama"
    verifier_config = json.loads((Path(verifier) / CONFIG).read_text()) if (Path(verifier) / CONFIG).is_file() else {}
    if getattr(config, "parallel_drafting", False):  # speculators' PEagleSpeculatorConfig; vLLM serves it as
        algorithm, extra = "peagle", {"mask_token_id": int(config.mask_token_id)}  # eagle3 + parallel_drafting
    else:
        algorithm, extra = "eagle3", {}
    return {
        "architectures": ["PEagleSpeculator" if algorithm == "peagle" else "Eagle3Speculator"],
        "speculators_model_type": algorithm,
        "speculators_version": _SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": algorithm,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": str(verifier),
                         "architectures": verifier_config.get("architectures") or ["LlamaForCausalLM"]},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": int(config.draft_vocab_size),
        "target_hidden_size": int(config.target_hidden_size),
        "eagle_aux_hidden_state_layer_ids": serving_layer_ids(aux_layers_of(config)),
        "norm_before_residual": bool(getattr(config, "norm_before_residual", False)),
        **{flag: bool(getattr(config, flag, False)) for flag in EAGLE31_FLAGS},
        "embed_requires_grad": False,
        **extra,
        "dtype": layer["dtype"],
        "specgen": section,
    }


# ---------------------------------------------------------------- import

def canonical_config(raw: dict, *, source: str, target_num_layers: int | None = None,
                     foreign_ids: str = "layer_outputs") -> transformers.LlamaConfig:
    """specgen's draft config from the config.json of any supported layout (module docstring).

    `target_num_layers` resolves the default aux layers of drafts that record none (SpecForge, published EAGLE-3);
    `foreign_ids` says how to read the ids of a plain EAGLE-3 checkpoint specgen did not write ("layer_outputs":
    SGLang / SpecForge, the default; "hidden_states": vLLM). `source` names the file in error messages.
    """
    if foreign_ids not in FOREIGN_IDS:
        raise SpecgenError(f"draft.foreign_aux_ids={foreign_ids!r}; use one of {list(FOREIGN_IDS)}")
    if "speculators_config" in raw or "speculators_model_type" in raw:
        return _from_speculators(raw, source, target_num_layers)
    return _from_plain(raw, source, target_num_layers, foreign_ids)


def _from_plain(raw: dict, source: str, target_num_layers: int | None, foreign_ids: str) -> transformers.LlamaConfig:
    architectures = raw.get("architectures") or []
    if not any("Eagle3" in name and "Llama" in name for name in architectures):
        raise SpecgenError(f"{source} describes {architectures or 'no architecture'}, not an EAGLE-3 Llama draft "
                           "(LlamaForCausalLMEagle3); point draft.path at an EAGLE-3 draft checkpoint")
    section = raw.get("specgen") or {}
    # specgen writes norm_output as vLLM reads it (EAGLE-3.1); a plain config from elsewhere is SpecForge's.
    means = "vllm" if section else "specforge"
    _check_forward(raw, source, norm_output_means=means)
    ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = raw.get("eagle_aux_hidden_state_layer_ids")
    if section.get("aux_layers") is not None:
        aux = _specgen_aux(section, ids, source)
    elif ids is not None:
        aux = [int(i) - 1 for i in ids] if foreign_ids == "hidden_states" else [int(i) for i in ids]
        log.info("%s: reading eagle_aux_hidden_state_layer_ids %s as %s (draft.foreign_aux_ids): aux layers %s",
                 source, ids, foreign_ids, aux)
    else:
        aux = _default_aux(source, target_num_layers)
    fields = {key: value for key, value in raw.items()
              if key not in ("eagle_config", "eagle_aux_hidden_state_layer_ids", "specgen", "architectures")}
    if means == "specforge":
        fields.pop("norm_output", None)
    if (raw.get("eagle_config") or {}).get("norm_before_fc") is not None:  # vLLM reads it there first
        fields["norm_before_fc"] = raw["eagle_config"]["norm_before_fc"]
    return _finish(fields, aux, section, source)


def _from_speculators(raw: dict, source: str, target_num_layers: int | None) -> transformers.LlamaConfig:
    if raw.get("speculators_model_type") not in ("eagle3", "peagle"):
        raise SpecgenError(f"{source} is a speculators {raw.get('speculators_model_type')!r} model; specgen reads "
                           "eagle3 and peagle speculators only")
    layer = dict(raw.get("transformer_layer_config") or {})
    if layer.get("model_type", "llama") != "llama":
        raise SpecgenError(f"{source}: the draft layer is {layer.get('model_type')!r}; specgen implements the "
                           "Llama EAGLE-3 layer only")
    if "norm_before_residual" not in raw:
        raise SpecgenError(f"{source} does not say norm_before_residual, which vLLM then reads as true and "
                           "speculators as false; add the key to the config")
    _check_forward({**layer, **raw}, source, norm_output_means="speculators")
    ids = raw.get("eagle_aux_hidden_state_layer_ids")
    section = raw.get("specgen") or {}
    if section.get("aux_layers") is not None:
        aux = _specgen_aux(section, ids, source)
    elif ids:
        aux = [int(i) - 1 for i in ids]
    else:
        aux = _default_aux(source, target_num_layers)
    fields = {**layer, "draft_vocab_size": raw.get("draft_vocab_size"),
              "target_hidden_size": raw.get("target_hidden_size"),
              "norm_before_residual": bool(raw["norm_before_residual"]),
              **{flag: bool(raw.get(flag) or False) for flag in EAGLE31_FLAGS}}
    if raw["speculators_model_type"] == "peagle":
        if raw.get("mask_token_id") is None:
            raise SpecgenError(f"{source} is a speculators peagle model without mask_token_id; add it to the config")
        fields.update(parallel_drafting=True, mask_token_id=int(raw["mask_token_id"]))
    fields = {key: value for key, value in fields.items() if value is not None and key != "architectures"}
    return _finish(fields, aux, section, source)


def _specgen_aux(section: dict, ids: list[int] | None, source: str) -> list[int]:
    """Aux layers recorded by specgen, cross-checked against the ids beside them (they must say the same)."""
    aux = [int(i) for i in section["aux_layers"]]
    fmt = section.get("format")
    expected = {"vllm": serving_layer_ids(aux), "speculators": serving_layer_ids(aux), "sglang": aux,
                "specforge": aux, None: aux}.get(fmt)  # None: written before formats existed (ids = aux)
    if ids is not None and [int(i) for i in ids] != expected:
        raise SpecgenError(f"{source} contradicts itself: specgen.aux_layers {aux} ({fmt or 'legacy'} format) but "
                           f"eagle_aux_hidden_state_layer_ids {list(ids)}; fix or re-export the checkpoint")
    return aux


def _default_aux(source: str, target_num_layers: int | None) -> list[int]:
    """EAGLE-3's and SpecForge's default: outputs of layers [1, n//2 - 1, n - 4] (vLLM: ids [2, n//2, n - 3])."""
    if target_num_layers is None:
        raise SpecgenError(f"{source} records no aux layers (eagle_config); the default depends on the target's "
                           "layer count: pass model.path=TARGET")
    n = int(target_num_layers)
    aux = [1, n // 2 - 1, n - 4]
    log.info("%s records no aux layers: EAGLE-3's default for %d target layers, outputs of layers %s", source, n, aux)
    return aux


EAGLE31_FLAGS = ("fc_norm", "norm_before_fc", "norm_output")  # vLLM 0.32 / speculators 0.9 names (Eagle3Draft)
_UNSUPPORTED = {  # field: (value specgen implements, what it would change)
    "use_aux_norm": (False, "per-layer RMSNorm before fc"),
    "attention_bias": (False, "attention biases"),
    "mlp_bias": (False, "MLP biases"),
    "bias": (False, "an fc bias"),
    "tie_word_embeddings": (False, "an LM head tied to the embedding"),
    "num_hidden_layers": (1, "more than one draft layer"),
}


def _check_forward(raw: dict, source: str, *, norm_output_means: str) -> None:
    """One-line error for every field that changes the forward in a way specgen's draft does not implement."""
    for key, (supported, meaning) in _UNSUPPORTED.items():
        if key in raw and raw[key] is not None and raw[key] != supported:
            raise SpecgenError(f"{source} sets {key}={raw[key]!r} ({meaning}), which specgen's EAGLE-3 draft "
                               "does not implement; it cannot be loaded without changing its outputs")
    if raw.get("model_type", "llama") != "llama":
        raise SpecgenError(f"{source}: model_type {raw['model_type']!r}; specgen implements the Llama EAGLE-3 layer only")
    if (raw.get("eagle_config") or {}).get("use_aux_hidden_state", True) is not True:
        raise SpecgenError(f"{source} sets use_aux_hidden_state=false (EAGLE-1 style input), which specgen does not "
                           "implement")
    if raw.get("logit_scale", 1.0) != 1.0:
        raise SpecgenError(f"{source} sets logit_scale={raw['logit_scale']}, which specgen does not implement")
    if "norm_output" in raw and norm_output_means == "specforge":
        # SpecForge 0.2.0: norm_output (default true) applies the final norm before the LM head; false skips it.
        # speculators / vLLM (and specgen's own configs): true feeds the normed state to the next step (EAGLE-3.1),
        # which specgen implements (Eagle3Draft); SpecForge's false (no final norm) it does not.
        if not raw["norm_output"]:
            raise SpecgenError(f"{source} sets norm_output=false (SpecForge: logits without the final norm), which "
                               "specgen's EAGLE-3 draft does not implement")
        log.warning("%s sets norm_output=true (SpecForge: the final norm before the LM head, as specgen does); "
                    "vLLM reads that key as EAGLE-3.1's normed feedback, so specgen drops it on export", source)


def _finish(fields: dict, aux: list[int], section: dict, source: str) -> transformers.LlamaConfig:
    fields = {key: value for key, value in fields.items() if key not in ("torch_dtype", "dtype")
              and not (key in EAGLE31_FLAGS and not value)}  # plain EAGLE-3 configs carry none of the flags
    config = transformers.LlamaConfig(**fields)
    config.architectures = [ARCHITECTURE]
    if getattr(config, "draft_vocab_size", None) is None:
        config.draft_vocab_size = config.vocab_size  # vLLM's and SGLang's default: the full vocabulary
    if getattr(config, "target_hidden_size", None) is None:
        config.target_hidden_size = config.hidden_size  # SpecForge's, vLLM's and SGLang's default
    config.norm_before_residual = bool(getattr(config, "norm_before_residual", False))
    if any(layer < 0 for layer in aux):
        raise SpecgenError(f"{source} reads the embedding output (hidden_states[0]) as an aux layer, which specgen "
                           "does not capture")
    config.eagle_config = {"eagle_aux_hidden_state_layer_ids": serving_layer_ids(aux), "use_aux_hidden_state": True}
    config.specgen = {key: value for key, value in section.items()
                      if key not in ("aux_layers", "aux_layer_convention", "format",
                                     "eagle_aux_hidden_state_layer_ids")}
    return config


def canonical_tensors(tensors: dict[str, torch.Tensor], config: transformers.PretrainedConfig) -> dict[str, torch.Tensor]:
    """Weights in specgen's names (midlayer.*), without the target's tensors; vocabulary maps completed."""
    out = {}
    for name, tensor in tensors.items():
        if name in _DROPPED:
            continue
        name = name.replace("layers.0.", "midlayer.", 1) if name.startswith("layers.0.") else name
        out[name] = tensor
    if "d2t" not in out and config.draft_vocab_size == config.vocab_size:
        out["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.long)  # full vocabulary: identity
    if "t2d" not in out and "d2t" in out:
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[torch.arange(len(out["d2t"])) + out["d2t"]] = True
        out["t2d"] = t2d
    return out
