"""The regenerate stage on tiny real models: Hugging Face greedy reference per turn, on-policy context, policies,
bad rows, resume after a kill, multi-process equality, reasoning split, and the output feeding generate."""

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import REPO, accelerate_launch, build_tiny_model, run_launched
from specgen.assets import ASSETS_DIR
from specgen.config import compose, job_recipe
from specgen.data.formats import normalize
from specgen.errors import SpecgenError
from specgen.regen.reply import assistant_reply
from specgen.regen.setup import template_kwargs
from specgen.regenerate import run

MAX_NEW_TOKENS = 6

CONVERSATIONS = [
    {"id": "colours", "system": "You are terse.",
     "conversations": [{"from": "human", "value": "Name a colour."}, {"from": "gpt", "value": "Blue."},
                       {"from": "human", "value": "And another one?"}, {"from": "gpt", "value": "Red."}]},
    {"messages": [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi there!"},
                  {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "How are you today?"},
                  {"role": "assistant", "content": "Fine, thanks."}]},  # no id: it becomes row-<index>
    {"id": "sum", "instruction": "Add 2 and 3.", "input": "", "output": "5"},
    {"id": "weather", "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny, 24C"},
        {"role": "assistant", "content": "It is sunny."}]},
    {"id": "story", "messages": [{"role": "user", "content": "Tell me a story about a fox."},
                                 {"role": "assistant", "content": "Once upon a time..."},
                                 {"role": "user", "content": "Shorter."},
                                 {"role": "assistant", "content": "A fox ran."}]},
]
BAD_LINES = [
    "this line is not JSON",
    json.dumps({"id": "no-reply", "messages": [{"role": "user", "content": "Anyone?"}]}),
    json.dumps({"id": "tokens", "input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}),
]


def write_source(path: Path, conversations: list[dict], bad_lines: list[str] = ()) -> Path:
    """JSONL with the conversations, a bad line after each of the first ones."""
    lines = []
    for i, row in enumerate(conversations):
        lines.append(json.dumps(row))
        if i < len(bad_lines):
            lines.append(bad_lines[i])
    path.write_text("\n".join(lines) + "\n")
    return path


def source_rows(path: Path) -> list[tuple[int, dict | None]]:
    """(row index, parsed row or None) as the readers number them: one row per non-blank line."""
    rows = []
    for index, line in enumerate(path.read_text().splitlines()):
        try:
            rows.append((index, json.loads(line)))
        except json.JSONDecodeError:
            rows.append((index, None))
    return rows


def regenerate(model: Path, data: Path, out_dir: Path, *overrides: str) -> dict:
    cfg = compose("regenerate", [f"model.path={model}", f"data.path={data}", f"output.dir={out_dir}",
                                 "runtime.progress=false", "runtime.device=cpu", "regenerate.temperature=0",
                                 f"regenerate.max_new_tokens={MAX_NEW_TOKENS}", *overrides])
    return run(cfg)


def output_rows(out_dir: Path) -> list[dict]:
    return [json.loads(line) for part in sorted(out_dir.glob("part-*.jsonl")) for line in part.open()]


def rejected_rows(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "rejected.jsonl").open()]


class GreedyReference:
    """One turn at a time, unbatched: what the model's own `generate` (greedy) writes after `messages`."""

    def __init__(self, model_dir: Path):
        self.model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        eos = self.model.generation_config.eos_token_id
        self.stop = {eos} if isinstance(eos, int) else set(eos)

    def turn(self, messages: list[dict]) -> tuple[str, bool]:
        """(text without the stop token, truncated)."""
        prompt = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = self.tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            new = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=MAX_NEW_TOKENS)[0, ids.shape[1]:].tolist()
        stop = next((i for i, token in enumerate(new) if token in self.stop), None)
        return self.tokenizer.decode(new[:stop], skip_special_tokens=False), stop is None

    def walk(self, row: dict) -> list[tuple[int, str, bool]]:
        """For each regenerated turn of an output row: (message position, reference text, truncated), with the
        row's own (regenerated) earlier turns as context."""
        return [(i, *self.turn(row["messages"][:i])) for i, message in enumerate(row["messages"])
                if message["role"] == "assistant" and not message.get("tool_calls")]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    """A tiny fp32 llama carrying the bundled 2048-token ChatML tokenizer."""
    return build_tiny_model("llama", tmp_path_factory.mktemp("chat-model"), vocab_size=2048, num_layers=2,
                            tokenizer_dir=ASSETS_DIR / "tokenizer")


SWITCH_PROMPTS = ["Hi", "Name a colour.", "What is 2+2?", "Tell me a joke.", "Why?", "Go on", "List three fruits.",
                  "Say something nice."]


@pytest.fixture(scope="module")
def switch_model(tmp_path_factory) -> Path:
    """A tiny model that, at each step, either writes '#' or ends its turn, depending on the context.

    Its LM head gives token 5 ('#') the score r.h and every other token 0, so greedy writes '#' when r.h > 0 and
    otherwise token 0, which its generation config lists as an end of turn (beside <|im_end|>, as Qwen lists
    <|endoftext|>). r is the difference of the final hidden states of two prompts (all have the same norm after
    the final RMSNorm), so the sign of r.h, and with it the turn's fate (empty, finished or truncated), varies
    with the conversation.
    """
    path = build_tiny_model("llama", tmp_path_factory.mktemp("switch-model"), vocab_size=2048, num_layers=2,
                            tokenizer_dir=ASSETS_DIR / "tokenizer")
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)

    def final_state(prompt: str) -> torch.Tensor:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        with torch.no_grad():
            return model.model(tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids)[0][0, -1]

    with torch.no_grad():
        model.lm_head.weight.zero_()
        model.lm_head.weight[5] = final_state(SWITCH_PROMPTS[4]) - final_state(SWITCH_PROMPTS[5])
    model.generation_config.eos_token_id = [2, 0]
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def greedy_run(chat_model, tmp_path_factory) -> tuple[Path, Path, dict]:
    """(source, output dir, manifest) of a greedy run over good and bad rows, in batches of up to 8."""
    root = tmp_path_factory.mktemp("greedy")
    source = write_source(root / "source.jsonl", CONVERSATIONS, BAD_LINES)
    manifest = regenerate(chat_model, source, root / "out", "output.shard_size=4", "regenerate.batch_size=8")
    return source, root / "out", manifest


def test_greedy_regeneration_equals_hf_generate_per_turn(greedy_run, chat_model):
    _, out_dir, manifest = greedy_run
    reference = GreedyReference(chat_model)
    rows = output_rows(out_dir)
    assert [row["id"] for row in rows] == ["colours", "row-2", "sum", "weather", "story"]
    truncated = 0
    for row in rows:
        for position, text, hit_limit in reference.walk(row):
            assert row["messages"][position] == {"role": "assistant", "content": text}, (row["id"], position)
            truncated += hit_limit
    stats = manifest["stats"]
    assert stats["regenerated_turns"] == 8 and stats["truncated_turns"] == truncated
    assert manifest["generation"]["temperature"] == 0 and manifest["generation"]["max_new_tokens"] == MAX_NEW_TOKENS


