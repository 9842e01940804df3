"""The draft vocabulary: the most frequent trained target tokens, and the d2t / t2d maps between vocabularies.

An EAGLE-3 draft predicts over a reduced vocabulary (32k of Llama-3's 128k ids cover almost all assistant tokens),
which makes its LM head and loss several times cheaper. The choice depends only on which token ids carry loss, so
it is made from token counts, with no model forward: `specgen.generate` writes them beside the shards
(`token_counts.json`); online training counts them while tokenizing.

Conventions (those of the published EAGLE-3 checkpoints and of vLLM / SGLang):
    d2t[d]  = target_id - d for draft id d, so target_id = d + d2t[d]      (LongTensor [draft_vocab])
    t2d[t]  = True when target id t is in the draft vocabulary              (BoolTensor [target_vocab])
Draft ids are assigned in increasing target-id order.
"""

import json
import logging
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from specgen.errors import SpecgenError
from specgen.store.commit import write_json_atomic

log = logging.getLogger("specgen.draft")

TOKEN_COUNTS = "token_counts.json"
TARGET_TOKEN_COUNTS = "target_token_counts.json"  # the target's top token at trainable positions (generate)


@dataclass(frozen=True)
class VocabMapping:
    """draft_to_target[d] is the target id of draft id d (strictly increasing)."""

    draft_to_target: torch.Tensor  # LongTensor [draft_vocab]
    target_vocab_size: int

    @property
    def draft_vocab_size(self) -> int:
        return len(self.draft_to_target)

    @property
    def d2t(self) -> torch.Tensor:
        return self.draft_to_target - torch.arange(self.draft_vocab_size)

    @property
    def t2d(self) -> torch.Tensor:
        mask = torch.zeros(self.target_vocab_size, dtype=torch.bool)
        mask[self.draft_to_target] = True
        return mask

    @classmethod
    def from_d2t(cls, d2t: torch.Tensor, target_vocab_size: int) -> "VocabMapping":
        draft_to_target = d2t.long().cpu() + torch.arange(len(d2t))
        if len(draft_to_target) > 1 and not bool((draft_to_target[1:] > draft_to_target[:-1]).all()):
            raise SpecgenError("d2t does not map draft ids to increasing target ids; the checkpoint is damaged")
        if len(draft_to_target) and (draft_to_target[0] < 0 or draft_to_target[-1] >= target_vocab_size):
            raise SpecgenError(f"d2t maps outside the target vocabulary of {target_vocab_size} tokens: the "
                               "checkpoint belongs to another target")
        return cls(draft_to_target, target_vocab_size)


def build_vocab_mapping(counts: Mapping[int, int], target_vocab_size: int, draft_vocab_size: int,
                        counted: str = "the trained tokens") -> VocabMapping:
    """Keep the `draft_vocab_size` most frequent trained tokens (ties: lower id first).

    When fewer distinct tokens were seen, the draft vocabulary is clipped to those, with a warning: a draft id
    that never carries loss could never be learned.
    """
    if draft_vocab_size < 1:
        raise SpecgenError(f"draft.vocab_size must be positive, got {draft_vocab_size}")
    seen = {int(token): int(count) for token, count in counts.items() if count > 0}
    if not seen:
        raise SpecgenError("no trained token was counted: the data has no loss-masked tokens to train a draft on")
    out_of_range = [token for token in seen if not 0 <= token < target_vocab_size]
    if out_of_range:
        raise SpecgenError(f"token ids {sorted(out_of_range)[:5]} lie outside the target vocabulary of "
                           f"{target_vocab_size}: the token counts come from another tokenizer")
    if draft_vocab_size > len(seen):
        log.warning("draft.vocab_size=%d but %s hold only %d distinct tokens: using a draft vocabulary of %d",
                    draft_vocab_size, counted, len(seen), len(seen))
        draft_vocab_size = len(seen)
    chosen = sorted(seen, key=lambda token: (-seen[token], token))[:draft_vocab_size]
    mapping = VocabMapping(torch.tensor(sorted(chosen), dtype=torch.long), target_vocab_size)
    coverage = sum(seen[token] for token in chosen) / sum(seen.values())
    log.info("draft vocabulary: %d of %d target tokens, covering %.2f%% of %s",
             draft_vocab_size, target_vocab_size, 100 * coverage, counted)
    return mapping


