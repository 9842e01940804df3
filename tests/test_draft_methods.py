"""Draft methods (specgen.methods): EAGLE-3.1's flags and P-EAGLE's parallel drafting, trained, saved,
reloaded and decoded through one interface; a checkpoint of one method refused by another in one line."""

import json

import pytest
import torch
from safetensors.torch import load_file

from specgen import methods
from specgen.config import compose, settings_of
from specgen.draft.checkpoint import load_draft, save_draft
from specgen.draft.exports import export_files
from specgen.draft.target_head import TargetDistribution
from specgen.errors import SpecgenError
from specgen.methods.eagle3.model import DraftKV
from specgen.methods.peagle.method import PEagleDraft, cod_selection, peagle_forward
from tests.test_draft_model import one_thread  # noqa: F401 (fixture)
from tests.test_formats import AUX, logits, stored, target_config

K = len(AUX)


def build(method: str, seed: int = 0, **keys):
    """A tiny draft of `method` through the interface, with the shipped `draft.*` settings and `keys` over them
    (draft.KEY=VALUE), its weights moved off their init so a misplaced norm shows."""
    from specgen.draft.vocab import VocabMapping

    torch.manual_seed(seed)
    mapping = VocabMapping(torch.arange(20) * 2, 50)
    draft_settings = settings_of("train", [f"draft.{key}={str(value).lower()}" for key, value in keys.items()],
                                 "draft")
    draft = methods.get(method).new_draft(target_config(), aux_layers=AUX, mapping=mapping,
                                          embedding=torch.randn(50, 32), lm_head=torch.randn(50, 32),
                                          draft=draft_settings)
    for parameter in draft.parameters():
        parameter.data.add_(0.1 * torch.randn_like(parameter))
    return draft.eval()


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def test_eagle31_is_written_under_the_names_vllm_and_speculators_read(tmp_path):
    draft = build("eagle3.1")
    assert draft.method_name == "eagle3.1" and len(draft.fc_norm) == K and draft.norm_output
    save_draft(draft, tmp_path, {"target": {"path": "T"}})
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["fc_norm"], config["norm_before_fc"], config["norm_output"]) == (True, False, True)
    assert config["specgen"]["method"] == "eagle3.1"
    assert {f"fc_norm.{i}.weight" for i in range(K)} <= set(load_file(tmp_path / "model.safetensors"))
    again = load_draft(tmp_path)
    again.embed_tokens.weight.data.copy_(draft.embed_tokens.weight)
    assert again.method_name == "eagle3.1" and torch.equal(logits(again), logits(draft))
    speculators, _ = export_files(draft.config, stored(draft), "speculators", verifier=str(tmp_path))
    assert (speculators["fc_norm"], speculators["norm_output"]) == (True, True)
    assert "fc_norm" not in speculators["transformer_layer_config"]
    with pytest.raises(SpecgenError, match="EAGLE-3.1's fc_norm, norm_output"):
        export_files(draft.config, stored(draft), "sglang")


def test_plain_eagle3_configs_are_unchanged(tmp_path):
    save_draft(build("eagle3"), tmp_path, {})
    config = json.loads((tmp_path / "config.json").read_text())
    assert not {"fc_norm", "norm_before_fc", "norm_output", "mask_token_id"} & set(config)
    assert config["specgen"]["method"] == "eagle3"


