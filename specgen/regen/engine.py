"""Batched generation on the transformers backend: left-padded `model.generate` with the KV cache.

Prompts are sorted by length and grouped under a token budget (`token_budget_batches`), so a batch holds prompts
of similar length and little compute goes to padding. Left padding puts every prompt's last token in the same
column, so all rows of a batch decode in lockstep from one shared KV cache; the attention mask hides the padding
and `generate` derives position ids from it, so a padded row computes what it would compute alone.

Two KV caches (`regenerate.kv_cache`):
- `dynamic` (the default): the cache grows by one position a step; a batch holds what fits the token budget.
- `static`: every batch has the same shape, `rows` x `max_length` (the longest prompt the run allows plus
  max_new_tokens; a short last batch is filled with copies of its last prompt, stopped from the first step and
  discarded), preallocated once. One shape means that on CUDA transformers compiles the decoding step once
  (`torch.compile`, CUDA graphs) instead of launching every kernel of every layer from Python at every step: the
  launch-bound cost of a small target on a GPU. On the CPU nothing is compiled and the fixed shape only costs (attention over
  max_length positions, the filler rows).

The generation settings are exactly the ones in `Sampling`: the checkpoint's own `generation_config` (which may
carry top_k, repetition_penalty, ...) is replaced, so the manifest records everything that shaped the text.
"""

import hashlib
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, PreTrainedModel, StoppingCriteria, StoppingCriteriaList

from specgen.data.batching import token_budget_batches
from specgen.errors import SpecgenError
from specgen.runtime import stop_token_ids


