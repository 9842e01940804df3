"""speculators (0.9) and SpecForge (0.2) themselves read specgen's exports, and specgen reads their checkpoints.

Both packages are installed `--no-deps` in vLLM's venv (.ci/vllm-venv): their draft modeling code is pure Python.
Each direction loads strictly (every stored tensor used, nothing missing but the target's embedding) and gives the
same draft logits as specgen on the same inputs: a base step over a sequence, then one chain step (TTT step 1).
"""

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from specgen.assets import ASSETS_DIR
from specgen.draft.checkpoint import load_draft
from specgen.draft.formats import export_files, write_files
from specgen.draft.model import DraftKV, Eagle3Draft, aux_layers_of, draft_config

pytestmark = pytest.mark.vllm  # runs in vLLM's venv, where the packages are installed

TARGET = ASSETS_DIR / "tiny-target"
T = 12


@pytest.fixture(scope="module")
def target():
    model = transformers.AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32)
    return model.config, model.get_input_embeddings().weight.detach()


@pytest.fixture(scope="module")
def inputs():
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 2048, (1, T), generator=generator)
    return ids, torch.randn(1, T, 3 * 128, generator=generator)


def specgen_draft(target, seed: int = 0) -> Eagle3Draft:
    config, embedding = target
    torch.manual_seed(seed)
    draft = Eagle3Draft(draft_config(config, aux_layers=[1, 3, 4], draft_vocab_size=1024))
    draft.d2t.copy_(torch.arange(1024))  # draft id d -> target id 2d
    draft.t2d[torch.arange(1024) * 2] = True
    for parameter in draft.parameters():
        parameter.data.add_(0.1 * torch.randn_like(parameter))  # norms away from 1: a misplaced norm shows
    draft.embed_tokens.weight.data.copy_(embedding)
    return draft.eval()


def export(draft: Eagle3Draft, fmt: str, folder: Path) -> Path:
    tensors = {name: t for name, t in draft.state_dict().items() if name != "embed_tokens.weight"}
    config, tensors = export_files(draft.config, tensors, fmt, info={"target": {"path": str(TARGET)}},
                                   speculative_tokens=4, verifier=str(TARGET))
    write_files(folder, config, tensors)
    return folder


def shifted(ids: torch.Tensor) -> torch.Tensor:
    return torch.cat([ids[:, 1:], ids.new_zeros(1, 1)], dim=1)


@torch.no_grad()
def specgen_logits(draft: Eagle3Draft, ids: torch.Tensor, aux: torch.Tensor) -> list[torch.Tensor]:
    kv, positions = DraftKV(), torch.arange(T)[None]
    base = draft(ids, draft.project(aux), positions, kv, extend_base=True)
    chain = draft(shifted(ids), base, positions + 1, kv, extend_base=False)
    return [draft.logits(base), draft.logits(chain)]


@torch.no_grad()
def speculators_logits(model, ids: torch.Tensor, aux: torch.Tensor) -> list[torch.Tensor]:
    """speculators' own TTT forward (2 steps); the logits are read off its lm_head."""
    captured = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: captured.append(out))
    model(hidden_states=aux, input_ids=ids, document_ids=torch.zeros(1, T, dtype=torch.long),
          position_ids=torch.arange(T)[None], ttt_steps=2)
    hook.remove()
    return captured


@torch.no_grad()
def specforge_logits(model, ids: torch.Tensor, aux: torch.Tensor) -> list[torch.Tensor]:
    """SpecForge's TTT loop (algorithms/eagle3/model.py, sdpa backend): backbone with cache_hidden, 2 steps."""
    hidden = model.project_hidden_states(aux)
    mask = model.prepare_decoder_attention_mask(attention_mask=torch.ones(1, T, dtype=torch.bool),
                                                hidden_states=hidden, batch_size=1, seq_length=T,
                                                past_key_values_length=0)
    cache, out, step_ids = [[], []], [], ids
    for _ in range(2):
        hidden = model.backbone(input_embeds=model.embed_input_ids(step_ids), hidden_states=hidden,
                                cache_hidden=cache, attention_mask=mask, position_ids=torch.arange(T)[None],
                                use_cache=True)
        out.append(model.compute_logits(hidden))
        step_ids = shifted(step_ids)
    return out


def assert_same(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> None:
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-5), (step, (a - b).abs().max().item())


def load_speculators(folder: Path):
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    config = Eagle3SpeculatorConfig.from_pretrained(folder)
    config.transformer_layer_config._attn_implementation = "eager"  # flex attention wants a compiler on CPU
    return Eagle3DraftModel.from_pretrained(folder, config=config).float().eval()


