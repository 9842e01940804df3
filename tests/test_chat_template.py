"""Chat template + loss mask with the real Llama-3.1 and Qwen3 tokenizers, and `prepare_rows`.

The masks are checked against an oracle written from each template's published reply format
(`llama_reply`, `qwen_reply`): every run of trained tokens must decode to exactly one assistant
reply (content, rendered reasoning, tool calls) followed by the end-of-turn token.
"""

import copy
import hashlib
import json

import pytest

from conftest import DATASETS, TOKENIZERS, require_shared
from specgen.data import (ChatTemplateTokenizer, Conversation, Pretokenized, chat_template_sha256, count_records,
                          iter_records, normalize, prepare_rows)
from specgen.errors import RowError, SpecgenError

FIXTURES = {"llama-3.1": "llama_tokenizer", "qwen3": "qwen3_tokenizer"}
# Tokens that only ever open a role header or a document: never trained.
HEADER_TOKENS = {"llama-3.1": ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>"),
                 "qwen3": ("<|im_start|>",)}


def llama_reply(message: dict) -> str:
    """What Llama-3.1 generates for an assistant message (its template trims content, ignores reasoning)."""
    if "tool_calls" in message:
        call = message["tool_calls"][0]["function"]
        arguments = json.dumps(call["arguments"], ensure_ascii=False)
        body = '{"name": "' + call["name"] + '", "parameters": ' + arguments + "}"
    else:
        body = message["content"].strip()
    return body + "<|eot_id|>"


def qwen_reply(message: dict, mask_empty_think: bool = True) -> str:
    """What Qwen3 generates after its generation prompt `<|im_start|>assistant\\n<think>\\n`."""
    reasoning, content = message.get("reasoning_content", ""), message["content"]
    think = reasoning.strip("\n") + "\n</think>\n\n"
    if mask_empty_think and not reasoning.strip():
        think = ""
    body = content.lstrip("\n")
    for i, call in enumerate(message.get("tool_calls", [])):
        separator = "\n" if (i == 0 and content) or i > 0 else ""
        arguments = json.dumps(call["function"]["arguments"], ensure_ascii=False)
        body += separator + '<tool_call>\n{"name": "' + call["function"]["name"] + '", "arguments": ' + arguments
        body += "}\n</tool_call>"
    return think + body + "<|im_end|>"


def masked_runs(tokenizer, sample) -> list[str]:
    """The decoded text of each maximal run of trained tokens."""
    runs, current = [], []
    for token, trained in zip(sample.input_ids + [None], sample.loss_mask + [0]):
        if trained:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    return runs


def trained_messages(conversation: Conversation, sample_id: str) -> list[dict]:
    assistants = [m for m in conversation.messages if m["role"] == "assistant"]
    if "#" in sample_id:
        return [assistants[int(sample_id.rsplit("#", 1)[1])]]
    return assistants


def expected_rejection(tokenizer_name: str, record: dict) -> str | None:
    """The reason a real-dataset row must be rejected, derived from the raw row."""
    if "turns" in record:
        return "no_assistant_turn"  # MT-Bench prompts
    parallel_calls = any(isinstance(m["content"], list) and sum(p["type"] == "tool_call" for p in m["content"]) > 1
                         for m in record.get("messages", []))
    if tokenizer_name == "llama-3.1" and parallel_calls:
        return "template_error"  # Llama-3.1: "This model only supports single tool-calls at once!"
    return None


def assert_sample_masks_assistant_replies(tokenizer_name, tokenizer, conversation, sample):
    reply = llama_reply if tokenizer_name == "llama-3.1" else qwen_reply
    assert masked_runs(tokenizer, sample) == [reply(m) for m in trained_messages(conversation, sample.sample_id)]
    header_ids = set(tokenizer.convert_tokens_to_ids(list(HEADER_TOKENS[tokenizer_name])))
    assert not header_ids & {t for t, m in zip(sample.input_ids, sample.loss_mask) if m}
    if tokenizer_name == "llama-3.1":
        assert sample.input_ids[0] == tokenizer.bos_token_id
        assert sample.input_ids.count(tokenizer.bos_token_id) == 1