@pytest.mark.parametrize("norm_before_fc", [False, True])
def test_eagle31_forward_matches_a_written_out_reference(norm_before_fc):
    """vLLM's llama_eagle3: input_norm over the k*H concat, then fc_norm per aux chunk, then fc; the layer's output
    normed once, fed to the next step and read by the LM head as it is."""
    draft = build("eagle3.1", norm_before_fc=norm_before_fc)
    torch.manual_seed(1)
    aux, ids = torch.randn(1, 5, K * 32), torch.randint(0, 50, (1, 5))
    states = rms(aux, draft.input_norm.weight) if norm_before_fc else aux
    chunks = [rms(chunk, norm.weight) for chunk, norm in zip(states.chunk(K, -1), draft.fc_norm)]
    projected = torch.cat(chunks, -1) @ draft.fc.weight.T
    with torch.no_grad():
        assert torch.allclose(draft.project(aux), projected, atol=1e-5)
        kv, positions = DraftKV(), torch.arange(5)[None]
        out = draft(ids, projected, positions, kv, extend_base=True)
        raw = draft.midlayer(draft.embed_tokens(ids), projected, *draft.rotary_emb(projected, positions),
                             DraftKV(), extend_base=True)
        assert torch.allclose(out, rms(raw, draft.norm.weight), atol=1e-5)
        assert torch.allclose(draft.logits(out), out @ draft.lm_head.weight.T, atol=1e-5)


def test_a_checkpoint_of_another_method_is_a_one_line_error_naming_both(tmp_path):
    save_draft(build("eagle3.1"), tmp_path, {})
    assert load_draft(tmp_path, method="eagle3.1").method_name == "eagle3.1"
    with pytest.raises(SpecgenError, match=r"holds a eagle3.1 draft but draft.method=p-eagle") as error:
        load_draft(tmp_path, method="p-eagle")
    assert "\n" not in str(error.value)
    from specgen.export import run as export

    with pytest.raises(SpecgenError, match=r"eagle3.1 draft but draft.method=eagle3"):
        export(compose("export", [f"draft.path={tmp_path}", f"output.dir={tmp_path / 'out'}", "draft.method=eagle3"]))
    with pytest.raises(SpecgenError, match="draft.method='dspark' is unknown"):
        methods.get("dspark")


def test_peagle_checkpoint_carries_the_mask_token_and_mask_hidden(tmp_path):
    draft = build("p-eagle", mask_token_id=7)
    assert isinstance(draft, PEagleDraft) and draft.mask_hidden.shape == (1, 1, K * 32)
    save_draft(draft, tmp_path, {})
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["mask_token_id"], config["parallel_drafting"], config["specgen"]["method"]) == (7, True, "p-eagle")
    assert load_file(tmp_path / "model.safetensors")["mask_hidden"].shape == (1, 1, K * 32)
    again = load_draft(tmp_path)
    assert isinstance(again, PEagleDraft) and torch.equal(again.mask_hidden, draft.mask_hidden)
    speculators, _ = export_files(draft.config, stored(draft), "speculators", verifier=str(tmp_path))
    assert speculators["speculators_model_type"] == "peagle" and speculators["mask_token_id"] == 7
    assert speculators["speculators_config"]["algorithm"] == "peagle"
    with pytest.raises(SpecgenError, match="P-EAGLE"):
        export_files(draft.config, stored(draft), "specforge")
    with pytest.raises(SpecgenError, match="mask_token_id=99 is not a token"):
        build("p-eagle", mask_token_id=99)


def unrolled_logits(draft, ids, aux, depths):
    """peagle_forward's logits at the last index of one sample, per depth (hooked off the LM head)."""
    captured = []
    hook = draft.lm_head.register_forward_hook(lambda module, args, out: captured.append(out))
    n = ids.shape[1]
    loss_mask = torch.ones(1, n + depths + 1, dtype=torch.long)
    padded_ids = torch.cat([ids, torch.zeros(1, depths + 1, dtype=torch.long)], 1)
    padded_aux = torch.cat([aux, torch.zeros(1, depths + 1, aux.shape[-1])], 1)
    probs = torch.full((1, n + depths + 1, 20), 1 / 20)
    with torch.no_grad():
        peagle_forward(draft, padded_ids, loss_mask, padded_aux,
                       TargetDistribution(probs, torch.zeros(1, n + depths + 1, dtype=torch.long)), depths=depths,
                       mask_shift=1, drop_out_of_vocab=False)
    hook.remove()
    # index n-1 reads token padded_ids[n] = 0 at depth 0: give the decoder the same token there
    return [step[n - 1] for step in captured], padded_ids[0, n]