def test_later_turns_see_the_regenerated_earlier_turns(greedy_run, chat_model):
    _, out_dir, _ = greedy_run
    reference = GreedyReference(chat_model)
    by_id = {row["id"]: row for row in output_rows(out_dir)}
    for row_id, original in (("colours", CONVERSATIONS[0]), ("story", CONVERSATIONS[4])):
        regenerated = by_id[row_id]["messages"]
        source_context = normalize(original).messages[:-1]  # with the dataset's own first reply
        # The check discriminates: with the dataset's first reply the model would write something else.
        assert reference.turn(source_context)[0] != regenerated[-1]["content"]
        assert reference.turn(regenerated[:-1])[0] == regenerated[-1]["content"]


def test_non_assistant_turns_ids_and_tool_calls_are_kept(greedy_run):
    source, out_dir, manifest = greedy_run
    rows = {row["id"]: row for row in output_rows(out_dir)}
    for index, record in source_rows(source):
        if record is None or record.get("id") in ("no-reply", "tokens"):
            continue
        original = normalize(record)
        row = rows[original.id or f"row-{index}"]
        assert len(row["messages"]) == len(original.messages)
        for before, after in zip(original.messages, row["messages"]):
            if before["role"] != "assistant" or before.get("tool_calls"):
                assert after == before
    assert rows["weather"]["messages"][1]["tool_calls"][0]["function"]["name"] == "weather"
    assert manifest["stats"]["kept_tool_call_turns"] == 1


def test_bad_rows_are_rejected_with_index_id_and_reason(greedy_run):
    source, out_dir, manifest = greedy_run
    bad = [(index, record and record["id"]) for index, record in source_rows(source)
           if record is None or record.get("id") in ("no-reply", "tokens")]
    rejected = [(r["source_index"], r["sample_id"], r["reason"]) for r in rejected_rows(out_dir)]
    assert rejected == [(*bad[0], "invalid_json"), (*bad[1], "no_assistant_turn"), (*bad[2], "pretokenized")]
    assert manifest["stats"]["rejected"] == {"invalid_json": 1, "no_assistant_turn": 1, "pretokenized": 1}
    assert manifest["stats"]["source_rows"] == 8 and manifest["stats"]["rows"] == 5


def test_last_turn_only_keeps_earlier_replies(chat_model, tmp_path):
    source = write_source(tmp_path / "source.jsonl", CONVERSATIONS[:2])
    manifest = regenerate(chat_model, source, tmp_path / "out", "regenerate.turns=last")
    reference = GreedyReference(chat_model)
    for original, row in zip(CONVERSATIONS[:2], output_rows(tmp_path / "out")):
        messages = normalize(original).messages
        assert row["messages"][:-1] == messages[:-1]  # the first reply is the dataset's
        assert row["messages"][-1]["content"] == reference.turn(messages[:-1])[0]
    assert manifest["stats"]["regenerated_turns"] == 2


