"""Prompts for speculative decoding (specgen.evaluate, and the acceptance probe during training).

A prompts file holds MT-Bench style rows ({"turns": [...], "category"}) or conversations in any format
`specgen.data.formats` reads (their user turns are the prompts). Malformed rows are skipped with a warning.
"""

import logging
from collections.abc import Iterator
from dataclasses import dataclass

from specgen.data.formats import Conversation, normalize, record_id
from specgen.data.sources import iter_records
from specgen.errors import RowError

log = logging.getLogger("specgen.data")


@dataclass
class Prompt:
    id: str
    category: str
    system: str | None
    user_turns: list[str]

    def first_turn_messages(self) -> list[dict]:
        """The chat messages of the first turn: the system prompt (if any) and the first user turn."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        return [*system, {"role": "user", "content": self.user_turns[0]}]


def read_prompts(path: str, max_prompts: int | None = None) -> Iterator[Prompt]:
    """Prompts from MT-Bench style rows ({"turns": [...], "category"}) or from conversations (their user turns)."""
    count = 0
    for source in iter_records(path):
        if max_prompts is not None and count >= max_prompts:
            return
        record = source.record
        if record is None:
            log.warning("skipping row %d of %s: %s", source.index, path, source.error)
            continue
        prompt_id = record_id(record) or f"row-{source.index}"
        category = str(record.get("category", "all"))
        if "turns" in record:
            turns = record["turns"]
            if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
                log.warning("skipping row %d of %s: 'turns' must be a non-empty list of strings", source.index, path)
                continue
            yield Prompt(prompt_id, category, None, list(turns))
        else:
            try:
                conversation = normalize(record)
            except RowError as error:
                log.warning("skipping row %d of %s: %s", source.index, path, error.message)
                continue
            if not isinstance(conversation, Conversation):
                log.warning("skipping row %d of %s: pre-tokenized rows hold no prompt text", source.index, path)
                continue
            messages = conversation.messages
            system = messages[0]["content"] if messages[0]["role"] == "system" else None
            yield Prompt(prompt_id, category, system, [m["content"] for m in messages if m["role"] == "user"])
        count += 1


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The token ids of `messages` rendered by the chat template with the generation prompt (the assistant's turn
    opened). apply_chat_template(tokenize=True) returns a list or, in recent transformers, a BatchEncoding."""
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
