"""Shared-prefix reuse: the prefix plan, KV continuation against the HF full forward for every architecture of the
llama backend, rows generated with reuse against rows generated without it (per architecture, per-turn Qwen3 rows,
across work units and processes), and the store-once layout read back against the flat one."""

import json
import subprocess
import sys
from pathlib import Path

import datasets
import pyarrow as pa
import pytest
import torch
import transformers

from conftest import REPO, TOKENIZERS, build_tiny_model, require_shared
from specgen import open_shards
from specgen.assets import ASSETS_DIR
from specgen.capture import load_target, make_capture
from specgen.capture.kv import GroupedPast, PastKV
from specgen.capture.reuse import MAX_PADDING, capture_with_prefix_reuse, resolve_prefix_reuse, reuse_pays
from specgen.config import compose
from specgen.data.prefixes import plan_prefixes
from specgen.data.sample import TokenizedSample
from specgen.errors import SpecgenError
from specgen.capture.manifest import prefix_reuse_summary
from specgen.generate import run
from specgen.verify import relative_error
from specgen.verify import run as verify

LLAMA_FAMILY = ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe"]
VOCAB = 512
BF16_TOLERANCE = 2e-2  # relative error, as `specgen.verify` accepts for bf16 datasets

SYSTEM = ("You are the support assistant of a small bookshop. Always greet the customer, answer in two sentences at "
          "most, never invent a price, and point to the opening hours (nine to six, closed on Sundays) when asked.")
QUESTIONS = [("Do you sell maps?", "Maps are a common request.", "Yes, we sell city and hiking maps."),
             ("Are you open on Sunday?", "Check the hours.", "No, we are closed on Sundays."),
             ("Can I order a book?", "Orders are possible.", "Yes, ask at the counter or by phone."),
             ("How much is the atlas?", "No prices may be invented.", "Please ask the shop for the current price.")]


# --- the plan ----------------------------------------------------------------------------------------------------

def distinct_prefixes(sequences) -> int:
    return len({tuple(seq[:i]) for seq in sequences for i in range(1, len(seq) + 1)})


def test_plan_computes_a_shared_system_prompt_once():
    system = list(range(100, 140))
    sequences = [system + [1, 2, 3], system + [4, 5], [7, 8, 9], system + [1, 2, 6]]
    plan = plan_prefixes(sequences, min_tokens=8)
    assert [(n.start, n.end, n.parent) for n in plan.nodes] == [(0, 40, None)]  # [1, 2] is below min_tokens
    assert plan.sample_node == [0, 0, None, 0]
    assert plan.tokens_computed == 40 + 3 + 2 + 3 + 3
    assert plan.tokens_emitted == sum(map(len, sequences))


def test_plan_of_per_turn_rows_is_a_chain_and_min_one_computes_each_distinct_prefix_once():
    generator = torch.Generator().manual_seed(0)
    turns = [torch.randint(0, 50, (n,), generator=generator).tolist() for n in (30, 20, 25, 10)]
    # row k: the conversation up to turn k, then turn k's own ending (like Qwen3's reasoning of the last turn)
    rows = [sum(turns[:k], []) + [900 + k] * 5 for k in range(1, 5)]
    plan = plan_prefixes(rows, min_tokens=1)
    assert [(n.start, n.end, n.level) for n in plan.nodes] == [(0, 30, 0), (30, 50, 1), (50, 75, 2)]
    assert plan.chain(plan.sample_node[3]) == [0, 1, 2]
    assert plan.tokens_computed == distinct_prefixes(rows) == 85 + 4 * 5
    random_rows = [torch.randint(0, 3, (int(n),), generator=generator).tolist()
                   for n in torch.randint(1, 12, (40,), generator=generator)]
    assert plan_prefixes(random_rows, min_tokens=1).tokens_computed == distinct_prefixes(random_rows)


def test_plan_handles_duplicates_and_rows_that_are_prefixes_of_others():
    base = list(range(20))
    plan = plan_prefixes([base, base + [5, 6], base, base[:10] + [99]], min_tokens=4)
    assert plan.prefix_length(0) == plan.prefix_length(2) == 20  # nothing left to compute for them
    assert plan.prefix_length(1) == 20 and plan.prefix_length(3) == 10
    assert plan.tokens_computed == 22 + 1
    with pytest.raises(SpecgenError, match="prefix_min_tokens"):
        plan_prefixes([base], min_tokens=0)


