"""Regeneration throughput of the transformers engine: one request at a time, batched with the dynamic KV cache, and
batched with the static one (`regenerate.kv_cache=static`), side by side; with `--modes ... vllm` (run by the python
of vLLM's venv, `.ci/vllm-venv`) vLLM's engine beside them (`engine=vllm`: its default settings, continuous batching:
a conversation's next turn is submitted as soon as its previous one is back), and with `vllm-depth` the same engine
driven depth by depth (every conversation's first turn, then every second one, ...: how specgen drove it before),
and with `vllm-full` the same engine running every turn to its end (no loop watch: how specgen ran it before a looping
turn was stopped at the token that makes it loop; `--on-loop drop|resample`, as `regenerate.on_loop`).

Every mode runs specgen's regeneration path (chat template, turn-by-turn on-policy context, decode) on the same
model and conversations, in one process, differing only in `regenerate.batch_size` and `regenerate.kv_cache` (and
`engine.name` for the vllm mode).
Greedy decoding by default, so every mode must write the same text (the table says how many turns agree with the
first mode, and "speed" its seconds over each mode's; low-precision kernels may break rare near-ties differently in
a batch). A random model rarely ends its turns early, so the modes generate the same number of tokens. The
schedules differ where turns end at different lengths: a real model (--model) on real conversations (--data),
sampled (--temperature; every request is seeded from its row, message and draw, so both vLLM schedules draw the
same turns up to float rounding).

Each mode first runs once untimed on the first --batch-size conversations with the same settings (kernels,
allocator; with the static cache on CUDA, transformers compiles the decoding step then: "warm-up s" in the table),
then is timed on all of them.

Models (random weights, seed 0, the real Llama-3.1 vocabulary and tokenizer from ../shared):
  --shape small      hidden 512, 8 layers (a small real LLM's shape; the default)
  --shape smollm2    SmolLM2-135M-Instruct's decoder (hidden 576, 30 layers, 9/3 heads), with Llama-3.1's vocabulary
or --model DIR, any local Hugging Face model folder.

  python benchmarks/regenerate.py [--rows 32] [--max-new-tokens 32] [--batch-size 32] [--threads 2]
      [--shape small|smollm2 | --model DIR] [--dtype float32] [--device cpu|cuda] [--data FILE] [--temperature 0]
      [--on-loop keep|drop|resample] [--modes single dynamic static vllm vllm-depth vllm-full]
vLLM's two schedules on SmolLM2-135M-Instruct and its prompt mix (`python -m specgen.assets.smollm2 [--prompts F]`):
  VLLM_CPU_KVCACHE_SPACE=6 VLLM_CPU_OMP_THREADS_BIND=nobind OMP_NUM_THREADS=2 .venv-vllm/bin/python \
      benchmarks/regenerate.py --model M --data F --rows 64 --max-new-tokens 256 --temperature 0.7 \
      --modes vllm vllm-depth
Stopping looping turns, as #42's kept replies are made (add --on-loop resample to the command above):
      --on-loop resample --modes vllm vllm-full
On one GPU (about 2 minutes):
  python benchmarks/regenerate.py --device cuda --dtype bfloat16 --shape smollm2 --rows 512 --batch-size 128 \\
      --max-new-tokens 256 --modes dynamic static
"""

import argparse
import itertools
import tempfile
import time
from pathlib import Path

import torch

from common import SHARED, SMALL, SMOLLM2_135M, build_llama

DATA = SHARED / "datasets" / "sharegpt_fastchat_dummy.json"
SHAPES = {"small": SMALL, "smollm2": SMOLLM2_135M}
MODES = {"single": ("one at a time", "dynamic"), "dynamic": ("batched", "dynamic"),
         "static": ("batched, static", "static"), "vllm": ("vLLM engine", None),
         "vllm-depth": ("vLLM, by depth", None), "vllm-full": ("vLLM, full draws", None)}
MAX_PROMPT_TOKENS = 1024  # the longest prompt regenerated (a static cache holds this + max_new_tokens a row)


def sampling(max_new_tokens: int, temperature: float):
    from specgen.regen.engine import Sampling

    return Sampling(temperature=temperature, top_p=1.0, top_k=0, max_new_tokens=max_new_tokens)


def hf_generator(model, tokenizer, *, batch_size: int, max_new_tokens: int, kv_cache: str, temperature: float):
    from specgen.regen.engine import Generator

    return Generator(model, tokenizer, sampling(max_new_tokens, temperature), batch_size=batch_size,
                     batch_tokens=1 << 30, kv_cache=kv_cache, max_length=MAX_PROMPT_TOKENS + max_new_tokens)


def vllm_generator(model_dir: Path, model, tokenizer, *, max_new_tokens: int, temperature: float):
    """specgen's vLLM generator with `engine=vllm`'s settings, as `specgen regenerate engine=vllm` builds it."""
    from omegaconf import OmegaConf

    from specgen.config import compose
    from specgen.regen.vllm import VllmGenerator

    engine = OmegaConf.to_container(compose("regenerate", ["engine=vllm"]).engine)
    return VllmGenerator(model_dir, model, tokenizer, sampling(max_new_tokens, temperature), engine=engine,
                         max_model_len=MAX_PROMPT_TOKENS + max_new_tokens)