def test_prompts_longer_than_max_length_cut_or_reject_the_row(greedy_run, chat_model, tmp_path):
    source, full_dir, _ = greedy_run
    tokenizer = AutoTokenizer.from_pretrained(chat_model)

    def prompt_length(messages: list[dict]) -> int:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return len(tokenizer(text, add_special_tokens=False).input_ids)

    full = {row["id"]: row["messages"] for row in output_rows(full_dir)}
    turns = {row_id: [(i, prompt_length(messages[:i])) for i, m in enumerate(messages)
                      if m["role"] == "assistant" and not m.get("tool_calls")] for row_id, messages in full.items()}
    limit = sorted(length for row in turns.values() for _, length in row)[len(full) // 2]
    manifest = regenerate(chat_model, source, tmp_path / "out", f"data.max_length={limit}")

    too_long = {row_id: next((i for i, length in row if length > limit), None) for row_id, row in turns.items()}
    rejected = {r["sample_id"] for r in rejected_rows(tmp_path / "out") if r["reason"] == "prompt_too_long"}
    assert rejected == {row_id for row_id, row in turns.items() if too_long[row_id] == row[0][0]}
    cut = {row_id: position for row_id, position in too_long.items() if position not in (None, turns[row_id][0][0])}
    assert cut and manifest["stats"]["cut_rows"] == len(cut)
    for row in output_rows(tmp_path / "out"):
        # A cut row ends before its first turn without room; what it keeps is what the full run wrote.
        assert row["messages"] == full[row["id"]][: cut.get(row["id"])]


def test_truncated_and_empty_turns_are_counted_and_dropped_by_policy(switch_model, tmp_path):
    conversations = [{"id": f"c{i}", "messages": [
        {"role": "user", "content": prompt}, {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "More?"}, {"role": "assistant", "content": "ok"}]}
        for i, prompt in enumerate(SWITCH_PROMPTS)]
    source = write_source(tmp_path / "source.jsonl", conversations)
    reference = GreedyReference(switch_model)

    kept = regenerate(switch_model, source, tmp_path / "keep", "regenerate.on_truncated=keep",
                      "regenerate.on_empty=keep")
    outcome = {}  # row id -> reason of its first bad turn (None when every turn is fine)
    truncated = empty = 0
    for row in output_rows(tmp_path / "keep"):
        outcome[row["id"]] = None
        for position, text, hit_limit in reference.walk(row):
            assert row["messages"][position]["content"] == text
            truncated, empty = truncated + hit_limit, empty + (not text.strip())
            if outcome[row["id"]] is None and (hit_limit or not text.strip()):
                outcome[row["id"]] = "truncated" if hit_limit else "empty"
    assert len(outcome) == len(conversations)
    assert truncated and empty and None in outcome.values(), "the data must mix finished, empty and cut turns"
    assert (kept["stats"]["truncated_turns"], kept["stats"]["empty_turns"]) == (truncated, empty)
    assert kept["stats"]["dropped"] == {}

    dropped = regenerate(switch_model, source, tmp_path / "drop", "regenerate.on_truncated=drop",
                         "regenerate.on_empty=drop")
    good = [row for row in output_rows(tmp_path / "keep") if outcome[row["id"]] is None]
    assert output_rows(tmp_path / "drop") == good
    expected = {row_id: reason for row_id, reason in outcome.items() if reason}
    assert {r["sample_id"]: r["reason"] for r in rejected_rows(tmp_path / "drop")} == expected
    assert dropped["stats"]["dropped"] == {reason: list(expected.values()).count(reason)
                                           for reason in set(expected.values())}
    assert dropped["stats"]["rows"] + sum(dropped["stats"]["dropped"].values()) == len(conversations)


def test_changed_settings_on_an_existing_output_are_an_error(greedy_run, chat_model):
    source, out_dir, _ = greedy_run
    with pytest.raises(SpecgenError, match="different configuration"):
        regenerate(chat_model, source, out_dir, "output.shard_size=4", "regenerate.max_new_tokens=7")


def regenerate_command(model: Path, data: Path, out_dir: Path) -> list[str]:
    """A sampled run (so the per-part seeding is exercised) in parts of one row."""
    return [f"model.path={model}", f"data.path={data}", f"output.dir={out_dir}", "runtime.device=cpu",
            "runtime.progress=false", "output.shard_size=1", "regenerate.temperature=1.0", "regenerate.top_p=0.9",
            "regenerate.max_new_tokens=24"]


def part_files(out_dir: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(out_dir.glob("part-*"))}


def test_resume_after_kill_redoes_only_unfinished_parts(chat_model, tmp_path):
    source = write_source(tmp_path / "source.jsonl", CONVERSATIONS * 2)
    reference = run(compose("regenerate", regenerate_command(chat_model, source, tmp_path / "reference")))

    out_dir = tmp_path / "killed"
    cmd = [sys.executable, "-m", "specgen.regenerate", *regenerate_command(chat_model, source, out_dir)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not list(out_dir.glob("part-*.jsonl")) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    finished = {path.name: os.stat(path).st_mtime_ns for path in out_dir.glob("part-*.jsonl")}
    assert 1 <= len(finished) < len(CONVERSATIONS) * 2, "the kill must land mid-run"
    assert not (out_dir / "manifest.json").exists()

    resumed = run(compose("regenerate", regenerate_command(chat_model, source, out_dir)))
    assert {name: os.stat(out_dir / name).st_mtime_ns for name in finished} == finished  # not redone
    assert part_files(out_dir) == part_files(tmp_path / "reference")
    assert resumed["stats"] == reference["stats"] and not list(out_dir.glob("*.tmp"))


@pytest.mark.slow
def test_two_processes_equal_one(chat_model, tmp_path):
    source = write_source(tmp_path / "source.jsonl", CONVERSATIONS, BAD_LINES)
    single = run(compose("regenerate", regenerate_command(chat_model, source, tmp_path / "single")))
    launch = accelerate_launch("specgen.regenerate", *regenerate_command(chat_model, source, tmp_path / "double"))
    result = run_launched(launch, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert part_files(tmp_path / "double") == part_files(tmp_path / "single")
    double = json.loads((tmp_path / "double" / "manifest.json").read_text())
    assert double["stats"] == single["stats"]
    # Units are claimed, not dealt: every unit was claimed by exactly one process, and the claims are gone.
    claimed = double["last_run"]["units_by_process"]
    assert sorted(claimed) == ["0", "1"] and sum(claimed.values()) == len(double["parts"])
    assert not (tmp_path / "double" / ".specgen-claims").exists()
    assert (tmp_path / "double" / "rejected.jsonl").read_text() == (tmp_path / "single" / "rejected.jsonl").read_text()


def test_damaged_parts_are_named_when_read(greedy_run, tmp_path):
    import shutil

    from specgen.data.sources import iter_records

    _, out_dir, manifest = greedy_run
    assert set(manifest["checksums"]) == set(manifest["parts"]) and all(manifest["checksums"].values())
    copy = shutil.copytree(out_dir, tmp_path / "copy")
    part = copy / manifest["parts"][1]
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 1  # one bit of one character: still valid JSON lines, different text
    part.write_bytes(bytes(data))
    with pytest.raises(SpecgenError, match=f"{manifest['parts'][1]}: checksum mismatch"):
        list(iter_records(copy))


@pytest.mark.parametrize("finished", [True, False])
def test_a_read_hashes_each_part_once(greedy_run, tmp_path, monkeypatch, finished):
    """Reading a regenerate output as a source (kind check, row count for the ETA, the rows) hashes each part once,
    with its manifest or (unfinished) from the sidecars."""
    import shutil

    import specgen.data.sources as sources

    _, out_dir, manifest = greedy_run
    copy = shutil.copytree(out_dir, tmp_path / "copy")
    if not finished:
        (copy / "manifest.json").unlink()
    hashed = []

    def counting(files, checksums):
        hashed.extend(files)
        return checksum_problems(files, checksums)

    checksum_problems = sources.checksum_problems
    monkeypatch.setattr(sources, "checksum_problems", counting)
    source = sources.capped_source(copy, None)
    assert source.file_rows == len(list(source.records))
    assert sorted(hashed) == sorted(manifest["parts"])


def test_unfinished_output_reads_its_finished_parts_only(greedy_run, tmp_path, caplog):
    """A regenerate output.dir read before its run finished (no manifest yet, the last part still being written)
    gives the finished parts' rows, never a sidecar or the part in flight, and says so; a damaged part is named."""
    import shutil

    from specgen.data.sources import iter_records

    _, out_dir, manifest = greedy_run
    assert len(manifest["parts"]) >= 2
    copy = shutil.copytree(out_dir, tmp_path / "copy")
    (copy / "manifest.json").unlink()
    last = copy / manifest["parts"][-1]
    last.rename(last.with_name(last.name + ".tmp"))  # in flight: written to *.tmp, its sidecar already there
    expected = [json.loads(line) for name in manifest["parts"][:-1]
                for line in (out_dir / name).read_text().splitlines()]

    with caplog.at_level("WARNING", logger="specgen.data.sources"):
        records = list(iter_records(copy))
    assert [r.error for r in records if r.error] == []
    assert [r.record for r in records] == expected
    assert f"reading its {len(manifest['parts']) - 1} finished parts" in caplog.text

    first = copy / manifest["parts"][0]
    data = bytearray(first.read_bytes())
    data[len(data) // 2] ^= 1
    first.write_bytes(bytes(data))
    with pytest.raises(SpecgenError, match=f"{manifest['parts'][0]}: checksum mismatch"):
        list(iter_records(copy))


def test_output_feeds_generate(greedy_run, chat_model, tmp_path):
    from specgen import open_shards
    from specgen.generate import run as generate

    _, out_dir, manifest = greedy_run
    captured = generate(compose("generate", [f"model.path={chat_model}", f"data.path={out_dir}",
                                             f"output.dir={tmp_path / 'shards'}", "runtime.progress=false",
                                             "capture.aux_layers=[0,1]"]))
    assert captured["stats"]["rejected"] == {}
    dataset = open_shards(tmp_path / "shards")
    assert sorted(dataset[i]["sample_id"] for i in range(len(dataset))) == sorted(
        row["id"] for row in output_rows(out_dir))
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    story = next(dataset[i] for i in range(len(dataset)) if dataset[i]["sample_id"] == "story")
    trained = tokenizer.decode(story["input_ids"][story["loss_mask"].bool()])
    row = next(row for row in output_rows(out_dir) if row["id"] == "story")
    for message in row["messages"]:
        if message["role"] == "assistant":
            assert message["content"] in trained  # the target's own replies are what the draft trains on


# A ChatML template with a Qwen3-style thinking switch: enable_thinking=false closes an empty block in the prompt.
SWITCHABLE_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}")


def test_reasoning_split_renders_back_to_the_generated_text(qwen3_tokenizer):
    """The assistant message made from a completion renders, under the Qwen3 thinking template, to exactly the
    prompt followed by the generated text and the end-of-turn token."""
    messages = [{"role": "user", "content": "What is 2+2?"}]
    prompt = qwen3_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<think>\n")  # the template opens the block; the model writes the rest
    generated = "Two plus two.\nThat is four.\n</think>\n\nIt is 4."
    message = assistant_reply(generated, prompt=prompt, split_reasoning=True)
    assert (message["reasoning_content"], message["content"]) == ("Two plus two.\nThat is four.", "It is 4.")
    rendered = qwen3_tokenizer.apply_chat_template([*messages, message], tokenize=False)
    assert rendered == prompt + generated + "<|im_end|>\n"


def test_reasoning_split_for_closed_cut_and_plain_turns():
    closed = assistant_reply("<think>\nHmm.\n</think>\n\nDone.", prompt="<|im_start|>assistant\n",
                             split_reasoning=True)
    assert (closed["reasoning_content"], closed["content"]) == ("Hmm.", "Done.")
    no_thinking = assistant_reply("Done.", prompt="<|im_start|>assistant\n<think>\n\n</think>\n\n",
                                  split_reasoning=True)
    assert (no_thinking["reasoning_content"], no_thinking["content"]) == ("", "Done.")
    cut = assistant_reply("still thinking", prompt="<|im_start|>assistant\n<think>\n", split_reasoning=True)
    assert (cut["reasoning_content"], cut["content"]) == ("still thinking", "")
    plain = assistant_reply("<think>x</think>y", prompt="", split_reasoning=False)
    assert plain == {"role": "assistant", "content": "<think>x</think>y"}


def test_thinking_switch(qwen3_tokenizer):
    switchable = AutoTokenizer.from_pretrained(ASSETS_DIR / "tokenizer")
    switchable.chat_template = SWITCHABLE_TEMPLATE
    kwargs = template_kwargs(compose("regenerate", ["regenerate.thinking=false"]), switchable)
    assert kwargs == {"enable_thinking": False}
    prompt = switchable.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                            add_generation_prompt=True, **kwargs)
    assert prompt.endswith("<think>\n\n</think>\n\n")
    assert template_kwargs(compose("regenerate"), switchable) == {}
    with pytest.raises(SpecgenError, match="contradicts"):
        template_kwargs(compose("regenerate", ["regenerate.thinking=true",
                                               "+data.chat_template_kwargs.enable_thinking=false"]), switchable)
    with pytest.raises(SpecgenError, match="no enable_thinking switch"):  # this Qwen3 template always thinks
        template_kwargs(compose("regenerate", ["regenerate.thinking=false"]), qwen3_tokenizer)


TINY_TARGET = ASSETS_DIR / "tiny-target"  # 2048 positions


def long_prompt_source(path: Path, tokens: tuple[int, int]) -> Path:
    """Two short conversations and one ("long") whose first prompt has between tokens[0] and tokens[1] tokens."""
    tokenizer = AutoTokenizer.from_pretrained(TINY_TARGET)
    words = 1
    while True:
        messages = [{"role": "user", "content": "word " * words}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        length = len(tokenizer(text, add_special_tokens=False).input_ids)
        if length > tokens[0]:
            break
        words += max(1, (tokens[0] - length) // 2)
    assert length <= tokens[1], length
    rows = [CONVERSATIONS[2], {"id": "long", "messages": [*messages, {"role": "assistant", "content": "ok"}]},
            CONVERSATIONS[4]]
    return write_source(path, rows)


def test_prompts_and_new_tokens_stay_within_the_model_positions(tmp_path, capsys):
    """data.max_length=4096 on a 2048-position model with max_new_tokens=48: prompts up to 2000 tokens are
    regenerated; a longer one (which fits data.max_length) is rejected and counted, as engine=vllm does
    (tests/test_vllm.py); the summary says the limit and why."""
    source = long_prompt_source(tmp_path / "chat.jsonl", (2000, 2048))
    manifest = regenerate(TINY_TARGET, source, tmp_path / "out", "data.max_length=4096",
                          "regenerate.max_new_tokens=48")
    limit = "the model's 2048 positions - regenerate.max_new_tokens=48"
    assert manifest["generation"]["max_prompt_tokens"] == 2000 and manifest["generation"]["prompt_limit"] == limit
    assert [row["id"] for row in output_rows(tmp_path / "out")] == ["sum", "story"]
    rejected = rejected_rows(tmp_path / "out")
    assert [(r["sample_id"], r["reason"]) for r in rejected] == [("long", "prompt_too_long")]
    assert f"than the 2000 allowed ({limit})" in rejected[0]["message"]
    assert manifest["stats"]["rejected"] == {"prompt_too_long": 1}
    out = capsys.readouterr().out
    assert "exceeds 2,000 tokens (the model's 2048 positions" in out and "prompt_too_long: 1" in out


def test_the_engine_context_never_exceeds_the_model_positions():
    from transformers import AutoConfig

    from specgen.regen.setup import context_limits

    config = AutoConfig.from_pretrained(TINY_TARGET)
    common = [f"model.path={TINY_TARGET}", "engine=vllm", "regenerate.max_new_tokens=48"]
    assert context_limits(compose("regenerate", common), config)[:2] == (2000, 2048)  # not 2048 + 48
    assert context_limits(compose("regenerate", [*common, "data.max_length=512"]), config) == (
        512, 560, "data.max_length=512")
    assert context_limits(compose("regenerate", [*common, "engine.max_model_len=1024"]), config)[:2] == (976, 1024)
    with pytest.raises(SpecgenError, match="^engine.max_model_len=4096 exceeds the 2048 positions"):
        context_limits(compose("regenerate", [*common, "engine.max_model_len=4096"]), config)
    with pytest.raises(SpecgenError, match="^regenerate.max_new_tokens=2048 leaves no room for a prompt"):
        context_limits(compose("regenerate", [*common, "regenerate.max_new_tokens=2048"]), config)


def test_the_loop_rule_counts_repeats_of_an_ngram():
    from specgen.regen.turns import TurnPolicy

    policy = TurnPolicy(loop_ngram=3, loop_repeats=2)
    assert not policy.loops([1, 2, 3, 9, 1, 2, 3, 8])  # a 3-gram twice: allowed
    assert policy.loops([1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3])  # three times: a loop
    assert policy.loops([7] * 5) and not policy.loops([7] * 4)  # overlapping runs of one token: 3 and 2 times
    assert not policy.loops([1, 2])  # shorter than the n-gram
    assert not TurnPolicy(loop_ngram=3, loop_repeats=0).loops([7] * 50)  # 0: the check is off
    with pytest.raises(SpecgenError, match="loop_ngram"):
        TurnPolicy(loop_ngram=0)


def test_the_loop_watch_fires_at_the_token_that_makes_a_turn_loop_and_stays_fired():
    """`LoopWatch` fed token by token (as vLLM streams a turn) agrees with the rule on every prefix, so a generator
    that stops a turn at its first True stops it exactly where the turn began to loop: any longer draw loops too."""
    import random

    from specgen.regen.engine import LoopWatch
    from specgen.regen.turns import TurnPolicy

    rng = random.Random(0)
    fired = 0
    for trial in range(200):
        ngram, repeats = rng.randint(1, 4), rng.randint(0, 3)
        tokens = [rng.randint(0, 4) for _ in range(rng.randint(0, 40))]
        policy, watch = TurnPolicy(loop_ngram=ngram, loop_repeats=repeats), LoopWatch(ngram, repeats)
        flags = [watch.extend(tokens[i:i + 1]) for i in range(len(tokens))]
        assert flags == [policy.loops(tokens[:i + 1]) for i in range(len(tokens))]
        assert flags == sorted(flags)  # False, ..., False, True, ...: once looping, always looping
        assert LoopWatch(ngram, repeats).extend(tokens) == policy.loops(tokens)
        fired += any(flags)
    assert 0 < fired < 200
    assert TurnPolicy(on_loop="keep").watch() is None and TurnPolicy(loop_repeats=0).watch() is None
    assert TurnPolicy(on_loop="resample").watch() is not None


def test_looping_turns_are_counted_and_dropped_by_policy(switch_model, tmp_path):
    """The switch model writes '#' (one token) until it stops: a turn of 7+ '#' repeats the 4-gram '####' more
    than 3 times, which the documented rule calls a loop (here truncated turns loop too)."""
    conversations = [{"id": f"c{i}", "messages": [{"role": "user", "content": prompt},
                                                  {"role": "assistant", "content": "ok"}]}
                     for i, prompt in enumerate(SWITCH_PROMPTS)]
    source = write_source(tmp_path / "source.jsonl", conversations)
    rule = ["regenerate.max_new_tokens=16", "regenerate.loop_ngram=4", "regenerate.loop_repeats=3"]

    kept = regenerate(switch_model, source, tmp_path / "keep", *rule, "regenerate.on_loop=keep",
                      "regenerate.on_empty=keep")
    looping = {row["id"] for row in output_rows(tmp_path / "keep") if "#" * 7 in row["messages"][-1]["content"]}
    assert looping and len(looping) < len(conversations), "the data must mix looping and other turns"
    assert kept["stats"]["loop_turns"] == len(looping) and kept["stats"]["dropped"] == {}

    dropped = regenerate(switch_model, source, tmp_path / "drop", *rule, "regenerate.on_empty=keep")
    assert {r["sample_id"]: r["reason"] for r in rejected_rows(tmp_path / "drop")} == dict.fromkeys(looping, "loop")
    assert dropped["stats"]["dropped"] == {"loop": len(looping)} and dropped["stats"]["loop_turns"] == len(looping)


def test_resampling_draws_a_looping_turn_again_then_drops_its_row(chat_model, tmp_path):
    """regenerate.on_loop=resample: a looping draw is discarded and the turn drawn again, up to resample_tries more
    times, then the row is dropped as with drop. Every draw is counted (loop_turns: every looping draw; resampled:
    the discarded ones), no kept turn loops, and a re-run repeats the output byte for byte. A loop here is any token
    twice in a 12-token turn sampled from the top 8 (loop_ngram=1, loop_repeats=1): some draws loop, some do not."""
    from specgen.regen.turns import TurnPolicy

    source = write_source(tmp_path / "source.jsonl", CONVERSATIONS * 3)
    rule = ["regenerate.temperature=1.0", "regenerate.top_k=8", "regenerate.max_new_tokens=12",
            "regenerate.loop_ngram=1", "regenerate.loop_repeats=1", "regenerate.on_empty=keep"]
    dropped = regenerate(chat_model, source, tmp_path / "drop", *rule)
    assert dropped["stats"]["dropped"].get("loop") and dropped["stats"]["rows"], "the draws must mix loops and others"
    assert dropped["stats"]["resampled_turns"] == 0 and "resample_tries" not in dropped["generation"]

    manifest = regenerate(chat_model, source, tmp_path / "resample", *rule, "regenerate.on_loop=resample",
                          "regenerate.resample_tries=3")
    stats = manifest["stats"]
    assert stats["resampled_turns"] > 0 and manifest["generation"]["resample_tries"] == 3
    # every looping draw was either drawn again or, with no tries left, dropped its row
    assert stats["loop_turns"] == stats["resampled_turns"] + stats["dropped"].get("loop", 0)
    assert stats["rows"] > dropped["stats"]["rows"]
    for rejection in rejected_rows(tmp_path / "resample"):
        if rejection["reason"] == "loop":
            assert "(regenerate.on_loop=resample, after 3 more draws)" in rejection["message"]
    again = regenerate(chat_model, source, tmp_path / "again", *rule, "regenerate.on_loop=resample",
                       "regenerate.resample_tries=3")
    assert part_files(tmp_path / "again") == part_files(tmp_path / "resample") and again["stats"] == stats

    # No looping draw is kept: watch the real model's draws (what the generator returns) in one unit.
    from specgen.data.sources import iter_records
    from specgen.regen.setup import build_regenerator, load_model
    from specgen.runtime import load_tokenizer

    cfg = compose("regenerate", [f"model.path={chat_model}", f"data.path={source}", "runtime.device=cpu", *rule,
                                 "regenerate.on_loop=resample", "regenerate.resample_tries=3"])
    tokenizer = load_tokenizer(cfg.tokenizer.path)
    regenerator = build_regenerator(cfg, tokenizer, load_model(cfg, torch.device("cpu")))
    draws, complete = [], regenerator.generator.complete

    def watched(prompts, on_batch=None):
        draws.extend(completions := complete(prompts, on_batch))
        return completions

    regenerator.generator.complete = watched
    result = regenerator.regenerate(iter_records(source))
    policy = TurnPolicy(loop_ngram=1, loop_repeats=1)
    looped = [tokenizer.decode(d.token_ids, skip_special_tokens=True).strip() for d in draws if policy.loops(d.token_ids)]
    kept = {m["content"].strip() for row in result.rows for m in row["messages"] if m["role"] == "assistant"}
    assert looped and not set(looped) & kept and len(looped) == result.stats["loop_turns"]


def test_resampling_needs_sampling_and_a_positive_number_of_tries(chat_model, tmp_path):
    source = write_source(tmp_path / "source.jsonl", CONVERSATIONS)
    with pytest.raises(SpecgenError, match=r"^regenerate.on_loop=resample needs sampling \(regenerate.temperature"):
        regenerate(chat_model, source, tmp_path / "greedy", "regenerate.on_loop=resample")
    with pytest.raises(SpecgenError, match="regenerate.resample_tries"):
        regenerate(chat_model, source, tmp_path / "zero", "regenerate.temperature=1.0",
                   "regenerate.on_empty=resample", "regenerate.resample_tries=0")


def test_progress_moves_per_row_chunk_and_per_decoding_step(chat_model, tmp_path):
    """regenerate reports rows as each chunk of regenerate.batch_size rows finishes, and tokens after every
    decoding step (so a long batch is visibly alive); the reported tokens add up to the generated ones."""
    from specgen.data.sources import iter_records
    from specgen.regen.setup import build_regenerator, load_model
    from specgen.runtime import load_tokenizer

    source = write_source(tmp_path / "source.jsonl", CONVERSATIONS)
    cfg = compose("regenerate", [f"model.path={chat_model}", f"data.path={source}", "regenerate.temperature=0",
                                 "regenerate.max_new_tokens=5", "regenerate.batch_size=2", "runtime.device=cpu"])
    regenerator = build_regenerator(cfg, load_tokenizer(cfg.tokenizer.path), load_model(cfg, torch.device("cpu")))
    rows, tokens = [], []

    result = regenerator.regenerate(iter_records(source), on_batch=tokens.append, on_rows=rows.append, chunk_rows=2)

    assert rows == [2, 2, 1]
    assert sum(tokens) == result.stats["new_tokens"] and len(tokens) > result.stats["regenerated_turns"] / 2


def test_a_static_kv_cache_writes_what_the_dynamic_one_writes(greedy_run, chat_model, tmp_path):
    """regenerate.kv_cache=static decodes every batch in one shape (here 3 rows: the source's 5 good rows make a
    batch of 3 and one of 2 plus a filler row, whose reply is dropped): greedy, the same text and counts as the
    dynamic cache, progress counts the real rows only, and the manifest names the cache."""
    source, dynamic_dir, dynamic = greedy_run
    tokens = []
    cfg = compose("regenerate", [f"model.path={chat_model}", f"data.path={source}", f"output.dir={tmp_path / 'out'}",
                                 "runtime.progress=false", "runtime.device=cpu", "regenerate.temperature=0",
                                 f"regenerate.max_new_tokens={MAX_NEW_TOKENS}", "output.shard_size=4",
                                 "regenerate.batch_size=3", "regenerate.kv_cache=static"])
    from specgen.data.sources import iter_records
    from specgen.regen.setup import build_regenerator, load_model
    from specgen.runtime import load_tokenizer

    regenerator = build_regenerator(cfg, load_tokenizer(cfg.tokenizer.path), load_model(cfg, torch.device("cpu")))
    assert regenerator.generator.static_rows == 3
    result = regenerator.regenerate(iter_records(source), on_batch=tokens.append)
    assert sum(tokens) == result.stats["new_tokens"] == dynamic["stats"]["new_tokens"]

    static = run(cfg)
    assert [row["messages"] for row in output_rows(tmp_path / "out")] == [
        row["messages"] for row in output_rows(dynamic_dir)]
    assert static["stats"] == dynamic["stats"]
    assert "static KV cache" in static["generation"]["backend"]
    assert "static" not in dynamic["generation"]["backend"]


def test_the_filler_rows_of_a_static_batch_are_stopped_at_once_and_never_counted():
    """A static batch's fillers (rows after the real ones) are marked done from the first step, so a sampled filler
    cannot keep the batch decoding after its real rows end; progress counts the real rows only."""
    from specgen.regen.engine import _StepCounter

    reported = []
    watch = _StepCounter([7], rows=2, report=reported.append)
    step1 = torch.tensor([[1, 5], [1, 7], [1, 5]])  # row 1 ends with the stop token 7; row 2 is a filler
    assert watch(step1).tolist() == [False, False, True] and reported == [2]
    assert watch(torch.tensor([[1, 5, 5], [1, 7, 0], [1, 5, 5]])).tolist() == [False, False, True]
    assert reported == [2, 1]
    assert _StepCounter([7], rows=3, report=None)(step1).tolist() == [False, False, False]


def test_a_static_kv_cache_that_cannot_hold_one_row_or_runs_in_vllm_is_refused(chat_model, tmp_path):
    from specgen.regen.setup import load_model

    common = [f"model.path={chat_model}", f"data.path={tmp_path / 'none.jsonl'}", "regenerate.kv_cache=static"]
    with pytest.raises(SpecgenError, match="raise regenerate.batch_tokens to a multiple of 1030"):
        load_model(compose("regenerate", [*common, "regenerate.batch_tokens=1000", "data.max_length=1024",
                                          "regenerate.max_new_tokens=6"]), torch.device("cpu"))
    with pytest.raises(SpecgenError, match="^regenerate.kv_cache=static is a setting of engine=hf"):
        load_model(compose("regenerate", [*common, "engine=vllm"]), torch.device("cpu"))


def test_synthesized_user_turns_continue_the_templates_user_header(chat_model, tmp_path):
    """regenerate.user_turns=synthesize: every user turn is the target's own continuation of the conversation so far
    rendered up to the template's user-turn header, and every reply answers those turns (top_k=1 makes the sampling
    an argmax, so HF's greedy generate is the reference); system turns are kept and a tool-calling row is rejected."""
    source = write_source(tmp_path / "source.jsonl", CONVERSATIONS)
    manifest = regenerate(chat_model, source, tmp_path / "out", "regenerate.user_turns=synthesize",
                          "regenerate.temperature=1.0", "regenerate.top_k=1", "regenerate.on_empty=keep")
    reference = GreedyReference(chat_model)
    rows = {row["id"]: row for row in output_rows(tmp_path / "out")}
    assert sorted(rows) == ["colours", "row-1", "story", "sum"]
    assert [(r["sample_id"], r["reason"]) for r in rejected_rows(tmp_path / "out")] == [("weather", "tool_calls")]
    synthesized = 0
    for index, original in enumerate(CONVERSATIONS):
        row = rows.get(original.get("id", f"row-{index}"))
        if row is None:
            continue
        before, after = normalize(original).messages, row["messages"]
        assert [m["role"] for m in after] == [m["role"] for m in before]
        for position, (old, new) in enumerate(zip(before, after)):
            if old["role"] == "system":
                assert new == old
            elif old["role"] == "user":
                header = reference.tokenizer.apply_chat_template(
                    after[:position] + [{"role": "user", "content": "\u2063"}], tokenize=False).split("\u2063")[0]
                assert header.endswith("<|im_start|>user\n")
                ids = reference.tokenizer(header, add_special_tokens=False, return_tensors="pt").input_ids
                with torch.no_grad():
                    out = reference.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                                   max_new_tokens=MAX_NEW_TOKENS)[0, ids.shape[1]:].tolist()
                stop = next((i for i, token in enumerate(out) if token in reference.stop), None)
                assert new == {"role": "user", "content": reference.tokenizer.decode(out[:stop]).strip()}
                assert new["content"] != old["content"]
                synthesized += 1
            else:
                assert new == {"role": "assistant", "content": reference.turn(after[:position])[0]}
    assert manifest["stats"]["synthesized_user_turns"] == synthesized == 7
    assert manifest["generation"]["user_turns"] == "synthesize"


def test_synthesized_user_turns_need_sampling_and_every_turn(chat_model, tmp_path):
    source = write_source(tmp_path / "source.jsonl", CONVERSATIONS[:1])
    with pytest.raises(SpecgenError, match="regenerate.temperature > 0"):
        regenerate(chat_model, source, tmp_path / "greedy", "regenerate.user_turns=synthesize")
    with pytest.raises(SpecgenError, match="regenerate.turns=all"):
        regenerate(chat_model, source, tmp_path / "last", "regenerate.user_turns=synthesize",
                   "regenerate.temperature=1.0", "regenerate.turns=last")


# --- growing a dataset: a re-run with a larger data.max_rows on the same output.dir (specgen.regen.grow) ---------

def grow_command(*overrides: str) -> list[str]:
    """Sampled (so the per-part seeding is exercised), in parts of 3 rows: data.max_rows=4 ends in a short part."""
    return ["output.shard_size=3", "regenerate.temperature=1.0", "regenerate.top_k=8", "regenerate.max_new_tokens=4",
            *overrides]


def without_run_bookkeeping(manifest: dict) -> dict:
    config = {**manifest["config"], "output": {**manifest["config"]["output"], "dir": None}}
    return {**manifest, "config": config, "last_run": None, "extensions": None}


@pytest.fixture(scope="module")
def grown(chat_model, tmp_path_factory) -> tuple[Path, Path, dict, dict]:
    """(source, the dataset made at once with data.max_rows=8, its manifest, the manifest of the same dataset grown
    from data.max_rows=4); the grown dataset is in `source.parent / "grown"`."""
    root = tmp_path_factory.mktemp("grow")
    source = write_source(root / "source.jsonl", CONVERSATIONS * 2)  # 10 rows
    once = regenerate(chat_model, source, root / "once", *grow_command("data.max_rows=8"))
    regenerate(chat_model, source, root / "grown", *grow_command("data.max_rows=4"))
    kept = os.stat(root / "grown" / "part-00000.jsonl").st_mtime_ns
    grown_manifest = regenerate(chat_model, source, root / "grown", *grow_command("data.max_rows=8"))
    assert os.stat(root / "grown" / "part-00000.jsonl").st_mtime_ns == kept  # the full part was kept, not redone
    return source, root / "once", once, grown_manifest


def test_growing_equals_one_run_of_the_larger_size(grown, chat_model, capsys):
    source, once_dir, once, manifest = grown
    out_dir = source.parent / "grown"
    assert list(part_files(out_dir)) == list(part_files(once_dir)) == [
        "part-00000.json", "part-00000.jsonl", "part-00001.json", "part-00001.jsonl", "part-00002.json",
        "part-00002.jsonl"]
    assert part_files(out_dir) == part_files(once_dir)  # the short part 1 was regenerated with its 3 rows
    assert (out_dir / "rejected.jsonl").read_bytes() == (once_dir / "rejected.jsonl").read_bytes()
    assert without_run_bookkeeping(manifest) == without_run_bookkeeping(once)
    growth = {"from_max_rows": 4, "to_max_rows": 8, "from_rows": 4, "to_rows": 8, "units_kept": 1,
              "units_regenerated": [1], "units": 3, "units_new": 2}
    assert [{k: v for k, v in g.items() if k != "started"} for g in manifest["extensions"]] == [growth]
    assert manifest["last_run"]["grown"] == manifest["extensions"][0] and once["extensions"] == []

    # Growing to every row (null): part 2 (rows 6-7) gets row 8, part 3 (row 9) is new; a re-run then grows nothing.
    capsys.readouterr()
    everything = regenerate(chat_model, source, out_dir, *grow_command("data.max_rows=null"))
    assert "extended from 8 to 10 rows (2 units kept, 2 new; data.max_rows=8 -> null)" in capsys.readouterr().out
    assert everything["stats"]["source_rows"] == 10 and len(everything["parts"]) == 4
    again = regenerate(chat_model, source, out_dir, *grow_command("data.max_rows=null"))
    assert "extended" not in capsys.readouterr().out and again["extensions"] == everything["extensions"]
    assert [g["to_max_rows"] for g in again["extensions"]] == [8, None] and again["last_run"]["grown"] is None


def test_rows_appended_to_the_source_grow_the_dataset_as_one_run(grown, chat_model, tmp_path, caplog):
    """data.max_rows=null over a source that has grown since the last run: the short last part is redone with its
    full rows and the new ones added, part for part what one run over the larger source makes."""
    source, once_dir, _, _ = grown
    rows = [json.loads(line) for line in source.read_text().splitlines()][:8]
    growing = write_source(tmp_path / "source.jsonl", rows[:4])  # parts of 3 rows: 3, 1
    regenerate(chat_model, growing, tmp_path / "out", *grow_command("data.max_rows=null"))
    write_source(growing, rows)  # 3, 3, 2
    with caplog.at_level("WARNING", logger="specgen.job"):
        manifest = regenerate(chat_model, growing, tmp_path / "out", *grow_command("data.max_rows=null"))
    assert "unit 1 (part-00001.jsonl) was made from 1 source rows: it now gives 3" in caplog.text
    assert manifest["stats"]["source_rows"] == 8
    assert part_files(tmp_path / "out") == part_files(once_dir)


def test_a_source_edited_in_place_is_refused_naming_the_part(grown, chat_model, tmp_path):
    """Same rows count, one question edited: the finished part answering the old question is refused, not kept."""
    rows = [json.loads(line) for line in grown[0].read_text().splitlines()][:4]
    source = write_source(tmp_path / "source.jsonl", rows)  # parts of 3 rows: 3, 1
    regenerate(chat_model, source, tmp_path / "out", *grow_command("data.max_rows=null"))
    rows[1]["messages"][0]["content"] += " Briefly."
    write_source(source, rows)
    with pytest.raises(SpecgenError, match=r"^unit 0 of output.dir \(source rows 0-2\) was made from rows that "
                                           r"data.path no longer holds"):
        regenerate(chat_model, source, tmp_path / "out", *grow_command("data.max_rows=null"))


def test_growing_a_source_of_unknown_size_to_its_end_redoes_the_short_part(grown, chat_model, tmp_path, monkeypatch):
    """data.max_rows=4 -> null where the source's size cannot be known up front: the claim cannot compare rows, so
    the growth itself reopens the short part; the result is the run over all of it."""
    import specgen.data.sources as sources

    _, once_dir, _, _ = grown
    rows = [json.loads(line) for line in (grown[0]).read_text().splitlines()][:8]
    source = write_source(tmp_path / "source.jsonl", rows)  # parts of 3 rows: 3, 1 -> 3, 3, 2
    regenerate(chat_model, source, tmp_path / "out", *grow_command("data.max_rows=4"))
    monkeypatch.setattr(sources, "count_records", lambda *args, **kwargs: None)
    manifest = regenerate(chat_model, source, tmp_path / "out", *grow_command("data.max_rows=null"))
    assert manifest["stats"]["source_rows"] == 8 and manifest["last_run"]["grown"]["units_regenerated"] == [1]
    assert part_files(tmp_path / "out") == part_files(once_dir)


def test_the_next_command_names_the_recipe_the_run_used(chat_model, tmp_path, capsys):
    """The summary's next command (generate on the new dataset) carries the run's recipe= (a user's file as an
    absolute path), which the manifest records: generate composed from that command line gets the recipe's keys.
    Without a recipe, neither names one."""
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("# @package _global_\ndata:\n  max_length: 333\n")
    source = write_source(tmp_path / "chat.jsonl", CONVERSATIONS[:2])
    capsys.readouterr()
    manifest = regenerate(chat_model, source, tmp_path / "out", f"recipe={os.path.relpath(recipe)}")
    assert manifest["recipe"] == str(recipe.resolve())
    line = next(line for line in capsys.readouterr().out.splitlines() if "python -m specgen.generate" in line)
    args = shlex.split(line.split("python -m specgen.generate", 1)[1])
    assert args[0] == f"recipe={recipe.resolve()}"
    cfg = compose("generate", args)
    assert cfg.data.max_length == 333 and cfg.data.path == str(tmp_path / "out") and cfg.model.path == str(chat_model)

    plain = regenerate(chat_model, source, tmp_path / "plain")
    assert plain["recipe"] is None and job_recipe() is None
    assert "recipe=" not in next(line for line in capsys.readouterr().out.splitlines() if "specgen.generate" in line)
    compose("generate", ["recipe=demo"])
    assert job_recipe() == "demo"  # a bundled recipe by its name


def test_generate_reads_the_first_rows_of_a_grown_dataset(grown, chat_model, tmp_path):
    """specgen generate data.path=DIR data.max_rows=N reads the first N rows of a grown dataset: its parts in order,
    the kept ones and the new ones as one source."""
    from specgen import open_shards
    from specgen.data.sources import capped_source
    from specgen.generate import run as generate

    source, _, _, _ = grown
    out_dir = source.parent / "grown"
    rows = output_rows(out_dir)  # every part, in part order
    assert len(rows) >= 8
    for n in (2, 4, 7, len(rows)):  # within the kept part, across the replaced one, into the new ones, all
        assert [record.record for record in capped_source(out_dir, n).records] == rows[:n]
    captured = generate(compose("generate", [f"model.path={chat_model}", f"data.path={out_dir}", "data.max_rows=7",
                                             f"output.dir={tmp_path / 'shards'}", "runtime.progress=false",
                                             "capture.aux_layers=[0,1]"]))
    assert captured["stats"]["rejected"] == {}
    dataset = open_shards(tmp_path / "shards")
    assert sorted(dataset[i]["sample_id"] for i in range(len(dataset))) == sorted(row["id"] for row in rows[:7])


def test_a_growth_stopped_midway_completes_on_a_re_run(grown, chat_model, tmp_path, monkeypatch):
    """A growth killed between the removal of the short part's sidecar and of the part, then after the new part was
    renamed over the old one but before its sidecar was written (the replacement's window), then after the next
    part: each re-run finishes the same dataset as one run of the larger size."""
    import pathlib

    import specgen.regenerate as stage
    import specgen.store.commit as commit

    class Killed(BaseException):
        pass

    source, once_dir, once, _ = grown
    out_dir = tmp_path / "out"
    regenerate(chat_model, source, out_dir, *grow_command("data.max_rows=4"))
    old_part = (out_dir / "part-00001.jsonl").read_bytes()
    unlink, write_json_atomic, write_part = pathlib.Path.unlink, commit.write_json_atomic, stage.write_part

    def killed_at_the_part(path, missing_ok=False):
        if path.name == "part-00001.jsonl":
            raise Killed
        return unlink(path, missing_ok=missing_ok)

    monkeypatch.setattr(pathlib.Path, "unlink", killed_at_the_part)
    with pytest.raises(Killed):
        regenerate(chat_model, source, out_dir, *grow_command("data.max_rows=8"))
    monkeypatch.setattr(pathlib.Path, "unlink", unlink)
    assert (out_dir / "part-00001.jsonl").read_bytes() == old_part and not (out_dir / "part-00001.json").exists()

    def killed_after_the_rename(path, value, **kwargs):
        if Path(path).name == "part-00001.json" and not commit.tmp_path(Path(path).with_suffix(".jsonl")).exists():
            raise Killed  # the new part is under its name, its sidecar not written yet
        return write_json_atomic(path, value, **kwargs)

    monkeypatch.setattr(commit, "write_json_atomic", killed_after_the_rename)
    with pytest.raises(Killed):
        regenerate(chat_model, source, out_dir, *grow_command("data.max_rows=8"))
    monkeypatch.setattr(commit, "write_json_atomic", write_json_atomic)
    assert (out_dir / "part-00001.jsonl").read_bytes() != old_part and not (out_dir / "part-00001.json").exists()

    def killed_at_unit_2(out, unit, *args):
        if unit == 2:
            raise Killed
        return write_part(out, unit, *args)

    monkeypatch.setattr(stage, "write_part", killed_at_unit_2)
    with pytest.raises(Killed):
        regenerate(chat_model, source, out_dir, *grow_command("data.max_rows=8"))
    monkeypatch.setattr(stage, "write_part", write_part)
    manifest = regenerate(chat_model, source, out_dir, *grow_command("data.max_rows=8"))

    assert part_files(out_dir) == part_files(once_dir) and not list(out_dir.glob("*.tmp"))
    assert without_run_bookkeeping(manifest) == without_run_bookkeeping(once)
    assert manifest["last_run"]["grown"]["units_kept"] == 1 and manifest["last_run"]["grown"]["units_new"] == 2


def test_a_smaller_size_or_another_setting_is_refused(grown, chat_model, tmp_path):
    source, _, _, _ = grown
    out_dir = source.parent / "grown"
    before = part_files(out_dir)
    with pytest.raises(SpecgenError, match=r"^output.dir=\S+ holds \d+ source rows regenerated with data.max_rows="
                                           r"\S+, and a dataset here only grows, so data.max_rows=2 is refused; to "
                                           r"train on fewer rows pass data.max_rows=2 to specgen generate"):
        regenerate(chat_model, source, out_dir, *grow_command("data.max_rows=2"))
    with pytest.raises(SpecgenError, match=r"different configuration \(changed: data.max_rows, "
                                           r"generation.max_new_tokens\)"):
        regenerate(chat_model, source, out_dir, *grow_command("data.max_rows=9"), "regenerate.max_new_tokens=5")
    assert part_files(out_dir) == before

    two = [f"data.path=[{source},{source}]"]
    regenerate(chat_model, source, tmp_path / "two", *grow_command("data.max_rows=1"), *two)
    with pytest.raises(SpecgenError, match="data.max_rows caps each source"):
        regenerate(chat_model, source, tmp_path / "two", *grow_command("data.max_rows=2"), *two)
