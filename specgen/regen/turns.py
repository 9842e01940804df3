"""Conversations -> the same conversations with their assistant turns written by the target.

Turn k of a conversation is generated from the conversation so far, rendered with the chat template and its
generation prompt, where turns before k are already the target's own: the context is on-policy, as when serving.
Every conversation's next turn is submitted to the generator as soon as its previous one comes back: a continuously
batching engine (vLLM) keeps decoding the others meanwhile, and the transformers `Generator`, which completes all
it was given at once, goes depth by depth (every conversation's first regenerated turn, then every second one, ...).
Each request carries a seed derived from the part's seed and its source row, message and draw, so an engine that
seeds each request samples a turn the same way whatever the order in which the turns come back.

Which turns: every assistant turn (`turns=all`) or only the final one (`turns=last`). Assistant turns that call
tools are kept verbatim: the tool turns that follow hold the results of exactly those calls, so a different call
would leave the conversation incoherent.

With `user_turns=synthesize` the target writes the user turns too: each user turn is sampled from the conversation so
far rendered up to the template's user-turn header (the text the template puts before a user message's content),
then the assistant answers it as above. The source rows only give the conversations' shape (system prompt, number of
turns), so any prompt corpus, or none worth the name, serves. It needs sampling (a greedy target would write the
same first question in every row), every assistant turn regenerated, and rows without tool calls (their kept calls
would answer questions that were replaced); other rows are rejected (`tool_calls`).

Nothing is lost silently. A generation that reaches max_new_tokens is *truncated*, one whose answer (content,
reasoning aside) is blank is *empty*, one that *loops* repeats itself: some run of `loop_ngram` consecutive
tokens occurs more than `loop_repeats` times in the turn (greedy decoding of a small model falls into such
cycles; `loop_repeats=0` switches the check off). All three are counted and the row is kept or dropped by policy;
a looping or empty turn may instead be *resampled*: drawn again (up to `resample_tries` times, each draw counted)
before its row is dropped, so a prompt that sometimes makes the target loop still gives data. A row whose
prompt for a turn is longer than `max_prompt_tokens` has no room for that turn in training (generate truncates at
the same length), so it is cut before that turn and counted, or rejected when no turn was regenerated yet.
Rows that leave the output become `Rejection`s (row index, id, reason) for `rejected.jsonl`.
"""

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

from jinja2.exceptions import TemplateError

from specgen.data.formats import Conversation, Pretokenized, normalize, record_id
from specgen.data.prepare import ON_BAD_ROW, Rejection
from specgen.data.sources import SourceRecord
from specgen.errors import RowError, SpecgenError
from specgen.regen.engine import Completion, Generator, LoopWatch, derived_seed
from specgen.regen.reply import assistant_reply, renders_reasoning

TURNS = ("all", "last")
POLICIES = ("keep", "drop")
RESAMPLE_POLICIES = (*POLICIES, "resample")  # for the faults a new draw can mend: loop, empty
USER_TURNS = ("keep", "synthesize")
# Stands in for a user turn's content to find where the template's user-turn header ends.
_USER_SENTINEL = "\u2063specgen-user-turn\u2063"
# Reasons a row is dropped by policy rather than rejected as bad input; the manifest counts them apart.
POLICY_REASONS = ("truncated", "empty", "loop")
# The per-unit counts, summed over units into the manifest.
COUNTS = ("source_rows", "rows", "regenerated_turns", "new_tokens", "truncated_turns", "empty_turns", "loop_turns",
          "resampled_turns", "loop_stopped_turns", "cut_rows", "kept_tool_call_turns", "synthesized_user_turns")


class _Prompt(NamedTuple):
    text: str
    ids: list[int]