def test_training_unroll_is_what_parallel_drafting_decodes():
    """Depth d at index a in training is mask slot d after verifying a in decoding (one parallel forward in vLLM):
    the proposer's K drafts are the argmaxes of the training logits at the last index."""
    draft = build("p-eagle", mask_token_id=5)
    torch.manual_seed(2)
    ids, aux = torch.randint(0, 50, (1, 9)), torch.randn(1, 9, K * 32)
    per_depth, next_token = unrolled_logits(draft, ids, aux, depths=4)
    proposer = methods.of_model(draft).proposer(draft)
    with torch.no_grad():
        drafted = proposer.propose(aux[0], ids[0, 1:].tolist() + [int(next_token)], 4)
    assert drafted == [int(draft.to_target_ids(step.argmax())) for step in per_depth]


def test_cod_selection_is_nested_and_scored_only():
    torch.manual_seed(0)
    valid = torch.rand(60) > 0.3
    documents = torch.cat([torch.zeros(30), torch.ones(30)]).long()
    keep = cod_selection(valid, documents, depths=5, ratio=0.7, ratio_min=0.2)
    assert keep[0].all() and len(keep) == 5
    for depth in range(1, 5):
        anchors = torch.where(keep[depth])[0]
        assert keep[depth - 1][anchors].all()  # nested: a depth's anchors were kept one depth up
        assert valid[anchors + depth].all() and (documents[anchors + depth] == documents[anchors]).all()
    assert keep[1].sum() > keep[2].sum() > keep[3].sum() > 0


@pytest.fixture(scope="module")
def demo_shards(tmp_path_factory):
    from specgen.generate import run as generate

    out = tmp_path_factory.mktemp("demo-shards")
    generate(compose("generate", ["recipe=demo", "data.max_rows=60", f"output.dir={out}", "runtime.progress=false"]))
    return out


@pytest.mark.parametrize("method,extra,fmt", [("eagle3.1", [], "speculators"),
                                               ("p-eagle", ["train.cod_ratio=0.7"], "speculators"),
                                               ("dflash", ["draft.dflash.block_size=4"], "vllm")])
def test_train_evaluate_and_export_each_method(demo_shards, tmp_path, method, extra, fmt):
    """The same shards train each method through the one trainer; evaluate decodes it losslessly; resume is exact."""
    from specgen.evaluate import run as evaluate
    from specgen.export import run as export
    from specgen.train import run as train

    common = ["recipe=demo", f"data.shards={demo_shards}", f"draft.method={method}", "train.log_every=4",
              "train.num_workers=0", "train.tensorboard=false", "runtime.progress=false", "train.eval_every=0", *extra]
    metrics = train(compose("train", [*common, "train.max_steps=12", f"output.dir={tmp_path / 'a'}"]))
    assert 1 <= metrics["accept_len_sim"] and metrics["loss"] > 0
    train(compose("train", [*common, "train.max_steps=8", "train.schedule_steps=12", f"output.dir={tmp_path / 'b'}"]))
    train(compose("train", [*common, "train.max_steps=12", "train.schedule_steps=12", "train.resume=true",
                            f"output.dir={tmp_path / 'b'}"]))
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert all(torch.equal(a[name], b[name]) for name in a)
    report = evaluate(compose("evaluate", ["recipe=demo", f"draft.path={tmp_path / 'a'}", f"draft.method={method}",
                                           "evaluate.max_prompts=3", "evaluate.max_new_tokens=24",
                                           "evaluate.turns=first", f"output.dir={tmp_path / 'eval'}",
                                           "runtime.progress=false"]))
    assert report["lossless"], report["lossless_line"]  # model.dtype=auto: bf16 where the CPU has it (near-ties)
    assert report["matches_target_greedy"] or report["target_dtype"] != "float32"
    assert report["verification_rounds"] > 0
    export(compose("export", [f"draft.path={tmp_path / 'a'}", f"output.dir={tmp_path / 'spec'}",
                              f"export.format={fmt}"]))
    assert load_draft(tmp_path / "spec").method_name == method
