"""Draft training throughput: offline with data loading vs the same loop fed from memory, and online vs offline.

    python benchmarks/train.py [--target DIR] [--data FILE] [--rows 600] [--steps 20] [--workers 0 1]

In one run, on the same target, data, draft initialisation and batch plan:
  (a) offline, batches read from shards by the DataLoader (for each --workers value),
  (b) offline, the same batches materialised in memory first (no data loading in the loop): the limit for (a),
  (c) online, the target captures every batch inside the loop (nothing on disk).
Each variant runs --warmup steps untimed, then --steps timed optimizer steps, round-robin a few steps at a time so
a change in machine load hits every variant alike; fetching a batch is timed on its own ("waiting"). Target: data
loading costs <= 5% of the step time: the DataLoader variants wait < 5% and run at >= 0.95 x the in-memory speed.
Shards are generated first with specgen.generate (into a temporary folder, or --shards to reuse).
"""

import argparse
import itertools
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from specgen.assets import ASSETS_DIR
from specgen.config import compose, settings_of
from specgen.draft.batch import DraftBatch
from specgen.training.setup import Process, Training, build_training
from specgen.training.trainer import DraftTrainer

ROUND_STEPS = 4  # steps per variant per round-robin round


def make_trainer(overrides: list[str], out_dir: Path) -> Training:
    """Training as `specgen train` builds it (`specgen.training.setup.build_training`: the shipped loss, optimizer
    and schedule), single process on the CPU; the variants feed its trainer their own batches."""
    settings = settings_of("train", [*overrides, f"output.dir={out_dir}", "runtime.device=cpu",
                                     "train.tensorboard=false", "runtime.progress=false"])
    return build_training(settings, Process(torch.device("cpu")), out_dir)


@dataclass
class Variant:
    """One way of feeding the loop, with its own trainer and its time and token counts so far."""

    name: str
    trainer: DraftTrainer
    batches: Iterator[DraftBatch]
    seconds: float = 0.0
    waiting: float = 0.0
    tokens: int = 0

    def run(self, steps: int, timed: bool = True) -> None:
        """`steps` optimizer steps; the time spent fetching each batch is measured on its own."""
        for _ in range(steps):
            start = time.perf_counter()
            batch = next(self.batches)
            fetched = time.perf_counter()
            self.trainer.train_batch(batch)
            if timed:
                self.waiting += fetched - start
                self.seconds += time.perf_counter() - start
                self.tokens += batch.num_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=ASSETS_DIR / "tiny-target")
    parser.add_argument("--data", type=Path, default=ASSETS_DIR / "chat" / "train.jsonl")
    parser.add_argument("--shards", type=Path, help="reuse shards generated from --target and --data")
    parser.add_argument("--rows", type=int, default=600)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--ttt-length", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data_keys = [f"data.path={args.data}", f"data.max_rows={args.rows}", f"data.max_length={args.max_length}"]
        shards = args.shards
        if shards is None:
            from specgen.generate import run as generate

            shards = tmp / "shards"
            generate(compose("generate", [f"model.path={args.target}", f"output.dir={shards}",
                                          "runtime.progress=false", *data_keys]))
        keys = [f"model.path={args.target}", *data_keys, f"train.batch_tokens={args.batch_tokens}",
                f"train.ttt_length={args.ttt_length}", "train.max_batch_size=null"]
        offline_keys = [*keys, f"data.shards={shards}"]
        needed = args.warmup + args.steps
        variants = []
        for workers in args.workers:
            training = make_trainer([*offline_keys, f"train.num_workers={workers}"], tmp / f"w{workers}")
            if training.data.source.batches_per_epoch() < needed:
                raise SystemExit(f"only {training.data.source.batches_per_epoch()} batches: raise --rows or lower "
                                 "--steps")
            variants.append(Variant(f"offline, DataLoader {workers} workers", training.trainer,
                                    iter(training.data.source.epoch(0))))
        training = make_trainer([*offline_keys, "train.num_workers=0"], tmp / "memory")
        in_memory = [DraftBatch(*(t.clone() for t in b.tensors()), samples=b.samples)
                     for b in itertools.islice(training.data.source.epoch(0), needed)]
        variants.append(Variant("offline, batches in memory", training.trainer, iter(in_memory)))
        online = make_trainer([*keys, "mode=online"], tmp / "online")
        variants.append(Variant("online, target in the loop (capture = waiting)", online.trainer,
                                iter(online.data.source.epoch(0))))
        for variant in variants:
            variant.run(args.warmup, timed=False)
        # Round-robin, a few steps at a time, so a change in machine load hits every variant alike.
        for _ in range(args.steps // ROUND_STEPS):
            for variant in variants:
                variant.run(ROUND_STEPS)

    memory = next(v for v in variants if v.name.startswith("offline, batches in memory"))
    memory_speed = memory.tokens / memory.seconds
    print(f"\ndraft training on {args.target.name}, {args.steps} timed steps of <= {args.batch_tokens} padded tokens "
          f"per variant, TTT {args.ttt_length}, {args.threads} threads")
    print(f"{'variant':<50} {'tokens/s':>9} {'vs memory':>10} {'waiting':>8} {'tokens':>8}")
    for v in variants:
        speed = v.tokens / v.seconds
        print(f"{v.name:<50} {speed:>9,.0f} {speed / memory_speed:>10.3f} {100 * v.waiting / v.seconds:>7.2f}% "
              f"{v.tokens:>8,}")
    for v in variants:
        if v.name.startswith("offline, DataLoader"):
            print(f"data loading cost ({v.name.split(', ')[1]}): {100 * v.waiting / v.seconds:.2f}% of step time, "
                  f"{100 * (memory_speed * v.seconds / v.tokens - 1):+.1f}% time per token vs memory (target <= 5%)")


if __name__ == "__main__":
    main()
