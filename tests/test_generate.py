"""End-to-end generate stage: reference values, resume, bad input, config guard, CLI errors, readers."""

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest
import torch

from conftest import BUNDLED_CHAT, REPO, TOKENIZERS, build_tiny_model, require_shared
from specgen import open_shards
from specgen.assets import ASSETS_DIR
from specgen.config import compose
from specgen.errors import SpecgenError
from specgen.generate import run

BUNDLED_TOKENIZER = ASSETS_DIR / "tokenizer"


@pytest.fixture(scope="module")
def small_target(tmp_path_factory) -> Path:
    """A tiny llama (fp32, 8 layers) carrying the bundled 2048-token tokenizer."""
    return build_tiny_model("llama", tmp_path_factory.mktemp("target"), vocab_size=2048,
                            tokenizer_dir=BUNDLED_TOKENIZER)


def generate(model: Path, out_dir: Path, *overrides: str) -> dict:
    cfg = compose("generate", [f"model.path={model}", f"data.path={BUNDLED_CHAT}", f"output.dir={out_dir}",
                               "runtime.progress=false",
                               "data.max_rows=24", "output.shard_size=8", *overrides])
    return run(cfg)


def load_rows(out_dir: Path) -> list[dict]:
    dataset = open_shards(out_dir)
    return [dataset[i] for i in range(len(dataset))]


