"""Draft training throughput: offline with data loading vs the same loop fed from memory, and online vs offline.

    python benchmarks/train.py [--target DIR] [--data FILE] [--rows 256] [--steps 20] [--workers 0 2]

In one run, on the same target, data, draft initialisation and batch plan:
  (a) offline, batches read from shards by the DataLoader (for each --workers value),
  (b) offline, the same batches materialised in memory first (no data loading in the loop): the limit for (a),
  (c) online, the target captures every batch inside the loop (nothing on disk).
Each variant runs --warmup steps untimed, then --steps timed optimizer steps (data fetch included in the time).
Target: data loading costs <= 5% of step time, i.e. (a) >= 0.95 x (b).
Shards are generated first with specgen.generate (into a temporary folder, or --shards to reuse).
"""

import argparse
import itertools
import tempfile
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from specgen.assets import ASSETS_DIR
from specgen.config import CONF_DIR, _hydra_argv
from specgen.draft.batches import BatchPlan
from specgen.draft.distributed import DDPBackend
from specgen.draft.target_head import TargetHead
from specgen.draft.trainer import DraftTrainer, LoopSettings
from specgen.draft.ttt import DraftBatch, TTTObjective
from specgen.draft.vocab import VocabMapping
from specgen.train import TrainingData, build_draft, offline_data, online_data


def stage_config(stage: str, overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name=stage, overrides=_hydra_argv(overrides))


def make_trainer(cfg, data: TrainingData, out_dir: Path) -> DraftTrainer:
    """A fresh draft (same seed every time) and a single-process trainer around it."""
    torch.manual_seed(0)
    draft = build_draft(cfg, data, None)
    objective = TTTObjective(draft, ttt_length=cfg.train.ttt_length, decay=cfg.train.ttt_decay)
    optimizer = torch.optim.AdamW(draft.trainable_parameters(), lr=cfg.train.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    backend = DDPBackend(objective, optimizer, scheduler, device=torch.device("cpu"), world_size=1, grad_accum=1,
                         grad_clip=cfg.train.grad_clip)
    head = TargetHead(data.lm_head, VocabMapping.from_d2t(draft.d2t, draft.config.vocab_size))
    settings = LoopSettings(total_steps=0, grad_accum=1, ttt_decay=cfg.train.ttt_decay, log_every=1,
                            save_every=None, autocast_dtype=None)
    return DraftTrainer(backend=backend, head=head, source=data.source, settings=settings, out_dir=out_dir,
                        save_draft=lambda state: None, is_main=True, progress=False)


def timed(trainer: DraftTrainer, batches, warmup: int, steps: int) -> tuple[float, int]:
    """tokens/s over `steps` optimizer steps after `warmup`, fetching each batch inside the timed region."""
    iterator = iter(batches)
    for batch in itertools.islice(iterator, warmup):
        trainer.train_batch(batch)
    tokens, start = 0, time.perf_counter()
    for batch in itertools.islice(iterator, steps):
        trainer.train_batch(batch)
        tokens += batch.num_tokens
    return tokens / (time.perf_counter() - start), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=ASSETS_DIR / "tiny-target")
    parser.add_argument("--data", type=Path, default=ASSETS_DIR / "chat" / "train.jsonl")
    parser.add_argument("--shards", type=Path, help="reuse shards generated from --target and --data")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--ttt-length", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data_keys = [f"data.path={args.data}", f"data.max_rows={args.rows}", f"data.max_length={args.max_length}"]
        shards = args.shards
        if shards is None:
            from specgen.generate import run as generate

            shards = tmp / "shards"
            generate(stage_config("generate", [f"model.path={args.target}", f"output.dir={shards}",
                                               "runtime.progress=false", *data_keys]))
        cfg = stage_config("train", [f"data.shards={shards}", f"model.path={args.target}", *data_keys,
                                     f"output.dir={tmp / 'ckpt'}", f"train.batch_tokens={args.batch_tokens}",
                                     f"train.ttt_length={args.ttt_length}", "runtime.device=cpu"])
        plan = BatchPlan(batch_tokens=args.batch_tokens, max_batch_size=None, seed=0)
        needed = args.warmup + args.steps
        rows = []
        offline = offline_data(cfg, plan, torch.device("cpu"))
        if offline.source.batches_per_epoch() < needed:
            raise SystemExit(f"only {offline.source.batches_per_epoch()} batches: raise --rows or lower --steps")
        for workers in args.workers:
            offline.source.num_workers = workers
            speed, tokens = timed(make_trainer(cfg, offline, tmp), offline.source.epoch(0), args.warmup, args.steps)
            rows.append((f"offline, DataLoader {workers} workers", speed, tokens))
        in_memory = [DraftBatch(*(t.clone() for t in (b.input_ids, b.loss_mask, b.aux_hidden_states,
                                                      b.last_hidden_state, b.lengths)))
                     for b in itertools.islice(offline.source.epoch(0), needed)]
        memory_speed, tokens = timed(make_trainer(cfg, offline, tmp), in_memory, args.warmup, args.steps)
        rows.append(("offline, batches in memory", memory_speed, tokens))
        online = online_data(cfg, plan, torch.device("cpu"))
        speed, tokens = timed(make_trainer(cfg, online, tmp), online.source.epoch(0), args.warmup, args.steps)
        rows.append(("online, target in the loop", speed, tokens))

    print(f"\ndraft training on {args.target.name}, {args.steps} timed steps of <= {args.batch_tokens} padded tokens, "
          f"TTT {args.ttt_length}, {args.threads} threads")
    print(f"{'variant':<34} {'tokens/s':>10} {'vs memory':>10} {'tokens':>8}")
    for name, speed, tokens in rows:
        print(f"{name:<34} {speed:>10,.0f} {speed / memory_speed:>10.3f} {tokens:>8,}")
    for name, speed, _ in rows:
        if name.startswith("offline, DataLoader"):
            print(f"data loading overhead ({name.split(', ')[1]}): {100 * (memory_speed / speed - 1):.1f}% of step "
                  "time (target <= 5%)")


if __name__ == "__main__":
    main()
