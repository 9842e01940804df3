"""Draft formats at the boundary: what each engine reads, export refusals, and imports without silent errors."""

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from specgen.config import compose
from specgen.draft.aux import aux_layers_of
from specgen.draft.checkpoint import load_draft, read_draft_config, save_draft
from specgen.draft.exports import export_files, write_files
from specgen.errors import SpecgenError
from specgen.methods.eagle3.model import Eagle3Draft, draft_config
from tests.test_draft_model import PUBLISHED_NAMES, one_thread  # noqa: F401 (fixture)

AUX = [1, 3, 4]


def target_config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=8,
                                    num_attention_heads=4, num_key_value_heads=2)


def tiny_draft(aux=AUX, seed: int = 0) -> Eagle3Draft:
    torch.manual_seed(seed)
    draft = Eagle3Draft(draft_config(target_config(), aux_layers=aux, draft_vocab_size=20, norm_before_residual=False))
    draft.d2t.copy_(torch.arange(20) * 2 - torch.arange(20))
    draft.t2d[torch.arange(20) * 2] = True
    for parameter in draft.parameters():  # norms away from 1, so a misplaced norm changes the logits
        parameter.data.add_(0.1 * torch.randn_like(parameter))
    return draft.eval()


def stored(draft: Eagle3Draft) -> dict[str, torch.Tensor]:
    return {name: tensor for name, tensor in draft.state_dict().items() if name != "embed_tokens.weight"}


def write(tmp_path: Path, fmt: str, draft: Eagle3Draft | None = None, **kwargs) -> Path:
    draft = draft or tiny_draft()
    config, tensors = export_files(draft.config, stored(draft), fmt, info={"target": {"path": "T"}}, **kwargs)
    write_files(tmp_path / fmt, config, tensors)
    return tmp_path / fmt


def logits(draft: Eagle3Draft) -> torch.Tensor:
    """The draft's logits on fixed inputs: one base step over 5 positions, then one chain step."""
    from specgen.methods.eagle3.model import DraftKV

    torch.manual_seed(3)
    k = len(aux_layers_of(draft.config))
    ids, aux = torch.randint(0, 50, (1, 5)), torch.randn(1, 5, k * draft.config.target_hidden_size)
    kv = DraftKV()
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(torch.randn(draft.embed_tokens.weight.shape, generator=torch.Generator().manual_seed(5)))
        hidden = draft(ids, draft.project(aux), torch.arange(5)[None], kv, extend_base=True)
        step = draft(ids[:, -1:], hidden[:, -1:], torch.tensor([[5]]), kv, extend_base=False)
    return torch.cat([draft.logits(hidden), draft.logits(step)], dim=1)


def test_default_checkpoint_carries_ids_as_vllm_reads_them(tmp_path):
    draft = tiny_draft()
    save_draft(draft, tmp_path / "ckpt", {"target": {"path": "T"}})
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    # vLLM 0.32 llama.py: aux id k = residual stream entering layer k = output of layer k - 1
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert config["specgen"]["aux_layers"] == AUX and config["specgen"]["format"] == "vllm"
    assert config["specgen"]["aux_layer_convention"] == "layer_outputs_0based"
    assert config["dtype"] == "float32" and config["norm_before_residual"] is False
    assert set(load_file(tmp_path / "ckpt" / "model.safetensors")) == PUBLISHED_NAMES
    assert aux_layers_of(load_draft(tmp_path / "ckpt").config) == AUX


@pytest.mark.parametrize("fmt", ["vllm", "sglang", "specforge", "speculators"], ids=lambda fmt: f"as-{fmt}")
def test_every_export_loads_back_with_the_same_logits(tmp_path, fmt):
    draft = tiny_draft()
    folder = write(tmp_path, fmt, speculative_tokens=4, verifier=str(tmp_path))
    config = json.loads((folder / "config.json").read_text())
    assert config["specgen"]["aux_layers"] == AUX and config["specgen"]["format"] == fmt
    ids = {"vllm": [2, 4, 5], "speculators": [2, 4, 5], "sglang": AUX, "specforge": AUX}[fmt]
    written = config.get("eagle_aux_hidden_state_layer_ids") or config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert written == ids
    loaded = load_draft(folder)
    assert aux_layers_of(loaded.config) == AUX
    assert torch.equal(logits(loaded), logits(draft))