# --- KV continuation in the capture backend ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    folders = {}

    def get(arch: str) -> Path:
        if arch not in folders:
            folders[arch] = build_tiny_model(arch, tmp_path_factory.mktemp(arch), vocab_size=VOCAB)
        return folders[arch]

    return get


def continue_batch(capture, sequences, prefix_lengths):
    """Capture each sequence's prefix with keep_kv, then its rest continuing from that KV (both right-padded)."""
    def padded(parts):
        ids = torch.zeros(len(parts), max(map(len, parts)), dtype=torch.long)
        for b, part in enumerate(parts):
            ids[b, : len(part)] = part
        return ids, torch.tensor([len(part) for part in parts])

    prefixes = padded([seq[:p] for seq, p in zip(sequences, prefix_lengths)])
    first = capture(*prefixes, keep_kv=True)
    past = PastKV.stacked(first.kv, prefixes[1])
    return capture(*padded([seq[p:] for seq, p in zip(sequences, prefix_lengths)]), past=past)


def assert_states_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, msg=what)
    else:
        assert relative_error(got, want) <= BF16_TOLERANCE, f"{what}: relative error {relative_error(got, want):.2e}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", LLAMA_FAMILY)
def test_continuation_matches_the_full_forward(saved_model, arch, attn_implementation, dtype):
    model = load_target(saved_model(arch), dtype=dtype, attn_implementation=attn_implementation)
    capture = make_capture(model, [0, 3, 6])
    assert capture.supports_kv
    generator = torch.Generator().manual_seed(1)
    prefix_lengths, suffix_lengths = [17, 4, 17, 9], [6, 13, 1, 9]  # pasts and suffixes of different lengths
    sequences = [torch.randint(0, VOCAB, (p + s,), generator=generator) for p, s in zip(prefix_lengths, suffix_lengths)]

    output = continue_batch(capture, sequences, prefix_lengths)

    for b, (sequence, p) in enumerate(zip(sequences, prefix_lengths)):
        with torch.inference_mode():
            hidden = model(sequence[None], output_hidden_states=True).hidden_states
        n = len(sequence) - p
        for slot, layer in enumerate([0, 3, 6]):
            assert_states_close(output.aux_hidden_states[b, :n, slot * 64:(slot + 1) * 64], hidden[layer + 1][0, p:],
                                f"row {b} aux layer {layer}")
        assert_states_close(output.last_hidden_state[b, :n], hidden[-1][0, p:], f"row {b} last hidden state")


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_continuation_keeps_sliding_windows(arch, attn_implementation):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)
    config = (transformers.MistralConfig(**common, sliding_window=4) if arch == "mistral" else
              transformers.Qwen2Config(**common, use_sliding_window=True, sliding_window=4, max_window_layers=4))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation).eval()
    generator = torch.Generator().manual_seed(2)
    sequences = [torch.randint(0, VOCAB, (n,), generator=generator) for n in (14, 9)]

    output = continue_batch(make_capture(model, [2, 5]), sequences, [6, 2])  # suffixes reach past the window

    for b, (sequence, p) in enumerate(zip(sequences, [6, 2])):
        with torch.inference_mode():
            hidden = model(sequence[None], output_hidden_states=True).hidden_states
        torch.testing.assert_close(output.aux_hidden_states[b, :len(sequence) - p, 64:], hidden[6][0, p:])
        torch.testing.assert_close(output.last_hidden_state[b, :len(sequence) - p], hidden[-1][0, p:])


def test_generic_backend_refuses_a_kv_cache(saved_model):
    with pytest.warns(UserWarning):
        capture = make_capture(load_target(saved_model("gpt2")), None)
    assert not capture.supports_kv
    with pytest.raises(SpecgenError, match="cannot continue from a KV cache"):
        capture(torch.zeros(1, 4, dtype=torch.long), torch.tensor([4]), keep_kv=True)


# --- generate: rows with reuse == rows without ---------------------------------------------------------------------

