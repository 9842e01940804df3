"""Generate throughput side by side: the bare forward, specgen without and with shared-prefix reuse.

  bare forward   the HF backbone forward (`model.model`) over the same length-sorted token batches: no capture,
                 no lm_head, no tokenizing, no I/O (the limit)
  padded         python -m specgen.generate with capture.prefix_reuse=false capture.packing=false (in-process; model
                 load excluded): length-bucketed right-padded batches
  reuse off      capture.prefix_reuse=false (packing on, the default): every sample packed end to end, no padding
  reuse on       the same with capture.prefix_reuse=true (the default)

Each configuration's `fwd/real` is the tokens it forwarded, padding included, per real token it computed (the
manifest's `padding`). `GEMM peak` is this machine's matmul rate, measured in the same process before each repeat
(a [4096 x 4096] @ [4096 x 4096] product in the benchmark's dtype, best of 5), and `of peak` is each configuration's
dense-equivalent FLOP/s (2 x decoder parameters x tokens + causal attention 2 x layers x hidden x length^2 per
sample, i.e. the work of every sample run alone) as a share of it, both from the same repeat.

The configurations ALTERNATE within each repeat (bare, off, on, bare, off, on, ...) in one process, so drift in the
machine's load hits all of them alike; the table gives the median tokens/s (tokens emitted per second of capture)
and the median of the per-repeat ratios to the bare run of the same repeat. Goals: reuse off >= 0.9 x bare, reuse on
>= 1.1 x bare on the glaive set (rows sharing long system prompts), and reuse on >= reuse off on data without much
sharing. The model is shaped like a small real LLM: Llama, hidden 512, 8 layers, the real Llama-3.1 vocabulary and
tokenizer (needs ../shared, or SPECGEN_SHARED=/path/to/shared).

  python benchmarks/generate.py [--data glaive|fastchat|alpaca|PATH] [--rows 300] [--repeats 3] [--threads 2]
      [--dtype float32] [--compile] [--vllm .venv-vllm/bin/python]    # + vLLM's extract_hidden_states (engine=vllm, prefix caching on)

--compile adds reuse off and reuse on with capture.compile=true (the decoder layers under torch.compile; the
warm-up, tens of seconds on a CPU, is part of the time, so it pays only on runs of several minutes).

--vllm runs `specgen generate engine=vllm` in a process of its own each repeat (the engine needs its own
interpreter); its tokens/s is the stage's own measure (engine start excluded), like the others', but its
CPU-seconds column includes the engine's start and its worker processes.

--scaling prints instead how the cost grows: tokens/s and peak RSS of `specgen generate` (defaults: reuse on) for
1x, 2x, 4x the rows and sequence lengths 512 / 2k / 8k (8k rows are consecutive glaive conversations joined into
one; capture.prefill_chunk_tokens=2048 above 2k), each cell in its own process so its peak RSS is its own.

  python benchmarks/generate.py --scaling [--rows 16] [--lengths 512,2048,8192] [--scales 1,2,4]

--padding prints instead, without running any model, the tokens each batching forwards per real token on glaive,
alpaca and the reasoning set (all their rows unless --padding-rows is given), batched per work unit of --shard-size
source rows as generate does: right-padded length buckets (capture.packing=false) against packed rows (the default),
at --batch-tokens and 64 samples per batch.

  python benchmarks/generate.py --padding [--batch-tokens 8192] [--shard-size 256]
"""

import argparse
import itertools
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from common import LLAMA_TOKENIZER as TOKENIZER
from common import REPO, SHARED, build_llama

DATASETS = {"glaive": SHARED / "datasets" / "sharegpt_glaive_toolcall.json",
            "fastchat": SHARED / "datasets" / "sharegpt_fastchat_dummy.json",
            "alpaca": SHARED / "datasets" / "alpaca_en_demo.json",
            "reasoning": SHARED / "datasets" / "openai_reasoning_tooluse_50.jsonl"}
AUX_LAYERS = [1, 3, 4]


def build_model(out_dir: Path, dtype: str = "bfloat16") -> None:
    build_llama(out_dir, dtype, max_positions=32768)


def data_path(name: str) -> Path:
    return DATASETS.get(name, Path(name))


def tokenized_samples(model_dir: Path, data: Path, rows: int, max_length: int):
    from transformers import AutoTokenizer

    from specgen.data.prepare import prepare_rows
    from specgen.data.sources import iter_records
    from specgen.data.template import ChatTemplateTokenizer

    chat = ChatTemplateTokenizer(AutoTokenizer.from_pretrained(model_dir), max_length=max_length)
    return [s for row in prepare_rows(itertools.islice(iter_records(data), rows), chat) for s in row.samples]


