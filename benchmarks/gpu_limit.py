"""The GPU path against the hardware's limit, in one command: capture and training of an 8B target, run as users run
them, in one table (issue 40).

On one H100 or H200 (about 6 minutes; made to finish within 8; --budget-s stops what would run past it):

    python benchmarks/gpu_limit.py                       # = --device cuda --shape 8b --rows 600 --steps 30
    bash benchmarks/gpu_limit.sh                         # the same on a device machine, results copied to $OUT

CPU smoke test (a tiny shape, under 2 minutes on 2 cores):

    python benchmarks/gpu_limit.py --device cpu --shape tiny --rows 16

What it does, in order:
  1. builds a randomly initialised Llama target ON --device, in bfloat16 on CUDA (float32 on the CPU, whose bf16
     matmuls are too slow to smoke-test with) (8b: Llama-3.1-8B's shape, 32 layers, hidden 4096, intermediate
     14336, 32/8 heads, vocabulary 128,256; random weights do not change the cost) and saves it with the Llama-3.1
     tokenizer and template (../shared/tokenizers/llama-3.1; SPECGEN_SHARED moves ../shared);
  2. tokenizes the first --rows alpaca rows (../shared/datasets/alpaca_en_demo.json) with the product's own chat
     template code and data defaults, and times the bare Hugging Face decoder stack on them (`model.model(...)`,
     no capture, no KV cache, right-padded batches under capture.batch_tokens in each work unit of
     output.shard_size rows, as generate groups them; the best of two passes after a warm-up);
  3. measures the GEMM peak in the target's dtype (torch.mm of two [8192]^2 matrices, the median of 5 timings
     of 10 calls after a warm-up);
  4. runs `specgen generate` end to end in a subprocess, each as a user types it: the default settings;
     `capture.prefix_reuse=false`; `capture.prefix_reuse=false output.codec=fp8` (and with --reuse-row,
     `capture.prefix_reuse=true`), all with `runtime.device=--device`; tokens/s is the run's own figure
     (manifest.json last_run: the tokens captured over the capture's seconds, model loading excluded), GB/s is the
     bytes it wrote (stats.bytes_on_disk) over the same seconds;
  5. runs `specgen train` offline on the default run's shards and `specgen train mode=online` (target and draft on
     the same device) for --steps steps each, default draft and settings (train.log_every=steps/3; --shape tiny:
     TINY_TRAINING too) but train.cache_target_argmax=false, so that the target head's FLOP count (the full
     vocabulary at every token) is what runs after the first epoch too (benchmarks/target_head.py times the cache);
     tokens/s is the real tokens over the seconds of the logging windows after the first (metrics.jsonl; the first
     holds the warm-up).

Each subprocess reports its peak memory: torch.cuda.max_memory_allocated on CUDA, else the process's peak RSS. The
table also goes to --out/table.md and every figure to --out/results.json.
"""

import argparse
import atexit
import gc
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("SPECGEN_SHARED", REPO.parent / "shared"))
TOKENIZER = SHARED / "tokenizers" / "llama-3.1"
ALPACA = SHARED / "datasets" / "alpaca_en_demo.json"

SHAPES = {
    # Llama-3.1-8B
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8),
    # a smoke-test shape: every code path, in seconds on a CPU (8 layers: distinct default aux layers [1, 3, 4])
    "tiny": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2),
}
VOCAB = 128256  # the Llama-3.1 tokenizer's
# --shape tiny only: a smoke test's steps (8x fewer tokens than the default) and start-up
TINY_TRAINING = ["train.batch_tokens=1024", "train.tensorboard=false", "train.num_workers=0"]
CHILD = "--child"  # argv[1] of this script run as a stage's process (see `child`)


# --- a stage's process ---------------------------------------------------------------------------------------------

