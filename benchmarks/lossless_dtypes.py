"""Losslessness and acceptance in float32 and bfloat16: specgen.evaluate's verdict (near-ties told from failures) and
its acceptance length beside vLLM's, for the same drafts, prompts and K.

    python benchmarks/lossless_dtypes.py --drafts C1 [C2 ...] [--target M] [--prompts P] [--ks 3 5 7]
        [--max-prompts 16] [--max-new-tokens 64] [--dtypes float32 bfloat16] [--vllm-python .venv-vllm/bin/python]
        [--out DIR]

For every draft, dtype and K: `python -m specgen.evaluate` (first turns, `model.dtype=DTYPE`) and, where
`--vllm-python` runs, tests/vllm_replay.py on the same samples.jsonl with vLLM's CPU build in the same dtype. Prints
one table: acceptance length by specgen and by vLLM, the turns equal to greedy, near-ties, failures and the largest
near-tie in rounding units (specgen.draft.lossless). The target defaults to the one each draft records.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # this checkout's specgen, before an installed one
from served_acceptance import REPO, draft_flags, replay  # noqa: E402


def evaluate(draft: str, target: str | None, prompts: str, dtype: str, k: int, args, out: Path) -> dict:
    """specgen.evaluate as a user runs it; its eval.json."""
    command = [sys.executable, "-m", "specgen.evaluate", f"draft.path={draft}", f"data.path={prompts}",
               f"model.dtype={dtype}", f"evaluate.num_draft_tokens={k}", "evaluate.turns=first",
               f"evaluate.max_prompts={args.max_prompts}", f"evaluate.max_new_tokens={args.max_new_tokens}",
               f"output.dir={out}", "runtime.progress=false", *([f"model.path={target}"] if target else [])]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"specgen.evaluate failed: {' '.join(command)}\n{done.stderr[-3000:]}")
    return json.loads((out / "eval.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--drafts", nargs="+", required=True)
    parser.add_argument("--target")
    parser.add_argument("--prompts", default=str(REPO / "specgen" / "assets" / "chat" / "heldout.jsonl"))
    parser.add_argument("--ks", type=int, nargs="+", default=[3, 5, 7])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--max-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--vllm-python", default=str(REPO / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    args.out = args.out or Path(tempfile.mkdtemp(prefix="lossless-dtypes-"))
    use_vllm = Path(args.vllm_python).exists()
    rows = []
    for index, draft in enumerate(args.drafts):
        for dtype in args.dtypes:
            for k in args.ks:
                out = args.out / f"draft{index}-{dtype}-k{k}"
                report = evaluate(draft, args.target, args.prompts, dtype, k, args, out)
                row = {"draft": draft, "dtype": dtype, "k": k, "specgen": report["acceptance_length"],
                       "turns": report["num_turns"], "exact": report["num_turns"] - len(report["mismatched_turns"]),
                       "near_ties": len(report["near_tie_turns"]), "failures": len(report["failed_turns"]),
                       "largest": report["largest_near_tie_margin"], "line": report["lossless_line"], "vllm": None}
                if use_vllm:
                    served = replay(args.vllm_python, out / "samples.jsonl", out / "vllm.json", report["target"],
                                    args.max_new_tokens, *draft_flags(draft, k), "--dtype", dtype)
                    row["vllm"] = served.get("acceptance_length")
                    outputs = [json.loads(line)["output_token_ids"] for line in open(out / "samples.jsonl")]
                    row["vllm_equal_outputs"] = sum(a == b for a, b in zip(served["output_token_ids"], outputs))
                rows.append(row)
                print(json.dumps(row), flush=True)
    (args.out / "results.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"\nfirst turns of {args.prompts} (at most {args.max_prompts}), greedy, {args.max_new_tokens} new tokens; "
          f"vLLM: {'CPU build, same dtype' if use_vllm else 'not run (no --vllm-python)'}")
    print(f"{'draft':<24} {'dtype':<9} {'K':>2} {'specgen':>8} {'vLLM':>7} {'vLLM=specgen outputs':>21} "
          f"{'exact':>6} {'near-ties':>9} {'failures':>8} {'largest':>8}")
    for row in rows:
        vllm = f"{row['vllm']:.3f}" if row["vllm"] is not None else "-"
        same = f"{row['vllm_equal_outputs']}/{row['turns']}" if "vllm_equal_outputs" in row else "-"
        largest = f"{row['largest']:.1f}" if row["largest"] is not None else "-"
        print(f"{Path(row['draft']).name[-24:]:<24} {row['dtype']:<9} {row['k']:>2} {row['specgen']:>8.3f} {vllm:>7} "
              f"{same:>21} {row['exact']:>3}/{row['turns']:<2} {row['near_ties']:>9} {row['failures']:>8} "
              f"{largest:>8}")


if __name__ == "__main__":
    sys.exit(main())