def generate(model_dir: Path, data: Path, out_dir: Path, args, *overrides: str) -> dict:
    """specgen generate in this process; (tokens emitted, tokens computed, seconds of capture)."""
    from specgen.config import compose
    from specgen.generate import run

    manifest = run(compose("generate", [
        f"model.path={model_dir}", f"data.path={data}", f"output.dir={out_dir}", f"data.max_rows={args.rows}",
        f"data.max_length={args.max_length}", f"capture.aux_layers={AUX_LAYERS}", f"model.dtype={args.dtype}",
        f"capture.batch_tokens={args.batch_tokens}", "runtime.progress=false",
        f"output.shard_size={args.shard_size}", *overrides]))
    return {"tokens": manifest["stats"]["tokens"], "computed": manifest["prefix_reuse"]["tokens_computed"],
            "seconds": manifest["last_run"]["seconds"], "forwarded": manifest["padding"]["forwarded_tokens"]}


def bare_forward(backbone, samples, batch_tokens: int) -> dict:
    from specgen.data.batching import token_budget_batches

    start = time.perf_counter()
    with torch.inference_mode():
        for batch in token_budget_batches(samples, batch_tokens, 64):
            ids = torch.zeros(len(batch), len(batch[0]), dtype=torch.long)
            for b, s in enumerate(batch):
                ids[b, : len(s)] = torch.tensor(s.input_ids)
            backbone(input_ids=ids)
    tokens = sum(len(s) for s in samples)
    forwarded = sum(len(batch) * len(batch[0]) for batch in token_budget_batches(samples, batch_tokens, 64))
    return {"tokens": tokens, "computed": tokens, "seconds": time.perf_counter() - start, "forwarded": forwarded}


def gemm_peak(dtype: torch.dtype, size: int = 4096, tries: int = 5) -> float:
    """This machine's matmul FLOP/s now: the best of `tries` [size x size] @ [size x size] products."""
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    torch.mm(a, b)  # warm up
    best = float("inf")
    for _ in range(tries):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size ** 3 / best


def dense_flops(model, samples) -> float:
    """The work of running every sample alone: 2 x decoder parameters per token (the embedding lookup and the LM
    head, which capture never runs, excluded) + causal attention, QK^T and AV over half the [l, l] square."""
    body = model.model
    params = sum(p.numel() for p in body.layers.parameters()) + sum(p.numel() for p in body.norm.parameters())
    config = model.config
    attention_width = config.num_attention_heads * getattr(config, "head_dim", config.hidden_size //
                                                           config.num_attention_heads)
    return sum(2 * params * len(s) + 2 * config.num_hidden_layers * attention_width * len(s) ** 2 for s in samples)


