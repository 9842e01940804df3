"""Greedy speculative decoding with an EAGLE-3 draft, to measure acceptance length and check losslessness.

One round, after the target has verified everything up to position p and chosen the next token x[p+1]:
  1. the draft adds base entries for the newly verified positions (target aux hidden state at m, token x[m+1]);
  2. it drafts K tokens as a chain from position p (step j reads its own previous output, like TTT step j);
  3. the target consumes x[p+1] and the K draft tokens in one forward; the longest prefix of draft tokens that
     equals the target's own greedy choices is accepted, plus the target's token after it (the bonus token).
So every round emits between 1 and K+1 tokens, all of them the target's greedy choices: the output must equal
plain greedy decoding of the target (`greedy_generate`), which the evaluation checks. Both decodings keep, for each
token, the TOP_K highest logits of the row that chose it (`Generation.top_logits`), so that a divergence between
them can be told apart as rounding or as a bug (`specgen.draft.lossless`).
"""

import time
from dataclasses import dataclass, field

import torch
from torch import nn
import transformers
from transformers import DynamicCache

from specgen import methods
from specgen.capture.layers import layer_output_hooks
from specgen.errors import SpecgenError
from specgen.runtime.compat import cache_kwarg

TOP_K = 20  # logits kept per generated token (ids and values of the row that chose it), for divergence diagnosis


class TargetRunner:
    """The target with a KV cache; each forward also returns the outputs of the aux decoder layers.

    Its layer hooks live only for the duration of its own forwards, so a target shared with the training loop
    (online training's capture) runs without them there and keeps no layer output alive between forwards."""

    def __init__(self, model: transformers.PreTrainedModel, aux_layers: list[int]):
        self.model = model
        self._layers = getattr(model.get_decoder(), "layers", None)
        if self._layers is None:
            raise SpecgenError(f"{type(model).__name__} exposes no decoder `layers`; speculative evaluation "
                               "supports decoder-only models with model.model.layers (Llama, Qwen, Mistral, ...)")
        self.aux_layers = list(aux_layers)

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    @torch.inference_mode()
    def forward(self, token_ids: list[int], cache: DynamicCache) -> tuple[torch.Tensor, torch.Tensor]:
        """Consume `token_ids` after what `cache` holds: (logits [n, V] float32, aux hidden states [n, k*H])."""
        outputs: dict[int, torch.Tensor] = {}
        input_ids = torch.tensor([token_ids], device=self.device)
        with layer_output_hooks(self._layers, self.aux_layers, outputs.__setitem__):
            logits = self.model(input_ids=input_ids, use_cache=True, **cache_kwarg(cache)).logits[0].float()
        aux = torch.cat([outputs[layer][0] for layer in self.aux_layers], dim=-1)
        return logits, aux


@dataclass
class Generation:
    tokens: list[int]  # generated tokens (prompt excluded), cut after the first end-of-sequence token
    accepted: list[int] = field(default_factory=list)  # draft tokens accepted in each verification round
    rounds_emitted: list[int] = field(default_factory=list)  # tokens emitted by each round (after the cut)
    seconds: float = 0.0
    # Per generated token: (ids, logits) of the TOP_K highest logits of the row that chose it, highest first.
    top_logits: list[tuple[list[int], list[float]]] = field(default_factory=list)
    # Speculative decoding only: the draft tokens each verification round fed the target after its first token.
    drafted: list[list[int]] = field(default_factory=list)

    @property
    def verification_rounds(self) -> int:
        return len(self.accepted)


def top_logits(rows: torch.Tensor) -> list[tuple[list[int], list[float]]]:
    """For each row of logits [n, V]: (ids, values) of its TOP_K highest logits, highest first."""
    values, ids = rows.float().topk(min(TOP_K, rows.shape[-1]), dim=-1)
    return list(zip(ids.tolist(), values.tolist()))


def accepted_count(drafted: list[int], greedy: list[int]) -> int:
    """How many draft tokens a verification accepts: the longest prefix of `drafted` equal to the target's greedy
    choices `greedy` (one per draft token, plus the bonus position after them)."""
    accepted = 0
    while accepted < len(drafted) and drafted[accepted] == greedy[accepted]:
        accepted += 1
    return accepted


def _finish(tokens: list[int], max_new_tokens: int, eos_ids: set[int]) -> tuple[list[int], bool]:
    """Cut after the first EOS or at max_new_tokens; True when generation is over."""
    for index, token in enumerate(tokens[:max_new_tokens]):
        if token in eos_ids:
            return tokens[: index + 1], True
    return tokens[:max_new_tokens], len(tokens) >= max_new_tokens