class Wrapped:
    """specgen's vLLM generator with one behaviour changed; everything else is the generator's own."""

    def __init__(self, generator):
        self.generator = generator

    def __getattr__(self, name):
        return getattr(self.generator, name)


class DepthByDepth(Wrapped):
    """`collect` returns once every request in flight is done, so a conversation's next turn waits for the slowest
    turn of the depth."""

    def collect(self, on_batch=None):
        done = []
        while finished := self.generator.collect(on_batch):
            done += finished
        return done


class FullDraws(Wrapped):
    """No loop watch: every turn runs to a stop token or max_new_tokens."""

    def submit(self, key, prompt, seed, watch=None):
        self.generator.submit(key, prompt, seed)


def regenerate(generator, model, tokenizer, records, on_loop: str = "drop"):
    """Regenerate `records` with `generator`: (unit stats, seconds, output rows)."""
    from specgen.regen.turns import ConversationRegenerator, TurnPolicy

    regenerator = ConversationRegenerator(tokenizer, generator, TurnPolicy(on_empty="keep", on_loop=on_loop),
                                          max_prompt_tokens=MAX_PROMPT_TOKENS)
    synchronize(model.device)
    start = time.perf_counter()
    result = regenerator.regenerate(records, seed=0)
    synchronize(model.device)
    return result.stats, time.perf_counter() - start, result.rows


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def assistant_turns(rows: list[dict]) -> list[str]:
    return [m["content"] for row in rows for m in row["messages"] if m["role"] == "assistant"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=32, help="conversations (the ShareGPT sample, repeated if needed)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=32, help="conversations per batch in the batched modes")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shape", choices=SHAPES, default="small")
    parser.add_argument("--model", type=Path, default=None, help="a local HF model folder (instead of --shape)")
    parser.add_argument("--dtype", default="float32", help="float32 (CPUs lack fast bf16 kernels) | bfloat16 | auto")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--data", type=Path, default=DATA, help="conversations (JSON/JSONL), repeated if needed")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--on-loop", choices=("keep", "drop", "resample"), default="drop",
                        help="regenerate.on_loop: what a looping turn does (resample needs --temperature > 0)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    from specgen.capture.target import load_target
    from specgen.data.sources import iter_records

    tmp = tempfile.TemporaryDirectory()  # removed at exit: vLLM's engine reads the folder too
    model_dir = args.model or build_llama(Path(tmp.name) / "model", shape=SHAPES[args.shape])
    model = load_target(model_dir, dtype=args.dtype, device=args.device)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    records = list(itertools.islice(itertools.cycle(iter_records(args.data)), args.rows))

    results, engine = [], None
    for mode in args.modes:
        name, kv_cache = MODES[mode]
        size = 1 if mode == "single" else args.batch_size
        if mode.startswith("vllm"):  # one engine, its start not timed; it batches continuously (no batch size)
            engine = engine or vllm_generator(model_dir, model, tokenizer, max_new_tokens=args.max_new_tokens,
                                              temperature=args.temperature)
            generator = {"vllm": engine, "vllm-depth": DepthByDepth(engine), "vllm-full": FullDraws(engine)}[mode]
            size = "-"
        else:
            generator = hf_generator(model, tokenizer, batch_size=size, max_new_tokens=args.max_new_tokens,
                                     kv_cache=kv_cache, temperature=args.temperature)
        warm = regenerate(generator, model, tokenizer, records[:args.batch_size], args.on_loop)[1]
        if engine is not None:
            engine.llm.reset_prefix_cache()  # every mode starts from a cold prefix cache
        stats, seconds, rows = regenerate(generator, model, tokenizer, records, args.on_loop)
        results.append((name, size, warm, stats, seconds, assistant_turns(rows)))
        del generator

    model_name = args.model or f"llama shape {args.shape}, Llama-3.1 vocab"
    print(f"model {model_name} ({str(model.dtype).removeprefix('torch.')}, {model.device}, {args.threads} threads); "
          f"{args.rows} conversations of {args.data.name}, "
          f"{f'temperature {args.temperature}' if args.temperature else 'greedy'}, max_new_tokens={args.max_new_tokens}")
    header = (f"{'mode':<16} {'batch':>5} {'warm-up s':>9} {'rows':>5} {'turns':>6} {'stopped':>7} "
              f"{'new tokens':>10} {'seconds':>8} {'tokens/s':>9} {'speed':>6} {'same turns':>10}")
    print(header + "\n" + "-" * len(header))
    for name, size, warm, stats, seconds, turns in results:
        same = sum(a == b for a, b in zip(results[0][5], turns))
        print(f"{name:<16} {size:>5} {warm:>9.1f} {stats['rows']:>5} {stats['regenerated_turns']:>6} "
              f"{stats['loop_stopped_turns']:>7} {stats['new_tokens']:>10,} {seconds:>8.1f} "
              f"{stats['new_tokens'] / seconds:>9,.0f} {results[0][4] / seconds:>5.2f}x {same:>5}/{len(turns)}")
    print("rows: kept conversations; turns: kept draws; stopped: looping draws stopped at the token that made them "
          "loop; speed: the first mode's seconds / this mode's (same rows); same turns: kept turns equal to the "
          "first mode's")

if __name__ == "__main__":
    main()
