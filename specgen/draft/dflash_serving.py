"""DFlash checkpoints (the layout vLLM 0.32's `method="dflash"` reads) and the greedy decode that mirrors its proposer.

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
import time
from pathlib import Path

import torch
import transformers
from transformers import DynamicCache

from specgen.draft import formats
from specgen.draft.dflash import METHOD, DFlashDraft, aux_layers_of, is_dflash_config
from specgen.draft.speculative import Generation, TargetRunner, _finish
from specgen.errors import SpecgenError
from specgen.store.commit import checksum_problems

_NOT_STORED = ("embed_tokens.weight",)


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
               "aux_layer_convention": formats.AUX_LAYER_CONVENTION,
               "target_layer_ids": "dflash_config.target_layer_ids = 0-based decoder-layer outputs (= aux_layers); "
                                   "vLLM reads them as eagle aux ids + 1"}
    return {**data, "specgen": section}


def stored_tensors(draft: DFlashDraft) -> dict[str, torch.Tensor]:
    tensors = {name: t for name, t in draft.state_dict().items() if name not in _NOT_STORED}
    if draft.config.draft_vocab_size == draft.config.vocab_size:
        tensors.pop("d2t")  # vLLM has no draft_id_to_target_id parameter for a full vocabulary
    return tensors


def save_dflash(draft: DFlashDraft, out_dir: str | Path, info: dict, dtype: torch.dtype | None = None) -> None:
    """Write config.json + model.safetensors (each atomically; the weights' sha256 recorded in config.json)."""
    tensors = stored_tensors(draft)
    if dtype is not None:
        tensors = {n: t.to(dtype) if t.is_floating_point() else t for n, t in tensors.items()}
    formats.write_files(out_dir, config_dict(draft.config, formats.stored_dtype(tensors), info), tensors)


def read_config(path: str | Path) -> transformers.Qwen3Config:
    folder = Path(path)
    raw = json.loads((folder / formats.CONFIG).read_text())
    if not is_dflash_config(raw):
        raise SpecgenError(f"{folder} is not a DFlash draft (architectures {raw.get('architectures')})")
    raw = {k: v for k, v in raw.items() if k not in ("transformers_version",)}
    config = transformers.Qwen3Config(**{k: v for k, v in raw.items() if k != "specgen"})
    config.specgen = raw.get("specgen") or {}
    return config


def load_dflash(path: str | Path, embedding: torch.Tensor | None = None) -> DFlashDraft:
    """A DFlash checkpoint (as `save_dflash` writes it); `embedding` is the target's input embedding."""
    folder = Path(path)
    config = read_config(folder)
    damaged = checksum_problems({formats.WEIGHTS: folder / formats.WEIGHTS},
                                (config.specgen or {}).get("checksums") or {})
    if damaged:
        raise SpecgenError(f"{folder}: {damaged[0]}; restore the checkpoint from a copy or train it again")
    draft = DFlashDraft(config)
    state = {name: t.float() if t.is_floating_point() else t for name, t in formats.read_tensors(folder).items()}
    if "d2t" not in state:
        state["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.long)
    state.setdefault("t2d", _t2d(state["d2t"], config.vocab_size))
    missing, unexpected = draft.load_state_dict(state, strict=False)
    missing = [name for name in missing if name not in _NOT_STORED]
    if missing or unexpected:
        raise SpecgenError(f"{folder / formats.WEIGHTS} does not match its DFlash config: missing {missing}, "
                           f"unexpected {unexpected}")
    if embedding is not None:
        set_dflash_embedding(draft, embedding)
    return draft


def _t2d(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[torch.arange(len(d2t)) + d2t] = True
    return t2d


def set_dflash_embedding(draft: DFlashDraft, embedding: torch.Tensor) -> None:
    if tuple(embedding.shape) != tuple(draft.embed_tokens.weight.shape):
        raise SpecgenError(f"the target's embedding is {tuple(embedding.shape)} but the DFlash draft expects "
                           f"{tuple(draft.embed_tokens.weight.shape)}: the draft was trained for another target")
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(embedding)


# ---------------------------------------------------------------------------------------------------------------
# Decoding, as vLLM's DFlashProposer drafts


@torch.inference_mode()
def dflash_generate(target: TargetRunner, draft: DFlashDraft, prompt_ids: list[int], *, num_draft_tokens: int,
                    max_new_tokens: int, eos_ids: set[int]) -> Generation:
    """Greedy speculative decoding with K = `num_draft_tokens` DFlash drafts per round, as vLLM runs it:
    the draft's context grows by the target features of every verified position (prompt, then the bonus token and
    the accepted drafts of each round); each round drafts from ONE forward over [bonus, mask x K] at positions
    p..p+K, taking the argmax of slots 1..K; the target verifies them and the longest matching prefix is accepted
    plus the target's own next token (acceptance counted as `specgen.draft.speculative` / vLLM count it)."""
    if num_draft_tokens < 1:
        raise SpecgenError(f"evaluate.num_draft_tokens must be at least 1, got {num_draft_tokens}")
    start = time.perf_counter()
    device = next(draft.parameters()).device
    cache, context = DynamicCache(), None
    logits, aux = target.forward(prompt_ids, cache)
    result = Generation(tokens=[int(logits[-1].argmax())])
    pending = aux  # target features of verified positions not yet in the draft's context
    known = 0  # positions in the draft's context
    done = result.tokens[0] in eos_ids or max_new_tokens <= 1
    while not done:
        positions = torch.arange(known, known + pending.shape[0], device=device)[None]
        new = draft.context_kv(pending.to(device)[None], positions)
        context = new if context is None else [(torch.cat([k0, k1], 2), torch.cat([v0, v1], 2))
                                               for (k0, v0), (k1, v1) in zip(context, new)]
        known += pending.shape[0]
        block = torch.tensor([[result.tokens[-1]] + [draft.mask_token_id] * num_draft_tokens], device=device)
        block_positions = torch.arange(known, known + num_draft_tokens + 1, device=device)[None]
        hidden = draft(block, block_positions, context, _decode_visibility(draft, known, num_draft_tokens, device))
        drafted = draft.to_target_ids(draft.logits(hidden[0, 1:]).argmax(-1)).tolist()

        verified_length = known + 1  # the target's cache once the bonus token is consumed
        logits, aux = target.forward([result.tokens[-1]] + drafted, cache)
        greedy = logits.argmax(-1).tolist()
        accepted = 0
        while accepted < num_draft_tokens and drafted[accepted] == greedy[accepted]:
            accepted += 1
        emitted = drafted[:accepted] + [greedy[accepted]]
        rejected = cache.get_seq_length() - (verified_length + accepted)
        if rejected:
            cache.crop(-rejected)
        pending = aux[: accepted + 1]

        before = len(result.tokens)
        result.tokens, done = _finish(result.tokens + emitted, max_new_tokens, eos_ids)
        result.accepted.append(accepted)
        result.rounds_emitted.append(len(result.tokens) - before)
    result.seconds = time.perf_counter() - start
    return result


def _decode_visibility(draft: DFlashDraft, known: int, k: int, device) -> torch.Tensor | None:
    """All context entries and the whole block (None), or with `causal` the block's earlier slots only."""
    if not draft.causal:
        return None
    own = torch.ones(k + 1, k + 1, dtype=torch.bool, device=device).tril()
    return torch.cat([torch.ones(k + 1, known, dtype=torch.bool, device=device), own], dim=1)[None]
