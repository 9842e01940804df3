"""Scale-out and overlap: processes, the background writer, and memory against the number of captured layers.

  (1) scaling   the same job as 1 process and as 2 processes (`accelerate launch --multi_gpu --num_processes 2`, which
                starts CPU processes joined by gloo on a machine without GPUs), one compute thread per process, plus
                1 process with 2 threads; tokens/s of the whole job from its manifest.
  (2) overlap   in one process, on the same tokenized units: the bare backbone forward (no capture, no I/O), capture
                with writing skipped (a shard writer that drops the batches), capture + the background writer (what
                generate does), and capture + writing inline on the main thread (no overlap). Target: background
                writer >= 0.95 of the run that skips writing.
  (3) memory    peak resident memory of the generate loop (above the process's memory once the target is loaded
                and paged in) against the number of captured layers, and against the model depth at a fixed number
                of captured layers.
  (4) uneven    2 processes on rows whose work units alternate long and short rows (a static unit % 2 split would
                give one process 2/3 of the tokens) against the same rows mixed in every unit, and 1 process: with
                dynamic claims the uneven job should take no longer than the even one (target: within 1.1x).

Each measurement runs in a fresh process. Models are tiny random Llamas carrying the bundled 2048-token tokenizer.
Compute runs on one thread per process by default: on a small shared CPU box, two OpenMP threads per process are
not faster than one (see the "1 process x 2 threads" row) and make the timings erratic.

  python benchmarks/distributed.py [--rows 200] [--hidden 256] [--layers 8] [--threads 1] [--device auto]
      [--skip scaling,overlap,memory,uneven]
"""

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from specgen.assets import ASSETS_DIR  # noqa: E402

DATA = ASSETS_DIR / "chat" / "train.jsonl"


def build_model(out_dir: Path, hidden: int, layers: int, dtype: str) -> Path:
    import transformers as tf

    if (out_dir / "config.json").exists():
        return out_dir
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=2048, hidden_size=hidden, intermediate_size=3 * hidden,
                            num_hidden_layers=layers, num_attention_heads=max(hidden // 64, 1),
                            num_key_value_heads=max(hidden // 128, 1), max_position_embeddings=4096,
                            tie_word_embeddings=False)
    tf.AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype)).save_pretrained(out_dir)
    tf.AutoTokenizer.from_pretrained(ASSETS_DIR / "tokenizer").save_pretrained(out_dir)
    return out_dir


def generate_args(model: Path, out_dir: Path, args, *extra: str) -> list[str]:
    return [f"model.path={model}", f"data.path={ASSETS_DIR / 'chat' / 'train.jsonl'}", f"output.dir={out_dir}",
            f"data.max_rows={args.rows}", "data.max_length=512",
            "output.shard_size=50", f"capture.batch_tokens={args.batch_tokens}", f"runtime.device={args.device}",
            "runtime.progress=false", *extra]


# ---------------------------------------------------------------------------------------------------- (1) scaling

