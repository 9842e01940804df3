"""Does a draft trained on fp8 shards match one trained on bf16 shards? Loss, accuracy and acceptance, side by side.

Generates the same rows twice from one target (`output.codec` default = bf16, and `output.codec=fp8`), trains an
EAGLE-3 draft on each with `python -m specgen.train` for every seed given (same seed = same data order and init,
so the codec is the only difference), and evaluates each draft with `python -m specgen.evaluate` (greedy
speculative decoding on held-out prompts). Seed-to-seed spread on the same shards is the noise the fp8-vs-bf16
difference is judged against.

Needs a trained target (a random one makes every number meaningless), e.g. the bundled one or
`python -m specgen.assets.train_target --out DIR`, and `specgen.train` / `specgen.evaluate` in this checkout.

  python benchmarks/fp8_training.py --target DIR [--rows 400] [--epochs 2] [--seeds 0 1] [--eval-prompts 40]
      [--train train.batch_tokens=2048 train.lr=1e-3 ...]   (extra specgen.train overrides, e.g. for a CPU run)
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import mean

from specgen.assets import ASSETS_DIR

REPO = Path(__file__).resolve().parent.parent
CODECS = {"bf16": [], "fp8": ["output.codec=fp8"]}


def stage(name: str, *overrides: str, required: bool = True) -> bool:
    """Run `python -m specgen.<name>` in its own process (as a user would); a failure stops the benchmark when
    `required`, else it is reported and the run goes on (False)."""
    cmd = [sys.executable, "-m", f"specgen.{name}", "runtime.progress=false", *overrides]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    if result.returncode != 0:
        message = f"{' '.join(cmd)} failed:\n{result.stderr[-3000:]}"
        if required:
            sys.exit(message)
        print(message, file=sys.stderr)
    return result.returncode == 0


def final_metrics(train_dir: Path, tail: float = 0.2) -> dict:
    """Training loss and per-step accuracy averaged over the last `tail` of the logged windows."""
    lines = [json.loads(line) for line in (train_dir / "metrics.jsonl").read_text().splitlines()]
    last = lines[-max(1, int(len(lines) * tail)):]
    accuracies = sorted(k for k in last[0] if k.startswith("acc_"))
    return {"loss": mean(m["loss"] for m in last), "acc_0": mean(m["acc_0"] for m in last),
            "acc_mean": mean(mean(m[k] for k in accuracies) for m in last)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help="a trained target model folder")
    parser.add_argument("--data", default=str(ASSETS_DIR / "chat" / "train.jsonl"), help="conversations (data.path)")
    parser.add_argument("--rows", type=int, default=400)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--eval-prompts", type=int, default=40)
    parser.add_argument("--train", nargs="*", default=[], help="extra specgen.train overrides")
    parser.add_argument("--work", help="keep shards and drafts here (default: a temporary folder)")
    args = parser.parse_args()
    if not (REPO / "specgen" / "train.py").exists():
        sys.exit("pending: specgen.train is not in this checkout; run this once the trainer is merged")

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        results, bytes_per_token = {}, {}
        for codec, overrides in CODECS.items():
            shards = work / f"shards-{codec}"
            stage("generate", f"model.path={args.target}", f"data.path={args.data}", f"output.dir={shards}",
                  f"data.max_rows={args.rows}",
                  f"data.max_length={args.max_length}", *overrides)
            bytes_per_token[codec] = json.loads((shards / "manifest.json").read_text())["stats"]["bytes_per_token"]
            for seed in args.seeds:
                draft = work / f"draft-{codec}-{seed}"
                stage("train", f"data.shards={shards}", f"output.dir={draft}", f"train.epochs={args.epochs}",
                      f"runtime.seed={seed}", "train.tensorboard=false", "output.overwrite=true", *args.train)
                evaluation = work / f"eval-{codec}-{seed}"
                evaluated = stage("evaluate", f"draft.path={draft}", f"model.path={args.target}",
                                  f"output.dir={evaluation}", f"evaluate.max_prompts={args.eval_prompts}", required=False)
                acceptance = (json.loads((evaluation / "eval.json").read_text())["acceptance_length"] if evaluated
                              else float("nan"))
                results[codec, seed] = {**final_metrics(draft), "acceptance": acceptance}

    print(f"\ntarget {args.target}; rows={args.rows} epochs={args.epochs} {' '.join(args.train)}; bytes/token bf16 "
          f"{bytes_per_token['bf16']:,.0f}, fp8 {bytes_per_token['fp8']:,.0f} "
          f"({bytes_per_token['fp8'] / bytes_per_token['bf16']:.2f}x)")
    columns = ["loss", "acc_0", "acc_mean", "acceptance"]
    print(f"{'shards':<8}{'seed':>6}" + "".join(f"{c:>12}" for c in columns))
    for (codec, seed), r in results.items():
        print(f"{codec:<8}{seed:>6}" + "".join(f"{r[c]:>12.4f}" for c in columns))
    print("\n|fp8 - bf16| at the same seed (codec effect) vs |seed a - seed b| on the same shards (noise)")
    for c in columns:
        codec_gap = mean(abs(results["fp8", s][c] - results["bf16", s][c]) for s in args.seeds)
        noise = [abs(results[k, a][c] - results[k, b][c]) for k in CODECS for a, b in zip(args.seeds, args.seeds[1:])]
        print(f"{c:<12} codec {codec_gap:.4f}   seed noise {mean(noise) if noise else float('nan'):.4f}")


if __name__ == "__main__":
    main()
