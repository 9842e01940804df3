"""Selective target capture: a target forward that keeps only the hidden layers an EAGLE-3 draft reads.

    model = load_target(cfg.model.path, dtype="bfloat16", device="cuda")
    capture = make_capture(model, aux_layers=None)      # None -> [1, L//2 - 1, L - 4]
    out = capture(input_ids, lengths)                   # right-padded batch
    out.aux_hidden_states   # [B, T, k*H]  outputs of decoder layers aux_layers, concatenated in that order
    out.last_hidden_state   # [B, T, H]    final-norm output; capture.lm_head(...) rebuilds the logits

Aux layer i is the output of decoder layer i before the final norm (HF `hidden_states[i + 1]`),
see `specgen.capture.layers`. Llama-family models use a dedicated layer-by-layer forward
(`specgen.capture.llama`); any other causal LM falls back to forward hooks (`specgen.capture.generic`).
"""

import logging

import transformers

from specgen.capture.generic import HookCapture
from specgen.capture.layers import default_aux_layers, resolve_aux_layers, validate_aux_layers
from specgen.capture.llama import LLAMA_FAMILY, LlamaFamilyCapture
from specgen.capture.target import CaptureOutput, TargetCapture, config_hash, load_target

__all__ = [
    "CaptureOutput", "TargetCapture", "config_hash", "default_aux_layers", "load_target", "make_capture",
    "resolve_aux_layers", "validate_aux_layers",
]

log = logging.getLogger(__name__)


def make_capture(model: transformers.PreTrainedModel, aux_layers: list[int] | None,
                 compile: bool = False) -> TargetCapture:
    """The capture backend for `model`: the dedicated Llama-family forward where the exact class is
    known to share the Llama structure, otherwise the generic hook backend (which warns).
    `compile` (capture.compile): its decoder layers under torch.compile where the backend can (`capture.compiled`
    says whether it did; a backend that cannot says so in a warning)."""
    capture = LlamaFamilyCapture(model, aux_layers) if type(model).__name__ in LLAMA_FAMILY else \
        HookCapture(model, aux_layers)
    if compile and capture.supports_compile:
        capture.compile()
    elif compile:
        log.warning("capture.compile=true, but the %s capture backend runs its forward eagerly (only the llama "
                    "backend compiles its decoder layers)", capture.backend)
    return capture
