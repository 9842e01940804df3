"""Capture throughput per batching and attention kernel, on one device, as a share of its measured GEMM peak.

    python benchmarks/capture_kernels.py [--device cuda] [--dtype bfloat16] [--shape bench512|1b|8b] [--rows 2000]
        [--max-length 2048] [--batch-tokens 16384] [--repeats 3]

In one process, on one randomly initialised Llama of the chosen shape (its weights do not change the cost), the
same rows (lengths drawn log-normally, seed 0, like chat data: median ~300 tokens, up to --max-length) are
captured by (the model is built on --device in --dtype directly: an 8B shape is ready in seconds on a GPU):
  bare         the Hugging Face decoder stack alone (`model.model`), right-padded batches: the baseline
  padded       specgen's capture, right-padded batches (`capture.packing=false`)
  packed       specgen's capture, one packed row per batch, the attention kernel it picks (on CUDA in bf16/fp16:
               flash-attn's varlen, else torch's `varlen_attn`; else SDPA per segment)
  packed-sdpa  the same packed rows with SDPA per segment forced (the fallback)
  +compile     (--compile) padded and packed with each decoder layer under torch.compile(dynamic=True)
round-robin for --repeats rounds (median seconds). `of peak` is the useful FLOP/s (real tokens only: 2 x the
decoder's matmul weights per token, plus causal attention 2 x L^2 x heads x head_dim per layer and sequence) over a
[N x N] GEMM's FLOP/s in the same dtype measured before the rounds. No shared data or tokenizer is needed.
"""

import argparse
import statistics
import time

import torch
import transformers

from specgen.capture import make_capture
from specgen.capture import packed as packed_module
from specgen.capture.packed import PackedSegments
from specgen.data.batching import pad_right, packed_batches, token_budget_batches

SHAPES = {
    # the 512-hidden benchmark model of benchmarks/common.py (its vocabulary shrunk: no LM head runs)
    "bench512": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                     num_key_value_heads=4),
    # Llama-3.2-1B's decoder shape
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8),
    # Llama-3.1-8B's decoder shape
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8),
}
AUX_LAYERS = [1, 3, 5]


def row_lengths(rows: int, max_length: int) -> list[int]:
    generator = torch.Generator().manual_seed(0)
    lengths = torch.exp(torch.randn(rows, generator=generator) * 0.9 + 5.7).round().long()
    return lengths.clamp(16, max_length).tolist()


def useful_flops(config: transformers.LlamaConfig, lengths: list[int]) -> float:
    head_dim = config.hidden_size // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    matmul = 2 * config.num_hidden_layers * (config.hidden_size * (2 * config.hidden_size + 2 * kv)
                                             + 3 * config.hidden_size * config.intermediate_size)
    attention = sum(2 * length * length * config.num_attention_heads * head_dim * config.num_hidden_layers
                    for length in lengths)
    return matmul * sum(lengths) + attention


