"""Per-row format detection and normalisation to OpenAI-style messages, and every rejection reason."""

import json

import pytest

from conftest import DATASETS, require_shared
from specgen.data import Conversation, Pretokenized, iter_records, normalize
from specgen.errors import RowError

WEATHER_TOOL = {"name": "get_weather", "description": "Weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def test_sharegpt_with_function_calls_observations_tools_and_system():
    record = {
        "id": 17, "system": "Be brief.", "tools": json.dumps([WEATHER_TOOL]),
        "conversations": [
            {"from": "human", "value": "Weather in Paris?"},
            {"from": "function_call", "value": '{"name": "get_weather", "arguments": {"city": "Paris"}}'},
            {"from": "observation", "value": '{"temp": 21}'},
            {"from": "gpt", "value": "21 degrees."},
        ],
    }
    conversation = normalize(record)

    assert conversation == Conversation(id="17", tools=[{"type": "function", "function": WEATHER_TOOL}], messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": '{"temp": 21}', "name": "get_weather"},
        {"role": "assistant", "content": "21 degrees."},
    ])


def test_sharegpt_role_aliases_and_an_explicit_system_turn():
    record = {"conversations": [{"from": "system", "value": "S"}, {"from": "user", "value": "U"},
                                {"from": "assistant", "value": "A"}], "system": "ignored: the row has one"}
    assert [(m["role"], m["content"]) for m in normalize(record).messages] == [
        ("system", "S"), ("user", "U"), ("assistant", "A")]


def test_openai_typed_parts_become_content_reasoning_and_tool_calls():
    record = {"messages": [
        {"role": "system", "content": [{"type": "text", "value": "Use tools."}]},
        {"role": "user", "content": [{"type": "text", "text": "Area of circles r=1 and r=2?"}]},
        {"role": "assistant", "content": [
            {"type": "reasoning", "value": "Two calls."},
            {"type": "tool_call", "value": '{"name": "circle_area", "arguments": {"radius": 1}}'},
            {"type": "tool_call", "value": {"name": "circle_area", "arguments": '{"radius": 2}'}}]},
        {"role": "tool", "content": [{"type": "text", "value": "3.14"}]},
        {"role": "assistant", "content": [{"type": "text", "value": "First "}, {"type": "text", "value": "3.14"}]},
    ], "tools": [{"type": "function", "function": {"name": "circle_area"}}]}
    conversation = normalize(record)

    calls = [{"type": "function", "function": {"name": "circle_area", "arguments": {"radius": r}}} for r in (1, 2)]
    assert conversation.messages[2] == {"role": "assistant", "content": "", "reasoning_content": "Two calls.",
                                        "tool_calls": calls}
    assert conversation.messages[3] == {"role": "tool", "content": "3.14"}
    assert conversation.messages[4] == {"role": "assistant", "content": "First \n3.14"}
    assert conversation.tools == [{"type": "function", "function": {"name": "circle_area"}}]
    assert conversation.id is None


def test_openai_string_content_tool_calls_reasoning_content_and_tool_ids():
    record = {"id": "x", "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "reasoning_content": "Call it.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1", "name": "get_weather"},
        {"role": "assistant", "content": "Sunny."},
    ]}
    messages = normalize(record).messages

    assert messages[1] == {"role": "assistant", "content": "", "reasoning_content": "Call it.", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]}
    assert messages[2] == {"role": "tool", "content": "sunny", "name": "get_weather", "tool_call_id": "c1"}
    assert "tool_calls" not in messages[3] and "reasoning_content" not in messages[3]


def test_alpaca_joins_instruction_and_input():
    record = {"instruction": "Translate.", "input": "Bonjour", "output": "Hello", "system": "You translate."}
    assert normalize(record).messages == [{"role": "system", "content": "You translate."},
                                          {"role": "user", "content": "Translate.\n\nBonjour"},
                                          {"role": "assistant", "content": "Hello"}]
    assert normalize({"instruction": "Hi", "input": "", "output": "Hey"}).messages[0] == {"role": "user",
                                                                                           "content": "Hi"}