def conversations(turns_per_row: list[int], system: bool = True, reasoning: bool = True) -> list[dict]:
    rows = []
    for number, turns in enumerate(turns_per_row):
        messages = [{"role": "system", "content": SYSTEM}] if system else []
        for turn in range(turns):
            question, thought, answer = QUESTIONS[(number + turn) % len(QUESTIONS)]
            messages.append({"role": "user", "content": f"{question} (customer {number})"})
            reply = {"role": "assistant", "content": answer}
            if reasoning:
                reply["reasoning_content"] = thought
            messages.append(reply)
        rows.append({"id": f"c{number}", "messages": messages})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def generate(model: Path, out_dir: Path, data: Path, *overrides: str) -> dict:
    return run(compose("generate", [f"model.path={model}", f"output.dir={out_dir}", f"data.path={data}",
                                    "runtime.progress=false", "output.shard_size=4", "capture.prefix_min_tokens=4",
                                    *overrides]))


def rows_by_id(out_dir: Path) -> dict[str, dict]:
    dataset = open_shards(out_dir)
    rows = [dataset[i] for i in range(len(dataset))]
    assert len({row["sample_id"] for row in rows}) == len(rows)
    return {row["sample_id"]: row for row in rows}


def assert_same_rows(got: dict, want: dict, exact: bool = False) -> None:
    assert sorted(got) == sorted(want)
    for sample_id, row in want.items():
        other = got[sample_id]
        assert torch.equal(other["input_ids"], row["input_ids"]) and torch.equal(other["loss_mask"], row["loss_mask"])
        for name in ("aux_hidden_states", "last_hidden_state"):
            if exact:
                assert torch.equal(other[name], row[name]), f"{sample_id} {name}"
            else:
                assert_states_close(other[name], row[name], f"{sample_id} {name}")


@pytest.fixture(scope="module")
def qwen3_target(tmp_path_factory) -> Path:
    """A tiny fp32 Qwen3 carrying the real Qwen3 tokenizer (whose template gives one row per assistant turn)."""
    return build_tiny_model("qwen3", tmp_path_factory.mktemp("qwen3"), vocab_size=151680, hidden_size=32,
                            tokenizer_dir=require_shared(TOKENIZERS["qwen3"]))


@pytest.mark.parametrize("overrides", [
    (),
    ("capture.batch_tokens=300", "capture.prefix_cache_tokens=1"),  # many batches mixing pasts; a wave per tree
    pytest.param(("capture.compile=true",), marks=pytest.mark.slow),  # prefixes and continuations compiled too
])
def test_qwen3_per_turn_rows_with_reuse_equal_rows_without(qwen3_target, tmp_path, overrides):
    rows = conversations([3, 1, 2, 3, 2, 1])
    rows.insert(2, {**rows[1], "id": "copy-of-c1"})  # a duplicate: all of it is a shared prefix
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    reference = generate(qwen3_target, tmp_path / "full", data, "capture.prefix_reuse=false")
    manifest = generate(qwen3_target, tmp_path / "reuse", data, *overrides)

    got, want = rows_by_id(tmp_path / "reuse"), rows_by_id(tmp_path / "full")
    assert {"c0#0", "c0#1", "c0#2", "c1", "copy-of-c1"} <= set(want)  # per-turn rows
    assert_same_rows(got, want)
    report, stats = manifest["prefix_reuse"], manifest["stats"]
    assert report["enabled"] and not reference["prefix_reuse"]["enabled"]
    assert report["tokens_emitted"] == stats["tokens"] == reference["stats"]["tokens_computed"]
    # within each work unit, the system prompt and each turn's context are computed once
    units = [open_shards(path) for path in sorted((tmp_path / "reuse").glob("shard-*.arrow"))]
    unique = sum(distinct_prefixes([unit[i]["input_ids"].tolist() for i in range(len(unit))]) for unit in units)
    assert unique <= report["tokens_computed"] <= 1.1 * unique
    assert report["tokens_computed"] < 0.6 * report["tokens_emitted"]
    # every batch's padding stays within MAX_PADDING of its real tokens, so the whole run does too
    assert report["tokens_computed"] <= manifest["padding"]["forwarded_tokens"] \
        <= (1 + MAX_PADDING) * report["tokens_computed"]


