"""Packed capture (no padding): one row of sequences end to end against the Hugging Face forward of each alone,
for the llama backend and the generic one; generate with and without packing; models that cannot pack."""

import warnings
from pathlib import Path

import pytest
import torch
import transformers

from conftest import BUNDLED_CHAT, build_tiny_model
from specgen import open_shards
from specgen.assets import ASSETS_DIR
from specgen.capture import load_target, make_capture
from specgen.capture.packed import PackedSegments, PackingUnsupported
from specgen.config import compose
from specgen.data.batching import packed_batches, token_budget_batches
from specgen.data.sample import TokenizedSample
from specgen.generate import run

VOCAB, HIDDEN, NUM_LAYERS = 512, 64, 8
AUX_LAYERS = [6, 0, 3]
LENGTHS = [11, 5, 8, 1]


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    folders = {}

    def get(arch: str):
        if arch not in folders:
            folders[arch] = build_tiny_model(arch, tmp_path_factory.mktemp(arch), vocab_size=VOCAB)
        return folders[arch]

    return get


def quiet_capture(model, aux_layers):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make_capture(model, aux_layers)


def packed_row(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, PackedSegments]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (1, sum(lengths)), generator=generator), PackedSegments.from_lengths(lengths)


def assert_close_at_scale(got: torch.Tensor, want: torch.Tensor, msg: str) -> None:
    """assert_close's defaults; in bf16 also 2 ulps of the tensor's largest value (as tests/test_capture.py)."""
    atol = 1.6e-2 * float(want.abs().max()) if want.dtype == torch.bfloat16 else None
    torch.testing.assert_close(got, want, atol=atol, rtol=None if atol is None else 1.6e-2, msg=msg)


def assert_matches_each_alone(model, output, input_ids, segments, aux_layers) -> None:
    for lo, hi in segments.spans():
        with torch.inference_mode():
            reference = model(input_ids[:, lo:hi], output_hidden_states=True)
        for slot, layer in enumerate(aux_layers):
            got = output.aux_hidden_states[0, lo:hi, slot * HIDDEN:(slot + 1) * HIDDEN]
            assert_close_at_scale(got, reference.hidden_states[layer + 1][0], f"aux layer {layer}, [{lo}, {hi})")
        assert_close_at_scale(output.last_hidden_state[0, lo:hi], reference.hidden_states[-1][0], f"[{lo}, {hi})")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gpt2"])
def test_packed_row_matches_each_sequence_alone(saved_model, arch, attn_implementation, dtype):
    model = load_target(saved_model(arch), dtype=dtype, attn_implementation=attn_implementation)
    capture = quiet_capture(model, AUX_LAYERS)
    assert capture.supports_packing and capture.backend == ("generic" if arch == "gpt2" else "llama")
    input_ids, segments = packed_row(LENGTHS)

    output = capture.packed(input_ids, segments)

    assert output.aux_hidden_states.shape == (1, sum(LENGTHS), len(AUX_LAYERS) * HIDDEN)
    assert output.last_hidden_state.dtype == getattr(torch, dtype)
    assert_matches_each_alone(model, output, input_ids, segments, AUX_LAYERS)
    assert model.config._attn_implementation == attn_implementation  # restored after the packed forward


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_packed_sliding_window_layers_match_each_sequence_alone(arch):
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=NUM_LAYERS,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    config = (transformers.MistralConfig(**common, sliding_window=4) if arch == "mistral" else
              transformers.Qwen2Config(**common, use_sliding_window=True, sliding_window=4, max_window_layers=4))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    input_ids, segments = packed_row([12, 3, 7])   # one segment within the window, two longer than it

    output = make_capture(model, [2, 5]).packed(input_ids, segments)

    assert_matches_each_alone(model, output, input_ids, segments, [2, 5])


def test_positions_restart_at_every_segment():
    segments = PackedSegments.from_lengths([3, 1, 2])
    assert segments.bounds == [0, 3, 4, 6] and segments.lengths == [3, 1, 2]
    assert segments.position_ids(torch.device("cpu")).tolist() == [[0, 1, 2, 0, 0, 1]]
    with pytest.raises(ValueError):
        PackedSegments.from_lengths([3, 0])


