"""Where a draft training step's time goes (issue 40): the product's own step, timed phase by phase and op by op.

    python benchmarks/train_profile.py --shards S [--device cuda] [--steps 8] [--warmup 3] [key=value ...]

The training is built as `specgen train data.shards=S key=value ...` builds it (`build_training`: the default draft,
loss, optimizer and batch plan unless key=value changes them) and `DraftTrainer.train_batch` runs every step. Its
parts are timed where the trainer calls them, each between two device synchronisations:

  data        the next batch from the trainer's own loader (reading shards, collating)
  target head the target's distribution at the scored positions (`batch_target`: lm_head + softmax, and the
              full-vocabulary argmax, or its `ArgmaxCache` after a sample's first epoch)
  forward     the method's objective: the draft unrolled over ttt_length steps, scored (`Strategy.forward`)
  backward    `Strategy.backward`
  optimizer   `Strategy.update` (clipping, the optimizer step, the schedule)
  rest        the step's remainder: moving the batch to the device, masks, statistics

Then `torch.profiler` records --profile-steps more steps, and the ops are summed into kinds by name (matmul,
softmax and loss, indexing, copies, elementwise and reductions, other) by their own time on the device (CUDA: the
kernels each op launched; CPU: the op's own CPU time), with the top ops and the count of ops a step runs (on a
GPU each costs a launch). The synchronisations add a little to every phase, so the phases' sum is the step with them;
the op table needs none.

Prints one table and writes it with every figure to --out (table.md, profile.json). CPU: the same, on the
machine's cores (--threads).
"""

import argparse
import itertools
import json
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

from specgen.config import settings_of
from specgen.training import trainer as trainer_module
from specgen.training.setup import Process, build_training

PHASES = ("data", "target head", "forward", "backward", "optimizer", "rest")
# op name -> kind: the first kind one of whose fragments the name contains (aten op names, as torch.profiler lists them)
KINDS = (
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm", "aten::linear",
                "aten::matmul", "aten::_flash", "aten::_efficient", "aten::_scaled_dot_product")),
    ("softmax and loss", ("softmax", "log_softmax", "aten::nll", "cross_entropy")),
    ("indexing", ("aten::index", "aten::nonzero", "aten::masked", "aten::gather", "aten::scatter",
                  "aten::index_put", "aten::_index_put", "aten::where", "aten::embedding")),
    ("copies", ("aten::copy_", "aten::_to_copy", "aten::cat", "aten::stack", "aten::clone", "aten::contiguous",
                "aten::fill_", "aten::zero_", "aten::zeros", "aten::full", "aten::empty", "aten::repeat_interleave")),
    ("elementwise and reductions", ("aten::mul", "aten::add", "aten::sub", "aten::div", "aten::pow",
                                    "aten::rsqrt", "aten::mean", "aten::sum", "aten::silu", "aten::neg",
                                    "aten::exp", "aten::sqrt", "aten::lerp", "aten::addcmul", "aten::addcdiv",
                                    "aten::_foreach", "aten::eq", "aten::ne", "aten::gt", "aten::lt", "aten::ge",
                                    "aten::bitwise", "aten::argmax", "aten::max", "aten::cummax", "aten::norm",
                                    "aten::clamp", "aten::sigmoid", "aten::threshold", "aten::logical",
                                    "aten::_amp", "aten::sign", "aten::abs", "aten::mv", "aten::dot")),
)


def kind_of(name: str) -> str:
    for kind, fragments in KINDS:
        if any(fragment in name for fragment in fragments):
            return kind
    return "other"


class PhaseClock:
    """Seconds per phase, each call between two device synchronisations."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds: dict[str, list[float]] = defaultdict(list)
        self.enabled = True

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            if not self.enabled:
                return fn(*args, **kwargs)
            self.sync()
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            self.sync()
            self.seconds[name].append(time.perf_counter() - start)
            return out
        return timed


def training_parser(description: str) -> argparse.ArgumentParser:
    """The arguments every script that builds a training here takes (--shards, --device, --threads, overrides);
    `parse` applies --threads."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--shards", type=Path, required=True, help="shards from specgen generate")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    parser.add_argument("overrides", nargs="*", help="specgen train key=value overrides")
    return parser