@pytest.mark.parametrize("arch", LLAMA_FAMILY)
def test_rows_with_reuse_equal_rows_without_per_architecture(tmp_path, arch):
    """bf16 targets with the bundled tokenizer: one long system prompt shared by every conversation, 3 work units."""
    model = build_tiny_model(arch, tmp_path / "model", vocab_size=2048, dtype=torch.bfloat16,
                             tokenizer_dir=ASSETS_DIR / "tokenizer")
    data = write_jsonl(tmp_path / "chat.jsonl", conversations([1, 2, 1, 3, 1, 1, 2, 1, 1, 2], reasoning=False))
    bf16 = "model.dtype=bfloat16"  # bf16 whatever the CPU (auto is float32 without native bf16 matmul)
    generate(model, tmp_path / "full", data, "capture.prefix_reuse=false", bf16)
    manifest = generate(model, tmp_path / "reuse", data, bf16)
    assert_same_rows(rows_by_id(tmp_path / "reuse"), rows_by_id(tmp_path / "full"))
    sidecars = [json.loads(path.read_text())["stats"] for path in sorted((tmp_path / "reuse").glob("shard-*.json"))]
    assert len(sidecars) == 3 and all(s["tokens_computed"] < s["tokens_emitted"] for s in sidecars)
    assert manifest["prefix_reuse"]["tokens_computed"] == sum(s["tokens_computed"] for s in sidecars)


@pytest.mark.slow
def test_units_are_computed_alike_in_any_process(qwen3_target, tmp_path):
    """A prefix shared across work units is computed in each unit, from that unit's rows alone: a unit redone in
    another process (a resumed run, another rank) is bit-identical to the same unit computed in one run."""
    data = write_jsonl(tmp_path / "chat.jsonl", conversations([2, 1, 1, 2, 1, 2, 1, 1, 2]))
    out = tmp_path / "out"
    generate(qwen3_target, out, data)
    before = rows_by_id(out)
    for name in ("shard-00001.arrow", "shard-00001.json", "manifest.json"):
        (out / name).unlink()
    subprocess.run([sys.executable, "-m", "specgen.generate", f"model.path={qwen3_target}", f"output.dir={out}",
                    f"data.path={data}", "runtime.progress=false", "output.shard_size=4",
                    "capture.prefix_min_tokens=4"], cwd=REPO, check=True, capture_output=True)
    assert_same_rows(rows_by_id(out), before, exact=True)


# --- the store-once layout -----------------------------------------------------------------------------------------

def test_store_once_reads_back_equal_to_the_flat_layout(qwen3_target, tmp_path):
    data = write_jsonl(tmp_path / "chat.jsonl", conversations([3, 2, 1, 3, 2]))
    flat = generate(qwen3_target, tmp_path / "flat", data)
    once = generate(qwen3_target, tmp_path / "once", data, "output.store_prefix_once=true")

    assert_same_rows(rows_by_id(tmp_path / "once"), rows_by_id(tmp_path / "flat"), exact=True)
    assert (flat["layout"], once["layout"]) == ("flat", "prefix_refs")
    report = once["prefix_reuse"]
    assert report["bytes_stored"] == once["stats"]["bytes_on_disk"]
    assert report["bytes_stored"] < 0.6 * flat["prefix_reuse"]["bytes_stored"]
    assert abs(report["bytes_flat"] - flat["prefix_reuse"]["bytes_stored"]) < 0.01 * report["bytes_flat"]
    assert once["stats"]["tokens_stored"] == report["tokens_computed"]
    # Arrow readers see the stored layout: hidden states after prefix_len only.
    shards = sorted(str(path) for path in (tmp_path / "once").glob("shard-*.arrow"))
    table = pa.concat_tables(pa.ipc.open_file(pa.memory_map(path)).read_all() for path in shards)
    ds = datasets.load_dataset("arrow", data_files=shards, split="train")
    assert len(ds) == table.num_rows == len(open_shards(tmp_path / "once"))
    for row in ds:
        assert len(row["last_hidden_state"]) == len(row["input_ids"]) - row["prefix_len"]
    assert sum(row["prefix_len"] for row in ds) > 0
    assert set(open_shards(tmp_path / "once")[0]) == {"sample_id", "input_ids", "loss_mask", "aux_hidden_states",
                                                      "last_hidden_state"}
    verify(compose("verify", [f"data.shards={tmp_path / 'once'}", "verify.samples=3"]))  # exits non-zero on a problem


