"""Capture backend for Llama-family models (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE).

These share one structure: `model.model.{embed_tokens, rotary_emb, layers, norm}` around
`lm_head`. We replay the body of the HF `*Model.forward` ourselves, calling the HF decoder-layer
modules directly, so that only the running hidden state and the requested layer outputs are
alive at any time and `lm_head` is never applied.

Attention masks come from transformers' own `masking_utils`, called with no padding mask: for
right-padded batches the causal mask alone is exact for every real position. The mask builders
return what each attention implementation needs: `None` for sdpa/flash (which then run their
`is_causal` kernels; transformers' eager attention applies *no* masking when given `None`, so
eager gets an explicit additive causal mask), and sliding-window masks for layers that use them.
"""

import dataclasses

import torch
import transformers
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from specgen.capture.kv import (EXPLICIT_MASK_ATTENTION, GROUPED_ATTENTION, GroupedPast, KVRecorder, PastKV,
                               continuation_mask, grouped_past_attention)
from specgen.capture.packed import PackedSegments, packed_attention
from specgen.capture.target import CaptureOutput, TargetCapture
from specgen.errors import SpecgenError
from specgen.runtime.compat import cache_kwarg

LLAMA_FAMILY = frozenset({
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
})

transformers.AttentionInterface.register(GROUPED_ATTENTION, grouped_past_attention)

_MASK_BUILDERS = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}


def attention_type(config: transformers.PreTrainedConfig, layer: int) -> str:
    """The mask kind decoder layer `layer` uses, as the HF model code decides it.

    Qwen2/Qwen3 list it per layer in `config.layer_types`; Mistral and Qwen3-MoE use a sliding
    window on every layer when `config.sliding_window` is set; Llama always attends fully.
    """
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return layer_types[layer]
    return "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"


