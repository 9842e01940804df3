"""Draft training steps by optimizer on this machine: AdamW, and Muon with its Newton-Schulz iteration in bfloat16
(torch.optim.Muon's) or in float32 (specgen's choice on a CPU without native bfloat16 matmuls).

    python benchmarks/optimizer.py [--target DIR --shards DIR] [--steps 6] [--ttt-length 5] [--threads 2]

The same draft initialisation, the same batches (read from the shards into memory first), round-robin one step per
variant at a time so a change in machine load hits every variant alike. Prints seconds per step, the share of it
spent in optimizer.step(), tokens/s, and the mean training loss over the timed steps (the iteration's dtype changes
the speed, not what is learned). Without --shards, shards of the bundled tiny target are generated first.
"""

import argparse
import itertools
import tempfile
import time
import warnings
from pathlib import Path

import torch

from specgen.assets import ASSETS_DIR
from specgen.config import compose, settings_of
from specgen.runtime.dtype import DtypeChoice
from specgen.training.optim import Muon
from specgen.training.setup import Process, build_training

VARIANTS = {  # name -> (train.optimizer, dtype of Muon's iteration)
    "adamw": ("adamw", None),
    "muon, Newton-Schulz in bfloat16 (torch's)": ("muon", "bfloat16"),
    "muon, Newton-Schulz in float32": ("muon", "float32"),
}


class Timed:
    """Training as `specgen train` builds it with `train.optimizer`, its optimizer.step() timed on its own."""

    def __init__(self, overrides: list[str], optimizer_name: str, ns_dtype: str | None, out_dir: Path):
        settings = settings_of("train", [*overrides, f"train.optimizer={optimizer_name}", f"output.dir={out_dir}",
                                         "train.tensorboard=false", "runtime.progress=false"])
        training = build_training(settings, Process(torch.device("cpu")), out_dir)
        if isinstance(getattr(training.optimizer, "parts", {}).get("muon"), Muon):
            training.optimizer.parts["muon"].ns_dtype = DtypeChoice(ns_dtype, "benchmarks/optimizer.py")
        self.trainer, self.data = training.trainer, training.data
        self.optimizer_seconds = self.seconds = 0.0
        self.tokens, self.losses = 0, []
        built = self.trainer.strategy.optimizer
        step = built.step  # (as the trainer's scheduler wrapped it)

        def timed_step(*args, **kwargs):
            start = time.perf_counter()
            result = step(*args, **kwargs)
            self.optimizer_seconds += time.perf_counter() - start
            return result

        built.step = timed_step
        warnings.filterwarnings("ignore", message="Seems like `optimizer.step()` has been overridden")  # ours

    def run(self, batch, timed: bool = True) -> None:
        optimizer_before, start = self.optimizer_seconds, time.perf_counter()
        stats = self.trainer.train_batch(batch)
        if not timed:
            self.optimizer_seconds = optimizer_before
            return
        self.seconds += time.perf_counter() - start
        self.tokens += batch.num_tokens
        self.losses.append(self.trainer.settings.metrics(stats)["loss"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=ASSETS_DIR / "tiny-target")
    parser.add_argument("--data", type=Path, default=ASSETS_DIR / "chat" / "train.jsonl")
    parser.add_argument("--shards", type=Path, help="shards generated from --target (else generated here)")
    parser.add_argument("--rows", type=int, default=300)
    parser.add_argument("--batch-tokens", type=int, default=2048)
    parser.add_argument("--ttt-length", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        shards = args.shards
        if shards is None:
            from specgen.generate import run as generate

            shards = tmp / "shards"
            generate(compose("generate", [f"model.path={args.target}", f"data.path={args.data}",
                                          f"data.max_rows={args.rows}", f"output.dir={shards}",
                                          "runtime.progress=false"]))
        keys = [f"data.shards={shards}", f"model.path={args.target}", f"train.batch_tokens={args.batch_tokens}",
                f"train.ttt_length={args.ttt_length}", "runtime.device=cpu", "train.num_workers=0"]
        variants = {name: Timed(keys, *spec, tmp / str(i)) for i, (name, spec) in enumerate(VARIANTS.items())}
        data = next(iter(variants.values())).data
        batches = list(itertools.islice(data.source.epoch(0), args.steps + 1))
        if len(batches) < args.steps + 1:
            raise SystemExit(f"only {len(batches)} batches: raise --rows or lower --steps")
        for variant in variants.values():
            variant.run(batches[0], timed=False)  # warm-up
        for batch in batches[1:]:
            for variant in variants.values():
                variant.run(batch)

    base = variants["muon, Newton-Schulz in bfloat16 (torch's)"]
    print(f"\ndraft training on {args.target.name}, {args.steps} timed steps of <= {args.batch_tokens} tokens, "
          f"TTT {args.ttt_length}, {args.threads} threads")
    print(f"{'variant':<44} {'s/step':>7} {'in step()':>9} {'tokens/s':>9} {'vs torch Muon':>13} {'mean loss':>10}")
    for name, v in variants.items():
        loss = sum(v.losses) / len(v.losses) if v.losses else float("nan")
        print(f"{name:<44} {v.seconds / args.steps:>7.2f} {100 * v.optimizer_seconds / v.seconds:>8.1f}% "
              f"{v.tokens / v.seconds:>9,.0f} {base.seconds / v.seconds:>12.2f}x {loss:>10.4f}")


if __name__ == "__main__":
    main()