def compare(args) -> None:
    """bare / reuse off / reuse on, alternating, in this process (see the module doc)."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    data = data_path(args.data)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        build_model(model_dir, args.dtype)
        samples = tokenized_samples(model_dir, data, args.rows, args.max_length)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).eval()
        backbone, flops = model.model, dense_flops(model, samples)
        runs = {"bare forward": lambda out: bare_forward(backbone, samples, args.batch_tokens),
                "padded": lambda out: generate(model_dir, data, out, args, "capture.prefix_reuse=false",
                                               "capture.packing=false"),
                "reuse off": lambda out: generate(model_dir, data, out, args, "capture.prefix_reuse=false"),
                "reuse on": lambda out: generate(model_dir, data, out, args, "capture.prefix_reuse=true")}
        if args.compile:  # the compile warm-up (tens of seconds) counts: what a run of this size pays
            runs["reuse off, compiled"] = lambda out: generate(model_dir, data, out, args, "capture.prefix_reuse=false",
                                                               "capture.compile=true")
            runs["reuse on, compiled"] = lambda out: generate(model_dir, data, out, args, "capture.prefix_reuse=true",
                                                              "capture.compile=true")
        if args.vllm:
            runs["vllm, prefix cache"] = lambda out: child_result(args, args.vllm, model_dir, data, out, args.rows,
                                                                 args.max_length, ["engine=vllm"])
        results: dict[str, list[dict]] = {name: [] for name in runs}
        peaks = []
        for repeat, name in itertools.product(range(args.repeats), runs):
            if name == "bare forward":
                peaks.append(gemm_peak(getattr(torch, args.dtype)))
                print(f"repeat {repeat} GEMM peak {peaks[-1] / 1e9:,.1f} GFLOP/s", flush=True)
            cpu = cpu_seconds()
            slug = re.sub(r"\W+", "_", name)  # a folder name without commas (Hydra splits values at commas)
            result = runs[name](Path(tmp) / f"{slug}-{repeat}")
            result["cpu_seconds"] = cpu_seconds() - cpu  # this process's CPU time: steadier than wall on a busy machine
            result["of_peak"] = flops / result["seconds"] / peaks[-1]
            results[name].append(result)
            print(f"repeat {repeat} {name:<20} {result['tokens'] / result['seconds']:>9,.0f} tokens/s "
                  f"({result['seconds']:.1f}s wall, {result['cpu_seconds']:.1f}s CPU)", flush=True)
    print(table(results, args, peaks))


def cpu_seconds() -> float:
    """CPU seconds of this process and of its finished children (the vLLM run's processes)."""
    usages = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(usage.ru_utime + usage.ru_stime for usage in usages)


def table(results: dict[str, list[dict]], args, peaks: list[float]) -> str:
    bare = results["bare forward"]
    lines = [f"\ndata={args.data} rows={args.rows} tokens={bare[0]['tokens']:,} max_length={args.max_length} "
             f"dtype={args.dtype} threads={args.threads} repeats={args.repeats} (alternating; medians); "
             f"GEMM peak {statistics.median(peaks) / 1e9:,.1f} GFLOP/s",
             f"{'configuration':<22}{'tokens/s':>10}{'vs bare':>9}{'computed':>11}{'fwd/real':>10}{'of peak':>9}"
             f"{'CPU-s/Mtok':>12}  per-repeat vs bare"]
    ratios = {}
    for name, runs in results.items():
        rates = [r["tokens"] / r["seconds"] for r in runs]
        ratios[name] = [rate / (b["tokens"] / b["seconds"]) for rate, b in zip(rates, bare)]
        lines.append(f"{name:<22}{statistics.median(rates):>10,.0f}{statistics.median(ratios[name]):>9.2f}"
                     f"{runs[0]['computed'] / runs[0]['tokens']:>10.0%}"
                     f"{runs[0]['forwarded'] / runs[0]['computed']:>10.3f}"
                     f"{statistics.median(r['of_peak'] for r in runs):>9.0%}"
                     f"{statistics.median(r['cpu_seconds'] / r['tokens'] * 1e6 for r in runs):>12,.0f}  "
                     + " ".join(f"{r:.2f}" for r in ratios[name]))
    off, on = statistics.median(ratios["reuse off"]), statistics.median(ratios["reuse on"])
    lines.append(f"goals: reuse off >= 0.9 x bare: {off:.2f} {'ok' if off >= 0.9 else 'MISSED'}; "
                 f"reuse on >= 1.1 x bare: {on:.2f} {'ok' if on >= 1.1 else 'MISSED'}; "
                 f"reuse on >= reuse off: {on / off:.2f} {'ok' if on >= off else 'MISSED'}")
    return "\n".join(lines)


# --- scaling: each cell in its own process ---------------------------------------------------------------------

def joined_conversations(path: Path, rows: int, target_tokens: int) -> Path:
    """Rows of consecutive glaive conversations joined until each has about `target_tokens` tokens (4 chars each)."""
    source = json.loads(DATASETS["glaive"].read_text())
    joined, current, chars = [], None, 0
    for row in itertools.cycle(source):
        if current is None:
            current, chars = {"conversations": [], "tools": row.get("tools", "[]")}, 0
        current["conversations"] += row["conversations"]
        chars += sum(len(turn["value"]) for turn in row["conversations"])
        if chars >= 4 * target_tokens:
            joined.append(current)
            current = None
            if len(joined) == rows:
                break
    path.write_text(json.dumps(joined))
    return path


def scaling_child(args) -> None:
    torch.set_num_threads(args.threads)
    result = generate(Path(args.model), Path(args.data), Path(args.work), args, *args.override)
    result["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print("RESULT " + json.dumps(result))


def child_result(args, python: str, model_dir: Path, data: Path, out: Path, rows: int, max_length: int,
                 overrides: list[str]) -> dict:
    """specgen generate in a process of its own (interpreter `python`): its result dict, peak RSS included."""
    cmd = [python, __file__, "--scaling-child", "--model", str(model_dir), "--data", str(data), "--work", str(out),
           "--rows", str(rows), "--max-length", str(max_length), "--batch-tokens", str(args.batch_tokens),
           "--threads", str(args.threads), "--dtype", args.dtype, "--shard-size", str(args.shard_size),
           *[f"--override={o}" for o in overrides]]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
    if line is None:
        sys.exit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return json.loads(line[7:])


def scaling(args) -> None:
    lengths = [int(n) for n in args.lengths.split(",")]
    scales = [int(n) for n in args.scales.split(",")]
    lines = [f"scaling: specgen generate, {args.dtype}, threads={args.threads}, {args.rows} rows at 1x, "
             f"reuse {'on' if args.reuse else 'off'}",
             f"{'max_length':>10}{'rows':>6}{'tokens':>10}{'computed':>10}{'tokens/s':>10}{'peak RSS':>11}"]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = tmp / "model"
        build_model(model_dir, args.dtype)
        for length, scale in itertools.product(lengths, scales):
            rows = args.rows * scale
            data = (joined_conversations(tmp / f"joined-{length}-{rows}.json", rows, length) if length > 2048
                    else DATASETS["glaive"])
            overrides = [f"capture.prefix_reuse={str(args.reuse).lower()}"]
            if length > 2048:
                overrides.append("capture.prefill_chunk_tokens=2048")
            r = child_result(args, sys.executable, model_dir, data, tmp / f"out-{length}-{scale}", rows, length,
                             overrides)
            lines.append(f"{length:>10}{rows:>6}{r['tokens']:>10,}{r['computed']:>10,}"
                         f"{r['tokens'] / r['seconds']:>10,.0f}{r['peak_rss'] / 2**20:>9,.0f}MB")
            print(lines[-1], flush=True)
    print("\n".join(lines))


def padding(args) -> None:
    """Tokens forwarded per real token, padded vs packed, on every dataset (no model: batching alone)."""
    from specgen.data.batching import packed_batches, token_budget_batches

    lines = [f"padding: tokens forwarded / real tokens at batch_tokens={args.batch_tokens}, 64 samples per batch, "
             f"max_length={args.max_length}, units of {args.shard_size} rows",
             f"{'data':<11}{'rows':>6}{'samples':>9}{'real tokens':>13}{'padded':>9}{'packed':>9}{'forwards':>15}"]
    with tempfile.TemporaryDirectory() as tmp:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(tmp)
        for name in ("glaive", "alpaca", "reasoning"):
            samples = tokenized_samples(Path(tmp), DATASETS[name], args.padding_rows, args.max_length)
            real = sum(len(s) for s in samples)
            units = [[s for s in samples if s.source_index // args.shard_size == unit]
                     for unit in sorted({s.source_index // args.shard_size for s in samples})]
            padded = [b for unit in units for b in token_budget_batches(unit, args.batch_tokens, 64)]
            packed = [b for unit in units for b in packed_batches(unit, args.batch_tokens, 64)]
            forwarded = sum(len(batch) * len(batch[0]) for batch in padded)
            lines.append(f"{name:<11}{len({s.source_index for s in samples}):>6}{len(samples):>9}{real:>13,}"
                         f"{forwarded / real:>9.3f}{sum(len(s) for b in packed for s in b) / real:>9.3f}"
                         f"{f'{len(padded)} vs {len(packed)}':>15}")
            print(lines[-1], flush=True)
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="glaive", help="glaive, fastchat, or a dataset path")
    parser.add_argument("--rows", type=int, default=300)
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--batch-tokens", type=int, default=8192)
    parser.add_argument("--shard-size", type=int, default=1024, help="output.shard_size (prefixes are per unit)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--vllm", metavar="PYTHON", help="add engine=vllm (prefix caching on), run by this "
                        "interpreter (one with vllm installed, e.g. .venv-vllm/bin/python), to the comparison")
    parser.add_argument("--compile", action="store_true", help="add reuse off/on with capture.compile=true")
    parser.add_argument("--scaling", action="store_true", help="the 1x/2x/4x x 512/2k/8k table instead")
    parser.add_argument("--lengths", default="512,2048,8192")
    parser.add_argument("--scales", default="1,2,4")
    parser.add_argument("--reuse", action=argparse.BooleanOptionalAction, default=True, help="scaling: reuse on/off")
    parser.add_argument("--padding", action="store_true", help="padded vs packed tokens per real token, no model")
    parser.add_argument("--padding-rows", type=int, default=None, help="--padding: rows per dataset (all)")
    parser.add_argument("--scaling-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--override", action="append", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.scaling_child:
        return scaling_child(args)
    if not TOKENIZER.exists():
        sys.exit(f"{TOKENIZER} is missing: this benchmark needs ../shared (or SPECGEN_SHARED=/path/to/shared)")
    if args.scaling:
        return scaling(args)
    if args.padding:
        return padding(args)
    compare(args)


if __name__ == "__main__":
    main()
