"""speculators (0.9) and SpecForge (0.2) themselves read specgen's exports, and specgen reads their checkpoints.

Both packages are installed `--no-deps` in vLLM's venv (.ci/vllm-venv): their draft modeling code is pure Python.
Each direction loads strictly (every stored tensor used, nothing missing but the target's embedding) and gives the
same draft logits as specgen on the same inputs: a base step over a sequence, then one chain step (TTT step 1).
And one training step of specgen's TTT objective equals speculators' trainer forward (same gradients).
"""

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from specgen.assets import ASSETS_DIR
from specgen.draft.aux import aux_layers_of
from specgen.draft.checkpoint import load_draft
from specgen.draft.exports import export_files, write_files
from specgen.methods.eagle3.model import DraftKV, Eagle3Draft, draft_config

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
    draft = Eagle3Draft(draft_config(config, aux_layers=[1, 3, 4], draft_vocab_size=1024, norm_before_residual=False))
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


def packed_training_batch(target_model, lengths=(9, 14, 11), seed: int = 1) -> dict:
    """Three samples packed into one row, as both trainers lay them out: token ids, aux hidden states, the
    target's final-norm input (speculators' `verifier_last_hidden_states`) and its output (specgen's
    `last_hidden_state`), and loss masks whose prompts (the first 5 tokens of each sample) are not trained."""
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for n in lengths:
        pre_norm = 3 * torch.randn(n, 128, generator=generator)
        samples.append({"input_ids": torch.randint(3, 2048, (n,), generator=generator),
                        "aux_hidden_states": torch.randn(n, 3 * 128, generator=generator),
                        "pre_norm": pre_norm, "last_hidden_state": target_model.model.norm(pre_norm).detach(),
                        "loss_mask": (torch.arange(n) >= 5).long()})
    return samples


def test_a_training_step_equals_speculators_trainer_step(target, tmp_path):
    """Same weights, same packed batch, `train.loss_mask=input` and `out_of_vocab=keep` (the defaults): specgen's TTT
    objective and speculators' Eagle3DraftModel.forward (its KL loss, 4 TTT steps, document masks) give the same
    gradient on every weight both train. The `predicted` mask convention does not: the test tells them apart.
    (Prompts are longer than the TTT depth: speculators does not check documents, so where a sample's prompt is
    shorter it scores the previous sample's last positions against this sample's targets; specgen does not.)"""
    from speculators.losses import eager

    from specgen.draft.batch import batch_target, collate
    from specgen.draft.target_head import TargetHead
    from specgen.draft.vocab import VocabMapping
    from specgen.methods.eagle3.ttt import ttt_forward

    target_model = transformers.AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32)
    config, embedding = target
    torch.manual_seed(0)
    draft = Eagle3Draft(draft_config(config, aux_layers=[1, 3, 4], draft_vocab_size=1024, norm_before_residual=True))
    draft.d2t.copy_(torch.arange(1024))  # draft id d -> target id 2d
    draft.t2d[torch.arange(1024) * 2] = True
    for parameter in draft.parameters():
        parameter.data.add_(0.1 * torch.randn_like(parameter))
    draft.embed_tokens.weight.data.copy_(embedding)
    lm_head = target_model.lm_head.weight.detach()
    draft.init_lm_head_from_target(lm_head)
    model = load_speculators(export(draft, "speculators", tmp_path / "speculators")).train()
    assert model.config.norm_before_residual is True
    model.embed_tokens.weight.data.copy_(embedding)
    model.verifier_lm_head.weight.data.copy_(lm_head[draft.t2d])
    model.verifier_norm.weight.data.copy_(target_model.model.norm.weight.detach())
    samples = packed_training_batch(target_model)

    # speculators: each sample shifted by one (its shift_batch: token t+1 with hidden state t), then concatenated
    parts = {"hidden_states": [], "input_ids": [], "document_ids": [], "loss_mask": [], "position_ids": [],
             "verifier_last_hidden_states": []}
    for document, sample in enumerate(samples):
        n = len(sample["input_ids"])
        parts["hidden_states"].append(sample["aux_hidden_states"][:-1])
        parts["input_ids"].append(sample["input_ids"][1:])
        parts["verifier_last_hidden_states"].append(sample["pre_norm"][1:])
        parts["loss_mask"].append(sample["loss_mask"][1:].bool())
        parts["position_ids"].append(torch.arange(1, n))
        parts["document_ids"].append(torch.full((n - 1,), document))
    _, their_loss, _ = model(**{name: torch.cat(values)[None] for name, values in parts.items()}, ttt_steps=4,
                             ttt_step_loss_decay=1.0, loss_config={"kl_div": (eager.kl_div_loss, 1.0)})
    their_loss.backward()
    theirs = {name.replace("layers.0.", "midlayer."): p.grad for name, p in model.named_parameters() if p.requires_grad}

    head = TargetHead(lm_head, VocabMapping(torch.arange(1024) * 2, 2048))
    batch = collate(samples, pad_id=0, packed=True)

    def our_gradients(mask_shift: int) -> dict[str, torch.Tensor]:
        draft.zero_grad()
        out = ttt_forward(draft, batch.input_ids, batch.loss_mask, batch.aux_hidden_states,
                          batch_target(head, batch, mask_shift), ttt_length=4, decay=1.0, mask_shift=mask_shift,
                          drop_out_of_vocab=False, position_ids=batch.position_ids, document_ids=batch.document_ids)
        out.loss.backward()  # cross-entropy: KL plus the target's entropy, which has no gradient
        return {name: p.grad.clone() for name, p in draft.named_parameters() if name in theirs}

    assert set(theirs) == {"fc.weight", "norm.weight"} | {n for n in theirs if n.startswith("midlayer.")}
    assert len(theirs) == 12
    for mask_shift, agrees in ((1, True), (2, False)):
        ours = our_gradients(mask_shift)
        worst = max(float((ours[name] - theirs[name]).norm() / theirs[name].norm()) for name in theirs)
        assert (worst < 1e-4) is agrees, (mask_shift, worst)