@dataclass(frozen=True)
class TurnPolicy:
    turns: str = "all"          # all | last: which assistant turns are regenerated
    on_truncated: str = "keep"  # keep | drop a row with a turn that reached max_new_tokens
    on_empty: str = "drop"      # keep | drop | resample a row with a turn whose answer is blank
    on_loop: str = "drop"       # keep | drop | resample a row with a turn that loops (see `loops`)
    resample_tries: int = 2     # draws after the first for a turn that loops or is empty under `resample`
    loop_ngram: int = 8         # a turn loops when a run of this many tokens ...
    loop_repeats: int = 3       # ... occurs more than this many times in it (0: never)
    user_turns: str = "keep"    # keep | synthesize: the target writes the user turns too (module doc)

    def __post_init__(self) -> None:
        for key, value, allowed in (("turns", self.turns, TURNS), ("on_truncated", self.on_truncated, POLICIES),
                                    ("on_empty", self.on_empty, RESAMPLE_POLICIES),
                                    ("on_loop", self.on_loop, RESAMPLE_POLICIES),
                                    ("user_turns", self.user_turns, USER_TURNS)):
            if value not in allowed:
                raise SpecgenError(f"regenerate.{key} must be one of {list(allowed)}, got {value!r}")
        if self.user_turns == "synthesize" and self.turns != "all":
            raise SpecgenError("regenerate.user_turns=synthesize needs regenerate.turns=all: a kept reply would "
                               "answer a question the target replaced")
        if self.resample_tries < 1:
            raise SpecgenError(f"regenerate.resample_tries must be >= 1, got {self.resample_tries}")
        if self.loop_ngram < 1 or self.loop_repeats < 0:
            raise SpecgenError(f"regenerate.loop_ngram must be >= 1 and regenerate.loop_repeats >= 0, got "
                               f"{self.loop_ngram} and {self.loop_repeats}")

    def loops(self, tokens: list[int]) -> bool:
        """True when some run of `loop_ngram` consecutive tokens occurs more than `loop_repeats` times in `tokens`
        (`LoopWatch`)."""
        return LoopWatch(self.loop_ngram, self.loop_repeats).extend(tokens)

    def watch(self) -> LoopWatch | None:
        """A fresh loop check for a generator to stop a turn as soon as it loops; None where a looping turn is kept
        (`on_loop=keep`) or never loops (`loop_repeats=0`), so every turn runs to its end."""
        return LoopWatch(self.loop_ngram, self.loop_repeats) if self.on_loop != "keep" and self.loop_repeats else None


@dataclass
class _Row:
    """One conversation in flight; `conversation.messages` is updated in place as its turns are regenerated."""

    source_index: int
    row_id: str
    conversation: Conversation
    targets: list[int]  # message positions of the assistant turns to regenerate, in order
    done: int = 0       # how many of `targets` are regenerated
    redraws: int = 0    # how many times the current target was drawn again (regenerate.on_loop/on_empty=resample)
    rejection: Rejection | None = None  # set when the row leaves the output

    @property
    def waiting(self) -> bool:
        return self.rejection is None and self.done < len(self.targets)

    def leave(self, reason: str, message: str) -> None:
        if self.rejection is None:
            self.rejection = Rejection(self.source_index, self.row_id, reason, message)

    def output(self) -> dict:
        row = {"id": self.row_id, "messages": self.conversation.messages}
        if self.conversation.tools:
            row["tools"] = self.conversation.tools
        return row


@dataclass
class UnitResult:
    """What one work unit of source rows became: output rows, rows left out, and counts for the sidecar."""

    rows: list[dict]
    rejections: list[Rejection]
    stats: dict