@pytest.mark.parametrize("tokenizer_name", sorted(TOKENIZERS))
@pytest.mark.parametrize("dataset", sorted(DATASETS))
def test_every_real_row_masks_exactly_the_assistant_replies_or_gives_a_reason(tokenizer_name, dataset, request):
    tokenizer = request.getfixturevalue(FIXTURES[tokenizer_name])
    path = require_shared(DATASETS[dataset])
    chat = ChatTemplateTokenizer(tokenizer, max_length=1 << 16)
    records = list(iter_records(path))
    rows = list(prepare_rows(records, chat))

    assert len(rows) == len(records) == count_records(path)
    for source, row in zip(records, rows):
        assert row.source_index == source.index
        reason = expected_rejection(tokenizer_name, source.record)
        if reason is not None:
            assert not row.samples and [r.reason for r in row.rejections] == [reason]
            continue
        assert row.samples and not row.rejections
        conversation = normalize(source.record)
        turns = sum(m["role"] == "assistant" for m in conversation.messages)
        turn_ids = [s.sample_id.rsplit("#", 1)[1] for s in row.samples if "#" in s.sample_id]
        assert turn_ids in ([], [str(k) for k in range(turns)])
        for sample in row.samples:
            assert sample.source_index == source.index and len(sample.input_ids) == len(sample.loss_mask)
            assert_sample_masks_assistant_replies(tokenizer_name, tokenizer, conversation, sample)


def two_turn_reasoning_conversation(row_id: str | None = "chat") -> Conversation:
    return Conversation(id=row_id, tools=None, messages=[
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4.", "reasoning_content": "Adding two and two gives four."},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6.", "reasoning_content": "Three plus three is six."},
    ])


def test_qwen3_history_rewriting_gives_one_row_per_turn_that_keeps_its_reasoning(qwen3_tokenizer):
    conversation = two_turn_reasoning_conversation()
    result = ChatTemplateTokenizer(qwen3_tokenizer, max_length=4096).tokenize(conversation, 7)

    assert [s.sample_id for s in result.samples] == ["chat#0", "chat#1"] and result.dropped == []
    first, second = result.samples
    assert masked_runs(qwen3_tokenizer, first) == ["Adding two and two gives four.\n</think>\n\n4.<|im_end|>"]
    assert masked_runs(qwen3_tokenizer, second) == ["Three plus three is six.\n</think>\n\n6.<|im_end|>"]
    # Row 1 is what the model saw while serving turn 1: turn 0's reasoning dropped, its answer kept, untrained.
    second_text = qwen3_tokenizer.decode(second.input_ids)
    assert "Adding two and two" not in second_text and "<|im_start|>assistant\n4.<|im_end|>" in second_text
    assert all(s.source_index == 7 for s in result.samples)


def test_llama_keeps_a_non_rewriting_conversation_in_one_row(llama_tokenizer):
    result = ChatTemplateTokenizer(llama_tokenizer, max_length=4096).tokenize(two_turn_reasoning_conversation(), 0)

    assert [s.sample_id for s in result.samples] == ["chat"]
    assert masked_runs(llama_tokenizer, result.samples[0]) == ["4.<|eot_id|>", "6.<|eot_id|>"]


@pytest.mark.parametrize("tokenizer_name", sorted(TOKENIZERS))
def test_train_turns_last_trains_only_the_final_reply_in_one_row(tokenizer_name, request):
    tokenizer = request.getfixturevalue(FIXTURES[tokenizer_name])
    chat = ChatTemplateTokenizer(tokenizer, max_length=4096, train_turns="last")
    result = chat.tokenize(two_turn_reasoning_conversation(row_id=None), 3)

    (sample,) = result.samples
    assert sample.sample_id == "row-3"
    eot = "<|eot_id|>" if tokenizer_name == "llama-3.1" else "<|im_end|>"
    assert len(masked_runs(tokenizer, sample)) == 1 and masked_runs(tokenizer, sample)[0].endswith("6." + eot)
    assert "4." in tokenizer.decode(sample.input_ids)  # earlier turns stay as context


@pytest.mark.parametrize("mask_empty_think", [True, False])
def test_mask_empty_think_controls_the_empty_reasoning_scaffold(qwen3_tokenizer, mask_empty_think):
    conversation = Conversation(id=None, tools=None, messages=[{"role": "user", "content": "Hi"},
                                                               {"role": "assistant", "content": "Hello there"}])
    chat = ChatTemplateTokenizer(qwen3_tokenizer, max_length=4096, mask_empty_think=mask_empty_think)
    (sample,) = chat.tokenize(conversation, 0).samples

    assert qwen3_tokenizer.decode(sample.input_ids).endswith("<think>\n\n</think>\n\nHello there<|im_end|>\n")
    # Unmasked, the scaffold after the prompt's "<think>\n" is trained; its first token "\n\n" straddles
    # the prompt's last character and the reply's first, and a token overlapping the reply is trained.
    scaffold = "" if mask_empty_think else "\n\n</think>\n\n"
    assert masked_runs(qwen3_tokenizer, sample) == [scaffold + "Hello there<|im_end|>"]


def tool_call_conversation(*, parallel: bool = False) -> Conversation:
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                             "parameters": {"type": "object",
                                                            "properties": {"city": {"type": "string"}}}}}
    return Conversation(id="w", tools=[tool], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call, call] if parallel else [call]},
        {"role": "assistant", "content": "Let me check."},
    ])


