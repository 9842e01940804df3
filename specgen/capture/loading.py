"""The target of `specgen.generate`, loaded for its engine (hf, deepspeed, vllm) with the capture settings applied:
aux layers, compile, prefix reuse and packing where its backend can, and what the shards will hold."""

import logging

import torch
from omegaconf import DictConfig

from specgen.capture import TargetCapture, make_capture
from specgen.capture.layers import resolve_aux_layers
from specgen.capture.offline import Target
from specgen.capture.outputs import SampleOutputs
from specgen.capture.reuse import resolve_prefix_reuse
from specgen.capture.target import load_target
from specgen.capture.zero import ZeroCapture, load_zero3_target
from specgen.errors import SpecgenError
from specgen.settings import filter_settings, output_settings, vllm_capture_settings, zero3_settings
from specgen.store.columns import ShardSpec

log = logging.getLogger("specgen.generate")


def load_capture(cfg: DictConfig, tokenizer, device: torch.device) -> Target:
    if cfg.engine.name == "vllm":  # a vLLM engine computes the states (specgen.capture.vllm); imported lazily
        from specgen.capture.vllm import load_vllm_capture

        return target_for(cfg, tokenizer, load_vllm_capture(vllm_capture_settings(cfg)), prefix_reuse=False)
    if cfg.engine.name == "deepspeed":
        model, zero3_config, keepalive = load_zero3_target(zero3_settings(cfg), device)
    elif cfg.engine.name == "hf":
        model = load_target(cfg.model.path, dtype=cfg.model.dtype, device=str(device),
                            attn_implementation=cfg.model.attn_implementation)
    else:
        raise SpecgenError(f"engine={cfg.engine.name} is unknown; use engine=hf (the default), engine=deepspeed "
                           "or engine=vllm")
    aux_layers = resolve_aux_layers(cfg.capture.aux_layers, model.config.get_text_config().num_hidden_layers)
    positions = positions_of(model.config.get_text_config())
    if positions and cfg.data.max_length > positions:
        log.warning("data.max_length=%d is past the target's %d positions (max_position_embeddings): tokens past "
                    "them get states from outside the context it was trained on; lower data.max_length to cut "
                    "such rows there", cfg.data.max_length, positions)
    if cfg.capture.compile and cfg.engine.name != "hf":
        log.warning("capture.compile=true is for engine=hf; engine=%s runs its layers eagerly", cfg.engine.name)
    capture = make_capture(model, aux_layers, compile=bool(cfg.capture.compile) and cfg.engine.name == "hf")
    if cfg.engine.name == "deepspeed":
        capture = ZeroCapture(capture, zero3_config, keepalive)
    reuse, note = resolve_prefix_reuse(cfg.capture.prefix_reuse, device)
    if reuse and not capture.supports_kv:
        log.warning("%s, but the %s capture backend with attn_implementation=%s cannot continue from a KV cache: "
                    "every row is computed in full (prefix reuse needs a Llama-family model with "
                    "model.attn_implementation=sdpa or eager)", note, capture.backend,
                    model.config._attn_implementation)
        note += f"; the {capture.backend} backend cannot continue from a KV cache"
    log.info("prefix reuse %s (%s)", "on" if reuse and capture.supports_kv else "off", note)
    target = target_for(cfg, tokenizer, capture, prefix_reuse=reuse and capture.supports_kv)
    target.prefix_reuse_note = note
    if cfg.capture.packing and not capture.supports_packing:
        target.packing_note = f"the {capture.backend} capture backend does not pack sequences"
        log.warning("capture.packing=true, but %s: batches are padded", target.packing_note)
    return target


def target_for(cfg: DictConfig, tokenizer, capture: TargetCapture, prefix_reuse: bool) -> Target:
    dtype = str(capture.dtype).removeprefix("torch.")
    outputs = SampleOutputs.from_settings(output_settings(cfg), capture)
    spec = ShardSpec(hidden_size=capture.hidden_size, num_aux=len(capture.aux_layers), dtype=dtype,
                     store_prefix_once=bool(cfg.output.store_prefix_once), **outputs.spec_fields())
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return Target(capture=capture, spec=spec, pad_id=pad_id, outputs=outputs,
                  sample_filter=filter_settings(cfg), prefix_reuse=prefix_reuse,
                  packing=bool(cfg.capture.packing) and capture.supports_packing)


def positions_of(text_config) -> int | None:
    """The target's trained context in tokens (max_position_embeddings), if its config says."""
    positions = getattr(text_config, "max_position_embeddings", None)
    return int(positions) if positions else None