def test_rows_equal_hugging_face_forward(small_target, tmp_path):
    from transformers import AutoModelForCausalLM

    manifest = generate(small_target, tmp_path / "out", "capture.aux_layers=[0,3,7]")
    assert manifest["capture"]["aux_layers"] == [0, 3, 7]
    assert not (tmp_path / "out" / "target_token_counts.json").exists()  # counting the target's tokens is opt-in
    assert manifest["stats"]["samples"] == len(load_rows(tmp_path / "out")) > 0
    model = AutoModelForCausalLM.from_pretrained(small_target).eval()
    for row in load_rows(tmp_path / "out")[:6]:
        with torch.no_grad():
            hidden = model(row["input_ids"][None], output_hidden_states=True).hidden_states
        aux = row["aux_hidden_states"].view(len(row["input_ids"]), 3, -1)
        torch.testing.assert_close(aux[:, 0], hidden[1][0], rtol=1e-4, atol=1e-4)  # layer 0 output
        torch.testing.assert_close(aux[:, 1], hidden[4][0], rtol=1e-4, atol=1e-4)  # layer 3 output
        # layer 7 is the last layer: stored before the final norm, HF's hidden_states[8] is after it
        torch.testing.assert_close(model.model.norm(aux[:, 2]), hidden[8][0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(row["last_hidden_state"], hidden[-1][0], rtol=1e-4, atol=1e-4)


def test_default_layers_and_manifest(small_target, tmp_path):
    manifest = generate(small_target, tmp_path / "out", "capture.count_target_tokens=true")
    assert manifest["capture"]["aux_layers"] == [1, 3, 4]  # [1, L//2-1, L-4] for L=8
    assert manifest["capture"]["last_hidden_state"].startswith("post_norm")
    stats = manifest["stats"]
    rows = load_rows(tmp_path / "out")
    assert stats["tokens"] == sum(len(r["input_ids"]) for r in rows)
    assert stats["trainable_tokens"] == sum(int(r["loss_mask"].sum()) for r in rows)
    assert manifest["dtype"] == "float32" and manifest["hidden_size"] == 64 and manifest["num_aux"] == 3
    assert len(manifest["tokenizer"]["chat_template_sha256"]) == 64
    payload = stats["tokens"] * (4 + 1 + 4 * 64 * 4)
    assert stats["bytes_on_disk"] <= 1.05 * payload
    counts = json.loads((tmp_path / "out" / "token_counts.json").read_text())
    assert sum(counts["counts"].values()) == stats["trainable_tokens"]
    from transformers import AutoModelForCausalLM

    head = AutoModelForCausalLM.from_pretrained(small_target).lm_head
    want: dict[str, int] = {}
    for row in rows:  # the target's top token at each trainable position t (loss_mask[t + 1] == 1)
        positions = row["loss_mask"][1:].nonzero().flatten()
        for token in head(row["last_hidden_state"][positions]).argmax(-1).tolist():
            want[str(token)] = want.get(str(token), 0) + 1
    top = json.loads((tmp_path / "out" / "target_token_counts.json").read_text())
    assert top == {"vocab_size": 2048, "counts": dict(sorted(want.items(), key=lambda kv: int(kv[0])))}


def test_resume_after_kill_gives_the_uninterrupted_dataset(small_target, tmp_path):
    reference = tmp_path / "reference"
    generate(small_target, reference)
    interrupted = tmp_path / "interrupted"
    cmd = [sys.executable, "-m", "specgen.generate", f"model.path={small_target}", f"data.path={BUNDLED_CHAT}",
           f"output.dir={interrupted}",
           "runtime.progress=false", "data.max_rows=24", "output.shard_size=8", "capture.batch_tokens=256"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not list(interrupted.glob("shard-*.arrow")) and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (interrupted / "manifest.json").exists()
    assert (interrupted / ".specgen-lease.json").exists()  # the killed job's lease: taken over at once below
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
    got, want = load_rows(interrupted), load_rows(reference)
    assert [r["sample_id"] for r in got] == [r["sample_id"] for r in want]
    for a, b in zip(got, want):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        torch.testing.assert_close(a["aux_hidden_states"], b["aux_hidden_states"])
        torch.testing.assert_close(a["last_hidden_state"], b["last_hidden_state"])


def assert_same_rows(got_dir: Path, want_dir: Path) -> None:
    got, want = load_rows(got_dir), load_rows(want_dir)
    assert [r["sample_id"] for r in got] == [r["sample_id"] for r in want]
    for a, b in zip(got, want):
        for name in ("input_ids", "loss_mask", "aux_hidden_states", "last_hidden_state"):
            assert torch.equal(a[name], b[name]), name


def test_a_second_job_on_a_live_directory_is_refused_and_the_first_is_unharmed(small_target, tmp_path):
    reference = tmp_path / "reference"
    generate(small_target, reference, "capture.batch_tokens=256")  # the same batches: bit-identical rows
    busy = tmp_path / "busy"
    cmd = [sys.executable, "-m", "specgen.generate", f"model.path={small_target}", f"data.path={BUNDLED_CHAT}",
           f"output.dir={busy}",
           "runtime.progress=false", "data.max_rows=24", "output.shard_size=8", "capture.batch_tokens=256"]
    first = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 600  # a loaded machine can take minutes to start it
    while not (busy / ".specgen-lease.json").exists() and time.time() < deadline and first.poll() is None:
        time.sleep(0.02)
    first.send_signal(signal.SIGSTOP)  # the first job is alive but paused: the second must not touch its files
    assert (busy / ".specgen-lease.json").exists(), f"the first job took no lease: {first.poll()=}"
    try:
        for extra in ([], ["output.overwrite=true"]):
            second = subprocess.run([*cmd, *extra], cwd=REPO, capture_output=True, text=True)
            assert second.returncode == 2
            lines = second.stderr.strip().splitlines()
            assert len(lines) == 1 and "is in use by generate" in lines[0] and f"pid {first.pid}" in lines[0]
    finally:
        first.send_signal(signal.SIGCONT)
    assert first.wait(timeout=300) == 0, first.stderr.read()
    assert_same_rows(busy, reference)
    assert not (busy / ".specgen-lease.json").exists()


def test_a_full_disk_mid_shard_is_one_line_and_a_rerun_resumes(small_target, tmp_path):
    """A file-size limit (ulimit -f: EFBIG, what a full disk gives as ENOSPC) lets shard 0 commit, then stops shard 1
    mid-write; nothing half-written is left looking finished, and a re-run without the limit completes the data."""
    import resource

    args = ["runtime.progress=false", "data.max_rows=24", "output.shard_size=8", "capture.batch_tokens=256"]
    reference = tmp_path / "reference"
    generate(small_target, reference, "capture.batch_tokens=256")
    sizes = [(reference / f"shard-0000{i}.arrow").stat().st_size for i in range(3)]
    assert sizes[1] > sizes[0]
    limit = sizes[0] + 1024  # shard 0 (and every small file) fits; shard 1 cannot

    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    full = tmp_path / "full"
    cmd = [sys.executable, "-m", "specgen.generate", f"model.path={small_target}", f"data.path={BUNDLED_CHAT}",
           f"output.dir={full}", *args]
    failed = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, preexec_fn=limited)
    assert failed.returncode == 2
    lines = failed.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: out of disk space in {full}: the file being written needs at least ")
    needed = int(lines[0].split("needs at least ")[1].split(" ")[0].replace(",", ""))
    assert needed > limit  # the bytes shard 1 needs so far, more than the limit allowed
    assert sorted(p.name for p in full.glob("shard-*")) == ["shard-00000.arrow", "shard-00000.json"]
    assert not list(full.glob("*.tmp")) and not (full / "manifest.json").exists()

    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)  # space freed: resumes
    assert_same_rows(full, reference)


def test_bad_rows_are_reported_and_good_rows_kept(small_target, tmp_path):
    good = {"id": "good", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]}
    lines = [json.dumps(good), "{this is not json",
             json.dumps({"id": "empty", "messages": []}),
             json.dumps({"id": "role", "messages": [{"role": "wizard", "content": "x"},
                                                    {"role": "assistant", "content": "y"}]}),
             json.dumps({"id": "content", "messages": [{"role": "user", "content": 5},
                                                       {"role": "assistant", "content": "y"}]}),
             json.dumps({"id": "noassistant", "messages": [{"role": "user", "content": "only me"}]}),
             json.dumps({"id": "alpaca-no-output", "instruction": "do it"}),
             json.dumps({"id": "good2", "messages": [{"role": "user", "content": "2+2?"},
                                                     {"role": "assistant", "content": "4"}]})]
    data = tmp_path / "mixed.jsonl"
    data.write_text("\n".join(lines) + "\n")
    manifest = generate(small_target, tmp_path / "out", f"data.path={data}")
    assert sorted(r["sample_id"] for r in load_rows(tmp_path / "out")) == ["good", "good2"]
    rejected = [json.loads(line) for line in (tmp_path / "out" / "rejected.jsonl").read_text().splitlines()]
    assert [r["source_index"] for r in rejected] == [1, 2, 3, 4, 5, 6]
    assert all(r["reason"] and r["message"] for r in rejected)
    assert sum(manifest["stats"]["rejected"].values()) == 6
    with pytest.raises(SpecgenError, match="row 1"):
        generate(small_target, tmp_path / "strict", f"data.path={data}", "data.on_bad_row=fail")