@dataclass(frozen=True)
class Sampling:
    """How each turn is generated. temperature 0 is greedy decoding; top_k 0 and top_p 1 switch those filters off."""

    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise SpecgenError(f"regenerate.temperature must be >= 0 (0: greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SpecgenError(f"regenerate.top_p must lie in (0, 1] (1: off), got {self.top_p}")
        if self.top_k < 0:
            raise SpecgenError(f"regenerate.top_k must be >= 0 (0: off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise SpecgenError(f"regenerate.max_new_tokens must be a positive number of tokens, "
                               f"got {self.max_new_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generation_config(self, stop_token_ids: list[int], pad_token_id: int, **cache) -> GenerationConfig:
        """`cache`: transformers' cache settings (cache_implementation, max_cache_len), passed through."""
        sampling = {} if self.greedy else {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}
        return GenerationConfig(do_sample=not self.greedy, max_new_tokens=self.max_new_tokens,
                                eos_token_id=stop_token_ids, pad_token_id=pad_token_id, **cache, **sampling)


@dataclass(frozen=True)
class Completion:
    """One generated turn: its tokens without the stop token, and whether a stop token ended it."""

    token_ids: list[int]
    finished: bool  # False: it reached max_new_tokens (truncated), or its generator stopped it (`looped`)
    looped: bool = False  # stopped at the token that made it loop (`LoopWatch`); the rest was not generated

    @property
    def num_generated(self) -> int:
        """Tokens the model produced for this turn, the stop token included."""
        return len(self.token_ids) + int(self.finished)


@dataclass(frozen=True)
class _Request:
    """A prompt to complete; `capacity` is what it costs in a batch: the KV-cache positions it may grow to."""

    index: int
    prompt: list[int]
    capacity: int


KV_CACHES = ("dynamic", "static")
BACKENDS = {"dynamic": "transformers generate: left-padded batches, KV cache",
            "static": "transformers generate: left-padded batches of one shape, static KV cache"}
SEEDING = "torch.manual_seed(unit_seed(seed, part index)) before each part, so a part's text does not depend on " \
          "which process made it or on what ran before"


class LoopWatch:
    """A turn's loop check, token by token: `extend(tokens)` is True once some run of `ngram` consecutive tokens has
    occurred more than `repeats` times (overlapping occurrences count: a one-token cycle repeats every n-gram of
    itself; `repeats` 0: never). Once True it stays True as tokens are added, so a generator may stop a turn at the
    token that makes it loop: the rest of its draw would loop too, and the regenerator discards it either way."""

    def __init__(self, ngram: int, repeats: int):
        self.ngram, self.repeats = ngram, repeats
        self.tokens: list[int] = []
        self.counts: Counter = Counter()
        self.looped = False

    def extend(self, tokens: Iterable[int]) -> bool:
        for token in tokens:
            self.tokens.append(token)
            if self.repeats and len(self.tokens) >= self.ngram:
                gram = tuple(self.tokens[-self.ngram:])
                self.counts[gram] += 1
                self.looped = self.looped or self.counts[gram] > self.repeats
        return self.looped


def derived_seed(*key: int) -> int:
    """A 63-bit seed derived from the integers of `key` (a run's seed and a part index; a part's seed and a request's
    source row, message and draw): the same whatever else is generated beside it."""
    return int.from_bytes(hashlib.sha256(":".join(map(str, key)).encode()).digest()[:8], "little") >> 1


class Generator:
    """Complete many prompts with one model, in left-padded batches.

    A regenerator drives it with `submit` (a request: key, prompt, seed, loop watch) and `collect` (completions of
    submitted requests); this generator completes everything submitted at each `collect`, so turns go depth by depth,
    and its sampling draws from torch's RNG in submission order (`SEEDING`): a request's seed is not used, nor its
    loop watch (every turn runs to its end: a batch's rows share one RNG stream, so a batch that ended sooner would
    change the text of every batch after it).

    batch_size: at most this many prompts decode together.
    batch_tokens: at most this many KV-cache positions per batch, counted as
        rows x (longest prompt + max_new_tokens); bounds memory whatever the prompt lengths.
    kv_cache: "dynamic" | "static" (see the module's docstring); static needs `max_length`, the longest prompt
        plus max_new_tokens, and decodes batches of min(batch_size, batch_tokens // max_length) rows.
    """

    seeding = SEEDING

    def __init__(self, model: PreTrainedModel, tokenizer, sampling: Sampling, *, batch_size: int,
                 batch_tokens: int, kv_cache: str, max_length: int | None = None):
        if batch_size < 1 or batch_tokens < 1:
            raise SpecgenError(f"regenerate.batch_size and regenerate.batch_tokens must be positive, got "
                               f"{batch_size} and {batch_tokens}")
        if kv_cache not in KV_CACHES:
            raise SpecgenError(f"regenerate.kv_cache must be one of {', '.join(KV_CACHES)}, got {kv_cache!r}")
        self.model = model
        self.sampling = sampling
        self.batch_size = batch_size
        self.batch_tokens = batch_tokens
        self.kv_cache = kv_cache
        self.backend = BACKENDS[kv_cache]
        self._submitted: list[tuple[int, list[int]]] = []
        self.stop_token_ids = stop_token_ids(model, tokenizer)
        pad = tokenizer.pad_token_id
        self.pad_token_id = pad if pad is not None else self.stop_token_ids[0]  # any id: the mask hides it
        cache = {}
        if kv_cache == "static":
            self.max_length, self.static_rows = static_shape(max_length, batch_size, batch_tokens,
                                                              sampling.max_new_tokens)
            cache = {"cache_implementation": "static", "max_cache_len": self.max_length}
        model.generation_config = sampling.generation_config(self.stop_token_ids, self.pad_token_id, **cache)

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    def submit(self, key: int, prompt: list[int], seed: int, watch: LoopWatch | None = None) -> None:
        """Queue a request; `collect` completes it. `seed` and `watch` are not used (see the class docstring)."""
        self._submitted.append((key, prompt))

    def collect(self, on_batch: Callable[[int], None] | None = None) -> list[tuple[int, Completion]]:
        """(key, completion) of every request submitted since the last call, in submission order."""
        submitted, self._submitted = self._submitted, []
        return [(key, completion) for (key, _), completion
                in zip(submitted, self.complete([prompt for _, prompt in submitted], on_batch))]

    def complete(self, prompts: Sequence[list[int]],
                 on_batch: Callable[[int], None] | None = None) -> list[Completion]:
        """One completion per prompt, in the order given; `on_batch(tokens generated)` as they are generated (after
        every decoding step: the tokens of that step, stop tokens included), so a progress bar moves within a batch."""
        static = self.kv_cache == "static"
        requests = [_Request(i, prompt, self.max_length if static else len(prompt) + self.sampling.max_new_tokens)
                    for i, prompt in enumerate(prompts)]
        if static and max(map(len, prompts), default=0) + self.sampling.max_new_tokens > self.max_length:
            raise SpecgenError(f"a prompt of {max(map(len, prompts))} tokens does not fit the static KV cache of "
                               f"{self.max_length} positions with {self.sampling.max_new_tokens} new tokens")
        completions: list[Completion | None] = [None] * len(requests)
        for batch in token_budget_batches(requests, self.batch_tokens, self.batch_size,
                                          length=lambda request: request.capacity):
            done = self._generate([request.prompt for request in batch], on_batch)
            for request, completion in zip(batch, done):
                completions[request.index] = completion
        return completions

    @torch.inference_mode()
    def _generate(self, prompts: list[list[int]], on_step: Callable[[int], None] | None = None) -> list[Completion]:
        real = len(prompts)
        if self.kv_cache == "static":  # the batch's fixed shape; the fillers' completions are dropped below
            prompts = prompts + [prompts[-1]] * (self.static_rows - real)
        width = max(len(prompt) for prompt in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt):] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt):] = 1
        watch = on_step is not None or real < len(prompts)
        criteria = StoppingCriteriaList([_StepCounter(self.stop_token_ids, real, on_step)] if watch else [])
        output = self.model.generate(input_ids=input_ids.to(self.device),
                                     attention_mask=attention_mask.to(self.device), stopping_criteria=criteria)
        return [self._completion(row) for row in output[:real, width:].tolist()]

    def _completion(self, tokens: list[int]) -> Completion:
        """Cut at the first stop token: what follows is the padding of a row that finished before the batch."""
        for position, token in enumerate(tokens):
            if token in self.stop_token_ids:
                return Completion(tokens[:position], finished=True)
        return Completion(tokens, finished=False)


