"""Chat template + loss mask, using the tokenizer's own chat template.

No per-model table of header strings: the reply of assistant message i is found by rendering

    history = render(messages[:i])
    prompt  = render(messages[:i], add_generation_prompt=True)  # what a server sends the model
    turn    = render(messages[:i + 1])                           # the conversation up to the reply

Normally `turn` extends `prompt` and the reply is `turn[len(prompt):]` (from where they diverge, for
templates whose generation prompt differs from a finished turn's header), minus the whitespace the
template puts after the end-of-turn token. It holds exactly what the model generates: content, the
reasoning the template renders, tool calls and the end-of-turn token (`<|eot_id|>`, `<|im_end|>`),
never role headers. The text is tokenized once with character offsets, and a token is trained when
its characters overlap a reply.

Some templates rewrite history: Qwen3 drops the reasoning of assistant turns before the last user
query, so the rendering that ends at turn k is not a prefix of the whole conversation's rendering.
Training turn k on the full rendering would then teach the model a context it never sees while
serving. Such conversations are expanded into one row per assistant turn: row k is the rendering
that ends at turn k, with only turn k trained.
"""

import hashlib
import json
import re
from dataclasses import dataclass
from typing import NamedTuple

from jinja2.exceptions import TemplateError

from specgen.data.formats import Conversation, Pretokenized
from specgen.data.sample import TokenizedSample
from specgen.errors import RowError, SpecgenError

# The scaffold a thinking template writes around an empty reasoning block: nothing to learn there.
EMPTY_THINK = re.compile(r"<think>\s*</think>\s*")
TRAIN_TURNS = ("all", "last")

# Why a per-turn row was dropped, for the rejection log.
DROP_MESSAGES = {
    "no_trainable_tokens": "the trained turn starts beyond max_length tokens; raise data.max_length "
                           "to keep it",
}


@dataclass
class TokenizeResult:
    samples: list[TokenizedSample]
    dropped: list[tuple[str, str]]  # (sample_id, reason) of per-turn rows left out


class _Turn(NamedTuple):
    text: str  # the rendering that ends with this assistant turn
    span: tuple[int, int]  # characters of `text` the model generated in this turn


def chat_template_sha256(tokenizer) -> str:
    """sha256 of the chat template text the tokenizer renders with (of "" when it has none)."""
    template = tokenizer.chat_template
    if isinstance(template, dict):  # several named templates
        template = json.dumps(template, sort_keys=True)
    return hashlib.sha256((template or "").encode()).hexdigest()