def test_a_run_where_every_row_is_rejected_fails_and_says_why(small_target, tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"id": "a", "foo": 1}) + "\n" + json.dumps({"id": "b", "messages": []}) + "\n")
    with pytest.raises(SpecgenError, match=r"no usable sample .*: 2 rows rejected \(.*\); see .*rejected.jsonl"):
        generate(small_target, tmp_path / "out", f"data.path={data}")
    assert len((tmp_path / "out" / "rejected.jsonl").read_text().splitlines()) == 2  # the reasons stay on disk


def test_changed_config_is_an_error_unless_overwrite(small_target, tmp_path):
    generate(small_target, tmp_path / "out")
    with pytest.raises(SpecgenError, match="different configuration.*capture.aux_layers"):
        generate(small_target, tmp_path / "out", "capture.aux_layers=[1,2]")
    manifest = generate(small_target, tmp_path / "out", "capture.aux_layers=[1,2]", "output.overwrite=true")
    assert manifest["num_aux"] == 2 and open_shards(tmp_path / "out")[0]["aux_hidden_states"].shape[1] == 128
    # performance knobs are not part of the dataset's identity: resuming with another batch size is fine
    generate(small_target, tmp_path / "out", "capture.aux_layers=[1,2]", "capture.batch_tokens=64")


def test_a_grown_source_resumes_to_the_run_on_all_of_it_and_a_shrunk_one_is_refused(small_target, tmp_path, caplog):
    """Rows appended to data.path between runs: the re-run redoes the short last unit with its full rows and adds
    the new units, giving what a run on the grown source makes from scratch (without the check, the short unit's
    new rows were silently missing). A source that lost rows since is refused, naming the unit."""
    lines = BUNDLED_CHAT.read_text().splitlines(keepends=True)
    source = tmp_path / "source.jsonl"
    source.write_text("".join(lines[:20]))  # units of 8 rows: 8, 8, 4
    grown = (f"data.path={source}", "data.max_rows=null", "capture.batch_tokens=256")
    first = generate(small_target, tmp_path / "out", *grown)
    assert first["stats"]["source_rows"] == 20
    source.write_text("".join(lines[:28]))  # 8, 8, 8, 4
    reference = generate(small_target, tmp_path / "reference", *grown)
    with caplog.at_level("WARNING", logger="specgen.job"):
        resumed = generate(small_target, tmp_path / "out", *grown)
    assert "the source has grown since unit 2 (shard-00002.arrow) was made from 4 source rows: it now gives 8" \
        in caplog.text
    assert resumed["stats"] == reference["stats"] and resumed["stats"]["source_rows"] == 28
    assert_same_rows(tmp_path / "out", tmp_path / "reference")

    source.write_text("".join(lines[:12]))
    with pytest.raises(SpecgenError, match=r"holds unit 1 \(shard-00001.arrow\) made from 8 source rows, but "
                                           r"data.path now gives it 4 \(the source shrank"):
        generate(small_target, tmp_path / "out", *grown)


