"""The DFlash draft model: Qwen3 layers over [target context ; bonus token + K mask tokens], the layout vLLM's
qwen3_dflash serves (see `specgen.methods.dflash` for the whole method)."""

import math

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from specgen.draft.aux import aux_layers_of
from specgen.draft.vocab import ReducedVocabHead
from specgen.errors import SpecgenError

METHOD = "dflash"
ARCHITECTURE = "DFlashDraftModel"  # vLLM registry: DFlashDraftModel -> qwen3_dflash.DFlashQwen3ForCausalLM

_INHERITED = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "hidden_act", "rms_norm_eps", "max_position_embeddings", "rope_parameters", "vocab_size",
              "bos_token_id", "eos_token_id", "pad_token_id")
OVERRIDABLE = ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps")


def target_layer_ids(aux_layers: list[int]) -> list[int]:
    """specgen aux layers (0-based decoder-layer outputs) -> `dflash_config.target_layer_ids`: the same numbers."""
    return [int(layer) for layer in aux_layers]


def vllm_eagle_aux_ids(layer_ids: list[int]) -> list[int]:
    """What vLLM 0.32 makes of `target_layer_ids` (`get_eagle3_aux_layers_from_config`: id + 1, the residual stream
    entering layer id + 1 in `llama.py`). Stated here so a test can hold it against vLLM's own function."""
    return [int(i) + 1 for i in layer_ids]