def test_speculators_export_has_the_layout_vllm_serves_bare(tmp_path):
    folder = write(tmp_path, "speculators", speculative_tokens=4, verifier=str(tmp_path))
    config = json.loads((folder / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(tmp_path)
    assert config["transformer_layer_config"]["model_type"] == "llama"
    assert config["norm_before_residual"] is False  # vLLM reads an absent key as true
    names = set(load_file(folder / "model.safetensors"))
    assert names == {name.replace("midlayer.", "layers.0.") for name in PUBLISHED_NAMES}


def test_exports_refuse_what_the_format_cannot_represent(tmp_path):
    two = tiny_draft(aux=[1, 4])
    with pytest.raises(SpecgenError, match="hard-codes 3"):
        export_files(two.config, stored(two), "specforge")
    export_files(two.config, stored(two), "sglang")  # SGLang sizes fc from the ids
    draft = tiny_draft()
    draft.config.norm_before_residual = True
    for fmt in ("sglang", "specforge"):
        with pytest.raises(SpecgenError, match="norm_before_residual"):
            export_files(draft.config, stored(draft), fmt)
    assert export_files(draft.config, stored(draft), "vllm")[0]["norm_before_residual"] is True
    with pytest.raises(SpecgenError, match="verifier"):
        export_files(draft.config, stored(draft), "speculators")
    with pytest.raises(SpecgenError, match="export.format"):
        export_files(draft.config, stored(draft), "onnx")


def test_legacy_specgen_checkpoint_reads_its_ids_as_layer_outputs(tmp_path):
    """Checkpoints written before formats existed stored aux layers in eagle_config as they are."""
    folder = write(tmp_path, "vllm")
    config = json.loads((folder / "config.json").read_text())
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = AUX
    for key in ("format", "aux_layer_convention", "eagle_aux_hidden_state_layer_ids"):
        config["specgen"].pop(key)
    (folder / "config.json").write_text(json.dumps(config))
    assert aux_layers_of(read_draft_config(folder)) == AUX
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 4, 5]  # contradicts its own specgen section
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecgenError, match="contradicts itself"):
        read_draft_config(folder)


def foreign(tmp_path: Path, edit, *, weights: str = "model.safetensors", embed: bool = True) -> Path:
    """A SpecForge-style checkpoint: the sglang layout without specgen's section, the embedding stored."""
    draft = tiny_draft()
    folder = write(tmp_path, "sglang", draft)
    config = json.loads((folder / "config.json").read_text())
    config.pop("specgen")
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))
    tensors = load_file(folder / "model.safetensors")
    if embed:
        tensors["embed_tokens.weight"] = torch.randn(50, 32)
    (folder / "model.safetensors").unlink()
    if weights == "model.safetensors":
        save_file(tensors, str(folder / weights))
    else:
        torch.save(tensors, folder / weights)
    return folder


def test_specforge_config_without_eagle_config_takes_specforge_defaults(tmp_path):
    def strip(config):
        for key in ("eagle_config", "target_hidden_size", "norm_before_residual"):
            config.pop(key)

    folder = foreign(tmp_path, strip, weights="pytorch_model.bin")  # the published EAGLE-3 drafts ship .bin
    with pytest.raises(SpecgenError, match="model.path"):
        read_draft_config(folder)
    loaded = load_draft(folder, target_config=target_config())
    assert aux_layers_of(loaded.config) == [1, 3, 4]  # SpecForge / EAGLE-3: outputs of [1, n//2 - 1, n - 4]
    assert loaded.config.target_hidden_size == 32
    assert torch.equal(logits(loaded), logits(tiny_draft()))


def test_foreign_ids_are_read_as_told(tmp_path):
    folder = foreign(tmp_path, lambda config: None)
    assert aux_layers_of(read_draft_config(folder)) == AUX  # SpecForge / SGLang: layer outputs
    assert aux_layers_of(read_draft_config(folder, foreign_ids="hidden_states")) == [0, 2, 3]


@pytest.mark.parametrize("key,value,match", [
    ("norm_output", False, "norm_output"),  # SpecForge: logits without the final norm
    ("num_hidden_layers", 2, "num_hidden_layers"),
    ("attention_bias", True, "attention_bias"),
    ("model_type", "qwen3", "model_type"),
])
def test_forward_changing_fields_are_one_line_errors(tmp_path, key, value, match):
    folder = foreign(tmp_path, lambda config: config.update({key: value}))
    with pytest.raises(SpecgenError, match=match) as error:
        read_draft_config(folder)
    assert "\n" not in str(error.value)


def test_specforge_norm_output_true_is_specgen_forward(tmp_path):
    folder = foreign(tmp_path, lambda config: config.update({"norm_output": True}))
    assert torch.equal(logits(load_draft(folder)), logits(tiny_draft()))