def test_a_source_edited_since_a_unit_was_made_is_refused_naming_the_unit(small_target, tmp_path):
    """The same number of rows, one of them edited in place: the finished unit holding it no longer describes the
    source, so a re-run is refused instead of keeping it beside units made from the edited rows."""
    lines = BUNDLED_CHAT.read_text().splitlines(keepends=True)
    source = tmp_path / "source.jsonl"
    source.write_text("".join(lines[:20]))  # units of 8 rows: 8, 8, 4
    args = (f"data.path={source}", "data.max_rows=null", "capture.batch_tokens=256")
    generate(small_target, tmp_path / "out", *args)
    generate(small_target, tmp_path / "out", *args)  # the same rows: resumes (nothing left to do)
    row = json.loads(lines[11])
    row["conversations"][-1]["value"] += " Edited."
    source.write_text("".join([*lines[:11], json.dumps(row) + "\n", *lines[12:20]]))
    with pytest.raises(SpecgenError, match=r"^unit 1 of output.dir \(source rows 8-15\) was made from rows that "
                                           r"data.path no longer holds as they were \(edited since\)"):
        generate(small_target, tmp_path / "out", *args)


@pytest.mark.parametrize("override, key", [
    ("model.attn_implementation=eager", "model.attn_implementation"),
    ("model.dtype=bfloat16", "model.dtype"),
])
def test_resume_refuses_what_changes_the_numbers(small_target, tmp_path, override, key):
    """The attention kernel and the dtype the target runs in change the stored states: a dataset started with one
    does not resume with another (engine=hf against engine=vllm: tests/test_vllm.py); the same dtype asked for by
    another name resumes."""
    generate(small_target, tmp_path / "out", "model.dtype=auto", "capture.prefix_reuse=false")
    with pytest.raises(SpecgenError, match=rf"^output.dir=\S+ holds a dataset made with a different configuration "
                                           rf"\(changed: {re.escape(key)}\)"):
        generate(small_target, tmp_path / "out", "capture.prefix_reuse=false", override)
    # the small target is a float32 checkpoint: auto and float32 are the same numbers
    generate(small_target, tmp_path / "out", "model.dtype=float32", "capture.prefix_reuse=false")


@pytest.mark.parametrize("override, expected", [
    ("data.path=/nonexistent/data.jsonl", "data.path"),
    ("capture.aux_layers=[1,99]", "capture.aux_layers"),
    ("model.path=/nonexistent/model", "model.path"),
])
def test_cli_errors_are_one_line(small_target, tmp_path, override, expected):
    proc = subprocess.run([sys.executable, "-m", "specgen.generate", f"model.path={small_target}",
                           f"data.path={BUNDLED_CHAT}", f"output.dir={tmp_path / 'out'}", override],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    error_lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and expected in error_lines[0]


def test_shards_load_with_pyarrow_and_datasets(small_target, tmp_path):
    import datasets

    generate(small_target, tmp_path / "out")
    shards = sorted(str(p) for p in (tmp_path / "out").glob("shard-*.arrow"))
    table = pa.concat_tables(pa.ipc.open_file(pa.memory_map(p)).read_all() for p in shards)
    ds = datasets.load_dataset("arrow", data_files=shards, split="train")
    reader = open_shards(tmp_path / "out")
    assert table.num_rows == len(ds) == len(reader)
    first = reader[0]
    assert ds[0]["sample_id"] == first["sample_id"] and ds[0]["input_ids"] == first["input_ids"].tolist()
    assert first["input_ids"].dtype == torch.long and first["aux_hidden_states"].dtype == torch.float32


def test_qwen3_template_gives_per_turn_rows(tmp_path):
    """The Qwen3 template rewrites history, so each assistant turn of a multi-turn conversation is its own row."""
    tokenizer_dir = require_shared(TOKENIZERS["qwen3"])
    model = build_tiny_model("qwen3", tmp_path / "qwen3", vocab_size=151680, hidden_size=32, num_layers=8,
                             tokenizer_dir=tokenizer_dir)
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"id": "c", "messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Goodbye!", "reasoning_content": "Say bye."}]}) + "\n")
    generate(model, tmp_path / "out", f"data.path={data}")
    rows = {r["sample_id"]: r for r in load_rows(tmp_path / "out")}
    assert sorted(rows) == ["c#0", "c#1"]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    first_turn = tokenizer.decode(rows["c#0"]["input_ids"][rows["c#0"]["loss_mask"].bool()])
    assert "Greet back." in first_turn and "Hello!" in first_turn