class ChatTemplateTokenizer:
    """Turns normalised rows into `TokenizedSample`s with a loss mask over the assistant's tokens.

    max_length: keep the first `max_length` tokens of each row.
    train_turns: "all" trains every assistant turn, "last" only the final one.
    mask_empty_think: leave an empty `<think></think>` scaffold untrained.
    chat_template_kwargs: extra template variables (e.g. `enable_thinking`, `date_string`).
    """

    def __init__(self, tokenizer, *, max_length: int, train_turns: str = "all", mask_empty_think: bool = True,
                 chat_template_kwargs: dict | None = None):
        if max_length < 1:
            raise SpecgenError(f"data.max_length must be a positive number of tokens, got {max_length}")
        if train_turns not in TRAIN_TURNS:
            raise SpecgenError(f"data.train_turns must be one of {list(TRAIN_TURNS)}, got {train_turns!r}")
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.train_turns = train_turns
        self.mask_empty_think = mask_empty_think
        self.chat_template_kwargs = dict(chat_template_kwargs or {})

    @classmethod
    def from_settings(cls, tokenizer, data) -> "ChatTemplateTokenizer":
        """The one way a stage builds it: from its data settings (`schema.settings(cfg, "data")` or any object with
        max_length, train_turns, mask_empty_think and chat_template_kwargs as plain values)."""
        return cls(tokenizer, max_length=data.max_length, train_turns=data.train_turns,
                   mask_empty_think=data.mask_empty_think, chat_template_kwargs=data.chat_template_kwargs)

    def tokenize(self, item: Conversation | Pretokenized, source_index: int) -> TokenizeResult:
        sample_id = item.id if item.id is not None else f"row-{source_index}"
        if isinstance(item, Pretokenized):
            rows = [(sample_id, item.input_ids[: self.max_length], item.loss_mask[: self.max_length])]
        else:
            rows = [(row_id, *self._encode(text, spans)) for row_id, text, spans in self._rows(item, sample_id)]

        samples, dropped = [], []
        for row_id, input_ids, loss_mask in rows:
            if any(loss_mask):
                samples.append(TokenizedSample(row_id, source_index, input_ids, loss_mask))
            else:
                dropped.append((row_id, "no_trainable_tokens"))
        if not samples:
            raise RowError("no_trainable_tokens", f"no assistant token lies within the first {self.max_length} "
                                                  "tokens; raise data.max_length or drop the row")
        return TokenizeResult(samples, dropped)

    def _rows(self, conversation: Conversation, sample_id: str) -> list[tuple[str, str, list[tuple[int, int]]]]:
        """(row id, text, trained character spans) for each row this conversation becomes.

        Per-turn row ids end in `#k`, k the turn's 0-based ordinal among the assistant messages.
        """
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise SpecgenError("the tokenizer has no chat template; use a tokenizer (model.path) that ships one, "
                               "or give pre-tokenized rows (input_ids + loss_mask)")
        # An assistant message that opens the conversation answers no prompt: it is context, not trained.
        assistant_positions = [i for i, m in enumerate(conversation.messages) if m["role"] == "assistant"]
        turns = {k: self._render_turn(conversation, i) for k, i in enumerate(assistant_positions) if i > 0}
        if not turns:
            raise RowError("no_assistant_turn", "the only assistant message opens the conversation, so there is "
                                                "no prompt it answers")
        last = turns[max(turns)]
        full_text = last.text
        if self.train_turns == "last":
            return [(sample_id, full_text, [last.span])]
        if all(full_text.startswith(turn.text) for turn in turns.values()):
            return [(sample_id, full_text, [turn.span for turn in turns.values()])]
        return [(f"{sample_id}#{k}", turn.text, [turn.span]) for k, turn in turns.items()]

    def _render_turn(self, conversation: Conversation, position: int) -> _Turn:
        history = self._render(conversation, conversation.messages[:position], add_generation_prompt=False)
        prompt = self._render(conversation, conversation.messages[:position], add_generation_prompt=True)
        text = self._render(conversation, conversation.messages[: position + 1], add_generation_prompt=False)
        generation_prompt = prompt[len(history):]
        if not prompt.startswith(history) or not generation_prompt:
            raise RowError("template_error", f"the chat template's generation prompt before message {position} "
                                             "does not extend the conversation, so the assistant header cannot "
                                             "be told from the reply")
        if text.startswith(history):
            # The reply starts where the finished turn stops matching the generation prompt: usually right
            # after it, earlier for templates whose generation prompt differs (e.g. an empty think block).
            start = len(history) + _common_prefix_length(generation_prompt, text[len(history):])
        else:
            # Adding the turn changed how earlier turns render (Qwen3 drops the empty think scaffold of an
            # assistant turn that is no longer last): the turn begins at the generation prompt, after the
            # point where the two renderings diverge.
            found = text.find(generation_prompt, _common_prefix_length(history, text))
            if found < 0:
                raise RowError("template_error", f"cannot locate assistant message {position} in the rendering: "
                                                 "the template rewrites earlier turns and renders the finished "
                                                 "turn differently from its generation prompt")
            start = found + len(generation_prompt)
        return _Turn(text, (start, len(text.rstrip())))

    def _render(self, conversation: Conversation, messages: list[dict], add_generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tools=conversation.tools, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt,
                                                      **self.chat_template_kwargs)
        except TemplateError as error:
            raise RowError("template_error", f"the chat template rejected the conversation: {error}") from None

    def _encode(self, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
        # The rendered text already holds BOS where the template wants it: add no special tokens.
        encoding = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True,
                                  truncation=True, max_length=self.max_length)
        if self.mask_empty_think:
            spans = _subtract(spans, [match.span() for match in EMPTY_THINK.finditer(text)])
        return encoding["input_ids"], _overlap_mask(encoding["offset_mapping"], spans)


def _common_prefix_length(a: str, b: str) -> int:
    """Length of the longest common prefix, by binary search over C-speed slice comparisons."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


def _subtract(spans: list[tuple[int, int]], holes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of sorted `spans` outside every hole."""
    for hole_start, hole_end in holes:
        pieces = []
        for start, end in spans:
            pieces += [(start, min(end, hole_start)), (max(start, hole_end), end)]
        spans = [(start, end) for start, end in pieces if start < end]
    return spans


def _overlap_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token whose characters overlap one of the sorted, disjoint `spans`."""
    mask, next_span = [], 0
    for start, end in offsets:
        while next_span < len(spans) and spans[next_span][1] <= start:
            next_span += 1
        inside = next_span < len(spans) and spans[next_span][0] < end and start < end
        mask.append(int(inside))
    return mask
