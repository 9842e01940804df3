"""Normalise one input row, whatever its dataset format, to OpenAI-style messages.

The format is detected per row from its keys, so a file may mix formats:

- pre-tokenized: `input_ids` + `loss_mask`, validated and passed through;
- ShareGPT: `conversations: [{"from", "value"}]`, with glaive/LLaMA-Factory `function_call` and
  `observation` turns, an optional `tools` (list or JSON string) and `system` field;
- OpenAI: `messages: [{"role", "content"}]`, content a string or a list of typed parts
  (`text` / `reasoning` / `tool_call`), optional `reasoning_content`, `tool_calls` and `tools`;
- Alpaca: `instruction` / `input` / `output`, optional `system`;
- prompt sets (`turns`, e.g. MT-Bench) are recognised only to be rejected: they have no assistant
  reply to train on.

The result uses one message shape for every format, the one chat templates expect: roles
system/user/assistant/tool, `content` a string, assistant `reasoning_content` and
`tool_calls: [{"type": "function", "function": {"name", "arguments": dict}}]` only when present
(some templates test `'tool_calls' in message`), tools in the OpenAI function schema.
Every problem raises `RowError` with a stable reason code.
"""

import json
from dataclasses import dataclass
from typing import Any

from specgen.errors import RowError

ROLES = ("system", "user", "assistant", "tool")

# ShareGPT speaker -> role. `function_call` turns become assistant messages carrying a tool call.
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "function_call": "assistant",
    "observation": "tool",
    "tool": "tool",
}

EXPECTED_KEYS = ("'conversations' (ShareGPT), 'messages' (OpenAI), 'instruction'+'output' (Alpaca) "
                 "or 'input_ids'+'loss_mask' (pre-tokenized)")


@dataclass
class Conversation:
    id: str | None
    messages: list[dict]
    tools: list[dict] | None


@dataclass
class Pretokenized:
    id: str | None
    input_ids: list[int]
    loss_mask: list[int]


def record_id(record: dict) -> str | None:
    """The row's own id (`id`, or MT-Bench's `question_id`) as a string, None when it has none."""
    value = record.get("id")
    if value is None:
        value = record.get("question_id")
    return None if value is None else str(value)


def normalize(record: dict) -> Conversation | Pretokenized:
    row_id = record_id(record)
    # Columnar sources (Parquet, datasets) give every row every column, None where a row lacks it.
    present = {key for key, value in record.items() if value is not None}
    if "input_ids" in present:
        return _pretokenized(record, row_id)
    if "conversations" in present:
        messages = _sharegpt_messages(record["conversations"])
    elif "messages" in present:
        messages = _openai_messages(record["messages"])
    elif "instruction" in present:
        messages = _alpaca_messages(record)
    elif "turns" in present:
        raise RowError("no_assistant_turn", "row has only prompts ('turns', e.g. MT-Bench) and no assistant "
                                            "reply; prompt sets are for evaluation, training needs conversations")
    else:
        raise RowError("unknown_format", f"row has keys {sorted(present)[:8]}; expected {EXPECTED_KEYS}")

    system = record.get("system")
    if system is not None:
        if not isinstance(system, str):
            raise RowError("bad_content", f"'system' must be a string, got {type(system).__name__}")
        if system and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": system})
    if not any(message["role"] == "assistant" for message in messages):
        raise RowError("no_assistant_turn", "conversation has no assistant turn to train on")
    return Conversation(id=row_id, messages=messages, tools=_tools(record.get("tools")))


def _pretokenized(record: dict, row_id: str | None) -> Pretokenized:
    input_ids, loss_mask = record["input_ids"], record.get("loss_mask")
    if loss_mask is None:
        raise RowError("missing_field", "pre-tokenized row has 'input_ids' but no 'loss_mask'")
    if not isinstance(input_ids, (list, tuple)) or not all(_is_int(t) for t in input_ids) or not input_ids:
        raise RowError("bad_content", "'input_ids' must be a non-empty list of integers")
    if not isinstance(loss_mask, (list, tuple)) or not all(m in (0, 1) for m in loss_mask):
        raise RowError("bad_content", "'loss_mask' must be a list of 0/1")
    if len(loss_mask) != len(input_ids):
        raise RowError("missing_field", f"'loss_mask' has {len(loss_mask)} entries for {len(input_ids)} "
                                        "'input_ids'; they must be the same length")
    return Pretokenized(id=row_id, input_ids=[int(t) for t in input_ids], loss_mask=[int(m) for m in loss_mask])


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _sharegpt_messages(turns: Any) -> list[dict]:
    if not isinstance(turns, list) or not turns:
        raise RowError("no_messages", "'conversations' must be a non-empty list of turns")
    messages = []
    pending_calls: list[str] = []  # names of tool calls awaiting their observation, in order
    for position, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise RowError("bad_content", f"turn {position} is {type(turn).__name__}, expected an object")
        speaker = turn.get("from")
        if speaker not in SHAREGPT_ROLES:
            raise RowError("unknown_role", f"turn {position} has from={speaker!r}; expected one of "
                                           f"{sorted(SHAREGPT_ROLES)}")
        value = turn.get("value")
        if not isinstance(value, str):
            raise RowError("bad_content", f"turn {position} ({speaker}) value must be a string, "
                                          f"got {type(value).__name__}")
        role = SHAREGPT_ROLES[speaker]
        if speaker == "function_call":
            call = _tool_call(value, f"turn {position}")
            pending_calls.append(call["function"]["name"])
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif role == "tool" and pending_calls:
            messages.append({"role": "tool", "content": value, "name": pending_calls.pop(0)})
        else:
            messages.append({"role": role, "content": value})
    return messages


