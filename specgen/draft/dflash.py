"""DFlash: a block-diffusion draft that proposes K tokens in ONE forward, from the target's context features.

What vLLM 0.32 serves (`method="dflash"`, `model_executor/models/qwen3_dflash.py`, `v1/spec_decode/dflash.py`),
and therefore what is trained here, with the same module names:

    ctx      = hidden_norm(fc(concat(aux hidden states of the target)))     # [S, k*H_t] -> [S, H], one per
                                                                            # verified position 0..p-1
    block    = embed([x_p, M, M, ..., M])                                   # 1 + K query slots at positions
                                                                            # p..p+K: the bonus token x_p, then
                                                                            # K mask tokens (dflash_config.mask_token_id)
    layer l  : q from input_layernorm(block);  keys/values = [k_proj/v_proj(ctx) ; k_proj/v_proj(input_layernorm(block))]
               q_norm / k_norm per head, then rotary (context keys at their own positions); every slot sees all
               context entries and (non-causal, the default) every slot of its block; Qwen3 layer otherwise
    logits   = lm_head(norm(block))   slot j = 1..K predicts token x_{p+j} (the slot's OWN position, no shift)

The context projection does NOT go through the layer's input_layernorm (vLLM's `precompute_and_store_context_kv`
normalises with hidden_norm only). The token embedding is the target's (frozen, not stored: vLLM shares it); the
LM head covers the draft vocabulary (`d2t`, as EAGLE-3) and is stored.

Layer ids: specgen's `capture.aux_layers` are 0-based decoder-layer OUTPUT indices, which is exactly DFlash's
`dflash_config.target_layer_ids` (SpecForge `extract_context_feature` reads hidden_states[id + 1]); vLLM turns them
into its EAGLE-3 aux ids as id + 1 (`get_eagle3_aux_layers_from_config`), i.e. the residual stream entering layer
id + 1 = the output of layer id. So `target_layer_ids == aux_layers`, with no shift (tested against vLLM's code).

Training (`dflash_loss`): per row, anchors a are sampled among positions whose token x_a and next token x_{a+1}
are trained (loss_mask) inside one sample; each anchor makes one block [x_a, M, ..., M] at positions a..a+B-1
(B = block_size = K + 1) that attends to the context entries 0..a-1 of its own sample and to its own block.
Slot k >= 1 is scored where loss_mask[a+k] holds (same sample, inside the row) against the target's distribution
at position a+k-1 (lm_head(last_hidden_state[a+k-1]), the distribution of token a+k), restricted to the draft
vocabulary; loss = sum over scored slots of exp(-(k-1)/gamma) * KL(target || draft) / number of scored slots
(speculators 0.9's DFlash loss; SpecForge uses hard data labels instead).
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from specgen.draft.model import ReducedVocabHead, aux_layers_of
from specgen.draft.target_head import TargetDistribution
from specgen.draft.ttt import (
    MASK_SHIFTS,
    STAT_CHAIN,
    STAT_CORRECT,
    STAT_IN_VOCAB,
    STAT_LOSS_SUM,
    STAT_PREDICTED,
    STAT_VALID,
    step_metrics,
)
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


def valid_anchors(loss_mask: torch.Tensor, document_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: positions a that may anchor a block: x_a and x_{a+1} are trained tokens of one sample."""
    valid = torch.zeros_like(loss_mask, dtype=torch.bool)
    valid[:, :-1] = (loss_mask[:, :-1] > 0) & (loss_mask[:, 1:] > 0) & (document_ids[:, :-1] == document_ids[:, 1:]) \
        & (document_ids[:, :-1] >= 0)
    return valid


def batch_seed(input_ids: torch.Tensor, seed: int) -> int:
    """A seed fixed by the batch's content and the run's seed: the same batch gets the same anchors after a resume."""
    weights = torch.arange(1, input_ids.numel() + 1, device=input_ids.device, dtype=torch.long)
    return int((input_ids.reshape(-1).long() * weights).sum().item() + 1_000_003 * seed) % (2 ** 63 - 1)