def test_verify_passes_and_catches_a_wrong_model(small_target, tmp_path):
    generate(small_target, tmp_path / "out")
    verify = [sys.executable, "-m", "specgen.verify", f"data.shards={tmp_path / 'out'}", "verify.samples=2"]
    ok = subprocess.run(verify, cwd=REPO, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    other = build_tiny_model("llama", tmp_path / "other", vocab_size=2048, seed=1, tokenizer_dir=BUNDLED_TOKENIZER)
    bad = subprocess.run([*verify, f"model.path={other}"], cwd=REPO, capture_output=True, text=True)
    assert bad.returncode == 1 and "differs from the HF forward" in bad.stderr


def test_verify_of_a_folder_that_is_not_there_says_so(tmp_path):
    """Not "the run did not finish; re-run the same command" (what a folder without its manifest gets): the key and
    the path, and what to pass instead."""
    proc = subprocess.run([sys.executable, "-m", "specgen.verify", f"data.shards={tmp_path / 'nope'}"], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == (f"error: data.shards={tmp_path / 'nope'} does not exist: pass a "
                                                    "specgen output directory or one shard file")


def test_verify_takes_pooled_replies_that_share_an_id_and_catches_a_row_stored_twice(small_target, tmp_path):
    """Replies regenerated from one prompt keep its id, so a pooled dataset holds one id several times: only the
    same id with the same tokens is a problem (a source listed twice here, as a row written twice would be)."""
    from specgen.store.manifest import read_manifest
    from specgen.verify import check_structure

    def chat(name: str, answer: str) -> Path:
        rows = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"Question {i}?"},
                                             {"role": "assistant", "content": f"{answer} {i}."}]} for i in range(3)]
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        return path

    reply0, reply1 = chat("reply0", "Yes"), chat("reply1", "No, never")
    generate(small_target, tmp_path / "pooled", f"data.path=[{reply0},{reply1}]")
    pooled = open_shards(tmp_path / "pooled")
    assert sorted(pooled.sample_ids()) == ["p0", "p0", "p1", "p1", "p2", "p2"]
    assert check_structure(pooled, read_manifest(tmp_path / "pooled"))[0] == []
    generate(small_target, tmp_path / "twice", f"data.path=[{reply0},{reply0}]")
    problems = check_structure(open_shards(tmp_path / "twice"), read_manifest(tmp_path / "twice"))[0]
    assert len(problems) == 3 and all("the same row (sample_id and tokens) as sample" in p for p in problems)