def _openai_messages(raw: Any) -> list[dict]:
    if not isinstance(raw, list) or not raw:
        raise RowError("no_messages", "'messages' must be a non-empty list")
    return [_openai_message(message, position) for position, message in enumerate(raw)]


def _openai_message(raw: Any, position: int) -> dict:
    where = f"message {position}"
    if not isinstance(raw, dict):
        raise RowError("bad_content", f"{where} is {type(raw).__name__}, expected an object")
    role = raw.get("role")
    if role not in ROLES:
        raise RowError("unknown_role", f"{where} has role={role!r}; expected one of {list(ROLES)}")
    where = f"message {position} ({role})"

    content, reasoning, tool_calls = raw.get("content"), [], []
    if isinstance(content, list):
        content, reasoning, tool_calls = _typed_parts(content, where)
    elif content is None and role == "assistant":
        content = ""  # an assistant turn that only calls tools
    elif not isinstance(content, str):
        raise RowError("bad_content", f"{where} content must be a string or a list of typed parts, "
                                      f"got {type(content).__name__}")

    if raw.get("reasoning_content") is not None:
        if not isinstance(raw["reasoning_content"], str):
            raise RowError("bad_content", f"{where} reasoning_content must be a string")
        reasoning.insert(0, raw["reasoning_content"])
    if raw.get("tool_calls") is not None:
        if not isinstance(raw["tool_calls"], list):
            raise RowError("bad_content", f"{where} tool_calls must be a list")
        tool_calls = [_tool_call(call, where) for call in raw["tool_calls"]] + tool_calls
    if (reasoning or tool_calls) and role != "assistant":
        raise RowError("bad_content", f"{where} has reasoning or tool calls, which only assistant turns may have")

    message = {"role": role, "content": content}
    if reasoning:
        message["reasoning_content"] = "\n".join(reasoning)
    if tool_calls:
        message["tool_calls"] = tool_calls
    if role == "tool":
        message.update({key: raw[key] for key in ("name", "tool_call_id") if isinstance(raw.get(key), str)})
    return message


def _typed_parts(parts: list, where: str) -> tuple[str, list[str], list[dict]]:
    """Split a typed content list into (text, reasoning pieces, tool calls).

    Parts carry their payload under `text` (OpenAI) or `value` (LLaMA-Factory); text parts are
    joined with newlines, as serving engines do when they flatten content lists.
    """
    texts, reasoning, tool_calls = [], [], []
    for part in parts:
        if not isinstance(part, dict) or "type" not in part:
            raise RowError("bad_content", f"{where} content part {part!r:.60} is not a typed part {{'type', 'text'}}")
        payload = part["text"] if part.get("text") is not None else part.get("value")
        kind = part["type"]
        if kind == "tool_call":
            tool_calls.append(_tool_call(payload, where))
        elif kind in ("text", "reasoning") and isinstance(payload, str):
            (texts if kind == "text" else reasoning).append(payload)
        elif kind in ("text", "reasoning"):
            raise RowError("bad_content", f"{where} {kind} part has no string 'text' or 'value'")
        else:
            raise RowError("bad_content", f"{where} has a content part of type {kind!r}; supported: "
                                          "text, reasoning, tool_call")
    return "\n".join(texts), reasoning, tool_calls


def _tool_call(raw: Any, where: str) -> dict:
    """One tool call in the OpenAI shape, from a dict or a JSON string, wrapped or bare {name, arguments}."""
    if isinstance(raw, str):
        raw = _json_value(raw, f"{where} tool call")
    if isinstance(raw, dict) and isinstance(raw.get("function"), dict):
        raw = raw["function"]
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
        raise RowError("bad_content", f"{where} tool call must be an object with a string 'name'")
    arguments = raw.get("arguments", raw.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = _json_value(arguments, f"{where} tool call arguments")
    if not isinstance(arguments, dict):
        raise RowError("bad_content", f"{where} tool call arguments must be a JSON object")
    return {"type": "function", "function": {"name": raw["name"], "arguments": arguments}}


def _tools(raw: Any) -> list[dict] | None:
    """Tool definitions in the OpenAI schema; bare {name, description, parameters} entries get wrapped."""
    if isinstance(raw, str):
        raw = _json_value(raw, "'tools'")
    if not raw:
        return None
    if not isinstance(raw, list):
        raise RowError("bad_content", f"'tools' must be a list (or its JSON string), got {type(raw).__name__}")
    tools = []
    for tool in raw:
        if isinstance(tool, dict) and isinstance(tool.get("function"), dict):
            tools.append({"type": "function", "function": tool["function"]})
        elif isinstance(tool, dict) and isinstance(tool.get("name"), str):
            fields = ("name", "description", "parameters")
            tools.append({"type": "function", "function": {key: tool[key] for key in fields if key in tool}})
        else:
            raise RowError("bad_content", f"tool {tool!r:.60} is neither {{'type': 'function', 'function': ...}} "
                                          "nor {'name', 'description', 'parameters'}")
    return tools


def _alpaca_messages(record: dict) -> list[dict]:
    instruction, extra, output = record["instruction"], record.get("input") or "", record.get("output")
    if output is None:
        raise RowError("missing_field", "Alpaca row has 'instruction' but no 'output'")
    if not all(isinstance(value, str) for value in (instruction, extra, output)):
        raise RowError("bad_content", "Alpaca 'instruction', 'input' and 'output' must be strings")
    prompt = f"{instruction}\n\n{extra}" if extra else instruction
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": output}]


def _json_value(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise RowError("bad_content", f"{what} is not valid JSON ({error.msg}): {text!r:.80}") from None
