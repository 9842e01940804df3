"""The target model: loading it, identifying it, and the interface every capture backend offers.

A capture runs the target on a right-padded batch and returns two things per token:

* `aux_hidden_states` [B, T, k*H]: the outputs of the k requested decoder layers (see
  `specgen.capture.layers` for the indexing convention), concatenated in the order requested;
* `last_hidden_state` [B, T, H]: the output of the final norm, i.e. exactly what the LM head
  consumes, so `lm_head(last_hidden_state)` rebuilds the target logits when they are needed.

Logits are never computed here (a full-vocabulary [B, T, V] tensor dwarfs everything else), and
no layer output beyond the requested ones is kept.
"""

import hashlib
import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import transformers

from specgen.capture.kv import GroupedPast, LayerKV, PastKV
from specgen.capture.layers import default_aux_layers, validate_aux_layers
from specgen.capture.packed import PackedSegments, PackingUnsupported
from specgen.errors import SpecgenError
from specgen.runtime.dtype import resolve_model_dtype

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# Config entries that describe how a checkpoint was saved or loaded rather than which model it is:
# the same weights in another folder, saved by another transformers version or loaded in another
# dtype or attention implementation must keep the same identity.
_NON_IDENTITY_CONFIG_KEYS = frozenset({
    "_name_or_path", "transformers_version", "dtype", "torch_dtype", "use_cache",
    "output_hidden_states", "output_attentions", "return_dict",
})