def test_no_mask_tensor_is_built(saved_model, monkeypatch):
    """The packed attention builds no [T, T] mask: SDPA's fused CPU kernel, causal, once per segment and layer."""
    model = load_target(saved_model("llama"), attn_implementation="sdpa")
    calls = []
    fused = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

    def recording(query, key, value, dropout, causal, **kwargs):
        calls.append((query.shape[2], causal))
        return fused(query, key, value, dropout, causal, **kwargs)

    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", recording)
    make_capture(model, None).packed(*packed_row([7, 3]))
    assert calls == [(7, True), (3, True)] * NUM_LAYERS


def gemma2_target(folder: Path) -> Path:
    """A tiny Gemma2 (attention logit softcapping: it cannot run packed) with the bundled tokenizer."""
    config = transformers.Gemma2Config(vocab_size=2048, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                       num_hidden_layers=NUM_LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                       head_dim=16, max_position_embeddings=4096, sliding_window=16)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(ASSETS_DIR / "tokenizer").save_pretrained(folder)
    return folder


def test_a_model_that_cannot_pack_is_refused(tmp_path):
    model = load_target(gemma2_target(tmp_path / "gemma2"), attn_implementation="eager")
    capture = quiet_capture(model, [1, 3, 4])
    with pytest.raises(PackingUnsupported, match="softcapping"):
        capture.packed(*packed_row([5, 4]))
    assert model.config._attn_implementation == "eager"


# --- generate: packed against padded ------------------------------------------------------------------------------

def generate(model: Path, out_dir: Path, *overrides: str) -> dict:
    return run(compose("generate", [f"model.path={model}", f"data.path={BUNDLED_CHAT}", f"output.dir={out_dir}",
                                    "runtime.progress=false", "data.max_rows=24", "output.shard_size=8",
                                    "capture.batch_tokens=1024", "capture.prefix_reuse=false", *overrides]))


def assert_same_dataset(got_dir: Path, want_dir: Path, columns: tuple[str, ...]) -> None:
    got, want = open_shards(got_dir), open_shards(want_dir)
    assert len(got) == len(want) > 0
    for i in range(len(got)):
        a, b = got[i], want[i]
        assert a["sample_id"] == b["sample_id"]
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        for name in columns:
            assert_close_at_scale(a[name], b[name], f"{name}, row {i}")


@pytest.mark.parametrize("arch, dtype", [("llama", "float32"), ("llama", "bfloat16"), ("gpt2", "float32"),
                                         ("gpt2", "bfloat16")])
def test_packed_generate_equals_padded_with_no_padding(tmp_path, arch, dtype):
    target = build_tiny_model(arch, tmp_path / arch, vocab_size=2048, tokenizer_dir=ASSETS_DIR / "tokenizer")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        packed = generate(target, tmp_path / "packed", f"model.dtype={dtype}")
        padded = generate(target, tmp_path / "padded", f"model.dtype={dtype}", "capture.packing=false")
    assert packed["dtype"] == dtype
    assert packed["padding"]["packing"] and packed["padding"]["packing_off_because"] is None
    assert packed["padding"]["forwarded_tokens"] == packed["padding"]["real_tokens"] == packed["stats"]["tokens"]
    assert packed["padding"]["ratio"] == 1.0
    assert not padded["padding"]["packing"] and padded["padding"]["ratio"] > 1.0
    assert_same_dataset(tmp_path / "packed", tmp_path / "padded", ("aux_hidden_states", "last_hidden_state"))


def test_packed_extra_columns_and_target_counts_equal_padded(tmp_path):
    """logits=topk, token log-probs, pooled vectors and target token counts come out of a packed batch too."""
    target = build_tiny_model("llama", tmp_path / "llama", vocab_size=2048, tokenizer_dir=ASSETS_DIR / "tokenizer")
    extra = ("capture.logits=topk", "capture.topk=4", "capture.token_logprobs=true", "capture.pooled=mean",
             "capture.count_target_tokens=true")
    generate(target, tmp_path / "packed", *extra)
    generate(target, tmp_path / "padded", *extra, "capture.packing=false")
    assert_same_dataset(tmp_path / "packed", tmp_path / "padded",
                        ("aux_hidden_states", "last_hidden_state", "topk_values", "pooled_hidden_state"))
    got, want = open_shards(tmp_path / "packed"), open_shards(tmp_path / "padded")
    for i in range(len(got)):
        assert torch.equal(got[i]["topk_indices"], want[i]["topk_indices"])
        torch.testing.assert_close(got[i]["token_logprobs"], want[i]["token_logprobs"], equal_nan=True)
    counts = [(tmp_path / name / "target_token_counts.json").read_text() for name in ("packed", "padded")]
    assert counts[0] == counts[1]