def scaling(model: Path, work: Path, args) -> list[tuple[str, float]]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    runs = {
        "1 process x 1 thread": ([sys.executable, "-m", "specgen.generate"], {"OMP_NUM_THREADS": "1"}),
        "2 processes x 1 thread": ([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
                                    "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
                                    "--dynamo_backend", "no", "-m", "specgen.generate"], {"OMP_NUM_THREADS": "1"}),
        "1 process x 2 threads": ([sys.executable, "-m", "specgen.generate"], {"OMP_NUM_THREADS": "2"}),
    }
    results = []
    for name, (cmd, extra_env) in runs.items():
        out_dir = work / name.replace(" ", "_")
        proc = subprocess.run([*cmd, *generate_args(model, out_dir, args)], cwd=REPO, env={**env, **extra_env},
                              capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        last_run = json.loads((out_dir / "manifest.json").read_text())["last_run"]
        results.append((name, last_run["tokens_per_second"]))
    return results


# ---------------------------------------------------------------------------------------------------- (4) uneven

UNEVEN_UNIT_ROWS = 25


def uneven_data(work: Path, rows: int) -> tuple[Path, Path]:
    """The same rows in two orders, as work units of UNEVEN_UNIT_ROWS rows: `uneven` alternates a unit of long rows
    (each conversation said twice) with a unit of short ones, so a static `unit % 2` split would hand one process
    all the long rows (2/3 of the tokens); `even` mixes long and short rows in every unit. Same tokens in both."""
    work.mkdir(parents=True, exist_ok=True)
    source = [json.loads(line) for line in (ASSETS_DIR / "chat" / "train.jsonl").read_text().splitlines()[:rows]]
    half = len(source) // 2
    long = [{**row, "id": f"long-{i}", "conversations": row["conversations"] * 2}
            for i, row in enumerate(source[:half])]
    short = [{**row, "id": f"short-{i}"} for i, row in enumerate(source[half:2 * half])]
    uneven, even = [], []
    for start in range(0, half, UNEVEN_UNIT_ROWS):
        uneven += long[start:start + UNEVEN_UNIT_ROWS] + short[start:start + UNEVEN_UNIT_ROWS]
        for a, b in zip(long[start:start + UNEVEN_UNIT_ROWS], short[start:start + UNEVEN_UNIT_ROWS]):
            even += [a, b]
    paths = work / "uneven.jsonl", work / "even.jsonl"
    for path, data in zip(paths, (uneven, even)):
        path.write_text("".join(json.dumps(row) + "\n" for row in data))
    return paths


def uneven(model: Path, work: Path, args) -> list[dict]:
    """2 processes on the uneven and the even order of the same rows (and 1 process on the uneven one):
    job seconds, tokens, and units each process claimed, from the manifests."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "specgen.generate"]
    uneven_path, even_path = uneven_data(work / "data", args.rows)
    results = []
    for repeat in range(args.repeats):
        for name, cmd, data in (("2 processes, uneven units", launch, uneven_path),
                                ("2 processes, even units", launch, even_path),
                                ("1 process, uneven units", [sys.executable, "-m", "specgen.generate"], uneven_path)):
            out_dir = work / f"{name.replace(' ', '_').replace(',', '')}-{repeat}"
            overrides = [arg for arg in generate_args(model, out_dir, args) if not arg.startswith(("data.path=",
                         "output.shard_size="))]
            proc = subprocess.run([*cmd, *overrides, f"data.path={data}", f"output.shard_size={UNEVEN_UNIT_ROWS}",
                                   "capture.prefix_reuse=false"], cwd=REPO, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                sys.exit(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
            manifest = json.loads((out_dir / "manifest.json").read_text())
            results.append({"name": name, "seconds": manifest["last_run"]["seconds"],
                            "tokens": manifest["stats"]["tokens"],
                            "units": manifest["last_run"].get("units_by_process") or {}})
    return results


# ---------------------------------------------------------------------------------------------------- (2) overlap

class DroppingShardWriter:
    """A shard writer that accepts batches and writes nothing: the "skip writing" run."""

    def __init__(self, out_dir, index, spec):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        pass

    def write(self, rows):
        pass

    def commit(self, stats, rejected, extra=None):
        pass


class InlineWriter:
    """The BackgroundWriter interface, but writing on the caller's thread (no overlap), for contrast."""

    def __init__(self, out_dir, spec):
        from specgen.store.writer import ShardWriter

        self.out_dir, self.spec, self.shard_writer = out_dir, spec, ShardWriter

    def begin(self, unit):
        self.shard = self.shard_writer(self.out_dir, unit, self.spec)

    def write(self, rows, ready):
        if ready is not None:
            ready.synchronize()
        self.shard.write(rows)

    def commit(self, stats, rejected, source_rows, extra=None):
        self.shard.commit(stats, rejected, extra)


def setup(model: Path, args, work: Path, *extra: str):
    """What generate does before its loop: config, workers, tokenizer, target, tokenized units."""
    import itertools

    from specgen.config import compose
    from specgen.data.sources import iter_records
    from specgen.data.template import ChatTemplateTokenizer
    from specgen.ranks import init_workers
    from specgen.data.sources import work_units
    from specgen.capture.loading import load_capture
    from specgen.capture.units import prepare_unit
    from specgen.runtime import load_tokenizer

    cfg = compose("generate", generate_args(model, work, args, *extra))
    workers = init_workers(cfg.runtime.device)
    tokenizer = load_tokenizer(cfg.tokenizer.path)
    chat = ChatTemplateTokenizer(tokenizer, max_length=cfg.data.max_length)
    target = load_capture(cfg, tokenizer, workers.device)
    records = itertools.islice(iter_records(cfg.data.path), cfg.data.max_rows)
    units = [prepare_unit(cfg, unit, rows, chat) for unit, rows in work_units(records, cfg.output.shard_size)]
    return cfg, workers, target, units


def timed_loop(cfg, workers, target, units, writer_factory) -> float:
    """Seconds for generate's capture loop over `units` with the given writer."""
    from contextlib import nullcontext

    from specgen.ranks.monitor import JobMonitor
    from specgen.capture.units import capture_units

    monitor = JobMonitor(workers, None, enabled=False, heartbeat_s=2.0)
    units = copy.deepcopy(units)  # capture_units adds to each unit's stats
    synchronize = torch.cuda.synchronize if workers.device.type == "cuda" else (lambda: None)
    synchronize()
    start = time.perf_counter()
    writer = writer_factory()
    with writer if hasattr(writer, "__exit__") else nullcontext(writer):
        capture_units(cfg, units, target, writer, monitor, workers.device)
    synchronize()
    return time.perf_counter() - start


def bare_forward(cfg, workers, target, units) -> float:
    from specgen.data.batching import token_budget_batches

    backbone = target.capture.model.model
    synchronize = torch.cuda.synchronize if workers.device.type == "cuda" else (lambda: None)
    synchronize()
    start = time.perf_counter()
    with torch.inference_mode():
        for unit in units:
            for batch in token_budget_batches(unit.samples, cfg.capture.batch_tokens, cfg.capture.max_batch_size):
                ids = torch.full((len(batch), max(len(s) for s in batch)), target.pad_id, dtype=torch.long)
                for b, s in enumerate(batch):
                    ids[b, : len(s)] = torch.tensor(s.input_ids)
                backbone(input_ids=ids.to(workers.device))
    synchronize()
    return time.perf_counter() - start


def overlap_child(model: Path, args, work: Path) -> dict:
    from specgen.pipeline import BackgroundWriter

    cfg, workers, target, units = setup(model, args, work / "unused")
    tokens = sum(unit.stats["tokens"] for unit in units)
    counter = iter(range(10**6))

    def fresh_dir() -> Path:
        path = work / f"run-{next(counter)}"
        path.mkdir(parents=True)
        return path

    def background(shard_writer=None):
        kwargs = {"shard_writer": shard_writer} if shard_writer else {}
        return lambda: BackgroundWriter(fresh_dir(), target.spec, depth=cfg.pipeline.write_queue,
                                        on_batch=lambda t: None, on_commit=lambda r: None, **kwargs)

    methods = {"bare forward": lambda: bare_forward(cfg, workers, target, units),
               "capture, writing skipped": lambda: timed_loop(cfg, workers, target, units,
                                                              background(DroppingShardWriter)),
               "capture + background writer": lambda: timed_loop(cfg, workers, target, units, background()),
               "capture + inline writer": lambda: timed_loop(cfg, workers, target, units,
                                                             lambda: InlineWriter(fresh_dir(), target.spec))}
    bare_forward(cfg, workers, target, units[:1])  # warm-up
    best = {name: float("inf") for name in methods}
    for _ in range(args.repeats):  # interleaved, best of N: the machine is shared and noisy
        for name, method in methods.items():
            best[name] = min(best[name], method())
    return {"tokens": tokens, "seconds": best}


# ---------------------------------------------------------------------------------------------------- (3) memory

def vm_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def memory_child(model: Path, args, work: Path, aux_layers: list[int]) -> dict:
    from specgen.pipeline import BackgroundWriter

    cfg, workers, target, units = setup(model, args, work / "unused", f"capture.aux_layers={aux_layers}")
    for parameter in target.capture.model.parameters():  # the weights are memory-mapped: page them all in now
        parameter.sum()
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current resident set
    before = vm_kb("VmRSS")
    timed_loop(cfg, workers, target, units, lambda: BackgroundWriter(
        work / "shards", target.spec, depth=cfg.pipeline.write_queue, on_batch=lambda t: None,
        on_commit=lambda r: None))
    return {"loaded_mb": before / 1024, "growth_mb": (vm_kb("VmHWM") - before) / 1024}


# ---------------------------------------------------------------------------------------------------- driver

def child(args) -> None:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.child == "overlap":
        result = overlap_child(Path(args.model), args, work)
    else:
        result = memory_child(Path(args.model), args, work, json.loads(args.aux_layers))
    print("RESULT " + json.dumps(result))


def run_child(kind: str, model: Path, work: Path, args, **extra) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, "--model", str(model), "--work", str(work),
           "--rows", str(args.rows), "--batch-tokens", str(args.batch_tokens), "--device", args.device,
           "--repeats", str(args.repeats)]
    for key, value in extra.items():
        cmd += [f"--{key.replace('_', '-')}", value]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(args.threads)})
    line = next((line for line in proc.stdout.splitlines() if line.startswith("RESULT ")), None)
    if line is None:
        sys.exit(f"{kind} child failed:\n{proc.stderr[-3000:]}")
    return json.loads(line[7:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch-tokens", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=1, help="compute threads per process in (2) and (3)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--skip", default="", help="comma-separated sections to skip: scaling,uneven,overlap,memory")
    parser.add_argument("--child", choices=["overlap", "memory"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--aux-layers", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    skip = set(filter(None, args.skip.split(",")))

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = build_model(tmp / "model", args.hidden, args.layers, args.dtype)
        print(f"model: llama hidden {args.hidden}, {args.layers} layers, {args.dtype}; {args.rows} rows of "
              f"{DATA.name}, batch_tokens={args.batch_tokens}, device={args.device}")

        if "scaling" not in skip:
            results = scaling(model, tmp / "scaling", args)
            base = results[0][1]
            print(f"\n(1) scaling: whole-job tokens/s (from the manifest)\n{'run':<26}{'tokens/s':>10}{'ratio':>8}")
            for name, rate in results:
                print(f"{name:<26}{rate:>10,.0f}{rate / base:>8.2f}")

        if "overlap" not in skip:
            result = run_child("overlap", model, tmp / "overlap", args)
            seconds = result["seconds"]
            skipped = result["tokens"] / seconds["capture, writing skipped"]
            bare = result["tokens"] / seconds["bare forward"]
            print(f"\n(2) overlap: {result['tokens']:,} tokens, {args.threads} threads, best of {args.repeats}\n"
                  f"{'run':<30}{'tokens/s':>10}{'vs skipped':>12}{'vs bare':>9}")
            for name, secs in seconds.items():
                rate = result["tokens"] / secs
                print(f"{name:<30}{rate:>10,.0f}{rate / skipped:>12.2f}{rate / bare:>9.2f}")

        if "memory" not in skip:
            one_layer_batch = args.batch_tokens * args.hidden * torch.finfo(getattr(torch, args.dtype)).bits / 8
            configs = [(16, k) for k in (1, 2, 4, 8, 16)] + [(8, 4), (32, 4)]
            results = {}
            for depth, captured in configs:
                deep = build_model(tmp / f"model-{depth}", args.hidden, depth, args.dtype)
                aux = [round(i * (depth - 1) / max(captured - 1, 1)) for i in range(captured)]
                results[depth, captured] = run_child("memory", deep, tmp / f"memory-{depth}-{captured}", args,
                                                     aux_layers=json.dumps(aux))
            print(f"\n(3) memory: peak RSS growth of the generate loop above the loaded target "
                  f"(batch_tokens={args.batch_tokens}, hidden {args.hidden}, {args.dtype}; one captured layer of "
                  f"one batch is {one_layer_batch / 2**20:.0f} MB)\n"
                  f"{'layers':>7}{'captured':>10}{'loaded MB':>11}{'growth MB':>11}   difference")
            for (depth, captured), r in results.items():
                reference = (16, 1) if depth == 16 else (16, 4)
                delta = r["growth_mb"] - results[reference]["growth_mb"]
                print(f"{depth:>7}{captured:>10}{r['loaded_mb']:>11,.0f}{r['growth_mb']:>11,.0f}   "
                      f"{delta:+,.0f} MB vs {reference[0]} layers / {reference[1]} captured")
            slope = (results[16, 16]["growth_mb"] - results[16, 1]["growth_mb"]) / 15
            print(f"per captured layer (16 layers, 1 -> 16 captured): {slope:,.1f} MB = "
                  f"{slope * 2**20 / one_layer_batch:.1f} batches of one layer")

        if "uneven" not in skip:
            results = uneven(model, tmp / "uneven", args)
            print(f"\n(4) uneven units: the same {results[0]['tokens']:,} tokens; units alternately of long and short "
                  f"rows, or mixed; per repeat, in run order\n"
                  f"{'run':<28}{'seconds':>9}  units claimed per process")
            for result in results:
                print(f"{result['name']:<28}{result['seconds']:>9.1f}  {result['units']}")
            median = {name: statistics.median(r["seconds"] for r in results if r["name"] == name)
                      for name in dict.fromkeys(r["name"] for r in results)}
            ideal = median["1 process, uneven units"] / 2
            print(f"median: uneven {median['2 processes, uneven units']:.1f} s, even "
                  f"{median['2 processes, even units']:.1f} s (uneven / even "
                  f"{median['2 processes, uneven units'] / median['2 processes, even units']:.2f}); 1 process / 2 = "
                  f"{ideal:.1f} s (uneven / that {median['2 processes, uneven units'] / ideal:.2f})")


if __name__ == "__main__":
    main()