def load_target(path: str | Path, *, dtype: str = "auto", device: str = "cpu",
                attn_implementation: str | None = None) -> transformers.PreTrainedModel:
    """Load a local Hugging Face causal LM folder for inference (eval mode, no gradients).

    dtype: "auto" follows `specgen.runtime.dtype`'s rule (the checkpoint's dtype, or float32 on a CPU without
    native matmuls in it), otherwise one of bfloat16 | float16 | float32. attn_implementation is passed to transformers
    as is (eager, sdpa, flash_attention_2, ...); None lets transformers choose.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise SpecgenError(f"model.path {str(path)!r} is not a folder; point model.path at a local Hugging Face "
                           f"model folder (config.json + weights)")
    if not (folder / "config.json").is_file():
        raise SpecgenError(f"model.path {str(path)!r} has no config.json; point model.path at a Hugging Face model "
                           f"folder saved with save_pretrained")
    if dtype != "auto" and dtype not in DTYPES:
        raise SpecgenError(f"model.dtype {dtype!r} is not supported; use auto, {', '.join(DTYPES)}")
    if dtype == "auto":
        dtype = resolve_model_dtype(dtype, _device_for_dtype(device), folder).name
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=DTYPES[dtype], device_map=device,
        attn_implementation=attn_implementation,
    )
    model.eval()
    model.requires_grad_(False)
    return model


def _device_for_dtype(device: str | None) -> str:
    """The device kind the dtype rule sees: None (DeepSpeed places the weights) is this process's accelerator."""
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def config_hash(model: transformers.PreTrainedModel) -> str:
    """sha256 (hex) of the model config's canonical JSON: sorted keys, no whitespace.

    Identifies the target architecture/hyper-parameters so shards and drafts can be matched to it.
    Private entries (`_...`) and the load-time entries in `_NON_IDENTITY_CONFIG_KEYS` are left out.
    """
    canonical = json.dumps(_identity(model.config.to_dict()), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def _identity(config: Any) -> Any:
    """`config` without private and load-time entries, recursively (composite models nest configs)."""
    if isinstance(config, dict):
        return {key: _identity(value) for key, value in config.items()
                if not (isinstance(key, str) and (key.startswith("_") or key in _NON_IDENTITY_CONFIG_KEYS))}
    if isinstance(config, list):
        return [_identity(value) for value in config]
    return config


@dataclass
class CaptureOutput:
    """Per-token target states for a right-padded batch; positions >= lengths[b] hold unspecified values."""

    aux_hidden_states: torch.Tensor  # [B, T, k*H], requested layers concatenated in the requested order
    last_hidden_state: torch.Tensor  # [B, T, H], output of the final norm (the LM head input)
    kv: list[LayerKV] | None = None  # with keep_kv: per decoder layer, keys and values of the input tokens
    token_logprobs: torch.Tensor | None = None  # [B, T] float32 from an engine that computes them (engine=vllm)


class TargetCapture(ABC):
    """A target forward that keeps only the requested layer outputs and never computes logits.

    Subclasses implement `_forward` for one family of models; `make_capture` picks the subclass.
    """

    backend: ClassVar[str]

    def __init__(self, model: transformers.PreTrainedModel, aux_layers: list[int] | None):
        text_config = model.config.get_text_config()
        self.model = model
        self.num_layers: int = text_config.num_hidden_layers
        self.hidden_size: int = text_config.hidden_size
        self.aux_layers: list[int] = (default_aux_layers(self.num_layers) if aux_layers is None
                                      else validate_aux_layers(aux_layers, self.num_layers))
        self._aux_slot = {layer: slot for slot, layer in enumerate(self.aux_layers)}

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_input_embeddings().weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    @property
    def lm_head(self) -> torch.nn.Module:
        """The target's output embedding: `lm_head(last_hidden_state)` gives the target logits."""
        return self.model.get_output_embeddings()

    @property
    def supports_kv(self) -> bool:
        """Whether `past` and `keep_kv` work (shared-prefix reuse needs them); see `specgen.capture.kv`."""
        return False

    @property
    def supports_packing(self) -> bool:
        """Whether `packed` works: sequences end to end in one row, no padding (see `specgen.capture.packed`)."""
        return False

    @property
    def supports_compile(self) -> bool:
        """Whether `compile()` works (the llama backend's decoder layers; see `LlamaFamilyCapture.compile`)."""
        return False

    @property
    def compiled(self) -> bool:
        """Whether `compile()` ran: the plain and packed forwards call compiled decoder layers."""
        return False

    def compile(self) -> None:
        """Run the decoder layers under `torch.compile` (capture.compile); only where `supports_compile`."""
        raise SpecgenError(f"the {self.backend} capture backend cannot compile its forward; capture.compile=true "
                           "needs a Llama-family target (the llama backend)")

    @torch.inference_mode()
    def packed(self, input_ids: torch.LongTensor, segments: PackedSegments) -> CaptureOutput:
        """Capture sequences laid end to end in one row: input_ids [1, N], `segments` where each one starts; the
        outputs are [1, N, ...], each segment's states those it has alone. Raises `PackingUnsupported` when this
        backend or model cannot run packed (the caller then captures padded batches)."""
        if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] != segments.total:
            raise ValueError(f"expected input_ids [1, {segments.total}] for the packed segments, got "
                             f"{tuple(input_ids.shape)}")
        if not self.supports_packing:
            raise PackingUnsupported(f"the {self.backend} capture backend does not pack sequences")
        segments.calls = 0
        out = self._forward_packed(input_ids.to(self.device), segments)
        if segments.calls != self.num_layers:
            raise PackingUnsupported(f"{type(self.model).__name__} ran {segments.calls} packed attention calls for "
                                     f"{self.num_layers} decoder layers: some layers mix tokens another way")
        return out

    def _forward_packed(self, input_ids: torch.LongTensor, segments: PackedSegments) -> CaptureOutput:
        """The packed forward of a backend that `supports_packing`: attention under `packed_attention`, positions
        from `segments.position_ids`."""
        raise PackingUnsupported(f"the {self.backend} capture backend does not pack sequences")

    @torch.inference_mode()
    def __call__(self, input_ids: torch.LongTensor, lengths: torch.LongTensor, chunk_tokens: int | None = None,
                 past: PastKV | GroupedPast | None = None, keep_kv: bool = False) -> CaptureOutput:
        """Capture a RIGHT-padded batch: input_ids [B, T], lengths [B] real tokens per row (1..T).

        With right padding every padding key comes after every real query, so the causal mask
        alone keeps real positions exact; padding positions are computed but meaningless.
        chunk_tokens: run at most this many positions per forward (chunked prefill with a KV cache,
        see `_forward_in_chunks`); None runs the whole sequence at once. Not combined with `past`/`keep_kv`.
        past: `PastKV`: row b continues `past.lengths[b]` earlier tokens (its positions start there);
        `GroupedPast`: rows grouped by the one past each group continues (the reuse runner's layout).
        keep_kv: also return the keys and values of input_ids (`CaptureOutput.kv`) to continue from later.
        """
        if input_ids.dim() != 2 or lengths.shape != input_ids.shape[:1]:
            raise ValueError(f"expected input_ids [B, T] and lengths [B], got {tuple(input_ids.shape)} "
                             f"and {tuple(lengths.shape)}")
        if input_ids.shape[1] == 0 or lengths.min() < 1 or lengths.max() > input_ids.shape[1]:
            raise ValueError(f"lengths must lie in [1, T={input_ids.shape[1]}], got {lengths.tolist()}")
        input_ids = input_ids.to(self.device)
        if past is not None or keep_kv:
            return self._continue(input_ids, lengths, past, keep_kv)
        if chunk_tokens is None or input_ids.shape[1] <= chunk_tokens:
            return self._forward(input_ids)
        return self._forward_in_chunks(input_ids, chunk_tokens)

    def _continue(self, input_ids: torch.LongTensor, lengths: torch.LongTensor, past: PastKV | GroupedPast | None,
                  keep_kv: bool) -> CaptureOutput:
        """Shared-prefix reuse: rows continue their own prefix's keys and values (see `specgen.capture.kv`)."""
        if not self.supports_kv:
            raise SpecgenError(f"the {self.backend} capture backend with attn_implementation="
                               f"{self.model.config._attn_implementation} cannot continue from a KV cache; use a "
                               f"Llama-family model with model.attn_implementation=sdpa or eager")
        if isinstance(past, GroupedPast) and past.bounds[-1] != len(lengths):
            raise ValueError(f"the grouped past covers {past.bounds[-1]} rows, the batch has {len(lengths)}")
        if isinstance(past, PastKV) and past.lengths.shape != lengths.shape:
            raise ValueError(f"past.lengths has shape {tuple(past.lengths.shape)}, expected {tuple(lengths.shape)}")
        return self._forward(input_ids, past=past, keep_kv=keep_kv)

    def _forward_in_chunks(self, input_ids: torch.LongTensor, chunk_tokens: int) -> CaptureOutput:
        """Chunked prefill: positions [s, s + chunk_tokens) at a time, attending to the earlier chunks through
        a KV cache, so activation memory follows the chunk length instead of T (the cache and the outputs
        still grow with T). Equal to the single pass up to floating-point rounding."""
        cache = transformers.DynamicCache(config=self.model.config)
        aux = self._new_aux_buffer(input_ids)
        last = torch.empty(*input_ids.shape, self.hidden_size, dtype=self.dtype, device=input_ids.device)
        for start in range(0, input_ids.shape[1], chunk_tokens):
            end = start + chunk_tokens
            out = self._forward(input_ids[:, start:end], past_key_values=cache)
            aux[:, start:end] = out.aux_hidden_states
            last[:, start:end] = out.last_hidden_state
        return CaptureOutput(aux_hidden_states=aux, last_hidden_state=last)

    @abstractmethod
    def _forward(self, input_ids: torch.LongTensor, past_key_values: transformers.Cache | None = None) -> CaptureOutput:
        """Run the target on input_ids (already on the model device).

        past_key_values: None for a whole sequence; else the KV cache of the positions before input_ids, which
        then continue from the cache's length, and whose entries for input_ids are appended in place.
        """

    def _new_aux_buffer(self, input_ids: torch.LongTensor) -> torch.Tensor:
        """Output buffer for the requested layers; each one is copied in as soon as it is produced,
        so no layer output outlives the step that made it."""
        batch, seq_len = input_ids.shape
        return torch.empty(batch, seq_len, len(self.aux_layers) * self.hidden_size, dtype=self.dtype,
                           device=input_ids.device)

    def _keep_if_requested(self, aux: torch.Tensor, layer: int, hidden_state: torch.Tensor) -> None:
        """Copy the output of decoder layer `layer` into its slot of `aux` if that layer was requested."""
        slot = self._aux_slot.get(layer)
        if slot is not None:
            aux[..., slot * self.hidden_size:(slot + 1) * self.hidden_size] = hidden_state