@torch.inference_mode()
def greedy_generate(target: TargetRunner, prompt_ids: list[int], *, max_new_tokens: int,
                    eos_ids: set[int]) -> Generation:
    """Plain greedy decoding of the target, one token per forward: the reference output."""
    start = time.perf_counter()
    cache = DynamicCache()
    logits, _ = target.forward(prompt_ids, cache)
    tokens, tops = [int(logits[-1].argmax())], top_logits(logits[-1:])
    done = tokens[0] in eos_ids or max_new_tokens <= 1
    while not done:
        logits, _ = target.forward(tokens[-1:], cache)
        tokens.append(int(logits[-1].argmax()))
        tops += top_logits(logits[-1:])
        tokens, done = _finish(tokens, max_new_tokens, eos_ids)
    tokens = tokens[:max_new_tokens]
    return Generation(tokens=tokens, seconds=time.perf_counter() - start, top_logits=tops[:len(tokens)])


@torch.inference_mode()
def speculative_generate(target: TargetRunner, draft: nn.Module, prompt_ids: list[int], *, num_draft_tokens: int,
                         max_new_tokens: int, eos_ids: set[int]) -> Generation:
    """Greedy speculative decoding with `num_draft_tokens` draft tokens per round, drafted the way vLLM drafts
    with the draft's method (`specgen.methods`: a chain for EAGLE-3, one parallel forward for P-EAGLE)."""
    if num_draft_tokens < 1:
        raise SpecgenError(f"evaluate.num_draft_tokens must be at least 1, got {num_draft_tokens}")
    start = time.perf_counter()
    proposer = methods.of_model(draft).proposer(draft)
    cache = DynamicCache()
    logits, aux = target.forward(prompt_ids, cache)
    result = Generation(tokens=[int(logits[-1].argmax())], top_logits=top_logits(logits[-1:]))
    # Base entries still to add to the draft: (target aux hidden state at m, token at m+1) for verified m.
    pending_aux, pending_tokens = aux, prompt_ids[1:] + result.tokens
    verified = len(prompt_ids)  # tokens in the target cache
    done = result.tokens[0] in eos_ids or max_new_tokens <= 1
    while not done:
        drafted = proposer.propose(pending_aux, pending_tokens, num_draft_tokens)

        verified_length = verified + 1  # tokens in the target cache once result.tokens[-1] is consumed
        logits, aux = target.forward([result.tokens[-1]] + drafted, cache)
        greedy = logits.argmax(-1).tolist()
        accepted = accepted_count(drafted, greedy)
        emitted = drafted[:accepted] + [greedy[accepted]]  # emitted[j] is chosen by row j of the verification
        result.top_logits += top_logits(logits[: accepted + 1])
        result.drafted.append(list(drafted))
        rejected = cache.get_seq_length() - (verified_length + accepted)  # keep x[p+1] and the accepted drafts
        if rejected:
            cache.crop(-rejected)  # a negative count removes that many tokens (transformers 4.x and 5.x alike)
        pending_aux, pending_tokens = aux[: accepted + 1], emitted
        verified = verified_length + accepted

        before = len(result.tokens)
        result.tokens, done = _finish(result.tokens + emitted, max_new_tokens, eos_ids)
        result.accepted.append(accepted)
        result.rounds_emitted.append(len(result.tokens) - before)
    del result.top_logits[len(result.tokens):]
    result.seconds = time.perf_counter() - start
    return result


@torch.inference_mode()
def replayed_greedy(target: TargetRunner, prompt_ids: list[int], drafted: list[list[int]], *, max_new_tokens: int,
                    eos_ids: set[int]) -> Generation:
    """The target's greedy choices in a speculative run's own forward shapes (evaluate.reference=replay): the prompt,
    then per round the last chosen token and that round's draft tokens (`Generation.drafted`) in one forward, keeping
    the target's choices up to the first draft token it does not choose, the cache cut back to the chosen tokens by
    absolute length. No draft runs. Its bookkeeping is its own, its forwards have the same shapes and cache contents
    as a correct speculative run, so in any dtype it equals that run's output exactly. It shares the target and the
    KV cache class with the run it checks: `greedy_generate` is the reference that checks those too."""
    start = time.perf_counter()
    cache = DynamicCache()
    logits, _ = target.forward(prompt_ids, cache)
    tokens, tops = [int(logits[-1].argmax())], top_logits(logits[-1:])
    done = tokens[0] in eos_ids or max_new_tokens <= 1
    for draft_tokens in drafted:
        if done:
            break
        logits, _ = target.forward([tokens[-1]] + draft_tokens, cache)
        for row, choice in enumerate(logits.argmax(-1).tolist()):
            tokens.append(choice)
            tops += top_logits(logits[row:row + 1])
            if row == len(draft_tokens) or draft_tokens[row] != choice:
                break
        surplus = cache.get_seq_length() - (len(prompt_ids) + len(tokens) - 1)  # the last chosen token is not in yet
        if surplus:
            cache.crop(-surplus)
        tokens, done = _finish(tokens, max_new_tokens, eos_ids)
    tokens = tokens[:max_new_tokens]
    return Generation(tokens=tokens, seconds=time.perf_counter() - start, top_logits=tops[:len(tokens)])