class ConversationRegenerator:
    """Regenerate the assistant turns of source rows with `generator`, rendering with `tokenizer`'s chat template.

    max_prompt_tokens: longest prompt a turn may be generated from (data.max_length, less where the model's positions
        leave less room beside max_new_tokens); prompt_limit: what sets it, for the messages.
    chat_template_kwargs: extra template variables, e.g. {"enable_thinking": False}.
    on_bad_row: "skip" logs a malformed row as a rejection; "fail" raises `SpecgenError` at the first one.
    """

    def __init__(self, tokenizer, generator: Generator, policy: TurnPolicy, *, max_prompt_tokens: int,
                 chat_template_kwargs: dict | None = None, on_bad_row: str = "skip", prompt_limit: str | None = None):
        if max_prompt_tokens < 1:
            raise SpecgenError(f"data.max_length must be a positive number of tokens, got {max_prompt_tokens}")
        if on_bad_row not in ON_BAD_ROW:
            raise SpecgenError(f"data.on_bad_row must be one of {list(ON_BAD_ROW)}, got {on_bad_row!r}")
        self.tokenizer = tokenizer
        self.generator = generator
        self.policy = policy
        self.max_prompt_tokens = max_prompt_tokens
        self.prompt_limit = prompt_limit or f"data.max_length={max_prompt_tokens}"
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.on_bad_row = on_bad_row
        self.split_reasoning = renders_reasoning(tokenizer)
        if generator.sampling.greedy and "resample" in (policy.on_loop, policy.on_empty):
            key = "on_loop" if policy.on_loop == "resample" else "on_empty"
            raise SpecgenError(f"regenerate.{key}=resample needs sampling (regenerate.temperature > 0): greedy "
                               "decoding draws the same turn again")
        if policy.user_turns == "synthesize" and generator.sampling.greedy:
            raise SpecgenError("regenerate.user_turns=synthesize needs sampling (regenerate.temperature > 0): greedy "
                               "decoding writes the same first user turn in every row")

    def regenerate(self, records: Iterable[SourceRecord], on_batch: Callable[[int], None] | None = None, *,
                   on_rows: Callable[[int], None] | None = None, chunk_rows: int | None = None,
                   seed: int = 0) -> UnitResult:
        """Regenerate a group of source rows (one work unit); output rows keep the source order.

        chunk_rows: regenerate every turn of `chunk_rows` rows before starting the next ones (None: all at once), and
        call `on_rows(n)` as each chunk's n rows finish, so progress is reported per row, not per unit.
        seed: the unit's seed, from which each request's seed is derived (`derived_seed`).
        """
        stats = Counter()
        rows: list[_Row] = []
        rejections: list[Rejection] = []
        for source in records:
            stats["source_rows"] += 1
            try:
                rows.append(self._plan(source))
            except RowError as error:
                rejections.append(self._rejection(source.index, _source_id(source), error))

        chunk = chunk_rows or max(len(rows), 1)
        for start in range(0, len(rows), chunk):
            group = rows[start:start + chunk]
            self._run(group, stats, seed, on_batch)
            if on_rows is not None:
                on_rows(len(group))

        kept = [row for row in rows if row.rejection is None]
        rejections += [row.rejection for row in rows if row.rejection is not None]
        rejections.sort(key=lambda rejection: rejection.source_index)
        stats["rows"] = len(kept)
        stats["kept_tool_call_turns"] = sum(_tool_call_turns(row.conversation) for row in kept)
        unit_stats = {key: stats[key] for key in COUNTS}
        unit_stats["dropped"] = dict(Counter(r.reason for r in rejections if r.reason in POLICY_REASONS))
        unit_stats["rejected"] = dict(Counter(r.reason for r in rejections if r.reason not in POLICY_REASONS))
        return UnitResult([row.output() for row in kept], rejections, unit_stats)

    def _run(self, rows: list[_Row], stats: Counter, seed: int, on_batch: Callable[[int], None] | None) -> None:
        """Regenerate every turn of `rows`, submitting a row's next turn as soon as its previous one comes back."""
        in_flight: dict[int, tuple[_Row, _Prompt]] = {}
        while True:
            for key, row in enumerate(rows):
                if key not in in_flight and row.waiting and (prompt := self._prompt(row, stats)) is not None:
                    in_flight[key] = row, prompt
                    position = row.targets[row.done]
                    self.generator.submit(key, prompt.ids, derived_seed(seed, row.source_index, position, row.redraws),
                                          self.policy.watch())
            if not in_flight:
                return
            for key, completion in self.generator.collect(on_batch):
                row, prompt = in_flight.pop(key)
                self._accept(row, prompt.text, completion, stats)

    def _plan(self, source: SourceRecord) -> _Row:
        if source.error is not None:
            raise source.error
        item = normalize(source.record)
        if isinstance(item, Pretokenized):
            raise RowError("pretokenized", "pre-tokenized rows (input_ids + loss_mask) have no conversation to "
                                           "regenerate; give conversations, or pass this row to generate directly")
        assistant = [i for i, message in enumerate(item.messages) if message["role"] == "assistant"]
        candidates = assistant[-1:] if self.policy.turns == "last" else assistant
        targets = [i for i in candidates if not item.messages[i].get("tool_calls")]
        if not targets:
            raise RowError("no_regenerable_turn", "every assistant turn to regenerate calls tools; those are kept "
                                                  "verbatim (the tool turns answer exactly those calls), so this "
                                                  "row has nothing to regenerate")
        if self.policy.user_turns == "synthesize":
            if len(targets) < len(assistant):
                raise RowError("tool_calls", "regenerate.user_turns=synthesize: the row's assistant turns call "
                                             "tools, and a kept call would answer a question the target replaced")
            targets = sorted(targets + [i for i, message in enumerate(item.messages[:targets[-1]])
                                        if message["role"] == "user"])
        row_id = item.id if item.id is not None else f"row-{source.index}"
        return _Row(source.index, row_id, item, targets)

    def _prompt(self, row: _Row, stats: Counter) -> _Prompt | None:
        """(text, token ids) of the prompt for the row's next turn; None when the row stops here."""
        position = row.targets[row.done]
        history = row.conversation.messages[:position]
        user = row.conversation.messages[position]["role"] == "user"
        try:
            if user:
                text = self._user_header(history, row.conversation.tools)
            else:
                text = self.tokenizer.apply_chat_template(history, tools=row.conversation.tools, tokenize=False,
                                                          add_generation_prompt=True, **self.chat_template_kwargs)
        except TemplateError as error:
            self._reject_row(row, RowError("template_error", f"the chat template rejected the conversation: "
                                                             f"{error}"))
            return None
        # The rendered text already holds BOS where the template wants it: add no special tokens.
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) <= self.max_prompt_tokens:
            return _Prompt(text, ids)
        if row.done:
            # Regenerated turns before this one are usable: end the conversation before the turn with no room.
            row.conversation.messages = history
            row.targets = row.targets[: row.done]
            stats["cut_rows"] += 1
        else:
            self._reject_row(row, RowError("prompt_too_long", f"the prompt for the first turn to regenerate has "
                                                              f"{len(ids)} tokens, more than the "
                                                              f"{self.max_prompt_tokens} allowed ({self.prompt_limit})"))
        return None

    def _user_header(self, history: list[dict], tools) -> str:
        """The conversation so far rendered up to where the template puts the next user message's content."""
        text = self.tokenizer.apply_chat_template(history + [{"role": "user", "content": _USER_SENTINEL}],
                                                  tools=tools, tokenize=False, add_generation_prompt=False,
                                                  **self.chat_template_kwargs)
        if _USER_SENTINEL not in text:
            raise TemplateError("it does not render a user message's content verbatim, so no user-turn header can "
                                "be cut from it (regenerate.user_turns=synthesize)")
        return text[:text.index(_USER_SENTINEL)]

    def _accept(self, row: _Row, prompt: str, completion: Completion, stats: Counter) -> None:
        text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False)
        position = row.targets[row.done]
        role = row.conversation.messages[position]["role"]
        if role == "user":
            message = {"role": "user", "content": text.strip()}
        else:
            message = assistant_reply(text, prompt=prompt, split_reasoning=self.split_reasoning)
        stats["new_tokens"] += completion.num_generated
        loops, empty = completion.looped or self.policy.loops(completion.token_ids), not message["content"].strip()
        stats["loop_turns"] += loops
        stats["loop_stopped_turns"] += completion.looped
        stats["empty_turns"] += empty
        if self._redraw(row, loops, empty):
            stats["resampled_turns"] += 1
            return  # the row waits: its next prompt is this turn's again, drawn from the RNG's next state
        stats["synthesized_user_turns" if role == "user" else "regenerated_turns"] += 1
        row.conversation.messages[position] = message
        row.done, row.redraws = row.done + 1, 0
        if not completion.finished and not completion.looped:
            stats["truncated_turns"] += 1
            if self.policy.on_truncated == "drop":
                row.leave("truncated", f"the {role} turn at message {position} reached regenerate.max_new_tokens="
                                       f"{self.generator.sampling.max_new_tokens} (regenerate.on_truncated=drop)")
        if loops and self.policy.on_loop != "keep":
            row.leave("loop", f"the {role} turn at message {position} repeats a run of "
                              f"{self.policy.loop_ngram} tokens more than {self.policy.loop_repeats} times "
                              f"(regenerate.on_loop={self._given_up('on_loop')})")
        if empty and self.policy.on_empty != "keep":
            row.leave("empty", f"the {role} turn at message {position} has an empty "
                               f"{'question' if role == 'user' else 'answer'} "
                               f"(regenerate.on_empty={self._given_up('on_empty')})")

    def _redraw(self, row: _Row, loops: bool, empty: bool) -> bool:
        """Whether this draw of the row's current turn is discarded and drawn again (`resample`, tries left)."""
        faults = [policy for policy, fault in ((self.policy.on_loop, loops), (self.policy.on_empty, empty)) if fault]
        if "resample" in faults and row.redraws < self.policy.resample_tries:
            row.redraws += 1
            return True
        return False

    def _given_up(self, key: str) -> str:
        policy = getattr(self.policy, key)
        return policy if policy != "resample" else f"resample, after {self.policy.resample_tries} more draws"

    def _reject_row(self, row: _Row, error: RowError) -> None:
        rejection = self._rejection(row.source_index, row.row_id, error)
        row.leave(rejection.reason, rejection.message)

    def _rejection(self, source_index: int, row_id: str | None, error: RowError) -> Rejection:
        if self.on_bad_row == "fail":
            raise SpecgenError(f"row {source_index} (id {row_id}) is unusable: {error.reason}: {error.message}; "
                               "fix it or set data.on_bad_row=skip to log it in rejected.jsonl and go on")
        return Rejection(source_index, row_id, error.reason, error.message)


def _source_id(source: SourceRecord) -> str | None:
    return None if source.record is None else record_id(source.record)


def _tool_call_turns(conversation: Conversation) -> int:
    return sum(1 for message in conversation.messages if message["role"] == "assistant" and message.get("tool_calls"))