def flip_low_bit(path: Path) -> None:
    """Flip bit 0 of a 4-byte-aligned byte in the middle of the file: the lowest mantissa bit of a stored float."""
    data = bytearray(path.read_bytes())
    data[(len(data) // 2) & ~3] ^= 1
    path.write_bytes(bytes(data))


def test_a_flipped_low_order_bit_fails_verify_naming_the_shard(small_target, tmp_path):
    out = tmp_path / "out"
    manifest = generate(small_target, out)
    assert set(manifest["checksums"]) == set(manifest["shards"]) and all(manifest["checksums"].values())
    open_shards(out, verify=True)
    flip_low_bit(out / "shard-00000.arrow")
    flip_low_bit(out / "shard-00002.arrow")
    assert len(open_shards(out)) == manifest["stats"]["samples"]  # the damage is invisible to a plain read
    with pytest.raises(SpecgenError, match="shard-00000.arrow.*shard-00002.arrow"):
        open_shards(out, verify=True)
    bad = subprocess.run([sys.executable, "-m", "specgen.verify", f"data.shards={out}", "verify.samples=0"], cwd=REPO,
                         capture_output=True, text=True)
    assert bad.returncode == 1
    problems = [line for line in bad.stderr.splitlines() if line.startswith("  - ")]
    assert len(problems) == 2  # the checksums alone: every structural check still passes
    assert "shard-00000.arrow: checksum mismatch" in problems[0] and "shard-00002.arrow" in problems[1]
    assert "1 of 3 shards intact" in bad.stdout


def test_prefix_reuse_store_once_and_fp8_outputs_equal_the_plain_run(small_target, tmp_path):
    """The features compose: reuse + store-once + fp8 + log-probs give the rows the plain flat run gives."""
    system = "You are a careful assistant. " * 12  # a long shared system prompt: one prefix for every row
    rows = [{"id": f"r{i}", "messages": [{"role": "system", "content": system},
                                         {"role": "user", "content": f"Question {i}?"},
                                         {"role": "assistant", "content": f"Answer number {i}."}]} for i in range(6)]
    data = tmp_path / "shared_prefix.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    options = [f"data.path={data}", "output.codec=fp8", "capture.token_logprobs=true", "capture.prefix_min_tokens=8",
               "capture.count_target_tokens=true"]
    plain = generate(small_target, tmp_path / "plain", *options, "capture.prefix_reuse=false")
    reused = generate(small_target, tmp_path / "reused", *options, "capture.prefix_reuse=true",
                      "output.store_prefix_once=true")
    assert reused["stats"]["tokens_computed"] < plain["stats"]["tokens_computed"]
    assert reused["stats"]["bytes_on_disk"] < plain["stats"]["bytes_on_disk"]
    got = {r["sample_id"]: r for r in load_rows(tmp_path / "reused")}
    for want in load_rows(tmp_path / "plain"):
        row = got[want["sample_id"]]
        assert torch.equal(row["input_ids"], want["input_ids"])
        for name in ("aux_hidden_states", "last_hidden_state", "token_logprobs"):
            torch.testing.assert_close(row[name].float(), want[name].float(), rtol=2e-2, atol=2e-2, equal_nan=True)
    top = {name: json.loads((tmp_path / name / "target_token_counts.json").read_text()) for name in ("plain", "reused")}
    assert top["plain"] == top["reused"]  # the target's top tokens, counted on either path


def test_max_length_past_the_targets_positions_is_said(small_target, tmp_path, capsys, caplog):
    """data.max_length beyond max_position_embeddings (4096 here) is captured, as the user asked, but never
    silently: a warning before the first batch, the positions in the manifest and a line in the summary."""
    within = generate(small_target, tmp_path / "within")
    assert within["capture"]["max_positions"] == 4096 and "context " not in capsys.readouterr().out
    with caplog.at_level("WARNING"):
        past = generate(small_target, tmp_path / "past", "data.max_length=8192")
    assert "data.max_length=8192 is past the target's 4096 positions" in caplog.text
    assert "data.max_length=8,192 is past the target's 4,096 positions" in capsys.readouterr().out
    assert past["stats"]["tokens"] == within["stats"]["tokens"]  # these rows are short: nothing else changes


def test_several_sources_in_data_path_are_one_dataset_capped_per_source(small_target, tmp_path):
    """data.path=[a,b]: the rows of a then b, data.max_rows of each; the same as generating from a file holding
    both."""
    lines = BUNDLED_CHAT.read_text().splitlines()
    first, second, both = tmp_path / "first.jsonl", tmp_path / "second.jsonl", tmp_path / "both.jsonl"
    first.write_text("\n".join(lines[:5]) + "\n")
    second.write_text("\n".join(lines[100:110]) + "\n")
    both.write_text("\n".join(lines[:4] + lines[100:104]) + "\n")
    manifest = generate(small_target, tmp_path / "listed", f"data.path=[{first},{second}]", "data.max_rows=4")
    generate(small_target, tmp_path / "joined", f"data.path={both}", "data.max_rows=null")
    listed, joined = load_rows(tmp_path / "listed"), load_rows(tmp_path / "joined")
    assert manifest["stats"]["source_rows"] == 8
    assert [r["sample_id"] for r in listed] == [r["sample_id"] for r in joined]
    assert all(torch.equal(torch.as_tensor(a[key]), torch.as_tensor(b[key]))
               for a, b in zip(listed, joined) for key in ("input_ids", "loss_mask"))
    with pytest.raises(SpecgenError, match=r"data.path\[\]=3 must be a str"):
        compose("generate", [f"model.path={small_target}", "data.path=[a.jsonl,3]", f"output.dir={tmp_path / 'x'}"])