def static_shape(max_length: int | None, batch_size: int, batch_tokens: int, max_new_tokens: int) -> tuple[int, int]:
    """(positions, rows) of every batch with a static KV cache: max_length positions, as many rows as
    regenerate.batch_size and regenerate.batch_tokens allow."""
    if max_length is None or max_length <= max_new_tokens:
        raise SpecgenError(f"a static KV cache needs the longest sequence, a prompt plus {max_new_tokens} new "
                           f"tokens; got max_length={max_length}")
    rows = min(batch_size, batch_tokens // max_length)
    if rows < 1:
        raise SpecgenError(f"regenerate.kv_cache=static holds every batch at {max_length} positions a row (the "
                           f"longest prompt plus regenerate.max_new_tokens) but regenerate.batch_tokens="
                           f"{batch_tokens} is less; raise regenerate.batch_tokens to a multiple of {max_length}")
    return max_length, rows


class _StepCounter(StoppingCriteria):
    """Stops only the rows after the first `rows` (the fillers of a static batch, so that a sampled filler never
    keeps the batch decoding after its real rows are done); after each decoding step it reports (when `report` is
    given) how many of the real rows produced a token in that step (rows not finished before it; a stop token
    counts, as in `Completion.num_generated`)."""

    def __init__(self, stop_token_ids: list[int], rows: int, report: Callable[[int], None] | None):
        self.stops = torch.tensor(stop_token_ids)
        self.finished = torch.zeros(rows, dtype=torch.bool)
        self.report = report

    def __call__(self, input_ids: torch.LongTensor, scores=None, **kwargs) -> torch.BoolTensor:
        real = len(self.finished)
        if self.report is not None:
            self.report(int((~self.finished).sum()))
            self.finished |= torch.isin(input_ids[:real, -1].cpu(), self.stops)
        fillers = torch.arange(input_ids.shape[0], device=input_ids.device) >= real
        return fillers
