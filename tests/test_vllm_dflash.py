"""vLLM (its CPU build) serves specgen's DFlash drafts as trained (`method="dflash"`): vLLM's own spec-decode counters
equal specgen.evaluate's exactly, and the outputs equal the target's alone.

DFlash drafts are trained by specgen.train (draft.method=dflash) on shards of the bundled demo target (a Llama), evaluated
by specgen.evaluate, and the same prompts are replayed in vLLM, greedy, same K, by tests/vllm_replay.py --method dflash
in a subprocess: a bidirectional 1-layer draft at K=4 (its trained block of 5) and a causal 2-layer draft at K=3 (a
shorter block than trained). Run in vLLM's venv (.ci/vllm-venv).

vLLM 0.32's CPU build does not serve a draft of 2+ layers exactly as trained: `precompute_and_store_context_kv`
normalises the context keys of all layers in one `ops.rms_norm` call with the stacked k_norm weights [L, head_dim]
(`qwen3_dflash.py`, `_normalize_context_k`), and the CPU kernel applies row 0 to every layer
(`test_vllm_cpu_rms_norm_applies_row_0_of_a_stacked_weight`), so layers >= 1 attend to context keys normalised by
layer 0's k_norm. Their drafts then differ a little from the trained draft's (specgen's decode, `DFlashProposer`);
the counters are compared exactly with specgen.evaluate run under that same normalisation (`vllm_cpu_context_keys`).
"""

import json
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import vllm_replay
from specgen.assets import ASSETS_DIR
from specgen.config import compose
from specgen.draft.exports import dflash_block_positions, vllm_speculative_config
from specgen.methods.dflash.serving import load_dflash

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TARGET = ASSETS_DIR / "tiny-target"
MAX_NEW_TOKENS, PROMPTS = 64, 16
QUIET = ["runtime.progress=false", "runtime.threads=1"]


# name: (training overrides, K served); the second is causal within the block, 2 layers, served with K < block - 1
CONFIGS = {"bidirectional": (["draft.dflash.block_size=5", "draft.dflash.num_layers=1"], 4),
           "causal": (["draft.dflash.block_size=5", "draft.dflash.causal=true", "draft.dflash.num_layers=2"], 3)}


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    from specgen.generate import run as generate

    root = tmp_path_factory.mktemp("dflash")
    generate(compose("generate", ["recipe=demo", "data.max_rows=80", f"output.dir={root / 'shards'}", *QUIET]))
    return root / "shards"


@pytest.fixture(scope="module", params=list(CONFIGS))
def trained(request, shards) -> dict:
    from specgen.evaluate import run as evaluate
    from specgen.train import run as train

    overrides, k = CONFIGS[request.param]
    root = shards.parent / request.param
    train(compose("train", ["recipe=demo", f"data.shards={shards}", f"output.dir={root / 'draft'}",
                            "draft.method=dflash", *overrides, "train.epochs=4", "train.num_workers=0",
                            "train.tensorboard=false", "train.eval_every=0", *QUIET]))
    report = evaluate(compose("evaluate", ["recipe=demo", f"draft.path={root / 'draft'}", "draft.method=dflash",
                                           f"evaluate.num_draft_tokens={k}", f"evaluate.max_prompts={PROMPTS}",
                                           f"evaluate.max_new_tokens={MAX_NEW_TOKENS}", f"output.dir={root / 'eval'}",
                                           "model.dtype=float32", *QUIET]))  # vllm_replay serves float32
    samples = [json.loads(line) for line in (root / "eval" / "samples.jsonl").read_text().splitlines()]
    return {"root": root, "shards": shards, "draft": root / "draft", "report": report, "samples": samples, "k": k}


@contextmanager
def vllm_cpu_context_keys():
    """specgen's DFlash decode with the context keys of every draft layer normalised by layer 0's k_norm, as vLLM
    0.32's CPU build computes them (its fused `ops.rms_norm` over the stacked k_norm weights uses row 0 only);
    the block slots' own keys keep each layer's k_norm, as in vLLM's forward."""
    from specgen.methods.dflash.model import DFlashDraft

    trained_context_kv = DFlashDraft.context_kv

    def context_kv(draft, aux_hidden_states, position_ids):
        first = draft.layers[0].self_attn.k_norm
        owns = [layer.self_attn.k_norm for layer in draft.layers]
        for layer in draft.layers:
            layer.self_attn.k_norm = first
        try:
            return trained_context_kv(draft, aux_hidden_states, position_ids)
        finally:
            for layer, own in zip(draft.layers, owns):
                layer.self_attn.k_norm = own

    DFlashDraft.context_kv = context_kv
    try:
        yield
    finally:
        DFlashDraft.context_kv = trained_context_kv


def evaluate_as_vllm_cpu_serves(trained: dict) -> dict:
    """specgen.evaluate's report on the same prompts with `vllm_cpu_context_keys` (what vLLM's CPU build counts)."""
    from specgen.evaluate import run as evaluate

    root = trained["root"]
    with vllm_cpu_context_keys():
        return evaluate(compose("evaluate", ["recipe=demo", f"draft.path={trained['draft']}", "draft.method=dflash",
                                             f"evaluate.num_draft_tokens={trained['k']}",
                                             f"evaluate.max_prompts={PROMPTS}",
                                             f"evaluate.max_new_tokens={MAX_NEW_TOKENS}",
                                             f"output.dir={root / 'eval-vllm-cpu'}", "model.dtype=float32", *QUIET]))