def sample_anchors(valid: torch.Tensor, max_anchors: int,
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `max_anchors` anchors per row, uniformly among the valid positions, in increasing order.
    Returns (anchors [B, A] long, kept [B, A] bool); A = min(max_anchors, most valid positions of a row);
    padding anchors are 0 and not kept."""
    counts = valid.sum(dim=1)
    width = max(1, min(max_anchors, int(counts.max().item()) if counts.numel() else 0))
    noise = torch.rand(valid.shape, generator=generator, device="cpu").to(valid.device)
    noise = noise.masked_fill(~valid, 2.0)
    chosen = noise.argsort(dim=1)[:, :width]
    kept = torch.arange(width, device=valid.device)[None] < counts.clamp(max=width)[:, None]
    sentinel = valid.shape[1]
    anchors = torch.where(kept, chosen, torch.full_like(chosen, sentinel)).sort(dim=1).values
    kept = anchors < sentinel
    return torch.where(kept, anchors, 0), kept


def block_visibility(anchors: torch.Tensor, kept: torch.Tensor, document_ids: torch.Tensor, block_size: int,
                     causal: bool = False) -> torch.Tensor:
    """[B, A*B, T + A*B] bool: slot (anchor a, offset k) sees context entries s < a of a's own sample and the slots
    of its own block (all of them; with `causal` offsets <= k). A padding block sees only its own slots."""
    batch, num_anchors = anchors.shape
    seq_len = document_ids.shape[1]
    slots = num_anchors * block_size
    anchor = anchors.repeat_interleave(block_size, dim=1)  # [B, slots]
    anchor_doc = document_ids.gather(1, anchor)
    keep = kept.repeat_interleave(block_size, dim=1)
    position = torch.arange(seq_len, device=anchors.device)
    context = (position[None, None] < anchor[..., None]) & (document_ids[:, None] == anchor_doc[..., None]) \
        & keep[..., None]
    block = torch.arange(slots, device=anchors.device) // block_size
    offset = torch.arange(slots, device=anchors.device) % block_size
    own = block[:, None] == block[None, :]
    if causal:
        own = own & (offset[None, :] <= offset[:, None])
    return torch.cat([context, own[None].expand(batch, -1, -1)], dim=2)


@dataclass
class DFlashOutput:
    loss: torch.Tensor
    stats: torch.Tensor  # [block_size - 1, 6]: per slot 1..B-1, the columns of specgen.draft.ttt (STAT_*)


def slot_weights(block_size: int, gamma: float | None, device=None) -> torch.Tensor:
    """[B] loss weight of each slot: 0 for the anchor slot, exp(-(k-1)/gamma) for slot k >= 1 (1 without gamma)."""
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    weights = torch.exp(-(k - 1).clamp(min=0) / gamma) if gamma else torch.ones(block_size, device=device)
    return weights * (k > 0)


def dflash_loss(draft: DFlashDraft, input_ids: torch.Tensor, loss_mask: torch.Tensor, aux_hidden_states: torch.Tensor,
                target: TargetDistribution, *, anchors: torch.Tensor, kept: torch.Tensor, gamma: float | None,
                position_ids: torch.Tensor | None = None, document_ids: torch.Tensor | None = None,
                drop_out_of_vocab: bool = True) -> DFlashOutput:
    """The DFlash training loss of one batch for the given anchors (see the module docstring)."""
    batch, seq_len = input_ids.shape
    size = draft.block_size
    device = input_ids.device
    if position_ids is None:
        position_ids = torch.arange(seq_len, device=device).expand(batch, -1)
    if document_ids is None:
        document_ids = torch.zeros_like(input_ids)
    num_anchors = anchors.shape[1]
    offsets = torch.arange(size, device=device)
    slot_index = anchors[..., None] + offsets  # [B, A, size]: the sequence index each slot stands for
    in_row = slot_index < seq_len
    safe = slot_index.clamp(max=seq_len - 1).reshape(batch, -1)
    anchor_doc = document_ids.gather(1, anchors)
    scored = (kept[..., None] & in_row & (offsets > 0)
              & (document_ids.gather(1, safe).view(batch, num_anchors, size) == anchor_doc[..., None])
              & (loss_mask.gather(1, safe).view(batch, num_anchors, size) > 0))

    block_ids = torch.full((batch, num_anchors, size), draft.mask_token_id, dtype=torch.long, device=device)
    block_ids[..., 0] = torch.where(kept, input_ids.gather(1, anchors), draft.mask_token_id)
    anchor_positions = position_ids.gather(1, anchors)
    block_positions = (anchor_positions[..., None] + offsets).reshape(batch, -1)
    visible = block_visibility(anchors, kept, document_ids, size, causal=draft.causal)
    context = draft.context_kv(aux_hidden_states, position_ids)
    hidden = draft(block_ids.reshape(batch, -1), block_positions, context, visible).view(batch, num_anchors, size, -1)

    # Slot k stands for token a+k; its target is the distribution at a+k-1 (which predicts token a+k).
    target_index = (slot_index - 1).clamp(min=0, max=seq_len - 1).reshape(batch, -1)
    picked = scored.reshape(batch, -1)
    slot_of = offsets.expand(batch, num_anchors, size).reshape(batch, -1)[picked]
    log_probs = F.log_softmax(draft.logits(hidden.reshape(batch, -1, hidden.shape[-1])[picked]).float(), dim=-1)
    rows = torch.arange(batch, device=device)[:, None].expand(-1, num_anchors * size)[picked]
    target_probs = target.probs[rows, target_index[picked]]
    target_argmax = target.argmax[rows, target_index[picked]]
    in_vocab = draft.t2d[target_argmax.clamp(min=0)]
    in_loss = in_vocab if drop_out_of_vocab else torch.ones_like(in_vocab)
    kl = (torch.xlogy(target_probs, target_probs) - target_probs * log_probs).sum(-1)  # KL(target || draft)
    weights = slot_weights(size, gamma, device)[slot_of]
    count = in_loss.sum()
    loss = (kl * weights * in_loss).sum() / count.clamp(min=1)
    if not picked.any():
        loss = loss + draft.fc.weight.sum() * 0  # nothing scored: a zero loss that still reaches the weights
    stats = _slot_stats(draft, scored, slot_of, kl.detach(), in_loss, in_vocab, log_probs.detach(), target_argmax)
    return DFlashOutput(loss=loss, stats=stats)


def _slot_stats(draft: DFlashDraft, scored: torch.Tensor, slot_of: torch.Tensor, kl: torch.Tensor,
                in_loss: torch.Tensor, in_vocab: torch.Tensor, log_probs: torch.Tensor,
                target_argmax: torch.Tensor) -> torch.Tensor:
    """Per slot 1..B-1 the sums of specgen.draft.ttt's STAT_* columns: `chain` counts blocks whose slots 1..k were
    all right among the blocks scored at slot 1, so accept_len_sim is a block's simulated acceptance."""
    size = draft.block_size
    stats = torch.zeros(size - 1, 6, dtype=torch.float64, device=scored.device)
    with torch.no_grad():
        hits = draft.to_target_ids(log_probs.argmax(-1)) == target_argmax
        right = torch.zeros_like(scored)
        right[scored] = hits
        chain = scored[..., 1].clone()
        for k in range(1, size):
            at = slot_of == k
            chain &= right[..., k]
            stats[k - 1, STAT_LOSS_SUM] = (kl * in_loss)[at].sum().double()
            stats[k - 1, STAT_VALID] = in_loss[at].sum().double()
            stats[k - 1, STAT_CORRECT] = hits[at].sum().double()
            stats[k - 1, STAT_PREDICTED] = at.sum().double()
            stats[k - 1, STAT_CHAIN] = chain.sum().double()
            stats[k - 1, STAT_IN_VOCAB] = in_vocab[at].sum().double()
    return stats


class DFlashObjective(nn.Module):
    """The draft and its loss as one module, with the trainer's forward signature (`TTTObjective`'s):
    forward(input_ids, loss_mask, aux_hidden_states, target_probs, target_argmax, position_ids, document_ids)
    -> (loss, stats). Anchors are drawn with a generator seeded by (seed, the batch's content). Slot k is scored
    where its own token is trained, so the trainer computes the target at the positions of train.loss_mask=predicted
    whatever train.loss_mask says (`mask_shift`)."""

    mask_shift = MASK_SHIFTS["predicted"]

    def __init__(self, draft: DFlashDraft, *, max_anchors: int, gamma: float | None, seed: int = 0,
                 drop_out_of_vocab: bool = True):
        super().__init__()
        self.draft = draft
        self.max_anchors = max_anchors
        self.gamma = gamma
        self.seed = seed
        self.drop_out_of_vocab = drop_out_of_vocab

    def forward(self, input_ids, loss_mask, aux_hidden_states, target_probs, target_argmax, position_ids,
                document_ids):
        generator = torch.Generator().manual_seed(batch_seed(input_ids, self.seed))
        anchors, kept = sample_anchors(valid_anchors(loss_mask, document_ids), self.max_anchors, generator)
        out = dflash_loss(self.draft, input_ids, loss_mask, aux_hidden_states,
                          TargetDistribution(target_probs, target_argmax), anchors=anchors, kept=kept,
                          gamma=self.gamma, position_ids=position_ids, document_ids=document_ids,
                          drop_out_of_vocab=self.drop_out_of_vocab)
        return out.loss, out.stats


# ---------------------------------------------------------------------------------------------------------------
# The draft method (`specgen.draft.methods`)


class DFlashProposer:
    """vLLM's DFlashProposer as a `specgen.draft.methods.Proposer`: the draft's context grows by the target features
    of every verified position; each call drafts from ONE forward over [x, M x K] at the next K + 1 positions, x
    being the last of `tokens` (the target's next token), and returns the argmax of slots 1..K."""

    def __init__(self, draft: DFlashDraft):
        self.draft = draft
        self.device = next(draft.parameters()).device
        self.context: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.known = 0  # positions in the draft's context

    def propose(self, aux: torch.Tensor, tokens: list[int], num_draft_tokens: int) -> list[int]:
        draft, device = self.draft, self.device
        positions = torch.arange(self.known, self.known + aux.shape[0], device=device)[None]
        new = draft.context_kv(aux.to(device)[None], positions)
        self.context = new if self.context is None else [
            (torch.cat([k0, k1], 2), torch.cat([v0, v1], 2)) for (k0, v0), (k1, v1) in zip(self.context, new)]
        self.known += aux.shape[0]
        block = torch.tensor([[tokens[-1]] + [draft.mask_token_id] * num_draft_tokens], device=device)
        block_positions = torch.arange(self.known, self.known + num_draft_tokens + 1, device=device)[None]
        hidden = draft(block, block_positions, self.context, self._visibility(num_draft_tokens))
        return draft.to_target_ids(draft.logits(hidden[0, 1:]).argmax(-1)).tolist()

    def _visibility(self, k: int) -> torch.Tensor | None:
        """All context entries and the whole block (None), or with `causal` the block's earlier slots only."""
        if not self.draft.causal:
            return None
        own = torch.ones(k + 1, k + 1, dtype=torch.bool, device=self.device).tril()
        return torch.cat([torch.ones(k + 1, self.known, dtype=torch.bool, device=self.device), own], dim=1)[None]


@dataclass(frozen=True)
class DFlashMethod:
    """draft.method=dflash. Keys: draft.dflash.{num_layers, block_size, causal} shape a new draft,
    draft.dflash.{max_anchors, loss_decay_gamma} its loss; draft.mask_token_id (shared with p-eagle) the mask slots'
    token. Checkpoints are vLLM's DFlash layout (`specgen.draft.dflash_serving`), the only export format."""

    name: str = METHOD

    def new_draft(self, target_config, *, aux_layers: list[int], mapping, embedding: torch.Tensor,
                  lm_head: torch.Tensor, draft_cfg: dict) -> DFlashDraft:
        from specgen.draft.dflash_serving import set_dflash_embedding
        from specgen.draft.peagle import default_mask_token_id

        options = draft_cfg.get("dflash") or {}
        mask_token_id = draft_cfg.get("mask_token_id")
        config = dflash_config(target_config, aux_layers=aux_layers, draft_vocab_size=mapping.draft_vocab_size,
                               num_layers=options.get("num_layers", 2), block_size=options.get("block_size", 5),
                               mask_token_id=int(default_mask_token_id(target_config) if mask_token_id is None
                                                 else mask_token_id),
                               causal=bool(options.get("causal", False)), overrides=draft_cfg.get("overrides"))
        draft = DFlashDraft(config)
        draft.d2t.copy_(mapping.d2t)
        draft.t2d.copy_(mapping.t2d)
        set_dflash_embedding(draft, embedding)
        if draft_cfg.get("init_lm_head", "target") == "target":
            draft.init_lm_head_from_target(lm_head)
        return draft

    def load(self, folder, *, embedding: torch.Tensor | None, target_config, foreign_ids: str) -> DFlashDraft:
        from specgen.draft.dflash_serving import load_dflash

        return load_dflash(folder, embedding=embedding)

    def objective(self, draft: DFlashDraft, *, train_cfg: dict, mask_shift: int) -> DFlashObjective:
        options = (train_cfg.get("draft") or {}).get("dflash") or {}
        return DFlashObjective(draft, max_anchors=options.get("max_anchors", 512),
                               gamma=options.get("loss_decay_gamma", 4.0), seed=int(train_cfg.get("seed", 0)),
                               drop_out_of_vocab=train_cfg.get("out_of_vocab", "drop") == "drop")

    def metrics(self, stats: torch.Tensor, train_cfg: dict) -> dict[str, float]:
        """TTT's metrics with one row per block slot 1..K; the logged loss weighs slot k by exp(-(k-1)/gamma)
        (the ratio of neighbouring slot weights, as the loss does)."""
        gamma = ((train_cfg.get("draft") or {}).get("dflash") or {}).get("loss_decay_gamma", 4.0)
        return step_metrics(stats, math.exp(-1 / gamma) if gamma else 1.0)

    def export(self, config, tensors: dict[str, torch.Tensor], fmt: str, *, info: dict | None = None,
               speculative_tokens: int = 3, verifier: str | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
        """vLLM's DFlash layout (`specgen.draft.dflash_serving`); every other format is refused in one line."""
        from specgen.draft import exports
        from specgen.draft.dflash_serving import config_dict

        if fmt != "vllm":
            raise SpecgenError(f"a DFlash draft exports as export.format=vllm only (served with method=dflash); "
                               f"{fmt} holds EAGLE-3 drafts")
        tensors = {name: t for name, t in tensors.items() if name != "embed_tokens.weight"}
        if config.draft_vocab_size == config.vocab_size:
            tensors.pop("d2t", None)  # vLLM has no draft_id_to_target_id parameter for a full vocabulary
        info = {key: value for key, value in (info or {}).items() if key != "checksums"}
        return config_dict(config, exports.stored_dtype(tensors), info), tensors

    def proposer(self, draft: DFlashDraft) -> DFlashProposer:
        return DFlashProposer(draft)


METHODS = {METHOD: DFlashMethod()}