def count_trained_tokens(samples: Iterable[tuple[Iterable[int], Iterable[int]]]) -> Counter:
    """Occurrences of each token id where the loss mask is set, from (input_ids, loss_mask) pairs."""
    counts: Counter = Counter()
    for input_ids, loss_mask in samples:
        counts.update(int(token) for token, trained in zip(input_ids, loss_mask) if trained)
    return counts


def write_token_counts(path: str | Path, counts: Mapping[int, int], vocab_size: int) -> None:
    """The `token_counts.json` format `specgen.generate` writes: {"vocab_size": V, "counts": {"id": n}}."""
    payload = {"vocab_size": int(vocab_size), "counts": {str(k): int(v) for k, v in sorted(counts.items())}}
    write_json_atomic(path, payload, indent=None)


def read_token_counts(path: str | Path) -> tuple[dict[int, int], int]:
    """(counts by token id, target vocab size) from a `token_counts.json`."""
    path = Path(path)
    try:
        payload = json.loads(path.read_text())
        return {int(k): int(v) for k, v in payload["counts"].items()}, int(payload["vocab_size"])
    except (OSError, json.JSONDecodeError, KeyError, ValueError) as error:
        raise SpecgenError(f"cannot read token counts from {path} ({error}); re-run specgen.generate to "
                           "rewrite it") from error


class ReducedVocabHead:
    """What every draft with a reduced vocabulary shares: `lm_head` over draft ids, `d2t` (target id = draft id +
    d2t[draft id]) and `config.draft_vocab_size`. Mixed into the draft modules (EAGLE-3, DFlash)."""

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocabulary ids to target-vocabulary ids (target = draft + d2t[draft])."""
        return draft_ids + self.d2t[draft_ids]

    def init_lm_head_from_target(self, target_lm_head: torch.Tensor) -> None:
        """Copy the target's LM head rows of the draft vocabulary (row d = target row d + d2t[d]) into lm_head."""
        rows = torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t
        with torch.no_grad():
            self.lm_head.weight.copy_(target_lm_head.to(self.lm_head.weight)[rows])

    def set_embedding(self, embedding: torch.Tensor) -> None:
        """Copy the target's input embedding into the draft (its frozen token embedding)."""
        expected = tuple(self.embed_tokens.weight.shape)
        if tuple(embedding.shape) != expected:
            raise SpecgenError(f"the target's embedding is {tuple(embedding.shape)} but the draft expects {expected}: "
                               "the draft was trained for another target")
        with torch.no_grad():
            self.embed_tokens.weight.copy_(embedding)

    def start_from_target(self, mapping: "VocabMapping", embedding: torch.Tensor, lm_head: torch.Tensor, *,
                          init_lm_head: str) -> None:
        """A fresh draft's vocabulary mapping and the target's embedding; its LM head the target's rows of the draft
        vocabulary when `init_lm_head` (draft.init_lm_head) is "target", else as initialised."""
        self.d2t.copy_(mapping.d2t)
        self.t2d.copy_(mapping.t2d)
        self.set_embedding(embedding)
        if init_lm_head == "target":
            self.init_lm_head_from_target(lm_head)

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]


def default_mask_token_id(target_config) -> int:
    """draft.mask_token_id when null: the target's pad token, else its (first) eos token, else 0."""
    text = target_config.get_text_config()
    for value in (getattr(text, "pad_token_id", None), getattr(text, "eos_token_id", None)):
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0