def counted(report: dict) -> dict:
    """A specgen.evaluate report in vLLM's counters."""
    rounds = report["verification_rounds"]
    return {"num_drafts": rounds, "num_accepted_tokens": report["accepted_draft_tokens"],
            "num_accepted_tokens_per_pos": [round(rate * rounds) for rate in report["acceptance_rate_per_position"]]}


def replay(trained: dict, name: str, *args: str) -> dict:
    root = trained["root"]
    return vllm_replay(root / "eval" / "samples.jsonl", root / f"vllm-{name}.json", "--k", str(trained["k"]),
                       "--max-new-tokens", str(MAX_NEW_TOKENS), "--target", str(TARGET), *args)


def test_vllm_serves_the_dflash_draft_as_trained(trained):
    report, samples = trained["report"], trained["samples"]
    assert report["lossless"] and report["matches_target_greedy"], report["lossless_line"]  # float32: exact
    if trained["k"] == CONFIGS["bidirectional"][1]:  # served as specgen.train's summary says (K = block_size - 1)
        spec = vllm_speculative_config("dflash", trained["draft"], trained["k"])
        assert trained["k"] == dflash_block_positions(load_dflash(trained["draft"]).config)
        served = replay(trained, "dflash", "--speculative-config", json.dumps(spec))
    else:
        served = replay(trained, "dflash", "--draft", str(trained["draft"]), "--method", "dflash")
    specgen_outputs = [sample["output_token_ids"] for sample in samples]
    assert served["output_token_ids"] == specgen_outputs  # the target's greedy text (specgen checked it)
    if trained["root"].name == "bidirectional":  # and vLLM's own target-alone decoding, once
        assert replay(trained, "target")["output_token_ids"] == specgen_outputs
    # vLLM's own counters: exactly specgen.evaluate's for the 1-layer draft; for the 2-layer one, exactly those of
    # specgen.evaluate under vLLM CPU's context-key normalisation (module docstring)
    layers = json.loads((trained["draft"] / "config.json").read_text())["num_hidden_layers"]
    expected = report if layers == 1 else evaluate_as_vllm_cpu_serves(trained)
    assert expected["matches_target_greedy"]
    rounds = expected["verification_rounds"]
    assert {name: served[name] for name in counted(expected)} == counted(expected)
    assert served["num_draft_tokens"] == trained["k"] * rounds
    assert served["acceptance_length"] == pytest.approx(expected["acceptance_length"], abs=1e-12)
    assert report["acceptance_length"] > 1.0  # the draft does get tokens accepted


def test_vllm_reads_target_layer_ids_as_specgen_aux_layers(trained):
    """vLLM's own reading of the checkpoint's dflash_config: the aux hidden states it captures from the (Llama)
    target are its EAGLE-3 ids = target_layer_ids + 1 = specgen aux layers + 1, i.e. the outputs of decoder layers
    aux (the stream entering layer aux + 1, `llama.py`), which is what the shards hold."""
    from vllm.transformers_utils.config import get_config
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

    from specgen.methods.dflash.model import vllm_eagle_aux_ids

    config = json.loads((trained["draft"] / "config.json").read_text())
    manifest = json.loads((trained["shards"] / "manifest.json").read_text())
    assert config["dflash_config"]["target_layer_ids"] == manifest["capture"]["aux_layers"]
    hf_config = get_config(str(trained["draft"]), trust_remote_code=False)
    spec = SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=hf_config))
    ids = get_eagle3_aux_layers_from_config(spec)
    assert list(ids) == vllm_eagle_aux_ids(manifest["capture"]["aux_layers"])
    assert list(ids) == [layer + 1 for layer in manifest["capture"]["aux_layers"]]


def test_vllm_cpu_rms_norm_applies_row_0_of_a_stacked_weight():
    """What `vllm_cpu_context_keys` reproduces: vLLM's DFlash context-key normalisation (`_normalize_context_k`) calls
    `ops.rms_norm(out, keys [L, n, kv_heads, head_dim], k_norm weights [L, head_dim])`, meaning row l for layer l;
    the CPU kernel applies row 0 to all. When this fails, vLLM serves every layer's k_norm: drop the emulation."""
    import torch
    from vllm import _custom_ops as ops
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("vLLM's CPU build only")
    keys = torch.randn(2, 3, 2, 32, generator=torch.Generator().manual_seed(0))
    weights = torch.stack([torch.full((32,), 1.0), torch.full((32,), 2.0)])
    out = torch.empty_like(keys)
    ops.rms_norm(out, keys, weights, 1e-6)
    unit = keys * torch.rsqrt(keys.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert torch.allclose(out[0], unit[0], atol=1e-5)
    assert torch.allclose(out[1], unit[1], atol=1e-5)  # layer 1 got row 0 (1.0), not its own row (2.0)