def test_gpt2_falls_back_to_full_rows_and_can_still_store_prefixes_once(tmp_path, caplog):
    model = build_tiny_model("gpt2", tmp_path / "gpt2", vocab_size=2048, tokenizer_dir=ASSETS_DIR / "tokenizer")
    data = write_jsonl(tmp_path / "chat.jsonl", conversations([1, 2, 1, 1], reasoning=False))
    with pytest.warns(UserWarning, match="GPT2"):
        flat = generate(model, tmp_path / "flat", data, "capture.prefix_reuse=false")
        once = generate(model, tmp_path / "once", data, "output.store_prefix_once=true")
    assert "cannot continue from a KV cache" in caplog.text
    assert not once["prefix_reuse"]["enabled"]
    assert once["prefix_reuse"]["tokens_computed"] == once["prefix_reuse"]["tokens_emitted"]
    assert once["prefix_reuse"]["bytes_stored"] < flat["prefix_reuse"]["bytes_stored"]
    assert_same_rows(rows_by_id(tmp_path / "once"), rows_by_id(tmp_path / "flat"))


def test_changing_the_layout_of_an_output_dir_needs_overwrite(qwen3_target, tmp_path):
    data = write_jsonl(tmp_path / "chat.jsonl", conversations([2, 1]))
    generate(qwen3_target, tmp_path / "out", data)
    with pytest.raises(SpecgenError, match="output.store_prefix_once"):
        generate(qwen3_target, tmp_path / "out", data, "output.store_prefix_once=true")
    # reuse itself is a performance knob: the dataset it gives is the same
    generate(qwen3_target, tmp_path / "out", data, "capture.prefix_reuse=false")


def test_writer_checks_suffix_lengths_against_prefix_len(tmp_path):
    from specgen.store import ShardSpec, ShardWriter

    spec = ShardSpec(hidden_size=4, num_aux=1, dtype="float32", store_prefix_once=True)
    row = {"sample_id": "s", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "prefix_ref": -1, "prefix_len": 1,
           "aux_hidden_states": torch.zeros(2, 4), "last_hidden_state": torch.zeros(2, 4)}
    with ShardWriter(tmp_path, 0, spec) as writer:
        writer.write([row])  # 1 borrowed + 2 stored tokens = 3
        with pytest.raises(ValueError, match="disagree on the token count"):
            writer.write([{**row, "prefix_len": 0}])


# --- grouped pasts (the reuse runner's layout): fused causal part + folded past part --------------------------------

def grouped_continuation(capture, prefixes, groups):
    """Capture each prefix with keep_kv, then every group's suffixes as one batch of rows grouped by prefix."""
    ids = torch.zeros(len(prefixes), max(map(len, prefixes)), dtype=torch.long)
    for b, prefix in enumerate(prefixes):
        ids[b, : len(prefix)] = prefix
    first = capture(ids, torch.tensor([len(p) for p in prefixes]), keep_kv=True)
    suffixes = [suffix for _, group in groups for suffix in group]
    bounds = [0]
    for _, group in groups:
        bounds.append(bounds[-1] + len(group))
    kv = [None if prefix is None else [(k[prefix, :, :len(prefixes[prefix])], v[prefix, :, :len(prefixes[prefix])])
                                       for k, v in first.kv] for prefix, _ in groups]
    past = GroupedPast(bounds=bounds, lengths=[0 if p is None else len(prefixes[p]) for p, _ in groups], kv=kv)
    ids = torch.zeros(len(suffixes), max(map(len, suffixes)), dtype=torch.long)
    for b, suffix in enumerate(suffixes):
        ids[b, : len(suffix)] = suffix
    return capture(ids, torch.tensor([len(s) for s in suffixes]), past=past)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", LLAMA_FAMILY)