def dflash_config(target_config: transformers.PretrainedConfig, *, aux_layers: list[int], draft_vocab_size: int,
                  num_layers: int, block_size: int, mask_token_id: int, causal: bool = False,
                  overrides: dict | None = None) -> transformers.Qwen3Config:
    """The draft's Qwen3 config (layers shaped like the target's), with the fields vLLM's DFlash loader reads:
    architectures [DFlashDraftModel], dflash_config {mask_token_id, target_layer_ids, causal}, block_size,
    draft_vocab_size, target_hidden_size."""
    text = target_config.get_text_config()
    if not 0 <= mask_token_id < text.vocab_size:
        raise SpecgenError(f"draft.mask_token_id={mask_token_id} is outside the target's vocabulary "
                           f"(0..{text.vocab_size - 1})")
    if block_size < 2:
        raise SpecgenError(f"draft.dflash.block_size={block_size}: a block is the bonus token + at least one mask")
    unknown = sorted(set(overrides or {}) - set(OVERRIDABLE))
    if unknown:
        raise SpecgenError(f"draft.overrides has keys {unknown} that a DFlash draft cannot override; allowed: "
                           f"{list(OVERRIDABLE)}")
    fields = {key: getattr(text, key) for key in _INHERITED if getattr(text, key, None) is not None}
    fields.setdefault("head_dim", text.hidden_size // text.num_attention_heads)
    fields.setdefault("intermediate_size", 4 * text.hidden_size)
    fields.update(overrides or {})
    config = transformers.Qwen3Config(**fields, num_hidden_layers=int(num_layers), tie_word_embeddings=False,
                                      attention_bias=False, use_sliding_window=False)
    config.architectures = [ARCHITECTURE]
    config.draft_vocab_size = int(draft_vocab_size)
    config.target_hidden_size = int(text.hidden_size)
    config.num_target_layers = int(text.num_hidden_layers)
    config.block_size = int(block_size)
    config.dflash_config = {"mask_token_id": int(mask_token_id), "target_layer_ids": target_layer_ids(aux_layers),
                            "causal": bool(causal)}
    return config


def _rms_norm(size: int, eps: float) -> LlamaRMSNorm:
    return LlamaRMSNorm(size, eps=eps)  # the same computation as Qwen3RMSNorm / vLLM's RMSNorm


class DFlashAttention(nn.Module):
    """Qwen3 attention whose keys/values are [context entries ; block slots]."""

    def __init__(self, config: transformers.Qwen3Config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.q_norm = _rms_norm(self.head_dim, config.rms_norm_eps)
        self.k_norm = _rms_norm(self.head_dim, config.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, n, H] -> keys (k_norm, rotary) and values, each [B, Hkv, n, d]."""
        batch, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(batch, n, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(batch, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        k, _ = apply_rotary_pos_emb(k, k, cos, sin)
        return k, v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context: tuple[torch.Tensor, torch.Tensor],
                visible: torch.Tensor | None) -> torch.Tensor:
        """x [B, n, H] block slots (after input_layernorm); context keys/values [B, Hkv, S, d];
        visible [B, n, S + n] bool (None: everything visible)."""
        batch, n, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(batch, n, self.num_heads, self.head_dim)).transpose(1, 2)
        q, _ = apply_rotary_pos_emb(q, q, cos, sin)
        k, v = self.keys_values(x, cos, sin)
        keys = torch.cat([context[0], k], dim=2)
        values = torch.cat([context[1], v], dim=2)
        repeat = self.num_heads // self.num_kv_heads
        if repeat > 1:
            keys, values = keys.repeat_interleave(repeat, dim=1), values.repeat_interleave(repeat, dim=1)
        mask = None if visible is None else visible[:, None]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=1.0 / math.sqrt(self.head_dim))
        return self.o_proj(out.transpose(1, 2).reshape(batch, n, -1))


class DFlashMLP(nn.Module):
    """Qwen3's MLP: down(act(gate(x)) * up(x)), no biases."""

    def __init__(self, config: transformers.Qwen3Config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DFlashLayer(nn.Module):
    """One Qwen3 decoder layer of the draft (`layers.{i}` in the checkpoint)."""

    def __init__(self, config: transformers.Qwen3Config):
        super().__init__()
        self.input_layernorm = _rms_norm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = _rms_norm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DFlashMLP(config)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                context: tuple[torch.Tensor, torch.Tensor], visible: torch.Tensor | None) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, context, visible)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DFlashDraft(ReducedVocabHead, nn.Module):
    """The DFlash draft. Parameter names are the checkpoint's (vLLM prefixes `model.` itself)."""

    method_name = METHOD

    def __init__(self, config: transformers.Qwen3Config):
        super().__init__()
        self.method_name = METHOD
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # the target's embedding, frozen, not stored
        self.fc = nn.Linear(len(aux_layers_of(config)) * config.target_hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = _rms_norm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = _rms_norm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.reset_parameters()

    @property
    def block_size(self) -> int:
        return int(self.config.block_size)

    @property
    def mask_token_id(self) -> int:
        return int(self.config.dflash_config["mask_token_id"])

    @property
    def causal(self) -> bool:
        return bool(self.config.dflash_config.get("causal", False))

    def reset_parameters(self) -> None:
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, LlamaRMSNorm):
                nn.init.ones_(module.weight)

    def context_kv(self, aux_hidden_states: torch.Tensor,
                   position_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer context keys/values [B, Hkv, S, d] of aux hidden states [B, S, k*H_t] at positions [B, S]."""
        ctx = self.hidden_norm(self.fc(aux_hidden_states.to(self.fc.weight.dtype)))
        cos, sin = self.rotary_emb(ctx, position_ids)
        return [layer.self_attn.keys_values(ctx, cos, sin) for layer in self.layers]

    def forward(self, block_ids: torch.Tensor, block_positions: torch.Tensor,
                context: list[tuple[torch.Tensor, torch.Tensor]], visible: torch.Tensor | None) -> torch.Tensor:
        """Block slots [B, n] (target token ids) at positions [B, n] -> final hidden states [B, n, H] (pre-norm)."""
        hidden = self.embed_tokens(block_ids).to(self.fc.weight.dtype)
        cos, sin = self.rotary_emb(hidden, block_positions)
        for layer, layer_context in zip(self.layers, context):
            hidden = layer(hidden, cos, sin, layer_context, visible)
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))


# ---------------------------------------------------------------------------------------------------------------
# Training: anchors, the block attention mask, the loss


# ---------------------------------------------------------------------------------------------------------------
# The draft method (`specgen.methods`)