def test_consecutive_assistant_messages_each_get_their_reply_masked(llama_tokenizer, qwen3_tokenizer):
    conversation = tool_call_conversation()
    (llama,) = ChatTemplateTokenizer(llama_tokenizer, max_length=4096).tokenize(conversation, 0).samples
    assert masked_runs(llama_tokenizer, llama) == [
        '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>', "Let me check.<|eot_id|>"]

    qwen = ChatTemplateTokenizer(qwen3_tokenizer, max_length=4096).tokenize(conversation, 0).samples
    runs = [run for sample in qwen for run in masked_runs(qwen3_tokenizer, sample)]
    assert runs == ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
                    "Let me check.<|im_end|>"]


def test_template_exception_becomes_a_template_error_row(llama_tokenizer):
    with pytest.raises(RowError) as raised:
        ChatTemplateTokenizer(llama_tokenizer, max_length=4096).tokenize(tool_call_conversation(parallel=True), 0)
    assert raised.value.reason == "template_error" and "single tool-calls" in raised.value.message


def test_truncation_keeps_the_start_and_cuts_the_mask_with_it(llama_tokenizer):
    conversation = two_turn_reasoning_conversation()
    full = ChatTemplateTokenizer(llama_tokenizer, max_length=4096).tokenize(conversation, 0).samples[0]
    trained = [t for t, m in enumerate(full.loss_mask) if m]
    cut = trained[-1]  # drops the final <|eot_id|>

    (sample,) = ChatTemplateTokenizer(llama_tokenizer, max_length=cut).tokenize(conversation, 0).samples
    assert sample.input_ids == full.input_ids[:cut] and sample.loss_mask == full.loss_mask[:cut]
    with pytest.raises(RowError) as raised:
        ChatTemplateTokenizer(llama_tokenizer, max_length=trained[0]).tokenize(conversation, 0)
    assert raised.value.reason == "no_trainable_tokens"


def test_truncated_per_turn_rows_are_reported_as_dropped(qwen3_tokenizer):
    conversation = two_turn_reasoning_conversation()
    rows = ChatTemplateTokenizer(qwen3_tokenizer, max_length=4096).tokenize(conversation, 0).samples
    first_trained_of_second = rows[1].loss_mask.index(1)

    result = ChatTemplateTokenizer(qwen3_tokenizer, max_length=first_trained_of_second).tokenize(conversation, 0)
    assert [s.sample_id for s in result.samples] == ["chat#0"]
    assert result.dropped == [("chat#1", "no_trainable_tokens")]


def test_pretokenized_rows_pass_through_truncated(llama_tokenizer):
    chat = ChatTemplateTokenizer(llama_tokenizer, max_length=4)
    (sample,) = chat.tokenize(Pretokenized(id=None, input_ids=[5, 6, 7, 8, 9], loss_mask=[0, 1, 1, 0, 1]), 2).samples
    assert (sample.sample_id, sample.input_ids, sample.loss_mask) == ("row-2", [5, 6, 7, 8], [0, 1, 1, 0])
    with pytest.raises(RowError) as raised:
        chat.tokenize(Pretokenized(id="p", input_ids=[5, 6, 7, 8, 9], loss_mask=[0, 0, 0, 0, 1]), 0)
    assert raised.value.reason == "no_trainable_tokens"


def test_chat_template_kwargs_reach_the_template(llama_tokenizer):
    conversation = two_turn_reasoning_conversation()
    chat = ChatTemplateTokenizer(llama_tokenizer, max_length=4096, chat_template_kwargs={"date_string": "01 Jan 2031"})
    assert "Today Date: 01 Jan 2031" in llama_tokenizer.decode(chat.tokenize(conversation, 0).samples[0].input_ids)


def test_chat_template_sha256_hashes_the_shipped_template(llama_tokenizer, qwen3_tokenizer):
    for name, tokenizer in (("llama-3.1", llama_tokenizer), ("qwen3", qwen3_tokenizer)):
        shipped = (TOKENIZERS[name] / "chat_template.jinja").read_bytes()
        assert chat_template_sha256(tokenizer) == hashlib.sha256(shipped).hexdigest()


def test_a_tokenizer_without_chat_template_is_a_user_error(llama_tokenizer):
    tokenizer = copy.copy(llama_tokenizer)  # a shallow copy: the shared fixture keeps its template
    tokenizer.chat_template = None
    chat = ChatTemplateTokenizer(tokenizer, max_length=16)
    with pytest.raises(SpecgenError, match="no chat template") as raised:
        chat.tokenize(two_turn_reasoning_conversation(), 0)
    assert not isinstance(raised.value, RowError)
    assert chat.tokenize(Pretokenized(id=None, input_ids=[1, 2], loss_mask=[0, 1]), 0).samples