def test_grouped_past_matches_the_full_forward(saved_model, arch, dtype):
    model = load_target(saved_model(arch), dtype=dtype, attn_implementation="sdpa")
    capture = make_capture(model, [0, 3, 6])
    generator = torch.Generator().manual_seed(3)
    tokens = lambda n: torch.randint(0, VOCAB, (n,), generator=generator)
    prefixes = [tokens(17), tokens(5)]
    groups = [(0, [tokens(n) for n in (6, 13, 1)]), (None, [tokens(9)]), (1, [tokens(n) for n in (20, 2)])]

    output = grouped_continuation(capture, prefixes, groups)

    b = 0
    for prefix, suffixes in groups:
        for suffix in suffixes:
            sequence = suffix if prefix is None else torch.cat([prefixes[prefix], suffix])
            with torch.inference_mode():
                hidden = model(sequence[None], output_hidden_states=True).hidden_states
            n, p = len(suffix), len(sequence) - len(suffix)
            for slot, layer in enumerate([0, 3, 6]):
                assert_states_close(output.aux_hidden_states[b, :n, slot * 64:(slot + 1) * 64],
                                    hidden[layer + 1][0, p:], f"row {b} aux layer {layer}")
            assert_states_close(output.last_hidden_state[b, :n], hidden[-1][0, p:], f"row {b} last hidden state")
            b += 1


def test_grouped_past_keeps_sliding_windows():
    """A window shorter than a group's span takes the masked fallback; its rows still equal the full forward."""
    config = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, sliding_window=4)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    generator = torch.Generator().manual_seed(4)
    prefixes = [torch.randint(0, VOCAB, (6,), generator=generator)]
    suffixes = [torch.randint(0, VOCAB, (n,), generator=generator) for n in (8, 3)]
    output = grouped_continuation(make_capture(model, [1, 2]), prefixes, [(0, suffixes)])
    for b, suffix in enumerate(suffixes):
        with torch.inference_mode():
            hidden = model(torch.cat([prefixes[0], suffix])[None], output_hidden_states=True).hidden_states
        torch.testing.assert_close(output.last_hidden_state[b, :len(suffix)], hidden[-1][0, 6:])


@pytest.mark.parametrize("batch_tokens", [4096, 40])  # one batch per level / many batches mixing pasts
def test_reuse_runner_rows_equal_the_plain_capture_on_a_deep_tree(saved_model, batch_tokens):
    """Per-turn chains (3 levels) beside unshared rows and a duplicate: rows equal the plain capture's, fp32."""
    capture = make_capture(load_target(saved_model("llama"), dtype="float32"), [0, 3, 6])
    generator = torch.Generator().manual_seed(5)
    tokens = lambda n: torch.randint(0, VOCAB, (n,), generator=generator).tolist()
    turns = [tokens(n) for n in (30, 20, 25)]
    sequences = [sum(turns[:k], []) + tokens(5 + k) for k in range(1, 4)] + [turns[0] + tokens(7)]
    sequences += [tokens(12), tokens(33), sequences[1]]
    samples = [TokenizedSample(sample_id=f"s{i}", source_index=i, input_ids=seq, loss_mask=[1] * len(seq))
               for i, seq in enumerate(sequences)]
    plan = plan_prefixes(sequences, min_tokens=4)
    assert max(node.level for node in plan.nodes) == 2 and reuse_pays(plan)

    rows = {row["sample_id"]: row for batch, _ in capture_with_prefix_reuse(
        capture, samples, plan, batch_tokens=batch_tokens, max_batch_size=64, cache_tokens=1, pad_id=0,
        device=torch.device("cpu")) for row in batch}

    assert sorted(rows) == sorted(s.sample_id for s in samples)
    for sample in samples:
        full = capture(torch.tensor([sample.input_ids]), torch.tensor([len(sample)]))
        torch.testing.assert_close(rows[sample.sample_id]["aux_hidden_states"], full.aux_hidden_states[0])
        torch.testing.assert_close(rows[sample.sample_id]["last_hidden_state"], full.last_hidden_state[0])


