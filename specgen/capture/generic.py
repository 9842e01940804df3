"""Fallback capture backend for any other Hugging Face causal LM: forward hooks on decoder layers.

Only the decoder (`model.get_decoder()`) runs, so the LM head and its logits are never computed.
A forward hook on each requested decoder layer copies that layer's output into the aux buffer as
it is produced; `output_hidden_states` stays off, so no other layer output is kept. The decoder
gets no attention mask: with right padding the causal mask alone is exact for real positions.

The decoder layers are found as the decoder's ModuleList with `num_hidden_layers` entries. This
path is checked against `output_hidden_states` for GPT-2 only; it warns so that other
architectures get a look before they are trusted.
"""

import warnings
from functools import partial

import torch
import transformers

from specgen.capture.layers import layer_output_hooks
from specgen.capture.packed import PackedSegments, PackingUnsupported, packed_attention
from specgen.capture.target import CaptureOutput, TargetCapture
from specgen.errors import SpecgenError
from specgen.runtime.compat import cache_kwarg


def find_decoder_layers(decoder: torch.nn.Module, num_layers: int) -> torch.nn.ModuleList:
    """The first ModuleList of `num_layers` modules inside `decoder` (e.g. `layers`, GPT-2's `h`)."""
    for module in decoder.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == num_layers:
            return module
    raise SpecgenError(f"could not find the {num_layers} decoder layers of {type(decoder).__name__} for capture; "
                       f"this architecture needs a dedicated capture backend (see specgen/capture/)")


class HookCapture(TargetCapture):
    """Runs the target's decoder with forward hooks on the requested layers."""

    backend = "generic"

    def __init__(self, model: transformers.PreTrainedModel, aux_layers: list[int] | None):
        super().__init__(model, aux_layers)
        self._decoder = model.get_decoder()
        self._layers = find_decoder_layers(self._decoder, self.num_layers)
        warnings.warn(f"{type(model).__name__} has no dedicated capture backend; using the generic forward-hook "
                      f"backend (validated on GPT-2 only: spot-check its hidden states against "
                      f"output_hidden_states before a large run)", stacklevel=3)

    def _forward(self, input_ids: torch.LongTensor, past_key_values: transformers.Cache | None = None) -> CaptureOutput:
        aux = self._new_aux_buffer(input_ids)
        with layer_output_hooks(self._layers, self.aux_layers, partial(self._keep_if_requested, aux)):
            output = self._decoder(input_ids=input_ids, use_cache=past_key_values is not None,
                                   output_hidden_states=False, **cache_kwarg(past_key_values))
        # ModelOutput and tuple outputs both carry the final-norm output first.
        return CaptureOutput(aux_hidden_states=aux, last_hidden_state=output[0])

    @property
    def supports_packing(self) -> bool:
        return True

    def _forward_packed(self, input_ids: torch.LongTensor, segments: PackedSegments) -> CaptureOutput:
        """The decoder on one packed row (`position_ids` restart per segment, block-diagonal attention); the first
        packed batch is also run padded once and must agree (`_check_packing`), since this backend serves
        architectures nobody checked here."""
        aux = self._new_aux_buffer(input_ids)
        with layer_output_hooks(self._layers, self.aux_layers, partial(self._keep_if_requested, aux)), \
                packed_attention(self.model.config, segments):
            try:
                output = self._decoder(input_ids=input_ids, position_ids=segments.position_ids(input_ids.device),
                                       use_cache=False, output_hidden_states=False)
            except TypeError as error:  # a decoder without position_ids
                name = type(self._decoder).__name__
                raise PackingUnsupported(f"{name} does not take position_ids: {error}") from None
        out = CaptureOutput(aux_hidden_states=aux, last_hidden_state=output[0])
        if not self._packing_checked:
            self._check_packing(input_ids, segments, out)
        return out

    _packing_checked = False

    def _check_packing(self, input_ids: torch.LongTensor, segments: PackedSegments, out: CaptureOutput) -> None:
        """Compare the packed states of each segment with the same sequences' padded forward (once per capture)."""
        lengths = segments.lengths
        padded = torch.zeros(len(lengths), max(lengths), dtype=input_ids.dtype, device=input_ids.device)
        for b, (lo, hi) in enumerate(segments.spans()):
            padded[b, :hi - lo] = input_ids[0, lo:hi]
        reference = self._forward(padded)
        for b, (lo, hi) in enumerate(segments.spans()):
            for got, want in ((out.last_hidden_state[0, lo:hi], reference.last_hidden_state[b, :hi - lo]),
                              (out.aux_hidden_states[0, lo:hi], reference.aux_hidden_states[b, :hi - lo])):
                if not states_agree(got, want):
                    raise PackingUnsupported(f"{type(self.model).__name__}'s packed states differ from its padded "
                                             f"ones (max difference {float((got - want).abs().max()):.3g})")
        self._packing_checked = True


def states_agree(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal within the dtype's rounding: float32 1e-4 of the tensor's scale, 16-bit types 2 ulps (1.6e-2) of it."""
    tolerance = 1e-4 if want.dtype == torch.float32 else 1.6e-2
    scale = float(want.abs().max()) or 1.0
    return bool(((got.float() - want.float()).abs() <= tolerance * scale).all())