def child(stage: str, overrides: list[str], peak_file: str) -> None:
    """`specgen STAGE key=value ...` (the console command itself, specgen.cli.main), and on exit this process's
    peak memory written to `peak_file`."""

    def record() -> None:
        peak = {"rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            peak["gpu_bytes"] = torch.cuda.max_memory_allocated()
        Path(peak_file).write_text(json.dumps(peak))

    atexit.register(record)
    from specgen.cli import main

    sys.argv = ["specgen", stage, *overrides]
    main()


def run_stage(name: str, stage: str, overrides: list[str], work: Path, timeout: float) -> dict:
    """Run one stage as a user would (`specgen STAGE ...`, here through `child`); its seconds, peak memory, and
    the tail of its output when it failed."""
    peak_file, log_file = work / f"{name}.peak.json", work / f"{name}.log"
    command = [sys.executable, str(Path(__file__).resolve()), CHILD, stage, str(peak_file), *overrides]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    start = time.perf_counter()
    with open(log_file, "w") as log:
        log.write("$ specgen " + " ".join([stage, *overrides]) + "\n")
        log.flush()
        try:
            code = subprocess.run(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=max(timeout, 1)).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    result = {"wall_s": time.perf_counter() - start, "ok": code == 0, "log": str(log_file)}
    if peak_file.exists():
        result.update(json.loads(peak_file.read_text()))
    if code != 0:
        tail = log_file.read_text().strip().splitlines()[-8:]
        result["error"] = f"exit {code}: " + " / ".join(line.strip() for line in tail)[-600:]
        print(f"  {name}: FAILED ({result['error']})", flush=True)
    return result


# --- the target, the rows, the bare stack and the GEMM peak --------------------------------------------------------

def build_target(shape: str, device: str, dtype: torch.dtype, out_dir: Path):
    """The random target built on `device` in `dtype` (no CPU initialisation), saved with the Llama-3.1 tokenizer."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=VOCAB, max_position_embeddings=8192, rope_theta=500000.0,
                                      tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128009,
                                      **SHAPES[shape])
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.eval().save_pretrained(out_dir)
    transformers.AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(out_dir)
    return model


def tokenized_units(overrides: list[str]):
    """(the rows generate captures as token ids, per work unit; the composed generate config): the product's source
    reader, chat template and data defaults."""
    from specgen.config import compose, to_container
    from specgen.data.prepare import prepare_rows
    from specgen.data.sources import capped_source, work_units
    from specgen.data.template import ChatTemplateTokenizer
    from specgen.runtime import load_tokenizer

    cfg = compose("generate", overrides)
    chat = ChatTemplateTokenizer(load_tokenizer(cfg.tokenizer.path), max_length=cfg.data.max_length,
                                 train_turns=cfg.data.train_turns, mask_empty_think=cfg.data.mask_empty_think,
                                 chat_template_kwargs=to_container(cfg.data)["chat_template_kwargs"])
    source = capped_source(cfg.data.path, cfg.data.max_rows, split=cfg.data.split, subset=cfg.data.subset)
    return [[list(sample.input_ids) for row in prepare_rows(records, chat, on_bad_row=cfg.data.on_bad_row)
             for sample in row.samples]
            for _, records in work_units(source.records, cfg.output.shard_size)], cfg


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bare_stack(model, units: list[list[list[int]]], batch_tokens: int, max_batch_size: int, device: str) -> dict:
    """The Hugging Face decoder stack alone over every row: best of two timed passes after a warm-up batch."""
    from specgen.data.batching import pad_right, token_budget_batches

    batches = [pad_right(batch, 0) for unit in units for batch in token_budget_batches(unit, batch_tokens,
                                                                                          max_batch_size)]
    real = sum(len(row) for unit in units for row in unit)

    def one_pass(subset) -> float:
        sync(device)
        start = time.perf_counter()
        with torch.inference_mode():
            for ids in subset:
                model.model(input_ids=ids.to(device, non_blocking=True), use_cache=False)
        sync(device)
        return time.perf_counter() - start

    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    one_pass(sorted(batches, key=lambda ids: -ids.numel())[:2])  # warm-up: kernels, allocator
    seconds = min(one_pass(batches) for _ in range(2))
    result = {"tokens": real, "seconds": seconds, "tokens_per_s": real / seconds,
              "forwarded": sum(ids.numel() for ids in batches)}
    if device.startswith("cuda"):
        result["gpu_bytes"] = torch.cuda.max_memory_allocated()
    return result


def gemm_peak(device: str, dtype: torch.dtype, size: int, repeats: int = 5) -> float:
    """FLOP/s of torch.mm on two [size]^2 matrices in `dtype`: the median of `repeats` timings after a warm-up, each
    of 10 back-to-back calls on CUDA (one sync per timing, not per call), of one on the CPU."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    calls = 10 if device.startswith("cuda") else 1
    torch.mm(a, b)
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        for _ in range(calls):
            torch.mm(a, b)
        sync(device)
        times.append((time.perf_counter() - start) / calls)
    return 2 * size ** 3 / statistics.median(times)


# --- FLOP counts ---------------------------------------------------------------------------------------------------

def target_flops_per_token(config, lengths: list[int]) -> tuple[float, float]:
    """(2 x decoder-layer matmul weights, causal attention per token): the capture's forward per real token. The
    attention term is 2 x layers x heads x head_dim x sum(L^2) / sum(L) (QK^T and PV over L^2/2 pairs each)."""
    head_dim = config.hidden_size // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    weights = config.num_hidden_layers * (config.hidden_size * (2 * config.hidden_size + 2 * kv)
                                          + 3 * config.hidden_size * config.intermediate_size)
    attention = (2 * config.num_hidden_layers * config.num_attention_heads * head_dim
                 * sum(n * n for n in lengths) / max(sum(lengths), 1))
    return 2 * weights, attention