def gemm_peak(device: str, dtype: torch.dtype, size: int) -> float:
    a, b = torch.randn(size, size, device=device, dtype=dtype), torch.randn(size, size, device=device, dtype=dtype)
    times = []
    for _ in range(6):
        sync(device)
        start = time.perf_counter()
        torch.mm(a, b)
        sync(device)
        times.append(time.perf_counter() - start)
    return 2 * size ** 3 / statistics.median(times[1:])


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_variant(name: str, model, capture, samples: list[list[int]], batch_tokens: int, device: str) -> dict:
    """Seconds and forwarded tokens of one pass over all rows."""
    forwarded = 0
    sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        if name in ("bare", "padded"):
            for batch in token_budget_batches(samples, batch_tokens, 64):
                ids = pad_right(batch, 0, device)
                forwarded += ids.numel()
                if name == "bare":
                    model.model(input_ids=ids)
                else:
                    capture(ids, torch.tensor([len(s) for s in batch]))
        else:
            for batch in packed_batches(samples, batch_tokens, 64):
                segments = PackedSegments.from_lengths([len(s) for s in batch])
                ids = torch.tensor([token for s in batch for token in s], device=device)[None]
                forwarded += ids.numel()
                capture.packed(ids, segments)
    sync(device)
    return {"seconds": time.perf_counter() - start, "forwarded": forwarded,
            "kernel": getattr(locals().get("segments"), "kernel", "")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--shape", default="bench512", choices=sorted(SHAPES))
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--batch-tokens", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gemm-size", type=int, default=8192)
    parser.add_argument("--compile", action="store_true", help="add padded and packed capture with every decoder "
                        "layer under torch.compile(dynamic=True) (the attention call included)")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    config = transformers.LlamaConfig(vocab_size=4096, max_position_embeddings=max(4096, args.max_length),
                                      tie_word_embeddings=False, **SHAPES[args.shape])
    torch.manual_seed(0)
    # Built where it runs, in its dtype: initialising an 8B model on the CPU first took minutes before anything ran.
    with torch.device(args.device):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    model = model.eval()
    capture = make_capture(model, AUX_LAYERS)
    lengths = row_lengths(args.rows, args.max_length)
    generator = torch.Generator().manual_seed(1)
    samples = [torch.randint(1, config.vocab_size, (n,), generator=generator).tolist() for n in lengths]
    flops = useful_flops(config, lengths)
    peak = gemm_peak(args.device, dtype, args.gemm_size)
    native, flash = packed_module._torch_varlen, packed_module._flash_varlen

    variants = ["bare", "padded", "packed", "packed-sdpa"] + (["padded+compile", "packed+compile"]
                                                             if args.compile else [])
    eager_layers = model.model.layers
    compiled_layers = torch.nn.ModuleList(torch.compile(layer, dynamic=True) for layer in eager_layers)
    results: dict[str, list[dict]] = {name: [] for name in variants}
    compile_seconds = 0.0

    def one(name: str, rows: list[list[int]]) -> dict:
        if name == "packed-sdpa":
            packed_module._torch_varlen = packed_module._flash_varlen = lambda: None
        if name.endswith("+compile"):
            model.model.layers = compiled_layers
        try:
            return run_variant(name.removesuffix("+compile"), model, capture, rows, args.batch_tokens, args.device)
        finally:
            packed_module._torch_varlen, packed_module._flash_varlen = native, flash
            model.model.layers = eager_layers

    for name in variants:  # warm-up: kernels, allocator, compilation (static, then dynamic shapes)
        seconds = one(name, samples[:64])["seconds"]
        compile_seconds += seconds if name.endswith("+compile") else 0.0
    for _ in range(args.repeats):
        for name in variants:
            results[name].append(one(name, samples))
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"{name} · {args.dtype} · shape {args.shape} · {args.rows} rows, {sum(lengths):,} real tokens "
          f"(median {int(statistics.median(lengths))}, max {max(lengths)}) · batch_tokens {args.batch_tokens} · "
          f"GEMM peak {peak / 1e12:.1f} TFLOP/s ([{args.gemm_size}]^2) · median of {args.repeats}"
          + (f" · compile warm-up {compile_seconds:.0f} s" if args.compile else ""))
    print("| variant | attention kernel | tokens/s | vs bare | fwd/real | useful TFLOP/s | of peak |")
    print("|---|---|---|---|---|---|---|")
    bare = statistics.median(r["seconds"] for r in results["bare"])
    for name in variants:
        seconds = statistics.median(r["seconds"] for r in results[name])
        kernel = results[name][-1]["kernel"] or "sdpa (padded)"
        print(f"| {name} | {kernel} | {sum(lengths) / seconds:,.0f} | {bare / seconds:.2f} | "
              f"{results[name][-1]['forwarded'] / sum(lengths):.3f} | {flops / seconds / 1e12:.2f} | "
              f"{flops / seconds / peak:.0%} |")


if __name__ == "__main__":
    main()