def test_long_samples_run_alone_with_chunked_prefill(tmp_path):
    target = build_tiny_model("llama", tmp_path / "llama", vocab_size=2048, tokenizer_dir=ASSETS_DIR / "tokenizer")
    chunked = generate(target, tmp_path / "chunked", "capture.prefill_chunk_tokens=128")
    generate(target, tmp_path / "whole", "capture.packing=false")
    assert chunked["padding"]["ratio"] == 1.0  # the long samples ran one at a time, the rest packed
    assert_same_dataset(tmp_path / "chunked", tmp_path / "whole", ("aux_hidden_states", "last_hidden_state"))


def test_a_refused_model_falls_back_to_padded_batches_and_says_why(tmp_path):
    target = gemma2_target(tmp_path / "gemma2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        refused = generate(target, tmp_path / "refused", "model.attn_implementation=eager")
        padded = generate(target, tmp_path / "padded", "model.attn_implementation=eager", "capture.packing=false")
    assert not refused["padding"]["packing"]
    assert "softcapping" in refused["padding"]["packing_off_because"]
    assert refused["padding"]["forwarded_tokens"] == padded["padding"]["forwarded_tokens"]
    assert_same_dataset(tmp_path / "refused", tmp_path / "padded", ("aux_hidden_states", "last_hidden_state"))


# --- packed batches ------------------------------------------------------------------------------------------------

def samples_of_lengths(lengths: list[int]) -> list[TokenizedSample]:
    return [TokenizedSample(f"s{i}", i, [7] * n, [1] * n) for i, n in enumerate(lengths)]


@pytest.mark.parametrize("max_batch_size", [None, 3])
def test_packed_batches_keep_the_budget_and_the_padded_order(max_batch_size):
    import random

    rng = random.Random(0)
    samples = samples_of_lengths([rng.randint(1, 600) for _ in range(300)] + [700, 700, 2000])
    batches = packed_batches(samples, 1024, max_batch_size)
    assert all(sum(len(s) for s in b) <= 1024 or len(b) == 1 for b in batches)
    assert max_batch_size is None or all(len(b) <= max_batch_size for b in batches)
    order = [s.sample_id for b in batches for s in b]
    assert order == [s.sample_id for b in token_budget_batches(samples, 1024, max_batch_size) for s in b]


@pytest.mark.slow
def test_compiled_capture_equals_eager_packed_and_padded(tmp_path, capsys):
    """capture.compile=true (decoder layers under torch.compile, dynamic shapes): the same dataset as the eager
    forward, packed and padded, and the manifest says it compiled; the packed attention stays one eager call per
    layer (its segment bounds never become part of a graph)."""
    target = build_tiny_model("llama", tmp_path / "llama", vocab_size=2048, tokenizer_dir=ASSETS_DIR / "tokenizer")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager = generate(target, tmp_path / "eager")
        compiled = generate(target, tmp_path / "compiled", "capture.compile=true")
        padded = generate(target, tmp_path / "padded", "capture.compile=true", "capture.packing=false")
    assert compiled["capture"]["compiled"] and not eager["capture"]["compiled"]
    assert capsys.readouterr().out.count("; decoder layers compiled)") == 2  # the two compiled runs say so
    assert compiled["padding"]["ratio"] == 1.0 and padded["padding"]["ratio"] > 1.0
    columns = ("aux_hidden_states", "last_hidden_state")
    assert_same_dataset(tmp_path / "compiled", tmp_path / "eager", columns)
    assert_same_dataset(tmp_path / "padded", tmp_path / "eager", columns)


def test_compile_on_a_backend_that_cannot_is_said_and_recorded(tmp_path, caplog):
    target = build_tiny_model("gpt2", tmp_path / "gpt2", vocab_size=2048, tokenizer_dir=ASSETS_DIR / "tokenizer")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        manifest = generate(target, tmp_path / "out", "capture.compile=true", "data.max_rows=4")
    assert manifest["capture"]["backend"] == "generic" and manifest["capture"]["compiled"] is False
    assert "capture.compile=true, but the generic capture backend runs its forward eagerly" in caplog.text