class LlamaFamilyCapture(TargetCapture):
    """Layer-by-layer forward of a Llama-family target keeping only the requested layer outputs."""

    backend = "llama"

    def __init__(self, model: transformers.PreTrainedModel, aux_layers: list[int] | None):
        super().__init__(model, aux_layers)
        self._layer_types = [attention_type(model.config, layer) for layer in range(self.num_layers)]
        self._compiled_layers: list | None = None  # compile(): the decoder layers under torch.compile
        unsupported = sorted(set(self._layer_types) - _MASK_BUILDERS.keys())
        if unsupported:
            raise SpecgenError(f"{type(model).__name__} uses attention layer types {unsupported}, which the llama "
                               f"capture backend does not handle; supported: {sorted(_MASK_BUILDERS)}")

    @property
    def supports_kv(self) -> bool:
        return self.model.config._attn_implementation in EXPLICIT_MASK_ATTENTION

    @property
    def supports_packing(self) -> bool:
        return True

    @property
    def supports_compile(self) -> bool:
        return True

    @property
    def compiled(self) -> bool:
        return self._compiled_layers is not None

    def compile(self) -> None:
        """Each decoder layer under `torch.compile(dynamic=True)` (inductor: fused norms, rotary, SwiGLU; one graph
        for every batch shape) in the plain, packed and prefix-reuse forwards; the packed and grouped-past attention
        calls run eagerly (excluded from compilation), and chunked prefill keeps the eager layers.
        The first batches pay the compilation (tens of seconds to minutes)."""
        self._compiled_layers = [torch.compile(layer, dynamic=True)
                                 for layer in self.model.model.layers[:self.num_layers]]

    def _layers(self, compiled: bool) -> list:
        return self._compiled_layers if compiled and self._compiled_layers is not None else \
            list(self.model.model.layers[:self.num_layers])

    def _forward_packed(self, input_ids: torch.LongTensor, segments: PackedSegments) -> CaptureOutput:
        """One packed row: positions restart at each segment, attention is block-diagonal (no mask tensor)."""
        body = self.model.model
        hidden_state = body.embed_tokens(input_ids)
        position_ids = segments.position_ids(input_ids.device)
        position_embeddings = body.rotary_emb(hidden_state, position_ids)
        aux = self._new_aux_buffer(input_ids)
        with packed_attention(self.model.config, segments):
            for index, decoder_layer in enumerate(self._layers(compiled=True)):
                output = decoder_layer(hidden_state, attention_mask=None, position_ids=position_ids,
                                       position_embeddings=position_embeddings, use_cache=False)
                hidden_state = output[0] if isinstance(output, tuple) else output
                self._keep_if_requested(aux, index, hidden_state)
        return CaptureOutput(aux_hidden_states=aux, last_hidden_state=body.norm(hidden_state))

    def _forward(self, input_ids: torch.LongTensor, past_key_values: transformers.Cache | None = None,
                 past: PastKV | GroupedPast | None = None, keep_kv: bool = False) -> CaptureOutput:
        if isinstance(past, GroupedPast):
            return self._forward_grouped(input_ids, past, keep_kv)
        body = self.model.model
        hidden_state = body.embed_tokens(input_ids)
        offset = past_key_values.get_seq_length() if past_key_values is not None else 0
        position_ids = torch.arange(offset, offset + input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        if past is None:
            masks = {
                kind: _MASK_BUILDERS[kind](config=self.model.config, inputs_embeds=hidden_state, attention_mask=None,
                                           position_ids=position_ids, **cache_kwarg(past_key_values))
                for kind in set(self._layer_types)
            }
        else:  # rows continue shared prefixes of different lengths: per-row positions and masks
            position_ids = past.lengths.to(input_ids.device)[:, None] + position_ids
            masks = {kind: continuation_mask(past.lengths.to(input_ids.device), input_ids.shape[1],
                                             window=self.model.config.sliding_window if kind == "sliding_attention"
                                             else None, attn_implementation=self.model.config._attn_implementation,
                                             dtype=hidden_state.dtype)
                     for kind in set(self._layer_types)}
        position_embeddings = body.rotary_emb(hidden_state, position_ids)
        recorder = KVRecorder(past, keep_kv) if past is not None or keep_kv else None
        cache = recorder if recorder is not None else past_key_values
        aux = self._new_aux_buffer(input_ids)
        for index, decoder_layer in enumerate(self._layers(compiled=cache is None)):
            output = decoder_layer(hidden_state, attention_mask=masks[self._layer_types[index]],
                                   position_ids=position_ids, position_embeddings=position_embeddings,
                                   use_cache=cache is not None, **cache_kwarg(cache))
            # transformers < 5 returns a tuple whose first element is the hidden state.
            hidden_state = output[0] if isinstance(output, tuple) else output
            self._keep_if_requested(aux, index, hidden_state)
        return CaptureOutput(aux_hidden_states=aux, last_hidden_state=body.norm(hidden_state),
                             kv=recorder.kept_layers(self.num_layers) if recorder is not None else None)

    def _forward_grouped(self, input_ids: torch.LongTensor, past: GroupedPast, keep_kv: bool) -> CaptureOutput:
        """Rows continuing grouped pasts (`specgen.capture.kv.GroupedPast`): the decoder layers (compiled under
        capture.compile) run with the grouped-past attention, which needs no mask, attends to each group's past in
        place and keeps the new keys/values itself when asked."""
        body = self.model.model
        hidden_state = body.embed_tokens(input_ids)
        position_ids = (past.row_lengths(input_ids.device)[:, None]
                        + torch.arange(input_ids.shape[1], device=input_ids.device)[None, :])
        position_embeddings = body.rotary_emb(hidden_state, position_ids)
        past = dataclasses.replace(past, kept={} if keep_kv else None)
        aux = self._new_aux_buffer(input_ids)
        config = self.model.config
        implementation, config._attn_implementation = config._attn_implementation, GROUPED_ATTENTION
        try:
            for index, decoder_layer in enumerate(self._layers(compiled=True)):
                output = decoder_layer(hidden_state, attention_mask=None, position_ids=position_ids,
                                       position_embeddings=position_embeddings, use_cache=False, grouped_past=past)
                hidden_state = output[0] if isinstance(output, tuple) else output
                self._keep_if_requested(aux, index, hidden_state)
        finally:
            config._attn_implementation = implementation
        return CaptureOutput(aux_hidden_states=aux, last_hidden_state=body.norm(hidden_state),
                             kv=[past.kept[layer] for layer in range(self.num_layers)] if keep_kv else None)
