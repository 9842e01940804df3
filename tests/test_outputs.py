"""More from the same forward: logits, token log-probs, pooled states and filters against the HF reference."""

import json
import math
import warnings
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import BUNDLED_CHAT, build_tiny_model
from specgen import open_shards
from specgen.assets import ASSETS_DIR
from specgen.capture import load_target, make_capture
from specgen.capture.outputs import OutputSettings, SampleOutputs, trainable_positions
from specgen.config import compose
from specgen.errors import SpecgenError
from specgen.generate import run

BUNDLED_TOKENIZER = ASSETS_DIR / "tokenizer"
VOCAB = 2048


@pytest.fixture(scope="module")
def small_target(tmp_path_factory) -> Path:
    """A tiny fp32 llama (8 layers, hidden 64) carrying the bundled 2048-token tokenizer."""
    return build_tiny_model("llama", tmp_path_factory.mktemp("target"), vocab_size=VOCAB,
                            tokenizer_dir=BUNDLED_TOKENIZER)


@pytest.fixture(scope="module")
def hf_logits(small_target):
    """hf_logits(input_ids) -> the plain Hugging Face forward's logits [T, V] (fp32)."""
    model = AutoModelForCausalLM.from_pretrained(small_target).eval()

    def logits(input_ids: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return model(input_ids[None]).logits[0].float()

    return logits


def generate(model: Path, out_dir: Path, *overrides: str, rows: int = 10) -> dict:
    cfg = compose("generate", [f"model.path={model}", f"data.path={BUNDLED_CHAT}", f"output.dir={out_dir}",
                               "runtime.progress=false",
                               f"data.max_rows={rows}", "data.max_length=256", "output.shard_size=4", *overrides])
    return run(cfg)


def load_rows(out_dir: Path) -> list[dict]:
    dataset = open_shards(out_dir)
    return [dataset[i] for i in range(len(dataset))]


def test_topk_and_full_logits_equal_hf_logits_at_trainable_positions(small_target, hf_logits, tmp_path):
    topk = generate(small_target, tmp_path / "topk", "capture.logits=topk", "capture.topk=5",
                    "capture.lm_head_chunk_tokens=7")
    with pytest.warns(UserWarning, match="2,048 logits per trainable position"):
        full = generate(small_target, tmp_path / "full", "capture.logits=full")
    assert topk["outputs"]["logits"]["mode"] == "topk" and topk["outputs"]["logits"]["topk"] == 5
    assert "loss_mask[t + 1] == 1" in full["outputs"]["logits"]["positions"]
    for top, whole in zip(load_rows(tmp_path / "topk"), load_rows(tmp_path / "full")):
        positions = trainable_positions(top["loss_mask"])
        assert len(positions) == int(top["loss_mask"][1:].sum()) > 0  # the last position never predicts
        assert bool((top["loss_mask"][positions + 1] == 1).all())
        reference = hf_logits(top["input_ids"])[positions]
        torch.testing.assert_close(whole["logits"], reference, rtol=1e-4, atol=1e-4)
        assert top["topk_values"].shape == top["topk_indices"].shape == (len(positions), 5)
        torch.testing.assert_close(top["topk_values"], reference.topk(5).values, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(reference.gather(1, top["topk_indices"]), top["topk_values"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_equal_hf_log_softmax_of_the_next_token(small_target, hf_logits, tmp_path, temperature):
    manifest = generate(small_target, tmp_path / "out", "capture.token_logprobs=true",
                        f"capture.logprob_temperature={temperature}", "capture.lm_head_chunk_tokens=5")
    rows = load_rows(tmp_path / "out")
    means, counts = [], []
    for row in rows:
        ids, length = row["input_ids"], len(row["input_ids"])
        reference = (hf_logits(ids) / temperature).log_softmax(-1)[torch.arange(length - 1), ids[1:]]
        assert row["token_logprobs"].shape == (length,) and math.isnan(row["token_logprobs"][-1])
        torch.testing.assert_close(row["token_logprobs"][:-1], reference, rtol=1e-4, atol=1e-4)
        trained = row["loss_mask"][1:].bool()  # token t+1 is trained
        torch.testing.assert_close(row["mean_logprob"], reference[trained].mean(), rtol=1e-4, atol=1e-4)
        means.append(float(row["mean_logprob"]))
        counts.append(int(trained.sum()))
    stats = manifest["stats"]["logprobs"]
    assert stats["samples"] == len(rows)
    assert stats["mean_logprob"] == pytest.approx(sum(m * c for m, c in zip(means, counts)) / sum(counts), rel=1e-5)
    assert stats["per_sample_mean_logprob"]["min"] == pytest.approx(min(means), rel=1e-6)
    assert manifest["outputs"]["token_logprobs"]["temperature"] == temperature


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "gpt2"])
def test_chunked_prefill_equals_a_single_pass_in_bf16(tmp_path, arch):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the generic backend warns for GPT-2 by design
        model = load_target(build_tiny_model(arch, tmp_path / arch, vocab_size=512, dtype=torch.bfloat16),
                            dtype="bfloat16")
        capture = make_capture(model, [0, 3, 6])
    input_ids = torch.randint(0, 512, (3, 45), generator=torch.Generator().manual_seed(0))
    lengths = torch.tensor([45, 30, 7])
    single = capture(input_ids, lengths)
    for chunk_tokens in (8, 16):
        chunked = capture(input_ids, lengths, chunk_tokens=chunk_tokens)
        for b, length in enumerate(lengths.tolist()):
            torch.testing.assert_close(chunked.aux_hidden_states[b, :length], single.aux_hidden_states[b, :length],
                                       rtol=2e-2, atol=2e-2)
            torch.testing.assert_close(chunked.last_hidden_state[b, :length], single.last_hidden_state[b, :length],
                                       rtol=2e-2, atol=2e-2)


def test_chunked_prefill_gives_the_same_dataset(tmp_path):
    """The bundled bf16 target, long samples: chunked prefill + chunked LM head against one pass."""
    target = ASSETS_DIR / "tiny-target"
    options = ["capture.token_logprobs=true", "capture.logits=topk", "capture.topk=4"]
    generate(target, tmp_path / "single", *options, rows=4)
    generate(target, tmp_path / "chunked", *options, "capture.prefill_chunk_tokens=32",
             "capture.lm_head_chunk_tokens=16", rows=4)
    singles, chunks = load_rows(tmp_path / "single"), load_rows(tmp_path / "chunked")
    assert max(len(row["input_ids"]) for row in singles) > 64  # several prefill chunks
    for single, chunked in zip(singles, chunks):
        torch.testing.assert_close(chunked["token_logprobs"], single["token_logprobs"], rtol=0, atol=5e-2,
                                   equal_nan=True)
        torch.testing.assert_close(chunked["mean_logprob"], single["mean_logprob"], rtol=0, atol=1e-2)
        torch.testing.assert_close(chunked["last_hidden_state"].float(), single["last_hidden_state"].float(),
                                   rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(chunked["topk_values"].float(), single["topk_values"].float(), rtol=2e-2,
                                   atol=2e-2)


@pytest.mark.parametrize("pooled, layer", [("mean", "last"), ("mean_trainable", "last"), ("last", "last"),
                                           ("mean", 3)])
def test_pooled_vectors_equal_pooling_the_stored_states(small_target, tmp_path, pooled, layer):
    manifest = generate(small_target, tmp_path / "out", f"capture.pooled={pooled}", f"capture.pooled_layer={layer}",
                        "capture.aux_layers=[1,3,5]", rows=6)
    assert manifest["outputs"]["pooled"]["mode"] == pooled and manifest["outputs"]["pooled"]["layer"] == layer
    for row in load_rows(tmp_path / "out"):
        states = row["last_hidden_state"] if layer == "last" else row["aux_hidden_states"][:, 64:128]
        want = {"mean": states.mean(0), "last": states[-1],
                "mean_trainable": states[row["loss_mask"].bool()].mean(0)}[pooled]
        assert row["pooled_hidden_state"].dtype == torch.float32 and row["pooled_hidden_state"].shape == (64,)
        torch.testing.assert_close(row["pooled_hidden_state"], want, rtol=1e-5, atol=1e-6)


def test_filters_drop_exactly_the_samples_out_of_bounds_and_list_them(small_target, tmp_path):
    generate(small_target, tmp_path / "all", "capture.token_logprobs=true", rows=10)
    values = {row["sample_id"]: float(row["mean_logprob"]) for row in load_rows(tmp_path / "all")}
    ordered = sorted(values.values())
    low, high = ordered[2], ordered[-3]  # keeps the samples in [low, high]
    manifest = generate(small_target, tmp_path / "filtered", "capture.token_logprobs=true",
                        f"filter.min_mean_logprob={low}", f"filter.max_mean_logprob={high}", rows=10)

    kept = {row["sample_id"] for row in load_rows(tmp_path / "filtered")}
    assert kept == {sid for sid, value in values.items() if low <= value <= high}
    rejected = [json.loads(line) for line in (tmp_path / "filtered" / "rejected.jsonl").read_text().splitlines()]
    by_reason = {reason: {r["sample_id"] for r in rejected if r["reason"] == reason}
                 for reason in ("mean_logprob_below_min", "mean_logprob_above_max")}
    assert by_reason["mean_logprob_below_min"] == {sid for sid, value in values.items() if value < low}
    assert by_reason["mean_logprob_above_max"] == {sid for sid, value in values.items() if value > high}
    assert all(isinstance(r["source_index"], int) and "filter." in r["message"] for r in rejected)
    stats = manifest["stats"]
    assert stats["rejected"] == {reason: len(ids) for reason, ids in by_reason.items()}
    assert stats["samples"] == len(kept) and stats["filtered_samples"] == len(values) - len(kept)
    assert stats["tokens"] == sum(len(row["input_ids"]) for row in load_rows(tmp_path / "filtered"))
    assert manifest["outputs"]["filter"] == {"min_mean_logprob": low, "max_mean_logprob": high}


def test_new_columns_read_with_datasets_and_open_shards(small_target, tmp_path):
    import datasets

    manifest = generate(small_target, tmp_path / "out", "output.codec=fp8", "capture.logits=topk", "capture.topk=3",
                        "capture.token_logprobs=true", "capture.pooled=last", rows=4)
    dataset = open_shards(tmp_path / "out")
    assert dataset.spec.codec == "fp8" and dataset.spec.logits == "topk" and dataset.spec.token_logprobs
    assert dataset.manifest["outputs"] == manifest["outputs"]
    shards = [str(tmp_path / "out" / name) for name in manifest["shards"]]
    hf = datasets.load_dataset("arrow", data_files=shards, split="train", cache_dir=str(tmp_path / "hf"))
    for index in range(len(dataset)):
        item, raw = dataset[index], hf[index]
        length, trainable = len(item["input_ids"]), len(trainable_positions(item["loss_mask"]))
        assert raw["sample_id"] == item["sample_id"]
        assert len(raw["aux_hidden_states"]) == length and len(raw["aux_hidden_states_scale"][0]) == 3
        assert len(raw["last_hidden_state_scale"]) == length
        assert torch.equal(torch.tensor(raw["topk_indices"]), item["topk_indices"])
        assert len(raw["topk_values"]) == trainable and len(raw["topk_values"][0]) == 3
        torch.testing.assert_close(torch.tensor(raw["token_logprobs"]), item["token_logprobs"], equal_nan=True)
        assert raw["mean_logprob"] == pytest.approx(float(item["mean_logprob"]))
        assert torch.equal(torch.tensor(raw["pooled_hidden_state"]), item["pooled_hidden_state"])


def test_options_change_the_dataset_identity(small_target, tmp_path):
    generate(small_target, tmp_path / "out", rows=2)
    with pytest.raises(SpecgenError, match="output.codec"):
        generate(small_target, tmp_path / "out", "output.codec=fp8", rows=2)
    generate(small_target, tmp_path / "out", "capture.prefill_chunk_tokens=16", rows=2)  # a performance knob


@pytest.mark.parametrize("overrides, message", [
    (["filter.min_mean_logprob=-3"], "capture.token_logprobs=true"),
    (["capture.pooled=mean", "capture.pooled_layer=2"], "pooled_layer"),
    (["capture.pooled=max"], "capture.pooled"),
    (["output.codec=int4"], "output.codec"),
    (["capture.logits=topk", "capture.topk=0"], "capture.topk"),
    (["capture.logits=top5"], "capture.logits"),
    (["capture.token_logprobs=true", "capture.logprob_temperature=0"], "temperature"),
])
def test_bad_options_are_refused(small_target, tmp_path, overrides, message):
    with pytest.raises(SpecgenError, match=message):
        generate(small_target, tmp_path / "out", *overrides, rows=1)


def test_targets_that_transform_their_logits_are_refused(small_target):
    model = load_target(small_target)
    model.config.final_logit_softcapping = 30.0  # what Gemma-2 does after its LM head
    with pytest.raises(SpecgenError, match="final_logit_softcapping"):
        SampleOutputs.from_settings(OutputSettings(token_logprobs=True), make_capture(model, None))