def test_columns_that_are_null_do_not_decide_the_format():
    """A Parquet file mixing formats gives each row every column, None where the row lacks it."""
    record = {"id": None, "conversations": None, "instruction": None, "input_ids": None,
              "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hey"}]}
    assert normalize(record) == Conversation(id=None, tools=None, messages=record["messages"])


def test_pretokenized_rows_and_ids():
    assert normalize({"question_id": 5, "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}) == Pretokenized(
        id="5", input_ids=[1, 2, 3], loss_mask=[0, 1, 1])


def sharegpt(*turns, **extra) -> dict:
    return {"conversations": [{"from": who, "value": value} for who, value in turns], **extra}


@pytest.mark.parametrize("record, reason, phrase", [
    ({"text": "plain"}, "unknown_format", "conversations"),
    ({"conversations": []}, "no_messages", "non-empty"),
    ({"messages": "hello"}, "no_messages", "non-empty list"),
    (sharegpt(("human", "Hi"), ("bot", "Hey")), "unknown_role", "'bot'"),
    ({"messages": [{"role": "narrator", "content": "x"}]}, "unknown_role", "'narrator'"),
    ({"messages": [{"role": "user", "content": 42}]}, "bad_content", "int"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "bad_content",
     "'image_url'"),
    ({"messages": [{"role": "user", "content": [{"type": "reasoning", "value": "x"}]}]}, "bad_content",
     "only assistant"),
    (sharegpt(("human", "Hi"), ("function_call", "get_weather(Paris)")), "bad_content", "not valid JSON"),
    (sharegpt(("human", "Hi"), ("function_call", '{"name": "f", "arguments": [1]}')), "bad_content",
     "arguments must be a JSON object"),
    (sharegpt(("human", "Hi"), ("gpt", None)), "bad_content", "string"),
    (sharegpt(("human", "Hi"), ("gpt", "Hey"), tools='{"name": "f"}'), "bad_content", "'tools' must be a list"),
    (sharegpt(("human", "Hi"), ("gpt", "Hey"), tools=[{"description": "no name"}]), "bad_content", "tool"),
    (sharegpt(("system", "S"), ("human", "Hi")), "no_assistant_turn", "no assistant"),
    ({"question_id": 81, "category": "writing", "turns": ["Write.", "Rewrite."]}, "no_assistant_turn", "prompts"),
    ({"instruction": "Do it."}, "missing_field", "'output'"),
    ({"input_ids": [1, 2]}, "missing_field", "'loss_mask'"),
    ({"input_ids": [1, 2], "loss_mask": [1]}, "missing_field", "same length"),
    ({"input_ids": [1, 2], "loss_mask": [1, 2]}, "bad_content", "0/1"),
    ({"input_ids": ["a", 2], "loss_mask": [1, 1]}, "bad_content", "integers"),
])
def test_each_malformed_row_has_its_reason(record, reason, phrase):
    with pytest.raises(RowError) as raised:
        normalize(record)
    assert raised.value.reason == reason and phrase in raised.value.message


@pytest.mark.parametrize("dataset", sorted(DATASETS))
def test_real_rows_normalise_without_losing_turns_or_tool_calls(dataset):
    for source in iter_records(require_shared(DATASETS[dataset])):
        record = source.record
        if "turns" in record:
            with pytest.raises(RowError, match="prompts"):
                normalize(record)
            continue
        conversation = normalize(record)
        messages = conversation.messages
        calls = sum(len(m.get("tool_calls", [])) for m in messages)
        assert all(isinstance(m["content"], str) for m in messages)
        assert all(set(m) <= {"role", "content", "reasoning_content", "tool_calls", "name", "tool_call_id"}
                   for m in messages)
        if "conversations" in record:
            assert len(messages) == len(record["conversations"])
            assert calls == sum(turn["from"] == "function_call" for turn in record["conversations"])
        elif "messages" in record:
            assert len(messages) == len(record["messages"])
            assert calls == sum(part["type"] == "tool_call" for m in record["messages"] for part in m["content"])
            assert sum("reasoning_content" in m for m in messages) == sum(
                part["type"] == "reasoning" for m in record["messages"] for part in m["content"])
        else:
            assert [m["content"] for m in messages][-1] == record["output"]
        assert all(tool["type"] == "function" and "name" in tool["function"] for tool in conversation.tools or [])