def specforge_model(folder: Path):
    """SpecForge's LlamaForCausalLMEagle3 built from the folder's config and loaded from its weights.

    SpecForge 0.2.0 pins transformers 5.8; under 5.19 its `from_pretrained` leaves the rotary buffers of its own
    LlamaRotaryEmbedding uninitialised (meta-device init), so the model is built directly, as its trainer does.
    """
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3

    model = LlamaForCausalLMEagle3(transformers.LlamaConfig.from_pretrained(folder), attention_backend="sdpa")
    missing, unexpected = model.load_state_dict(load_file(folder / "model.safetensors"), strict=False)
    return model.float().eval(), set(missing), set(unexpected)


def test_speculators_loads_our_export_and_agrees(target, inputs, tmp_path):
    draft = specgen_draft(target)
    folder = export(draft, "speculators", tmp_path / "speculators")
    model = load_speculators(folder)
    assert model.config.eagle_aux_hidden_state_layer_ids == [2, 4, 5]  # its hidden_states indices = aux + 1
    assert model.config.norm_before_residual is False
    stored, state = load_file(folder / "model.safetensors"), model.state_dict()
    assert set(state) - set(stored) == {"embed_tokens.weight", "verifier_norm.weight", "verifier_lm_head.weight"}
    assert set(stored) <= set(state) and all(torch.equal(state[name], stored[name]) for name in stored)
    model.embed_tokens.weight.data.copy_(target[1])  # the target's, as vLLM shares it (not stored in the draft)
    assert_same(specgen_logits(draft, *inputs), speculators_logits(model, *inputs))


def test_speculators_checkpoint_loads_into_specgen(target, inputs, tmp_path):
    model = load_speculators(export(specgen_draft(target), "speculators", tmp_path / "ours"))
    torch.manual_seed(7)
    for parameter in model.parameters():
        parameter.data.add_(0.05 * torch.randn_like(parameter))
    model.embed_tokens.weight.data.copy_(target[1])
    model.save_pretrained(tmp_path / "theirs")  # speculators' own config and weight names
    saved = json.loads((tmp_path / "theirs" / "config.json").read_text())
    assert saved["speculators_model_type"] == "eagle3" and saved["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    saved.pop("specgen")  # speculators keeps extra keys; without ours it is a plain speculators checkpoint
    (tmp_path / "theirs" / "config.json").write_text(json.dumps(saved))
    draft = load_draft(tmp_path / "theirs", embedding=target[1]).eval()
    assert aux_layers_of(draft.config) == [1, 3, 4]
    assert_same(specgen_logits(draft, *inputs), speculators_logits(model, *inputs))


def test_specforge_loads_our_export_and_agrees(target, inputs, tmp_path):
    draft = specgen_draft(target)
    folder = export(draft, "specforge", tmp_path / "specforge")
    model, missing, unexpected = specforge_model(folder)
    assert missing == {"embed_tokens.weight"} and not unexpected
    model.embed_tokens.weight.data.copy_(target[1])
    assert_same(specgen_logits(draft, *inputs), specforge_logits(model, *inputs))


def test_specforge_checkpoint_without_eagle_config_loads_into_specgen(target, inputs, tmp_path):
    """Most of SpecForge's shipped configs name neither eagle_config nor target_hidden_size: its defaults apply
    (3 aux layers: outputs of [1, n//2 - 1, n - 4]; target_hidden_size = hidden_size)."""
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3

    text = target[0]
    config = transformers.LlamaConfig(
        hidden_size=text.hidden_size, intermediate_size=text.intermediate_size, num_hidden_layers=1,
        num_attention_heads=text.num_attention_heads, num_key_value_heads=text.num_key_value_heads,
        head_dim=text.head_dim, vocab_size=text.vocab_size, rms_norm_eps=text.rms_norm_eps,
        max_position_embeddings=text.max_position_embeddings, tie_word_embeddings=False, pad_token_id=0)
    config.architectures = ["LlamaForCausalLMEagle3"]
    config.draft_vocab_size = 1024
    torch.manual_seed(3)
    model = LlamaForCausalLMEagle3(config, attention_backend="sdpa").float().eval()
    for parameter in model.parameters():
        parameter.data.normal_(0, 0.05)
    model.norm.weight.data.add_(1.0)
    model.embed_tokens.weight.data.copy_(target[1])
    model.d2t.copy_(torch.arange(1024))
    model.t2d.zero_()
    model.t2d[torch.arange(1024) * 2] = True
    model.save_pretrained(tmp_path / "specforge")
    saved = json.loads((tmp_path / "specforge" / "config.json").read_text())
    assert "eagle_config" not in saved and "target_hidden_size" not in saved
    draft = load_draft(tmp_path / "specforge", embedding=target[1], target_config=target[0]).eval()
    assert aux_layers_of(draft.config) == [1, 3, 4]
    assert_same(specgen_logits(draft, *inputs), specforge_logits(model, *inputs))
