"""Acceptance length per draft method (eagle3, eagle3.1, p-eagle, dflash) at several K on the demo recipe's shards.

    python benchmarks/draft_methods.py [--shards DIR] [--seeds 0 1 2] [--ks 3 5 7] [--ttt-length 7]
        [--methods eagle3 eagle3.1 p-eagle dflash] [--jobs 2] [--out DIR] [--set KEY=VALUE ...]
        [--vllm-python .venv-vllm/bin/python [--vllm-seeds 0]]

Every (method, seed) trains the demo recipe (`recipe=demo draft.method=M train.ttt_length=L runtime.seed=S`, one
thread; --jobs at once) on the same shards, then decodes the 79 held-out demo turns greedily at each K
(`benchmarks/draft_quality.acceptance`: specgen.draft.speculative, which drafts each method as vLLM does).
Acceptance length = 1 + accepted draft tokens / verification rounds (vLLM's counting). train.ttt_length is the
depth trained (TTT steps for EAGLE, parallel slots for P-EAGLE): give it the largest K. --set adds train overrides
to every run (e.g. train.max_steps=200 for a short first number). Training cost is the train process's own CPU
seconds (one thread, so about its wall time on a quiet core; wall seconds beside it). DFlash trains one block of
ttt_length masks (draft.dflash.block_size = ttt_length + 1) and is served with its first K. Prints one table.

With --vllm-python (vLLM's venv, .ci/vllm-venv), each draft of --vllm-seeds is also served by vLLM's CPU build at
every K on the same turns (tests/vllm_replay.py, float32, greedy, up to 8 sequences at once), with the target alone
as the baseline: vLLM's own acceptance length (which must equal specgen's count) and generated tokens per second.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from draft_quality import REPO, _python_env, acceptance, generate_shards  # noqa: E402
from served_acceptance import draft_flags, replay  # noqa: E402

TARGET = REPO / "specgen" / "assets" / "tiny-target"


def train_and_evaluate(method: str, seed: int, args) -> dict:
    ckpt = args.out / f"{method}-seed{seed}"
    method_keys = [f"draft.dflash.block_size={args.ttt_length + 1}"] if method == "dflash" else []
    start = time.perf_counter()
    train = subprocess.Popen([sys.executable, "-m", "specgen.train", "recipe=demo", f"data.shards={args.shards}",
                              f"output.dir={ckpt}", f"draft.method={method}", f"train.ttt_length={args.ttt_length}",
                              f"runtime.seed={seed}", "runtime.threads=1", "runtime.progress=false",
                              "train.tensorboard=false", "train.eval_every=0", "output.overwrite=true", *method_keys,
                              *args.set], env=_python_env(), cwd=REPO, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(train.pid, 0)  # this child's own CPU time: comparable on a loaded machine
    train.returncode = os.waitstatus_to_exitcode(status)
    if train.returncode:
        raise subprocess.CalledProcessError(train.returncode, train.args)
    result = {"method": method, "seed": seed, "train_seconds": time.perf_counter() - start,
              "train_cpu_seconds": usage.ru_utime + usage.ru_stime, "acceptance": {}, "vllm": {}}
    for k in args.ks:
        samples = ckpt / f"turns-k{k}.jsonl"
        done = subprocess.run([sys.executable, __file__, "--evaluate", str(ckpt), str(k), str(samples)], check=True,
                              env=_python_env(), cwd=REPO, capture_output=True, text=True)
        counted = json.loads(done.stdout.strip().splitlines()[-1])
        result["acceptance"][str(k)] = counted["acceptance_length"]
        if args.vllm_python and seed in args.vllm_seeds:
            served = serve(args, samples, *draft_flags(ckpt, k))
            result["vllm"][str(k)] = {"acceptance_length": served["acceptance_length"],
                                      "tokens_per_second": served["output_tokens_per_second"],
                                      "counts_equal": (served["num_drafts"], served["num_accepted_tokens"])
                                      == (counted["rounds"], counted["accepted"])}
    with open(args.out / "results.jsonl", "a") as f:
        f.write(json.dumps(result) + "\n")
    print(f"  {method} seed {seed}: " + " ".join(f"K={k} {v:.3f}" for k, v in result["acceptance"].items())
          + f" (train {result['train_seconds']:.0f} s wall, {result['train_cpu_seconds']:.0f} CPU-s)" + "".join(
              f" | vLLM K={k} {v['acceptance_length']:.3f} {v['tokens_per_second']:.1f} tok/s"
              f"{'' if v['counts_equal'] else ' COUNTS DIFFER'}" for k, v in result["vllm"].items()), flush=True)
    return result


def serve(args, samples: Path, *flags: str) -> dict:
    """The turns specgen decoded, replayed by vLLM (the target alone without flags): its counters and tokens/s."""
    out = samples.with_name(samples.stem + ("-vllm.json" if flags else "-vllm-target.json"))
    return replay(args.vllm_python, samples, out, TARGET, 96, *flags)


def print_table(results: list[dict], ks: list[int], target_tokens_per_second: float | None = None) -> None:
    print(f"\n{'method':<10} {'seeds':>5} " + " ".join(f"{'K=' + str(k) + ' (mean ± std)':>20}" for k in ks)
          + f" {'train CPU-s':>11} {'wall s':>7}")
    for method in dict.fromkeys(r["method"] for r in results):
        group = [r for r in results if r["method"] == method]
        cells = []
        for k in ks:
            values = [r["acceptance"][str(k)] for r in group]
            std = statistics.stdev(values) if len(values) > 1 else 0.0
            cells.append(f"{statistics.mean(values):>12.3f} ± {std:.3f}")
        print(f"{method:<10} {len(group):>5} " + " ".join(f"{c:>20}" for c in cells)
              + f" {statistics.mean(r['train_cpu_seconds'] for r in group):>11.0f}"
              f" {statistics.mean(r['train_seconds'] for r in group):>7.0f}")
    print("acceptance length = 1 + accepted / verification rounds, 79 held-out demo turns, greedy, 96 new tokens")
    served = [(r["method"], r["seed"], k, v) for r in results for k, v in r["vllm"].items()]
    if served:
        print(f"\nvLLM's CPU build, same turns (float32, greedy, max 8 sequences at once); target alone: "
              f"{target_tokens_per_second:.1f} generated tokens/s")
        print(f"{'method':<10} {'seed':>4} {'K':>3} {'vLLM acceptance':>16} {'tokens/s':>9} {'vs target':>9}  counts")
        for method, seed, k, v in served:
            print(f"{method:<10} {seed:>4} {k:>3} {v['acceptance_length']:>16.3f} {v['tokens_per_second']:>9.1f} "
                  f"{v['tokens_per_second'] / target_tokens_per_second:>8.2f}x  "
                  f"{'equal to specgen' if v['counts_equal'] else 'DIFFER'}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shards", type=Path)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--ks", type=int, nargs="+", default=[3, 5, 7])
    parser.add_argument("--ttt-length", type=int, default=7)
    parser.add_argument("--methods", nargs="+", default=["eagle3", "eagle3.1", "p-eagle", "dflash"])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE")
    parser.add_argument("--vllm-python", help="vLLM's venv python: also serve the drafts in vLLM")
    parser.add_argument("--vllm-seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--evaluate", nargs=3, help=argparse.SUPPRESS)  # internal: CKPT K SAMPLES -> JSON
    args = parser.parse_args()
    if args.evaluate:
        print(json.dumps(acceptance(args.evaluate[0], num_draft_tokens=int(args.evaluate[1]),
                                    samples_out=args.evaluate[2])))
        return
    args.out = args.out or Path(tempfile.mkdtemp(prefix="draft-methods-"))
    args.out.mkdir(parents=True, exist_ok=True)
    args.shards = args.shards or generate_shards(args.out / "shards")
    runs = [(method, seed) for seed in args.seeds for method in args.methods]
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda run: train_and_evaluate(*run, args), runs))
    target_tokens_per_second = None
    if args.vllm_python:  # the baseline: the target alone on the first served draft's turns (the same at every K)
        first = next(r for r in results if r["vllm"])
        turns = args.out / f"{first['method']}-seed{first['seed']}" / f"turns-k{args.ks[0]}.jsonl"
        target_tokens_per_second = serve(args, turns)["output_tokens_per_second"]
    print_table(results, args.ks, target_tokens_per_second)


if __name__ == "__main__":
    main()