def test_speculators_variants_are_one_line_errors(tmp_path):
    folder = write(tmp_path, "speculators", verifier=str(tmp_path))
    config = json.loads((folder / "config.json").read_text())
    for key in ("norm_output", "fc_norm"):  # EAGLE-3.1's flags are read (weights without fc_norm: one line)
        (folder / "config.json").write_text(json.dumps({**config, key: True}))
        assert getattr(read_draft_config(folder), key) is True
    with pytest.raises(SpecgenError, match="missing .*fc_norm") as error:
        load_draft(folder)
    assert "\n" not in str(error.value)
    del config["norm_before_residual"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecgenError, match="norm_before_residual"):
        read_draft_config(folder)


def test_export_stage_writes_and_refuses(tmp_path):
    from specgen.export import run

    ckpt = tmp_path / "ckpt"
    save_draft(tiny_draft(), ckpt, {"target": {"path": str(tmp_path / "target")}})
    summary = run(compose("export", [f"draft.path={ckpt}", f"output.dir={tmp_path / 'sg'}", "export.format=sglang",
                                     "export.dtype=bfloat16"]))
    assert summary["eagle_aux_hidden_state_layer_ids"] == AUX and summary["dtype"] == "bfloat16"
    config = json.loads((tmp_path / "sg" / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["specgen"]["exported_from"] == str(ckpt.resolve())
    with pytest.raises(SpecgenError, match="already holds"):
        run(compose("export", [f"draft.path={ckpt}", f"output.dir={tmp_path / 'sg'}"]))
    with pytest.raises(SpecgenError, match="export.format"):
        run(compose("export", [f"draft.path={ckpt}", f"output.dir={tmp_path / 'x'}", "export.format=gguf"]))


def sglang_captured_hidden_states(config: dict, hidden_states: tuple) -> list:
    """What SGLang 0.5.23 feeds the draft, following its code: `_resolve_eagle_aux_hidden_state` reads
    eagle_config["eagle_aux_hidden_state_layer_ids"]; llama.py `set_eagle3_layers_to_capture` sets
    layers_to_capture = [id + 1]; LlamaModel.forward captures the residual stream entering layer i for i in
    layers_to_capture, i.e. HF hidden_states[i]."""
    layers_to_capture = [layer_id + 1 for layer_id in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
    return [hidden_states[i] for i in layers_to_capture]


def vllm_captured_hidden_states(config: dict, hidden_states: tuple) -> list:
    """What vLLM 0.32 feeds the draft, following its code: gpu_model_runner `_get_eagle3_aux_layers_from_config`
    reads the ids (top level, else eagle_config) as aux_hidden_state_layers; llama.py LlamaModel.forward calls
    `_maybe_add_hidden_state` with start_layer before the first layer and idx + 1 after layer idx, i.e. id k is
    HF hidden_states[k]."""
    ids = config.get("eagle_aux_hidden_state_layer_ids") or config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    return [hidden_states[k] for k in ids]


@pytest.mark.parametrize("fmt,reader", [("vllm", vllm_captured_hidden_states),
                                        ("speculators", vllm_captured_hidden_states),
                                        ("sglang", sglang_captured_hidden_states)], ids=["as-vllm", "as-spec", "as-sglang"])
def test_each_engine_feeds_the_draft_the_layers_it_was_trained_on(tmp_path, fmt, reader):
    """The engine's reading of the exported ids selects the same target states specgen's capture trained on."""
    from specgen.assets import ASSETS_DIR
    from specgen.draft.speculative import TargetRunner

    path = ASSETS_DIR / "tiny-target"
    target = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    draft = Eagle3Draft(draft_config(target.config, aux_layers=AUX, draft_vocab_size=16, norm_before_residual=False))
    config, _ = export_files(draft.config, stored(draft), fmt, verifier=str(path))
    ids = torch.tensor([[5, 17, 99, 3, 250]])
    with torch.no_grad():
        hidden_states = target(ids, output_hidden_states=True).hidden_states
        from transformers import DynamicCache
        _, specgen_aux = TargetRunner(target, AUX).forward(ids[0].tolist(), DynamicCache())
    engine_aux = torch.cat([state[0] for state in reader(config, hidden_states)], dim=-1)
    assert torch.allclose(engine_aux, specgen_aux, atol=1e-5)
    if fmt != "sglang":  # the sglang file read by vLLM: one layer early
        wrong, _ = export_files(draft.config, stored(draft), "sglang")
        assert not torch.allclose(torch.cat([s[0] for s in reader(wrong, hidden_states)], dim=-1), specgen_aux)