@pytest.mark.parametrize("options", [{"max_length": 0}, {"max_length": 8, "train_turns": "first"}])
def test_bad_options_are_user_errors(llama_tokenizer, options):
    with pytest.raises(SpecgenError):
        ChatTemplateTokenizer(llama_tokenizer, **options)


# prepare_rows ----------------------------------------------------------------------------------------------

def write_jsonl(path, lines: list[str]):
    path.write_text("\n".join(lines) + "\n")
    return path


def mixed_rows_file(tmp_path):
    good = {"id": "ok", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]}
    parallel = {"id": "par", "messages": [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "w", "arguments": '{"city": "Paris"}'}},
            {"type": "function", "function": {"name": "w", "arguments": '{"city": "Rome"}'}}]}]}
    return write_jsonl(tmp_path / "mixed.jsonl", [
        json.dumps(good), "{not json", json.dumps([1, 2]),
        json.dumps({"question_id": 81, "turns": ["Write a poem."]}), json.dumps(parallel)])


def test_prepare_rows_yields_samples_or_one_rejection_per_row(tmp_path, llama_tokenizer):
    chat = ChatTemplateTokenizer(llama_tokenizer, max_length=4096)
    rows = list(prepare_rows(iter_records(mixed_rows_file(tmp_path)), chat))

    assert [r.source_index for r in rows] == [0, 1, 2, 3, 4]
    assert [s.sample_id for s in rows[0].samples] == ["ok"] and rows[0].rejections == []
    rejections = [r.rejections[0].to_json() for r in rows[1:]]
    assert [(r["source_index"], r["sample_id"], r["reason"]) for r in rejections] == [
        (1, None, "invalid_json"), (2, None, "not_an_object"), (3, "81", "no_assistant_turn"),
        (4, "par", "template_error")]
    assert all(not r.samples for r in rows[1:]) and all(r["message"] for r in rejections)
    assert json.loads(json.dumps(rejections))  # rejected.jsonl lines are plain JSON


def test_prepare_rows_fail_mode_names_the_row(tmp_path, llama_tokenizer):
    chat = ChatTemplateTokenizer(llama_tokenizer, max_length=4096)
    rows = prepare_rows(iter_records(mixed_rows_file(tmp_path)), chat, on_bad_row="fail")
    assert next(rows).samples
    with pytest.raises(SpecgenError, match="row 1 .*invalid_json") as raised:
        next(rows)
    assert not isinstance(raised.value, RowError)
    with pytest.raises(SpecgenError, match="on_bad_row"):
        next(prepare_rows([], chat, on_bad_row="ignore"))


def test_prepare_rows_logs_dropped_turns_without_failing(tmp_path, qwen3_tokenizer):
    conversation = two_turn_reasoning_conversation()
    record = {"id": "chat", "messages": conversation.messages}
    rows = ChatTemplateTokenizer(qwen3_tokenizer, max_length=4096).tokenize(conversation, 0).samples
    chat = ChatTemplateTokenizer(qwen3_tokenizer, max_length=rows[1].loss_mask.index(1))

    (row,) = prepare_rows(iter_records(write_jsonl(tmp_path / "c.jsonl", [json.dumps(record)])), chat,
                          on_bad_row="fail")
    assert [s.sample_id for s in row.samples] == ["chat#0"]
    assert [(r.sample_id, r.reason) for r in row.rejections] == [("chat#1", "no_trainable_tokens")]


@pytest.mark.parametrize("tokenizer_name", sorted(TOKENIZERS))
def test_an_assistant_message_opening_the_conversation_is_context_only(tokenizer_name, request):
    tokenizer = request.getfixturevalue(FIXTURES[tokenizer_name])
    greeting = {"role": "assistant", "content": "Hi! How can I help?"}
    conversation = Conversation(id="g", tools=None, messages=[greeting, {"role": "user", "content": "Hello"},
                                                              {"role": "assistant", "content": "Sure."}])
    chat = ChatTemplateTokenizer(tokenizer, max_length=4096)

    samples = chat.tokenize(conversation, 0).samples
    assert [run for s in samples for run in masked_runs(tokenizer, s)] == [
        (llama_reply if tokenizer_name == "llama-3.1" else qwen_reply)(conversation.messages[2])]
    assert all(s.sample_id in ("g", "g#1") for s in samples)
    assert "Hi! How can I help?" in tokenizer.decode(samples[-1].input_ids)
    with pytest.raises(RowError) as raised:
        chat.tokenize(Conversation(id=None, tools=None, messages=[greeting]), 0)
    assert raised.value.reason == "no_assistant_turn"
