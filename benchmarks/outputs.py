"""The optional outputs: bytes per token and generate throughput of each against the plain run, and fp8 decode error.

Part 1 runs `specgen.generate` on the same rows once per option set, side by side, interleaved over --repeats
rounds (the best round counts; the machine is noisy), on a model shaped like a small real LLM: hidden 512,
8 layers, the real Llama-3.1 vocabulary (128256) and tokenizer from ../shared, bf16.

Part 2 measures the fp8 decode error (relative RMS, per aux layer) with one scale per token for all aux layers
against one scale per token per aux layer, on: random normal states; synthetic states with real-target layer
magnitudes (early layers small, a massive-activation channel in the last); and real-model states (the bundled
trained tiny target on its chat sample).

  python benchmarks/outputs.py [--rows 48] [--max-length 384] [--repeats 2] [--threads 2]
"""

import argparse
import contextlib
import io
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate import DATASETS, TOKENIZER, build_model  # noqa: E402  (the benchmark model of benchmarks/generate.py)

DATA = DATASETS["fastchat"]  # the rows this benchmark has always run on (generate.py's DATA before its datasets)

AUX_LAYERS = [1, 3, 4]
RUNS = {
    "plain (bf16)": [],
    "fp8": ["output.codec=fp8"],
    "bf16 + top-20": ["capture.logits=topk", "capture.topk=20"],
    "fp8 + top-20": ["output.codec=fp8", "capture.logits=topk", "capture.topk=20"],
    "bf16 + full logits": ["capture.logits=full"],
    "token_logprobs": ["capture.token_logprobs=true"],
    "pooled mean": ["capture.pooled=mean"],
    "fp8 + top-20 + logprobs + pooled": ["output.codec=fp8", "capture.logits=topk", "capture.topk=20",
                                         "capture.token_logprobs=true", "capture.pooled=mean"],
}


def generate_runs(args) -> dict[str, dict]:
    import warnings

    from specgen.config import compose
    from specgen.generate import run

    best: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        build_model(model_dir)
        for round_number in range(args.repeats):
            for index, (name, overrides) in enumerate(RUNS.items()):
                out_dir = Path(tmp) / f"run-{round_number}-{index}"
                with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
                    warnings.simplefilter("ignore")  # the full-logits size warning
                    manifest = run(compose("generate", [
                        f"model.path={model_dir}", f"data.path={DATA}", f"output.dir={out_dir}",
                        f"data.max_rows={args.rows}", f"data.max_length={args.max_length}",
                        f"capture.aux_layers={AUX_LAYERS}", "runtime.progress=false", "output.shard_size=64",
                        *overrides]))
                result = {"tokens_per_s": manifest["last_run"]["tokens_per_second"],
                          "bytes_per_token": manifest["stats"]["bytes_per_token"],
                          "trainable_fraction": manifest["stats"]["trainable_tokens"] / manifest["stats"]["tokens"]}
                if name not in best or result["tokens_per_s"] > best[name]["tokens_per_s"]:
                    best[name] = result
                for path in out_dir.glob("shard-*.arrow"):  # full logits are GBs; keep the disk free
                    path.unlink()
    return best


def relative_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def decode_errors(aux: torch.Tensor, num_aux: int) -> dict[str, list[float]]:
    from specgen.store import fp8

    errors = {}
    for label, groups in (("1 scale/token", 1), ("1 scale/token/layer", num_aux)):
        decoded = fp8.decode(*fp8.encode(aux, groups), torch.bfloat16)
        errors[label] = [relative_rms(d, w) for d, w in zip(decoded.chunk(num_aux, -1), aux.chunk(num_aux, -1))]
    return errors


def real_model_states(max_samples: int = 16) -> torch.Tensor:
    """aux hidden states [N, 3*H] of the bundled trained bf16 target on its chat sample."""
    from specgen import open_shards
    from specgen.config import compose
    from specgen.generate import run

    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()):
        run(compose("generate", [f"output.dir={tmp}", f"data.max_rows={max_samples}", "runtime.progress=false"]))
        dataset = open_shards(tmp)
        return torch.cat([dataset[i]["aux_hidden_states"].clone() for i in range(len(dataset))])


def fp8_error_table() -> list[tuple[str, dict]]:
    generator = torch.Generator().manual_seed(0)
    random_states = torch.randn(4096, 3 * 512, generator=generator).to(torch.bfloat16)
    magnitudes = torch.tensor([0.05, 1.0, 8.0])
    layered = torch.randn(4096, 3, 512, generator=generator) * magnitudes[:, None]
    layered[::4, 2, 17] = 3000.0  # a massive activation on one channel of some tokens, as real targets have
    layered = layered.flatten(1).to(torch.bfloat16)
    return [("random N(0,1)", decode_errors(random_states, 3)),
            ("synthetic: layer rms 0.05/1/8 + outlier 3000", decode_errors(layered, 3)),
            ("real model (bundled target)", decode_errors(real_model_states(), 3))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=48)
    parser.add_argument("--max-length", type=int, default=384)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if not TOKENIZER.exists():
        sys.exit(f"{TOKENIZER} is missing: this benchmark needs ../shared")
    torch.set_num_threads(args.threads)

    start = time.perf_counter()
    results = generate_runs(args)
    plain = results["plain (bf16)"]
    print(f"\nLlama-3.1 vocab (128256), hidden 512, 8 layers, bf16, aux {AUX_LAYERS}; rows={args.rows} "
          f"max_length={args.max_length} threads={args.threads}, best of {args.repeats}; "
          f"{plain['trainable_fraction']:.0%} of tokens trainable")
    print(f"{'option':<36}{'B/token':>11}{'vs plain':>10}{'tokens/s':>10}{'vs plain':>10}")
    for name, r in results.items():
        print(f"{name:<36}{r['bytes_per_token']:>11,.0f}{r['bytes_per_token'] / plain['bytes_per_token']:>10.2f}"
              f"{r['tokens_per_s']:>10,.0f}{r['tokens_per_s'] / plain['tokens_per_s']:>10.2f}")

    print("\nfp8 decode error (relative RMS per aux layer, decoded to bf16)")
    print(f"{'states':<48}{'1 scale/token':>26}{'1 scale/token/layer':>26}")
    for name, errors in fp8_error_table():
        cells = ["/".join(f"{e:.3f}" for e in errors[label]) for label in ("1 scale/token", "1 scale/token/layer")]
        print(f"{name:<48}{cells[0]:>26}{cells[1]:>26}")
    print(f"\n({time.perf_counter() - start:.0f}s)")


if __name__ == "__main__":
    main()