def draft_matmul_params(checkpoint: Path) -> int:
    """The draft's matmul weights (decoder layer, fc, its LM head; no embedding): every 2-D tensor but embeddings."""
    from safetensors import safe_open

    total = 0
    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            shape = f.get_slice(name).get_shape()
            if len(shape) == 2 and "embed" not in name:
                total += shape[0] * shape[1]
    return total


# --- reading the stages' own figures -------------------------------------------------------------------------------

def generate_figures(out_dir: Path) -> dict:
    manifest = json.loads((out_dir / "manifest.json").read_text())
    run, stats = manifest["last_run"], manifest["stats"]
    return {"tokens": run["computed_tokens"], "seconds": run["seconds"], "tokens_per_s": run["tokens_per_second"],
            "bytes": stats["bytes_on_disk"], "gb_per_s": stats["bytes_on_disk"] / max(run["seconds"], 1e-9) / 1e9,
            "prefix_reuse": manifest["prefix_reuse"].get("decided") or manifest["prefix_reuse"]["enabled"],
            "codec": manifest["codec"]}


def train_figures(out_dir: Path) -> dict:
    """Tokens/s over the logging windows after the first (the first holds compilation, allocator and loader
    warm-up); with a single window, that one."""
    windows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    windows = [w for w in windows if "tokens_per_s" in w]
    seen = [0] + [w["tokens_seen"] for w in windows]
    spans = [(seen[i + 1] - seen[i], (seen[i + 1] - seen[i]) / max(w["tokens_per_s"], 1e-9))
             for i, w in enumerate(windows)]
    steady = spans[1:] or spans
    tokens, seconds = sum(t for t, _ in steady), sum(s for _, s in steady)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / max(seconds, 1e-9),
            "steps": windows[-1]["step"], "loss": windows[-1].get("loss")}


# --- the benchmark -------------------------------------------------------------------------------------------------

def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.").replace("bfloat16", "bf16").replace("float32", "fp32")


