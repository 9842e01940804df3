"""The EAGLE-3 draft: TTT attention masks, training-vs-decoding consistency, published layout and config."""

import json
import math

import pytest
import torch
import transformers

from specgen.draft.aux import aux_layers_of
from specgen.errors import SpecgenError
from specgen.methods.eagle3.model import DraftKV, Eagle3Draft, draft_config

PUBLISHED_NAMES = {  # yuhuili/EAGLE3-LLaMA3.1-Instruct-8B, as read by vLLM / SGLang llama_eagle3.py
    "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
    "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight", "midlayer.post_attention_layernorm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: a second CPU thread only adds synchronisation, which stalls badly on a busy machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def tiny_target_config(**kwargs) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=6,
                                    num_attention_heads=4, num_key_value_heads=2, **kwargs)


def tiny_draft(seed: int = 0, draft_vocab: int = 20) -> Eagle3Draft:
    torch.manual_seed(seed)
    draft = Eagle3Draft(draft_config(tiny_target_config(), aux_layers=[1, 2, 3], draft_vocab_size=draft_vocab,
                                     norm_before_residual=False))
    torch.nn.init.normal_(draft.embed_tokens.weight)
    for norm in (draft.midlayer.input_layernorm, draft.midlayer.hidden_norm, draft.norm):
        torch.nn.init.uniform_(norm.weight, 0.5, 1.5)  # non-trivial norms so a mix-up shows
    for linear in (draft.midlayer.self_attn.q_proj, draft.midlayer.self_attn.k_proj):
        torch.nn.init.normal_(linear.weight, std=0.3)  # peaked attention so a wrong mask shows
    return draft.eval()


