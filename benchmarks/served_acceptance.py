"""Acceptance length of trained drafts as vLLM serves them, on the first turns of a prompt set (MT-Bench by default).

    python benchmarks/served_acceptance.py --target M --drafts C1 [C2 ...] [--ks 3 5 7] [--max-new-tokens 64]
        [--prompts ../shared/datasets/mt_bench_questions.jsonl] [--vllm-python .venv-vllm/bin/python] [--out DIR]

The first user turn of every prompt, rendered by the target's chat template (specgen.data.prompts, as
specgen.evaluate does with evaluate.turns=first), is served greedily by vLLM's CPU build (tests/vllm_replay.py,
float32, up to 8 sequences at once): once by the target alone, then by each draft at each K. Prints vLLM's own
acceptance length (1 + accepted / drafts), generated tokens per second and whether the outputs equal the target
alone's (lossless). The drafts are specgen.train output folders; the method (eagle3, eagle3.1, p-eagle, dflash) is
read from each. vLLM's counters equal specgen.evaluate's (tests/test_vllm_*.py); this script is for targets where
specgen.evaluate's one-sequence-at-a-time decoding on a CPU is too slow to cover a prompt set (a real 135M target).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
REPLAY = REPO / "tests" / "vllm_replay.py"


def write_turns(target: str, prompts: str, out: Path) -> Path:
    """One JSON line per prompt: the first turn's prompt_token_ids (vllm_replay's input)."""
    from specgen.data.prompts import chat_prompt_ids, read_prompts
    from specgen.runtime import load_tokenizer

    tokenizer = load_tokenizer(target)
    with open(out, "w") as handle:
        for prompt in read_prompts(prompts):
            handle.write(json.dumps({"id": prompt.id, "category": prompt.category,
                                     "prompt_token_ids": chat_prompt_ids(tokenizer, prompt.first_turn_messages())})
                         + "\n")
    return out


def method_of(draft: str) -> str:
    from specgen.methods import method_of_config

    return method_of_config(json.loads((Path(draft) / "config.json").read_text()))


def draft_flags(draft: str | Path, k: int) -> list[str]:
    """tests/vllm_replay.py's flags serving `draft` at K with the speculative_config specgen.train's summary prints
    (`specgen.draft.exports.vllm_speculative_config`: vLLM's method name, parallel_drafting for P-EAGLE)."""
    from specgen.draft.exports import vllm_speculative_config

    return ["--speculative-config", json.dumps(vllm_speculative_config(method_of(str(draft)), str(draft), k))]


def replay(vllm_python: str, turns: Path, out: Path, target: str, max_new_tokens: int, *flags: str) -> dict:
    """tests/vllm_replay.py in vLLM's venv over `turns` (prompt_token_ids per line), the target alone or with the
    draft that `flags` name (`--speculative-config JSON`): vLLM's outputs, counters and tokens/s."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"))
    done = subprocess.run([vllm_python, str(REPLAY), str(turns), str(out), "--target", str(target),
                           "--max-new-tokens", str(max_new_tokens), *flags],
                          env=env, cwd=REPO, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"vllm_replay failed ({' '.join(flags) or 'target alone'}):\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    parser.add_argument("--drafts", nargs="+", required=True)
    parser.add_argument("--ks", type=int, nargs="+", default=[3, 5, 7])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prompts", default=str(REPO.parent / "shared" / "datasets" / "mt_bench_questions.jsonl"))
    parser.add_argument("--vllm-python", default=str(REPO / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    args.out = args.out or Path(tempfile.mkdtemp(prefix="served-acceptance-"))
    args.out.mkdir(parents=True, exist_ok=True)

    turns = write_turns(args.target, args.prompts, args.out / "turns.jsonl")
    alone = replay(args.vllm_python, turns, args.out / "target.json", args.target, args.max_new_tokens)
    rows = []
    for index, draft in enumerate(args.drafts):
        method = method_of(draft)
        for k in args.ks:
            served = replay(args.vllm_python, turns, args.out / f"draft{index}-k{k}.json", args.target,
                            args.max_new_tokens, *draft_flags(draft, k))
            rows.append({"draft": draft, "method": method, "k": k, "acceptance_length": served["acceptance_length"],
                         "per_position": served["acceptance_rate_per_position"],
                         "tokens_per_second": served["output_tokens_per_second"],
                         "lossless": served["output_token_ids"] == alone["output_token_ids"]})
            print(json.dumps(rows[-1]), flush=True)
    with open(args.out / "results.jsonl", "w") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in rows)
    turns_count = sum(1 for _ in open(turns))
    print(f"\n{turns_count} first turns of {args.prompts}, greedy, {args.max_new_tokens} new tokens, vLLM CPU float32; "
          f"target alone {alone['output_tokens_per_second']:.1f} tokens/s")
    print(f"{'draft':<40} {'method':<9} {'K':>2} {'acceptance':>10} {'tokens/s':>9} {'vs alone':>8}  lossless")
    for row in rows:
        print(f"{Path(row['draft']).name[-40:]:<40} {row['method']:<9} {row['k']:>2} {row['acceptance_length']:>10.3f} "
              f"{row['tokens_per_second']:>9.1f} {row['tokens_per_second'] / alone['output_tokens_per_second']:>7.2f}x"
              f"  {'yes' if row['lossless'] else 'NO'}")


if __name__ == "__main__":
    sys.exit(main())