def gib(value) -> str:
    return f"{value / 2 ** 30:.1f}" if value else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (the smoke test)")
    parser.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    parser.add_argument("--rows", type=int, default=600, help="alpaca rows captured (and trained on)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps of each training run "
                        "(default: 30 for 8b, 2 for tiny)")
    parser.add_argument("--out", type=Path, default=None, help="working folder (default: a temporary one, "
                        "removed at the end; the target alone is 16 GB at 8b)")
    parser.add_argument("--gemm-size", type=int, default=None, help="default: 8192 (8b), 1024 (tiny)")
    parser.add_argument("--reuse-row", action="store_true", help="also generate with capture.prefix_reuse=true")
    parser.add_argument("--budget-s", type=float, default=470, help="stages that would start past this many "
                        "seconds are skipped, a running one is stopped there")
    args = parser.parse_args()
    start = time.perf_counter()
    for path in (TOKENIZER, ALPACA):
        if not path.exists():
            sys.exit(f"error: {path} is missing: ../shared (or $SPECGEN_SHARED) must hold the Llama-3.1 tokenizer "
                     "and the alpaca rows")
    steps = args.steps or (30 if args.shape == "8b" else 2)
    gemm_size = args.gemm_size or (8192 if args.shape == "8b" else 1024)
    cuda = args.device.startswith("cuda")
    work = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="gpu-limit-"))
    work.mkdir(parents=True, exist_ok=True)
    if not args.out:  # the 16 GB target never stays behind, whatever ends the run
        atexit.register(shutil.rmtree, work, True)
    for old in [*work.glob("gen-*"), *work.glob("train-*"), work / "target"]:  # an earlier run's: would resume
        shutil.rmtree(old, ignore_errors=True)
    target_dir = work / "target"
    remaining = lambda: args.budget_s - (time.perf_counter() - start)  # noqa: E731
    log = lambda text: print(f"[{time.perf_counter() - start:6.1f}s] {text}", flush=True)  # noqa: E731

    dtype = torch.bfloat16 if cuda else torch.float32
    model = build_target(args.shape, args.device, dtype, target_dir)
    config = model.config
    log(f"target {args.shape} built on {args.device} and saved to {target_dir}")
    data = [f"model.path={target_dir}", f"data.path={ALPACA}", f"data.max_rows={args.rows}"]
    units, cfg = tokenized_units(data)
    lengths = [len(row) for unit in units for row in unit]
    bare = bare_stack(model, units, cfg.capture.batch_tokens, cfg.capture.max_batch_size, args.device)
    log(f"bare decoder stack: {bare['tokens_per_s']:,.0f} tokens/s")
    peak = gemm_peak(args.device, dtype, gemm_size)
    log(f"{dtype_name(dtype)} GEMM peak: {peak / 1e12:.2f} TFLOP/s")
    device_name = torch.cuda.get_device_name(torch.device(args.device)) if cuda else "cpu"
    del model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()

    weights, attention = target_flops_per_token(config, lengths)
    forward = weights + attention
    rows: list[tuple[str, dict, float | None]] = [("bare HF decoder stack (model.model, no capture)", bare, forward)]
    device = [f"runtime.device={args.device}", "runtime.progress=false"]
    generate_runs = [("generate, default settings", "default", []),
                     ("generate, capture.prefix_reuse=false", "noreuse", ["capture.prefix_reuse=false"]),
                     ("generate, no reuse, output.codec=fp8", "fp8", ["capture.prefix_reuse=false",
                                                                       "output.codec=fp8"])]
    if args.reuse_row:
        generate_runs.append(("generate, capture.prefix_reuse=true", "reuse", ["capture.prefix_reuse=true"]))
    for label, name, extra in generate_runs:
        if remaining() < 20:
            rows.append((label, {"error": "skipped: --budget-s spent"}, None))
            continue
        out_dir = work / f"gen-{name}"
        result = run_stage(name, "generate", [*data, *device, f"output.dir={out_dir}", *extra], work, remaining())
        if result["ok"]:
            result.update(generate_figures(out_dir))
            if name != "default":  # only the default run's shards are trained on
                shutil.rmtree(out_dir, ignore_errors=True)
        rows.append((label, result, forward))
        log(f"{label}: {result.get('tokens_per_s', 0):,.0f} tokens/s")

    ttt = default_ttt_length()
    log_every = max(1, steps // 3)
    training = [f"train.max_steps={steps}", f"train.log_every={log_every}", "train.cache_target_argmax=false",
                *device, *TINY_TRAINING * (args.shape == "tiny")]
    draft_params = None
    train_runs = [("train offline (specgen train, default draft)", "offline",
                   [f"data.shards={work / 'gen-default'}"]),
                  ("train online (mode=online, target + draft on one device)", "online", ["mode=online", *data])]
    for label, name, extra in train_runs:
        if remaining() < 20 or (name == "offline" and not (work / "gen-default" / "manifest.json").exists()):
            rows.append((label, {"error": "skipped: --budget-s spent" if remaining() < 20 else
                                 "skipped: no shards from the default generate run"}, None))
            continue
        out_dir = work / f"train-{name}"
        result = run_stage(f"train-{name}", "train", [*extra, *training, f"output.dir={out_dir}"], work, remaining())
        if result["ok"]:
            result.update(train_figures(out_dir))
            draft_params = draft_params or draft_matmul_params(out_dir)
        rows.append((label, result, None))
        log(f"{label}: {result.get('tokens_per_s', 0):,.0f} tokens/s")

    head = 2 * config.hidden_size * config.vocab_size  # the target's LM head, forward only, once per token
    draft = 6 * draft_params * ttt + head if draft_params else None
    rows = [(label, result, flops if flops is not None else
             (None if draft is None else draft + (forward if "online" in label else 0)))
            for label, result, flops in rows]
    table = render(rows, bare, peak, gemm_size, dtype, args, device_name, steps, lengths, weights, attention,
                   draft_params, ttt, head)
    print(table, flush=True)
    (work / "table.md").write_text(table + "\n")
    (work / "results.json").write_text(json.dumps({
        "device": device_name, "shape": args.shape, "dtype": dtype_name(dtype), "rows": args.rows, "steps": steps,
        "gemm_peak_flops": peak,
        "target_flops_per_token": {"weights": weights, "attention": attention},
        "draft_matmul_params": draft_params, "ttt_length": ttt, "target_head_flops_per_token": head,
        "runs": [{"label": label, "flops_per_token": flops, **result} for label, result, flops in rows]}, indent=1))
    log(f"done; table.md, results.json and the stages' logs in {work}" if args.out else
        "done (the temporary folder is removed: pass --out DIR to keep the table, results.json and logs)")
    if any("error" in result for _, result, _ in rows):
        sys.exit(1)


def default_ttt_length() -> int:
    """train.ttt_length as `specgen train` composes it with no arguments (the runs here do not change it)."""
    from specgen.config import compose

    return int(compose("train", [])["train"]["ttt_length"])


def render(rows, bare, peak, gemm_size, dtype, args, device_name, steps, lengths, weights, attention, draft_params, ttt,
           head) -> str:
    lines = [
        f"{device_name} · target {args.shape} ({dtype_name(dtype)}, random weights) · {args.rows} alpaca rows, "
        f"{sum(lengths):,} "
        f"tokens (median {int(statistics.median(lengths))}, max {max(lengths)}) · training: {steps} steps each"
        f"{' (' + ' '.join(TINY_TRAINING) + ')' if args.shape == 'tiny' else ''} · "
        f"{dtype_name(dtype)} GEMM peak {peak / 1e12:.2f} TFLOP/s (torch.mm, [{gemm_size}]^2)",
        "",
        "FLOP formulas, per real token:",
        f"  target forward = 2 x decoder-layer matmul weights + causal attention 2 x layers x heads x head_dim x "
        f"sum(L^2)/sum(L) = {weights / 1e9:.4g} + {attention / 1e9:.3g} GFLOP (embedding and LM head excluded: the "
        "capture runs neither)",
        "  draft training = 6 x draft matmul weights (decoder layer + fc + draft LM head, no embedding) x ttt_length"
        " + 2 x hidden x target vocabulary (the target's LM head, forward only, once)"
        + (f" = 6 x {draft_params / 1e6:.4g}M x {ttt} + {head / 1e9:.3g} GFLOP = "
           f"{(6 * draft_params * ttt + head) / 1e9:.4g} GFLOP" if draft_params else "")
        + " (nominal: fc runs once, not per TTT step; draft attention omitted)",
        "  online training = target forward + draft training",
        f"  share of peak = FLOP/token x tokens/s / {dtype_name(dtype)} GEMM peak; GB/s = bytes written / capture "
        "seconds; peak memory: torch.cuda.max_memory_allocated (CPU: peak RSS)",
        "",
        f"| run | tokens/s | vs bare | GFLOP/token | of {dtype_name(dtype)} peak | GB/s written | peak memory GiB | "
        "wall s | notes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, result, flops in rows:
        if "tokens_per_s" not in result:
            lines.append(f"| {label} | - | - | - | - | - | - | {result.get('wall_s', 0):.0f} | "
                         f"{result.get('error', 'failed')[:300].replace('|', '/')} |")
            continue
        speed = result["tokens_per_s"]
        memory = result.get("gpu_bytes") if args.device.startswith("cuda") else result.get("rss_bytes")
        notes = []
        if "prefix_reuse" in result:
            notes.append(f"prefix reuse: {result['prefix_reuse']}; {result['bytes'] / 1e9:.3g} GB written "
                         f"({result['codec']})")
        if "forwarded" in result:
            notes.append(f"{result['forwarded'] / result['tokens']:.3f} tokens forwarded per real one (padded)")
        if "steps" in result:
            notes.append(f"{result['tokens']:,} tokens in the windows after the first"
                         + (f"; last loss {result['loss']:.3f}" if result.get("loss") is not None else ""))
        cells = [label, f"{speed:,.0f}",
                 f"{speed / bare['tokens_per_s']:.2f}" if "steps" not in result else "-",
                 f"{flops / 1e9:.3g}" if flops else "-", f"{flops * speed / peak:.1%}" if flops else "-",
                 f"{result['gb_per_s']:.3g}" if "gb_per_s" in result else "-",
                 gib(memory) + (" (RSS)" if memory and not args.device.startswith("cuda") else ""),
                 f"{result.get('wall_s', result.get('seconds', 0)):.0f}", "; ".join(notes).replace("|", "/")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[1] == CHILD:
        child(sys.argv[2], sys.argv[4:], sys.argv[3])
    else:
        main()