def parse(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """Parsed arguments of a `training_parser`, --threads applied."""
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


def build(args, out_dir: Path, overrides: list[str]):
    """The training `specgen train` builds for these keys, on one process of --device."""
    settings = settings_of("train", [f"data.shards={args.shards}", f"output.dir={out_dir}",
                                     f"runtime.device={args.device}", "runtime.progress=false",
                                     "train.tensorboard=false", *overrides])
    return build_training(settings, Process(torch.device(args.device)), out_dir)


def op_table(prof, device: torch.device, steps: int) -> tuple[dict, list, int]:
    """(seconds per step by kind, the top ops [(name, kind, seconds per step, calls per step)], ops per step)."""
    cuda = device.type == "cuda"
    by_kind: dict[str, float] = defaultdict(float)
    ops, calls = [], 0
    for event in prof.key_averages():
        if not event.key.startswith("aten::"):
            continue
        own = (event.self_device_time_total if cuda else event.self_cpu_time_total) / 1e6 / steps
        calls += event.count
        kind = kind_of(event.key)
        by_kind[kind] += own
        ops.append((event.key, kind, own, event.count / steps))
    ops.sort(key=lambda op: -op[2])
    return dict(by_kind), ops, calls // steps


def main() -> None:
    parser = training_parser(__doc__.split("\n")[0])
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=8, help="steps timed phase by phase")
    parser.add_argument("--profile-steps", type=int, default=3, help="steps under torch.profiler after them")
    parser.add_argument("--top", type=int, default=12, help="ops listed")
    parser.add_argument("--out", type=Path, default=None, help="folder for table.md and profile.json")
    args = parse(parser)
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        training = build(args, Path(tmp) / "train", args.overrides)
        trainer = training.trainer
        clock = PhaseClock(device)
        strategy = trainer.strategy
        strategy.forward = clock.wrap("forward", strategy.forward)
        strategy.backward = clock.wrap("backward", strategy.backward)
        strategy.update = clock.wrap("optimizer", strategy.update)
        trainer_module.batch_target = clock.wrap("target head", trainer_module.batch_target)
        # the batch plan's epochs one after the other (a small dataset is simply seen again)
        batches = itertools.chain.from_iterable(trainer.source.epoch(epoch) for epoch in itertools.count())
        fetch = clock.wrap("data", lambda: next(batches))
        steps, tokens = [], []
        for index in range(args.warmup + args.steps):
            timed = index >= args.warmup
            clock.enabled = timed
            clock.sync()
            start = time.perf_counter()
            batch = fetch()
            trainer.train_batch(batch)
            clock.sync()
            if timed:
                steps.append(time.perf_counter() - start)
                tokens.append(batch.num_tokens)
            else:
                clock.seconds.clear()
        clock.enabled = False
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(args.profile_steps):
                trainer.train_batch(next(batches))
            clock.sync()
        by_kind, ops, ops_per_step = op_table(prof, device, args.profile_steps)
        params = sum(p.numel() for p in training.draft.parameters() if p.requires_grad)
    step = statistics.mean(steps)
    phases = {name: statistics.mean(clock.seconds[name]) if name in clock.seconds else 0.0
              for name in PHASES if name != "rest"}
    phases["rest"] = max(0.0, step - sum(phases.values()))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    lines = [f"{name} · shards {args.shards} · {' '.join(args.overrides) or 'default settings'} · "
             f"{args.steps} timed steps (after {args.warmup}), {statistics.mean(tokens):,.0f} real tokens a step, "
             f"{sum(tokens) / sum(steps):,.0f} tokens/s · draft {params / 1e6:.1f}M trained parameters", "",
             "| phase | ms per step | share |", "|---|---|---|"]
    lines += [f"| {phase} | {1e3 * seconds:.1f} | {seconds / step:.1%} |" for phase, seconds in phases.items()]
    lines += [f"| step | {1e3 * step:.1f} | 100% |", "",
              f"ops ({'device time, the kernels each op launched' if device.type == 'cuda' else 'own CPU time'}; "
              f"{ops_per_step:,} aten ops a step):", "", "| kind | ms per step | share of op time |", "|---|---|---|"]
    total = sum(by_kind.values()) or 1.0
    lines += [f"| {kind} | {1e3 * seconds:.1f} | {seconds / total:.1%} |"
              for kind, seconds in sorted(by_kind.items(), key=lambda kv: -kv[1])]
    lines += ["", "| op | kind | ms per step | calls per step |", "|---|---|---|---|"]
    lines += [f"| {op} | {kind} | {1e3 * seconds:.2f} | {calls:.0f} |" for op, kind, seconds, calls in ops[:args.top]]
    table = "\n".join(lines)
    print(table, flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "table.md").write_text(table + "\n")
        (args.out / "profile.json").write_text(json.dumps({
            "device": name, "overrides": args.overrides, "step_s": step, "tokens_per_step": statistics.mean(tokens),
            "phases_s": phases, "kinds_s": by_kind, "ops_per_step": ops_per_step,
            "ops": [{"op": op, "kind": kind, "s": seconds, "calls": calls} for op, kind, seconds, calls in ops]},
            indent=1))


if __name__ == "__main__":
    main()