def test_reuse_runs_only_where_it_pays(tmp_path):
    """No shared prefix worth keeping: the unit takes the plain path (tokens computed == emitted) with equal rows."""
    assert not reuse_pays(plan_prefixes([[1, 2, 3], [4, 5, 6]], min_tokens=1))
    assert reuse_pays(plan_prefixes([list(range(100)) + [1], list(range(100)) + [2]], min_tokens=1))
    little = [list(range(4)) + list(range(200, 300)), list(range(4)) + list(range(300, 400))]
    assert not reuse_pays(plan_prefixes(little, min_tokens=1))  # 4 of 208 tokens saved: below MIN_SAVING
    model = build_tiny_model("llama", tmp_path / "model", vocab_size=2048, dtype=torch.bfloat16,
                             tokenizer_dir=ASSETS_DIR / "tokenizer")
    data = write_jsonl(tmp_path / "chat.jsonl", conversations([1, 1, 1], system=False, reasoning=False))
    manifest = generate(model, tmp_path / "reuse", data, "capture.prefix_min_tokens=64")
    report = manifest["prefix_reuse"]
    assert report["enabled"] and report["tokens_computed"] == report["tokens_emitted"]
    generate(model, tmp_path / "full", data, "capture.prefix_reuse=false")
    assert_same_rows(rows_by_id(tmp_path / "reuse"), rows_by_id(tmp_path / "full"), exact=True)


# --- capture.prefix_reuse=auto: decided by device ------------------------------------------------------------------

def test_auto_reuses_prefixes_on_the_cpu_and_not_on_cuda():
    """auto takes the path measured faster on each device: reuse on the CPU, full rows on CUDA (issue 40). No GPU is
    needed: the decision is made from the device alone."""
    assert resolve_prefix_reuse("auto", "cpu") == (True, "capture.prefix_reuse=auto on cpu: reuse is the faster "
                                                         "path there")
    assert resolve_prefix_reuse("auto", torch.device("cpu"))[0]
    for device in ("cuda", "cuda:1", torch.device("cuda", 0)):
        reuse, why = resolve_prefix_reuse("auto", device)
        assert not reuse and why.startswith("capture.prefix_reuse=auto on cuda")
    assert resolve_prefix_reuse(True, "cuda:0") == (True, "capture.prefix_reuse=true")  # true and false are kept
    assert resolve_prefix_reuse(False, "cpu") == (False, "capture.prefix_reuse=false")
    with pytest.raises(ValueError, match="true, false or auto"):
        resolve_prefix_reuse("sometimes", "cpu")
    assert compose("generate", [])["capture"]["prefix_reuse"] == "auto"  # the default
    with pytest.raises(SpecgenError, match=r"capture.prefix_reuse=sometimes is not one of auto \| true \| false"):
        compose("generate", ["capture.prefix_reuse=sometimes"])
    with pytest.raises(SpecgenError, match="capture.prefix_reuse"):
        compose("generate", ["capture.prefix_reuse=1"])
    # what the summary says on a GPU (no reuse, and why)
    _, why = resolve_prefix_reuse("auto", "cuda")
    line = prefix_reuse_summary({"enabled": False, "decided": why, "tokens_computed": 10, "tokens_emitted": 10,
                                 "bytes_stored": 1, "bytes_flat": 1, "store_prefix_once": False})
    assert line.startswith("off: every row computed in full (capture.prefix_reuse=auto on cuda: full rows are the "
                           "faster path there)")


def test_auto_is_said_in_the_manifest_and_summary(tmp_path, capsys):
    model = build_tiny_model("llama", tmp_path / "model", vocab_size=2048, tokenizer_dir=ASSETS_DIR / "tokenizer")
    data = write_jsonl(tmp_path / "chat.jsonl", conversations([1, 2, 1], reasoning=False))
    manifest = generate(model, tmp_path / "auto", data)
    report = manifest["prefix_reuse"]
    assert report["enabled"] and report["setting"] == "auto"
    assert report["decided"] == "capture.prefix_reuse=auto on cpu: reuse is the faster path there"
    assert report["tokens_computed"] < report["tokens_emitted"]
    summary = capsys.readouterr().out
    assert "(capture.prefix_reuse=auto on cpu: reuse is the faster path there)" in summary
    manifest = generate(model, tmp_path / "off", data, "capture.prefix_reuse=false")
    assert not manifest["prefix_reuse"]["enabled"] and manifest["prefix_reuse"]["setting"] is False
    assert "off: every row computed in full (capture.prefix_reuse=false)" in capsys.readouterr().out
    assert_same_rows(rows_by_id(tmp_path / "auto"), rows_by_id(tmp_path / "off"))
