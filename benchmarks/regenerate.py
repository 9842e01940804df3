"""Regeneration throughput: batched left-padded `generate` against one request at a time, side by side.

Both modes run specgen's regeneration path (chat template, turn-by-turn on-policy context, decode) on the same
model and conversations, in one process, differing only in `regenerate.batch_size`: one conversation at a time,
or up to --batch-size conversations decoding together. Greedy decoding, so both must write the same text (the
table says how many turns agree exactly; low-precision kernels may break rare near-ties differently in a batch).
A random model rarely ends its turns early, so both modes generate the same number of tokens.

The default model is shaped like a small real LLM (hidden 512, 8 layers, the real Llama-3.1 vocabulary and
tokenizer, needs ../shared); --model takes any local Hugging Face model folder instead.

  python benchmarks/regenerate.py [--rows 32] [--max-new-tokens 32] [--batch-size 32] [--threads 2] [--model DIR]
                                  [--dtype float32]
"""

import argparse
import itertools
import tempfile
import time
from pathlib import Path

import torch

from common import SHARED, build_llama

DATA = SHARED / "datasets" / "sharegpt_fastchat_dummy.json"


def build_model(out_dir: Path) -> Path:
    return build_llama(out_dir)  # float32: this CPU has no fast bf16 path


def regenerate(model, tokenizer, records, *, batch_size: int, max_new_tokens: int) -> tuple[dict, float, list]:
    """Regenerate `records` with the given batch size: (unit stats, seconds, output rows)."""
    from specgen.regen.engine import Generator, Sampling
    from specgen.regen.turns import ConversationRegenerator, TurnPolicy

    sampling = Sampling(temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=max_new_tokens)
    generator = Generator(model, tokenizer, sampling, batch_size=batch_size, batch_tokens=1 << 30)
    regenerator = ConversationRegenerator(tokenizer, generator, TurnPolicy(on_empty="keep"), max_prompt_tokens=4096)
    start = time.perf_counter()
    result = regenerator.regenerate(records)
    return result.stats, time.perf_counter() - start, result.rows


def assistant_turns(rows: list[dict]) -> list[str]:
    return [m["content"] for row in rows for m in row["messages"] if m["role"] == "assistant"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=32, help="conversations (from the ShareGPT sample)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=32, help="conversations per batch in the batched mode")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", type=Path, default=None, help="a local HF model folder (default: built here)")
    parser.add_argument("--dtype", default="float32", help="float32 (CPUs lack fast bf16 kernels) | bfloat16 | auto")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    from specgen.capture.target import load_target
    from specgen.data.sources import iter_records

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or build_model(Path(tmp) / "model")
        model = load_target(model_dir, dtype=args.dtype, device="cuda" if torch.cuda.is_available() else "cpu")
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    records = list(itertools.islice(iter_records(DATA), args.rows))

    regenerate(model, tokenizer, records[:2], batch_size=2, max_new_tokens=4)  # warm-up: kernels, allocator
    modes = [("one at a time", 1), ("batched", args.batch_size)]
    results = [(name, size, *regenerate(model, tokenizer, records, batch_size=size,
                                        max_new_tokens=args.max_new_tokens)) for name, size in modes]

    print(f"model {model_dir if args.model else 'llama hidden 512, 8 layers, Llama-3.1 vocab'} "
          f"({str(model.dtype).removeprefix('torch.')}, {model.device}, {args.threads} threads); {args.rows} "
          f"conversations, greedy, max_new_tokens={args.max_new_tokens}")
    header = f"{'mode':<14} {'batch':>5} {'turns':>6} {'new tokens':>10} {'seconds':>8} {'tokens/s':>9} {'speedup':>8}"
    print(header + "\n" + "-" * len(header))
    base = results[0][2]["new_tokens"] / results[0][3]
    for name, size, stats, seconds, _ in results:
        rate = stats["new_tokens"] / seconds
        print(f"{name:<14} {size:>5} {stats['regenerated_turns']:>6} {stats['new_tokens']:>10,} {seconds:>8.1f} "
              f"{rate:>9,.0f} {rate / base:>7.1f}x")
    single, batched = (assistant_turns(result[4]) for result in results)
    same = sum(a == b for a, b in zip(single, batched))
    print(f"identical turns (batched vs one at a time): {same}/{len(single)}")


if __name__ == "__main__":
    main()
