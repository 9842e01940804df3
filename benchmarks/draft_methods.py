"""Acceptance length per draft method (eagle3, eagle3.1, p-eagle) at several K on the demo recipe's shards.

    python benchmarks/draft_methods.py [--shards DIR] [--seeds 0 1 2] [--ks 3 5 7] [--ttt-length 7]
        [--methods eagle3 eagle3.1 p-eagle] [--jobs 3] [--out DIR] [--set KEY=VALUE ...]

Every (method, seed) trains the demo recipe (`recipe=demo draft.method=M train.ttt_length=L runtime.seed=S`, one
thread; --jobs at once) on the same shards, then decodes the 79 held-out demo turns greedily at each K
(`benchmarks/draft_quality.acceptance`: specgen.draft.speculative, which drafts each method as vLLM does).
Acceptance length = 1 + accepted draft tokens / verification rounds (vLLM's counting). train.ttt_length is the
depth trained (TTT steps for EAGLE, parallel slots for P-EAGLE): give it the largest K. --set adds train overrides
to every run (e.g. train.max_steps=200 for a short first number). Prints one table.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from draft_quality import REPO, _python_env, acceptance, generate_shards  # noqa: E402


def train_and_evaluate(method: str, seed: int, args) -> dict:
    ckpt = args.out / f"{method}-seed{seed}"
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "specgen.train", "recipe=demo", f"data.shards={args.shards}",
                    f"output.dir={ckpt}", f"draft.method={method}", f"train.ttt_length={args.ttt_length}",
                    f"runtime.seed={seed}", "runtime.threads=1", "runtime.progress=false", "train.tensorboard=false",
                    "train.eval_every=0", "output.overwrite=true", *args.set],
                   check=True, env=_python_env(), cwd=REPO, stdout=subprocess.DEVNULL)
    result = {"method": method, "seed": seed, "train_seconds": time.perf_counter() - start, "acceptance": {}}
    for k in args.ks:
        done = subprocess.run([sys.executable, __file__, "--evaluate", str(ckpt), str(k)], check=True,
                              env=_python_env(), cwd=REPO, capture_output=True, text=True)
        result["acceptance"][str(k)] = json.loads(done.stdout.strip().splitlines()[-1])["acceptance_length"]
    with open(args.out / "results.jsonl", "a") as f:
        f.write(json.dumps(result) + "\n")
    print(f"  {method} seed {seed}: " + " ".join(f"K={k} {v:.3f}" for k, v in result["acceptance"].items())
          + f" (train {result['train_seconds']:.0f}s)", flush=True)
    return result


def print_table(results: list[dict], ks: list[int]) -> None:
    print(f"\n{'method':<10} {'seeds':>5} " + " ".join(f"{'K=' + str(k) + ' (mean ± std)':>20}" for k in ks)
          + f" {'train s':>8}")
    for method in dict.fromkeys(r["method"] for r in results):
        group = [r for r in results if r["method"] == method]
        cells = []
        for k in ks:
            values = [r["acceptance"][str(k)] for r in group]
            std = statistics.stdev(values) if len(values) > 1 else 0.0
            cells.append(f"{statistics.mean(values):>12.3f} ± {std:.3f}")
        print(f"{method:<10} {len(group):>5} " + " ".join(f"{c:>20}" for c in cells)
              + f" {statistics.mean(r['train_seconds'] for r in group):>8.0f}")
    print("acceptance length = 1 + accepted / verification rounds, 79 held-out demo turns, greedy, 96 new tokens")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shards", type=Path)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--ks", type=int, nargs="+", default=[3, 5, 7])
    parser.add_argument("--ttt-length", type=int, default=7)
    parser.add_argument("--methods", nargs="+", default=["eagle3", "eagle3.1", "p-eagle"])
    parser.add_argument("--jobs", type=int, default=3)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE")
    parser.add_argument("--evaluate", nargs=2, help=argparse.SUPPRESS)  # internal: CKPT K -> JSON
    args = parser.parse_args()
    if args.evaluate:
        print(json.dumps(acceptance(args.evaluate[0], num_draft_tokens=int(args.evaluate[1]))))
        return
    args.out = args.out or Path(tempfile.mkdtemp(prefix="draft-methods-"))
    args.out.mkdir(parents=True, exist_ok=True)
    args.shards = args.shards or generate_shards(args.out / "shards")
    runs = [(method, seed) for seed in args.seeds for method in args.methods]
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda run: train_and_evaluate(*run, args), runs))
    print_table(results, args.ks)


if __name__ == "__main__":
    main()
