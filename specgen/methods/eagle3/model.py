"""The EAGLE-3 draft: one Llama decoder layer that reads the target's fused hidden states and its own past.

    h      = fc(concat(aux hidden states of the target))        # [.., k*H_target] -> [.., H]
    x      = concat(input_layernorm(embed(token)), hidden_norm(h))   # [.., 2H]: what attention reads
    r      = h + attn(x)                                         # residual stream starts at h, or at
                                                                 # hidden_norm(h) with norm_before_residual
    out    = r + mlp(post_attention_layernorm(r))                # "pre-norm" output, fed to the next step
    logits = lm_head(norm(out))                                  # over the reduced draft vocabulary

This is the layout vLLM's and SGLang's `LlamaForCausalLMEagle3` loaders implement (module names included:
`fc`, `midlayer.{input_layernorm,hidden_norm,self_attn,post_attention_layernorm,mlp}`, `norm`, `lm_head`), so
a checkpoint saved by `specgen.draft.checkpoint` serves unchanged. The token embedding is the target's and stays
frozen; `d2t`/`t2d` map between draft and target vocabularies (see `specgen.draft.vocab`).
`config.norm_before_residual` (default False) is the variant vLLM's `llama_eagle3` and speculators name so: the
residual stream starts at the normalised hidden state instead of the raw one; it is carried in config.json.

Attention covers two kinds of entries (`DraftKV`):
* base entries, one per sequence position, made by a step that read the *target's* hidden state there;
* chain entries, made by later draft steps that read the draft's own previous output at the same position.
A query at index i attends to base entries 0..i (causal) and to the chain entries at index i (the diagonal).
During training (TTT) every index runs the chain at once; during decoding only the last verified index does.
Both use the same code path, so what is trained is exactly what is served.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from specgen.draft.aux import num_aux_layers, serving_layer_ids
from specgen.draft.exports import ARCHITECTURE
from specgen.draft.vocab import ReducedVocabHead
from specgen.errors import SpecgenError

# Attention score elements (batch x heads x queries x keys) computed at once, per device type; longer rows attend
# in query chunks (docs/benchmarks/2026-11-26-cuda-and-long-samples.md: on CPU 2^22 ran an 8k-token packed row
# 13x faster than one dense pass; on a GPU larger chunks keep the kernel launches few).
ATTENTION_CHUNK = {"cpu": 1 << 22, "cuda": 1 << 26}

# Target config entries the draft inherits: its single layer has the target's shape, so the draft's hidden state
# lives in the target's embedding space and attention uses the target's rotary scheme.
_INHERITED = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "hidden_act", "rms_norm_eps", "max_position_embeddings", "rope_parameters", "vocab_size",
              "bos_token_id", "eos_token_id", "pad_token_id")
# Sizes a user may override (anything that does not have to match the target).
OVERRIDABLE = ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
               "max_position_embeddings", "rms_norm_eps")


def draft_config(target_config: transformers.PretrainedConfig, *, aux_layers: list[int], draft_vocab_size: int,
                 overrides: dict | None = None, norm_before_residual: bool, fc_norm: bool = False,
                 norm_before_fc: bool = False, norm_output: bool = False) -> transformers.LlamaConfig:
    """The draft's config, derived from the target's (text) config.

    `aux_layers` are specgen's 0-based decoder-layer output indices; `eagle_config.eagle_aux_hidden_state_layer_ids`
    holds them as vLLM reads them (`serving_layer_ids`: Hugging Face hidden_states indices, aux + 1), so the
    checkpoint serves in vLLM as trained. `aux_layers_of(config)` gives specgen's indices back.
    `overrides` may change the sizes in `OVERRIDABLE`; the hidden size must stay the target's because the
    draft shares the target's token embedding. `norm_before_residual` selects the layer variant (module docstring).
    `fc_norm`, `norm_before_fc` and `norm_output` are EAGLE-3.1's flags (`Eagle3Draft`), under the names vLLM 0.32
    and speculators 0.9 read.
    """
    text = target_config.get_text_config()
    fields = {key: getattr(text, key) for key in _INHERITED if getattr(text, key, None) is not None}
    fields.setdefault("head_dim", text.hidden_size // text.num_attention_heads)
    fields.setdefault("intermediate_size", 4 * text.hidden_size)  # targets without one (GPT-2: n_inner=None)
    unknown = sorted(set(overrides or {}) - set(OVERRIDABLE))
    if unknown:
        raise SpecgenError(f"draft.overrides has keys {unknown} that cannot be overridden; allowed: "
                           f"{list(OVERRIDABLE)} (hidden_size and vocab_size follow the target)")
    fields.update(overrides or {})
    config = transformers.LlamaConfig(**fields, num_hidden_layers=1, tie_word_embeddings=False,
                                      attention_bias=False, mlp_bias=False)
    config.architectures = [ARCHITECTURE]
    config.draft_vocab_size = int(draft_vocab_size)
    config.norm_before_residual = bool(norm_before_residual)
    if fc_norm or norm_before_fc or norm_output:  # EAGLE-3.1 (absent keys: plain EAGLE-3, as before)
        config.fc_norm, config.norm_before_fc, config.norm_output = bool(fc_norm), bool(norm_before_fc), \
            bool(norm_output)
    config.target_hidden_size = int(text.hidden_size)
    config.eagle_config = {"eagle_aux_hidden_state_layer_ids": serving_layer_ids(aux_layers),
                           "use_aux_hidden_state": True}
    return config


def _repeat_kv(states: torch.Tensor, times: int) -> torch.Tensor:
    """[B, Hkv, n, d] -> [B, Hkv * times, n, d] for grouped-query attention."""
    return states if times == 1 else states.repeat_interleave(times, dim=1)


class DraftKV:
    """Keys and values the draft attends over (after rotary embedding, before head repetition).

    `base` holds one entry per position (steps that read the target's hidden states); `chain` holds, per later
    step, one entry per query index (steps that read the draft's own output). Start a fresh `DraftKV` for every
    training batch; in decoding keep it across rounds and call `drop_chain()` once a round is verified.
    """

    def __init__(self, document_ids: torch.Tensor | None = None):
        self.document_ids = document_ids  # [B, T] training only: a query sees base entries of its own document
        self.base_keys: torch.Tensor | None = None
        self.base_values: torch.Tensor | None = None
        self.chain: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._chunks: tuple[tuple[int, int, int], list[Chunk]] | None = None  # `chunks`' plan and what it is for

    @property
    def base_length(self) -> int:
        return 0 if self.base_keys is None else self.base_keys.shape[2]

    def add_base(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        if self.chain:
            raise RuntimeError("base entries cannot be added while chain entries exist; call drop_chain() first")
        if self.base_keys is None:
            self.base_keys, self.base_values = keys, values
        else:
            self.base_keys = torch.cat([self.base_keys, keys], dim=2)
            self.base_values = torch.cat([self.base_values, values], dim=2)

    def add_chain(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        if self.base_keys is None:
            raise RuntimeError("a chain step needs base entries to attend to; run a base step first")
        self.chain.append((keys, values))

    def drop_chain(self) -> None:
        self.chain = []

    def chunks(self, n: int, size: int) -> list["Chunk"]:
        """The query chunks of `size` for the last n of the base entries, each over the keys its queries can see
        (from the earliest sample start of its first query); computed once per batch (one device-to-host copy)
        and kept while the base entries stay."""
        key = (n, size, self.base_length)
        if self._chunks is None or self._chunks[0] != key:
            base_length = self.base_length
            starts = (sample_starts(self.document_ids[:, :base_length]).min(dim=0).values.tolist()
                      if self.document_ids is not None else None)
            plan = []
            for lo in range(0, n, size):
                hi, first = min(lo + size, n), base_length - n + lo  # queries [lo, hi) sit at base indices first..
                key_lo = starts[first] if starts is not None else 0
                plan.append(Chunk(lo, hi, key_lo, base_length - n + hi, first - key_lo))
            self._chunks = (key, plan)
        return self._chunks[1]

    def crop(self, length: int) -> None:
        """Keep the first `length` base entries (decoding: forget positions the target rejected)."""
        self.drop_chain()
        if self.base_keys is not None:
            self.base_keys = self.base_keys[:, :, :length]
            self.base_values = self.base_values[:, :, :length]


class DraftAttention(nn.Module):
    """Grouped-query attention whose projections read the 2H-wide [embedding; hidden] input."""

    def __init__(self, config: transformers.LlamaConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        width = 2 * config.hidden_size
        self.q_proj = nn.Linear(width, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: DraftKV, *,
                extend_base: bool) -> torch.Tensor:
        batch, n, _ = x.shape
        q = self.q_proj(x).view(batch, n, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if extend_base:
            kv.add_base(k, v)
        else:
            kv.add_chain(k, v)
        out = self._attend(q, kv)
        return self.o_proj(out.transpose(1, 2).reshape(batch, n, -1))

    def _attend(self, q: torch.Tensor, kv: DraftKV) -> torch.Tensor:
        """Softmax over [base entries 0..i ; chain entries at i] for the query at index i.

        The n queries sit at the last n base indices (q_start = base_length - n): in training n is the whole
        sequence, in decoding it is the newly verified positions (base step) or the last position (chain step).
        Up to ATTENTION_CHUNK score elements this is one dense pass; above it (long training rows) the queries
        run in chunks, each over the keys its queries can see (from the first one's sample start to its own
        index), recomputed in backward (`attend_in_chunks`), so memory grows linearly with the row.
        """
        n, base_length = q.shape[2], kv.base_length
        chain_keys = torch.stack([k for k, _ in kv.chain], dim=-2) if kv.chain else None  # [B, Hkv, n, steps, d]
        chain_values = torch.stack([v for _, v in kv.chain], dim=-2) if kv.chain else None
        budget = ATTENTION_CHUNK.get(q.device.type, ATTENTION_CHUNK["cpu"])
        size = max(1, budget // (q.shape[0] * q.shape[1] * base_length))
        documents = None if kv.document_ids is None else kv.document_ids[:, :base_length]
        if size >= n:
            return self._attend_rows(q, kv.base_keys, kv.base_values, chain_keys, chain_values, documents,
                                     base_length - n)
        return attend_in_chunks(self._attend_rows, kv.chunks(n, size), q, kv.base_keys, kv.base_values, chain_keys,
                                chain_values, documents)

    def _attend_rows(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     chain_keys: torch.Tensor | None, chain_values: torch.Tensor | None,
                     document_ids: torch.Tensor | None, q_start: int) -> torch.Tensor:
        """Queries q [B, H, n, d] at key indices q_start.. over keys/values [B, Hkv, K, d] (causal, within the
        query's document when `document_ids` [B, K] is given) and the chain entries [B, Hkv, n, steps, d] at each
        query's own index."""
        repeat = self.num_heads // self.num_kv_heads
        n, length = q.shape[2], keys.shape[2]
        scale = 1.0 / math.sqrt(self.head_dim)
        scores = torch.matmul(q, _repeat_kv(keys, repeat).transpose(2, 3)) * scale  # [B, H, n, K]
        query_index = torch.arange(q_start, q_start + n, device=q.device)[:, None]
        key_index = torch.arange(length, device=q.device)[None, :]
        hidden = key_index > query_index
        if document_ids is not None:  # packed training rows: attend within the query's own sample
            documents = document_ids[:, None, :]
            hidden = hidden | (documents[..., q_start:q_start + n, None] != documents[..., None, :])
        scores = scores.masked_fill(hidden, float("-inf"))
        if chain_keys is not None:
            chain_keys, chain_values = _repeat_kv(chain_keys, repeat), _repeat_kv(chain_values, repeat)
            diagonal = (q.unsqueeze(-2) * chain_keys).sum(-1) * scale  # [B, H, n, steps]
            scores = torch.cat([scores, diagonal], dim=-1)
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs[..., :length], _repeat_kv(values, repeat))
        if chain_keys is not None:
            out = out + (probs[..., length:].unsqueeze(-1) * chain_values).sum(-2)
        return out


def sample_starts(document_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] long: the index where each token's sample (run of equal document ids) starts in its row."""
    index = torch.arange(document_ids.shape[1], device=document_ids.device).expand_as(document_ids)
    boundary = torch.ones_like(document_ids, dtype=torch.bool)
    boundary[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return torch.where(boundary, index, torch.zeros_like(index)).cummax(dim=1).values


@dataclass(frozen=True)
class Chunk:
    """Queries [lo, hi) of a step over base keys [key_lo, key_hi); the first query sits at key index q_start of
    that range."""

    lo: int
    hi: int
    key_lo: int
    key_hi: int
    q_start: int

    def spans(self) -> tuple[slice, ...]:
        """The chunk's slice (dim 2) of each of q, keys, values, chain keys, chain values."""
        queries, keys = slice(self.lo, self.hi), slice(self.key_lo, self.key_hi)
        return queries, keys, keys, queries, queries

    def inputs(self, q, keys, values, chain_keys, chain_values, documents) -> tuple:
        """`DraftAttention._attend_rows`' arguments for this chunk (views of the whole step's tensors)."""
        views = [None if t is None else t[:, :, span]
                 for t, span in zip((q, keys, values, chain_keys, chain_values), self.spans(), strict=True)]
        return (*views, None if documents is None else documents[:, self.key_lo:self.key_hi], self.q_start)


def attend_in_chunks(attend, chunks: list[Chunk], q, keys, values, chain_keys, chain_values, documents):
    """`attend` (`DraftAttention._attend_rows`) chunk by chunk, the outputs concatenated along the queries. Where a
    gradient is wanted each chunk is recomputed in backward: memory linear in the row, as `torch.utils.checkpoint`
    per chunk, but with one gradient buffer per input filled chunk by chunk in place, where per-chunk slicing under
    autograd zero-fills and adds a whole-row gradient for every chunk (quadratic in the row)."""
    tensors = (q, keys, values, chain_keys, chain_values, documents)
    if not torch.is_grad_enabled():
        return _attend_all(attend, chunks, tensors)
    return _ChunkedAttention.apply(attend, chunks, *tensors)


def _attend_all(attend, chunks: list[Chunk], tensors: tuple) -> torch.Tensor:
    return torch.cat([attend(*chunk.inputs(*tensors)) for chunk in chunks], dim=2)


class _ChunkedAttention(torch.autograd.Function):
    """`attend_in_chunks`: forward without a graph; backward recomputes each chunk under the forward's autocast
    state and writes its input gradients into the slices of whole-tensor buffers (overlapping key ranges add)."""

    @staticmethod
    def forward(ctx, attend, chunks, q, keys, values, chain_keys, chain_values, documents):
        ctx.attend, ctx.chunks = attend, chunks
        device = q.device.type
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.save_for_backward(q, keys, values, chain_keys, chain_values, documents)
        return _attend_all(attend, chunks, (q, keys, values, chain_keys, chain_values, documents))

    @staticmethod
    def backward(ctx, grad_out):
        *inputs, documents = ctx.saved_tensors  # q, keys, values, chain keys, chain values; documents
        wanted = [t is not None and ctx.needs_input_grad[2 + i] for i, t in enumerate(inputs)]
        grads = [torch.zeros_like(t) if want else None for t, want in zip(inputs, wanted, strict=True)]
        device, enabled, dtype = ctx.autocast
        for chunk in ctx.chunks:
            *views, docs, q_start = chunk.inputs(*inputs, documents)
            leaves = [None if v is None else v.detach().requires_grad_(want) for v, want in zip(views, wanted)]
            with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
                out = ctx.attend(*leaves, docs, q_start)
            needed = [leaf for leaf, want in zip(leaves, wanted, strict=True) if want]
            parts = iter(torch.autograd.grad(out, needed, grad_out[:, :, chunk.lo:chunk.hi]))
            for grad, span, want in zip(grads, chunk.spans(), wanted, strict=True):
                if want:
                    grad[:, :, span] += next(parts)
        return None, None, *grads, None


class DraftDecoderLayer(nn.Module):
    """The draft's single decoder layer (`midlayer` in the published checkpoints)."""

    def __init__(self, config: transformers.LlamaConfig):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DraftAttention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv: DraftKV, *, extend_base: bool) -> torch.Tensor:
        normed = self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        # vLLM's llama_eagle3: the residual is taken after hidden_norm (norm_before_residual) or before it.
        residual = (normed if self.norm_before_residual else hidden) + self.self_attn(x, cos, sin, kv,
                                                                                      extend_base=extend_base)
        return residual + self.mlp(self.post_attention_layernorm(residual))


class Eagle3Draft(ReducedVocabHead, nn.Module):
    """EAGLE-3 draft model. Parameter names match the published checkpoints (see module docstring).

    EAGLE-3.1's flags (config, all False by default; vLLM 0.32 `llama_eagle3.py` and speculators 0.9 read them
    so): `norm_before_fc`: one RMSNorm (`input_norm`) over the concatenated k*H aux states before fc;
    `fc_norm`: an RMSNorm per aux layer (`fc_norm.{i}`) before fc (after input_norm when both are set);
    `norm_output`: a step returns norm(out), which is fed to the next step and read by the LM head unnormed.
    """

    method_name = "eagle3"

    def __init__(self, config: transformers.LlamaConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # the target's embedding, frozen
        self.fc = nn.Linear(num_aux_layers(config) * config.target_hidden_size, config.hidden_size, bias=False)
        k, width = num_aux_layers(config), config.target_hidden_size
        if getattr(config, "norm_before_fc", False):
            self.input_norm = LlamaRMSNorm(k * width, eps=config.rms_norm_eps)
        if getattr(config, "fc_norm", False):
            self.fc_norm = nn.ModuleList(LlamaRMSNorm(width, eps=config.rms_norm_eps) for _ in range(k))
        self.norm_output = bool(getattr(config, "norm_output", False))
        if self.norm_output or hasattr(self, "input_norm") or hasattr(self, "fc_norm"):
            self.method_name = "eagle3.1"
        self.midlayer = DraftDecoderLayer(config)
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Llama's initialisation: normal(0, initializer_range) weights, unit norms."""
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, LlamaRMSNorm):
                nn.init.ones_(module.weight)

    def project(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        """Fuse the target's k aux hidden states [.., k*H_target] into the draft's input hidden state [.., H]."""
        states = aux_hidden_states.to(self.fc.weight.dtype)
        if hasattr(self, "input_norm"):
            states = self.input_norm(states)
        if hasattr(self, "fc_norm"):
            chunks = states.chunk(len(self.fc_norm), dim=-1)
            states = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks, strict=True)], dim=-1)
        return self.fc(states)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor, kv: DraftKV, *,
                extend_base: bool) -> torch.Tensor:
        """One draft step over n positions: tokens [B, n] (target ids), hidden [B, n, H], positions [B, n].

        Returns the pre-norm output [B, n, H] (post-norm with norm_output): the next step's `hidden`, and
        `logits()`'s input.
        extend_base: the step read target hidden states (its entries become base entries) rather than the
        draft's own previous output (chain entries).
        """
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        cos, sin = self.rotary_emb(hidden, position_ids)
        out = self.midlayer(embeds, hidden, cos, sin, kv, extend_base=extend_base)
        return self.norm(out) if self.norm_output else out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [.., draft_vocab_size] from a step's output."""
        return self.lm_head(hidden if self.norm_output else self.norm(hidden))