def unroll(draft: Eagle3Draft, tokens: torch.Tensor, aux: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """TTT over whole sequences: step j reads tokens shifted by 1+j and sits at positions i+j."""
    seq_len = tokens.shape[1]
    kv, hidden, outputs = DraftKV(), draft.project(aux), []
    for step in range(steps):
        shifted = torch.cat([tokens[:, 1 + step:], tokens.new_zeros(1, 1 + step)], dim=1)
        hidden = draft(shifted, hidden, torch.arange(seq_len)[None] + step, kv, extend_base=step == 0)
        outputs.append(hidden)
    return outputs


def test_draft_config_follows_target_and_records_eagle_keys():
    target = tiny_target_config(rope_theta=5e5, rms_norm_eps=1e-5)
    config = draft_config(target, aux_layers=[1, 2, 3], draft_vocab_size=20, overrides={"intermediate_size": 64},
                          norm_before_residual=False)
    assert config.architectures == ["LlamaForCausalLMEagle3"]
    assert config.num_hidden_layers == 1
    assert (config.hidden_size, config.vocab_size, config.target_hidden_size) == (32, 50, 32)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 8)
    assert config.rope_parameters["rope_theta"] == 5e5 and config.rms_norm_eps == 1e-5
    assert config.intermediate_size == 64 and config.draft_vocab_size == 20
    assert config.eagle_config["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]  # vLLM's reading: layer i -> i + 1
    assert aux_layers_of(config) == [1, 2, 3]
    with pytest.raises(SpecgenError, match="hidden_size"):
        draft_config(target, aux_layers=[1, 2, 3], draft_vocab_size=20, overrides={"hidden_size": 64},
                     norm_before_residual=False)


def test_parameter_names_and_shapes_are_the_published_layout():
    draft = tiny_draft()
    stored = {name: tuple(t.shape) for name, t in draft.state_dict().items() if name != "embed_tokens.weight"}
    assert set(stored) == PUBLISHED_NAMES
    assert stored["fc.weight"] == (32, 3 * 32)
    assert stored["midlayer.self_attn.q_proj.weight"] == (4 * 8, 2 * 32)  # attention reads [embedding; hidden]
    assert stored["midlayer.self_attn.k_proj.weight"] == (2 * 8, 2 * 32)
    assert stored["lm_head.weight"] == (20, 32)
    assert stored["d2t"] == (20,) and stored["t2d"] == (50,)
    assert not draft.embed_tokens.weight.requires_grad


def test_ttt_attention_matches_explicit_mask():
    """Step j at index i attends to base entries 0..i and to the chain entries at index i, nothing else."""
    draft = tiny_draft()
    attention = draft.midlayer.self_attn
    batch, heads, seq_len, dim, steps = 1, 4, 5, 8, 3
    torch.manual_seed(1)
    keys = [torch.randn(batch, 2, seq_len, dim) for _ in range(steps)]
    values = [torch.randn(batch, 2, seq_len, dim) for _ in range(steps)]
    query = torch.randn(batch, heads, seq_len, dim)
    kv = DraftKV()
    kv.add_base(keys[0], values[0])
    for step in range(1, steps):
        kv.add_chain(keys[step], values[step])
    got = attention._attend(query, kv)

    # Reference: all steps' entries as one key list with the allowed (query, key) pairs written out.
    all_keys = torch.cat(keys, dim=2).repeat_interleave(2, dim=1)  # [B, H, steps*T, d]
    all_values = torch.cat(values, dim=2).repeat_interleave(2, dim=1)
    allowed = torch.zeros(seq_len, steps * seq_len, dtype=torch.bool)
    for i in range(seq_len):
        allowed[i, : i + 1] = True  # base (step 0) entries at indices <= i
        for step in range(1, steps):
            allowed[i, step * seq_len + i] = True  # the chain entry of `step` at index i
    scores = query @ all_keys.transpose(2, 3) / math.sqrt(dim)
    expected = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ all_values
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_ttt_unroll_equals_decoding_from_every_position():
    """What TTT trains at (index i, step j) is exactly what decoding computes for the j-th draft token after
    verifying position i: base steps over 0..i, then a chain at the last position feeding the true tokens."""
    draft = tiny_draft()
    seq_len, steps = 7, 4
    torch.manual_seed(2)
    tokens = torch.randint(0, 50, (1, seq_len))
    aux = torch.randn(1, seq_len, 96)
    with torch.no_grad():
        trained = unroll(draft, tokens, aux, steps)
        for i in range(seq_len - steps):
            kv = DraftKV()
            # Decoding feeds verified positions in pieces (prompt, then each round's accepted tokens).
            pieces = [(0, (i + 1) // 2), ((i + 1) // 2, i + 1)]
            for start, end in (piece for piece in pieces if piece[1] > piece[0]):
                hidden = draft(tokens[:, start + 1:end + 1], draft.project(aux[:, start:end]),
                               torch.arange(start, end)[None], kv, extend_base=True)[:, -1:]
            torch.testing.assert_close(hidden[0, 0], trained[0][0, i], rtol=1e-5, atol=1e-5)
            for step in range(1, steps):
                hidden = draft(tokens[:, i + 1 + step:i + 2 + step], hidden, torch.tensor([[i + step]]), kv,
                               extend_base=False)
                torch.testing.assert_close(hidden[0, 0], trained[step][0, i], rtol=1e-5, atol=1e-5)


def test_a_position_never_sees_the_future():
    """Changing the inputs at index k leaves every step's output at indices < k unchanged."""
    draft = tiny_draft()
    torch.manual_seed(3)
    tokens = torch.randint(0, 50, (1, 8))
    aux = torch.randn(1, 8, 96)
    changed_tokens, changed_aux = tokens.clone(), aux.clone()
    changed_aux[0, 5] += 1.0
    changed_tokens[0, 6] = (tokens[0, 6] + 1) % 50  # read by index 5 at step 0, index 4 at step 1, ...
    with torch.no_grad():
        before = unroll(draft, tokens, aux, 3)
        after = unroll(draft, changed_tokens, changed_aux, 3)
    for step in range(3):
        first_affected = 5 - step  # index whose step-`step` token is x[6] (or whose hidden is aux[5])
        torch.testing.assert_close(before[step][0, :first_affected], after[step][0, :first_affected])
        assert not torch.allclose(before[step][0, first_affected], after[step][0, first_affected])


def test_to_target_ids_uses_d2t_offsets():
    draft = tiny_draft(draft_vocab=3)
    draft.d2t.copy_(torch.tensor([4, 9, 10]))  # draft 0,1,2 -> target 4, 10, 12
    assert draft.to_target_ids(torch.tensor([0, 1, 2])).tolist() == [4, 10, 12]


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_layer_variants_match_a_written_out_reference(norm_before_residual):
    """vLLM's llama_eagle3 layer, written out: the residual stream starts at h, or at hidden_norm(h) when
    norm_before_residual; causal attention over [input_layernorm(e); hidden_norm(h)]; one MLP; final norm."""
    config = draft_config(tiny_target_config(), aux_layers=[1, 2, 3], draft_vocab_size=20,
                          norm_before_residual=norm_before_residual)
    assert config.norm_before_residual is norm_before_residual
    draft = tiny_draft()
    draft.midlayer.norm_before_residual = norm_before_residual  # same weights, the chosen variant
    layer, eps, seq_len = draft.midlayer, config.rms_norm_eps, 6
    torch.manual_seed(3)
    tokens, hidden = torch.randint(0, 50, (1, seq_len)), torch.randn(1, seq_len, 32) * 3
    positions = torch.arange(seq_len)[None]
    with torch.no_grad():
        got = draft(tokens, hidden, positions, DraftKV(), extend_base=True)

        embeds = _rms(draft.embed_tokens(tokens), layer.input_layernorm.weight, eps)
        normed = _rms(hidden, layer.hidden_norm.weight, eps)
        x = torch.cat([embeds, normed], dim=-1)
        attn = layer.self_attn
        q = (x @ attn.q_proj.weight.T).view(1, seq_len, 4, 8).transpose(1, 2)
        k = (x @ attn.k_proj.weight.T).view(1, seq_len, 2, 8).transpose(1, 2)
        v = (x @ attn.v_proj.weight.T).view(1, seq_len, 2, 8).transpose(1, 2)
        cos, sin = draft.rotary_emb(hidden, positions)
        q, k = transformers.models.llama.modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
        out = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1),
                                                               v.repeat_interleave(2, 1), is_causal=True)
        residual = (normed if norm_before_residual else hidden) + out.transpose(1, 2).reshape(1, seq_len, 32) \
            @ attn.o_proj.weight.T
        mlp = layer.mlp
        post = _rms(residual, layer.post_attention_layernorm.weight, eps)
        expected = residual + (torch.nn.functional.silu(post @ mlp.gate_proj.weight.T) * (post @ mlp.up_proj.weight.T)) \
            @ mlp.down_proj.weight.T
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_norm_before_residual_is_carried_by_the_checkpoint(tmp_path):
    from specgen.draft.checkpoint import load_draft, save_draft

    draft = Eagle3Draft(draft_config(tiny_target_config(), aux_layers=[1, 2, 3], draft_vocab_size=20,
                                     norm_before_residual=True))
    save_draft(draft, tmp_path, {})
    assert json.loads((tmp_path / "config.json").read_text())["norm_before_residual"] is True
    assert load_draft(tmp_path).midlayer.norm_before_residual is True
    plain = Eagle3Draft(draft_config(tiny_target_config(), aux_layers=[1, 2, 3], draft_vocab_size=20,
                                     norm_before_residual=False))
    assert plain.midlayer.norm_before_residual is False


def test_lm_head_from_the_target_copies_the_draft_vocabulary_rows():
    draft = tiny_draft(draft_vocab=5)
    draft_to_target = torch.tensor([3, 7, 8, 20, 49])
    draft.d2t.copy_(draft_to_target - torch.arange(5))
    target_head = torch.randn(50, 32)
    draft.init_lm_head_from_target(target_head)
    assert torch.equal(draft.lm_head.weight, target_head[draft_to_target])
