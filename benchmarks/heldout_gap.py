"""Why a draft serves below its training figures: teacher-forced agreement on trained and held-out rows, and the
teacher-forced chain on the target's own greedy replies against real speculative decoding of the same prompts.

    python benchmarks/heldout_gap.py --draft CKPT --prompts P.jsonl --trained-rows 1000 [--rows 8] [--k 3]
        [--max-new-tokens 64]

P is the prompt mix the draft was trained on (its first --trained-rows rows); alpaca-style rows ({instruction,
input, output}) are used. Prints, float32 on the CPU:
  - step-0 agreement of the draft with the target's top token, teacher-forced over the original replies of --rows
    rows among the trained ones and of --rows rows after them (the draft never saw those);
  - the same over the target's greedy replies to the first --rows prompts of P (any source, first turns), and the
    chain acceptance those replies give when every verification round is replayed teacher-forced, beside
    specgen's speculative decoding of the same prompts (the same rounds: training and serving compute alike).
The draft's target is its config's `specgen.target.path`. Measured 2026-11-26 (SmolLM2-135M, 1,000 rows): 0.617
trained, 0.378 held out; 1.511 teacher-forced against 1.529 decoded, 280 rounds each.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # this checkout's specgen, before an installed one
from draft_quality import acceptance, load_pair  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from specgen.data.prompts import chat_prompt_ids  # noqa: E402
from specgen.methods.eagle3.model import DraftKV


def alpaca_rows(path: Path, start: int, count: int) -> list[dict]:
    rows = []
    with open(path) as handle:
        for index, line in enumerate(handle):
            row = json.loads(line)
            if index >= start and "instruction" in row:
                rows.append(row)
            if len(rows) == count:
                break
    return rows


def user_text(row: dict) -> str:
    return row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")


class TeacherForced:
    """The draft's chain over a whole token sequence at once (TTT's unroll), against the target's top tokens."""

    def __init__(self, draft_path: str, steps: int):
        self.model, self.draft, self.runner, self.tokenizer = load_pair(draft_path)
        self.steps = steps

    @torch.no_grad()
    def guesses(self, ids: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
        """(step j's guess at every index i, for token i+2+j; the target's top token at every position)."""
        logits, aux = self.runner.forward(ids, DynamicCache())
        tokens, kv, hidden, out = torch.tensor([ids]), DraftKV(), self.draft.project(aux[None]), []
        for step in range(self.steps):
            shifted = torch.cat([tokens[:, 1 + step:], tokens.new_zeros(1, 1 + step)], dim=1)
            hidden = self.draft(shifted, hidden, torch.arange(len(ids))[None] + step, kv, extend_base=step == 0)
            out.append(self.draft.to_target_ids(self.draft.logits(hidden).argmax(-1))[0])
        return out, logits.argmax(-1)

    def agreement(self, prompt: list[int], reply: list[int]) -> tuple[int, int]:
        """Step 0 right / scored over the reply's tokens (index i predicts token i+2 where i+1 is in the reply)."""
        ids = prompt + reply
        guesses, top = self.guesses(ids)
        indices = range(len(prompt) - 1, len(ids) - 2)
        return sum(int(guesses[0][i] == top[i + 1]) for i in indices), len(indices)

    def chain(self, prompt: list[int], reply: list[int]) -> tuple[int, int]:
        """(rounds, accepted) replaying greedy verification over the target's own reply, K = self.steps."""
        ids = prompt + reply
        guesses, _ = self.guesses(ids)
        rounds = accepted = 0
        position = len(prompt) - 1
        while position < len(ids) - 2:
            run = 0
            while (run < self.steps and position + 2 + run < len(ids)
                   and guesses[run][position] == ids[position + 2 + run]):
                run += 1
            rounds, accepted, position = rounds + 1, accepted + run, position + run + 1
        return rounds, accepted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--prompts", type=Path, required=True)
    parser.add_argument("--trained-rows", type=int, required=True, help="the draft trained on rows [0, N) of P")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    forced = TeacherForced(args.draft, args.k)
    tokenizer = forced.tokenizer
    print(f"{'what':62s} {'step-0 agreement':>17s} {'chain':>14s}")
    for label, start in (("original replies of trained rows", 0), ("original replies of held-out rows",
                                                                   args.trained_rows)):
        right = scored = 0
        for row in alpaca_rows(args.prompts, start, args.rows):
            messages = [{"role": "user", "content": user_text(row)}]
            prompt = list(chat_prompt_ids(tokenizer, messages))
            full = tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": row["output"]}],
                                                 tokenize=True)
            full = list(full["input_ids"] if hasattr(full, "keys") else full)
            got = forced.agreement(prompt, full[len(prompt):])
            right, scored = right + got[0], scored + got[1]
        print(f"{label + f' ({args.rows}, teacher-forced)':62s} {right / max(scored, 1):17.3f} {'':>14s}")
    with tempfile.TemporaryDirectory() as folder:  # the first --rows rows of P, any source, their first turns
        samples = Path(folder) / "samples.jsonl"
        decoded = acceptance(args.draft, num_draft_tokens=args.k, max_new_tokens=args.max_new_tokens,
                             samples_out=str(samples), prompts=str(args.prompts), first_turns=True,
                             max_prompts=args.rows)
        lines = samples.read_text().splitlines()
    right = scored = rounds = accepted = 0
    for line in lines:
        sample = json.loads(line)
        got = forced.agreement(sample["prompt_token_ids"], sample["output_token_ids"])
        chain = forced.chain(sample["prompt_token_ids"], sample["output_token_ids"])
        right, scored, rounds, accepted = right + got[0], scored + got[1], rounds + chain[0], accepted + chain[1]
    print(f"{f'the target greedy replies to the first {args.rows} prompts (teacher-forced)':62s} "
          f"{right / max(scored, 1):17.3f} "
          f"{1 + accepted / max(rounds, 1):8.3f} ({rounds})")
    print(f"{'the same prompts, speculative decoding':62s} {'':>17s} "
          f"{decoded['acceptance_length']:8.3f} ({decoded['rounds']})")


if __name__ == "__main__":
    main()
