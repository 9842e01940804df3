"""Shared-prefix reuse: tokens computed, wall time and bytes stored, with and without reuse, side by side.

  (a) system prompt  Alpaca instructions as conversations that all start with one long system prompt and the same
                     tool definitions (rendered by the Qwen3 template into the system block)
  (b) per-turn rows  the multi-turn reasoning / tool-use conversations; the Qwen3 template drops earlier turns'
                     reasoning, so each assistant turn is its own row repeating the conversation before it

Each dataset runs through `python -m specgen.generate` (in-process, the same target) three ways: without reuse,
with reuse (flat layout), and with reuse plus `output.store_prefix_once=true`. "unique" is the number of distinct
token prefixes in the work unit (what a perfect reuse computes, and stores); the target is both ratios <= 1.1.
Configurations alternate within each repeat and the fastest repeat counts (the machine is shared and noisy).
The model is a Qwen3-architecture target (bf16, hidden 512, 8 layers) with the real Qwen3 tokenizer (needs ../shared).

  python benchmarks/prefix_reuse.py [--rows-a 64] [--rows-b 24] [--repeats 2] [--threads 2]
"""

import argparse
import itertools
import json
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
TOKENIZER = SHARED / "tokenizers" / "qwen3"
REASONING = SHARED / "datasets" / "openai_reasoning_tooluse_50.jsonl"
ALPACA = SHARED / "datasets" / "alpaca_en_demo.json"
AUX_LAYERS = [1, 3, 4]
HIDDEN = 512

CONFIGS = {
    "no reuse": ["capture.prefix_reuse=false"],
    "reuse": ["capture.prefix_reuse=true"],
    "reuse + store once": ["capture.prefix_reuse=true", "output.store_prefix_once=true"],
}


def build_model(out_dir: Path) -> None:
    import transformers as tf

    torch.manual_seed(0)
    config = tf.Qwen3Config(vocab_size=151680, hidden_size=HIDDEN, intermediate_size=1536, num_hidden_layers=8,
                            num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=8192,
                            tie_word_embeddings=False)
    tf.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(out_dir)
    tf.AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(out_dir)


def system_prompt_data(path: Path, rows: int) -> Path:
    """(a): every conversation carries the same system prompt and 8 tool definitions (about 1,200 tokens)."""
    reasoning = [json.loads(line) for line in REASONING.read_text().splitlines()]
    tools = {}
    for row in reasoning:
        for tool in json.loads(row["tools"]) if isinstance(row.get("tools"), str) else row.get("tools") or []:
            tools.setdefault(json.dumps(tool, sort_keys=True), tool)
    tools = list(tools.values())[:8]
    system = ("You are the assistant of an online service desk. Follow the policy below in every answer.\n"
              + "\n".join(f"Policy {i + 1}: answer only what was asked, cite the tool you used, keep a neutral tone, "
                          f"and never reveal internal identifiers (rule set {i + 1} of 12)." for i in range(12)))
    alpaca = json.loads(ALPACA.read_text())[:rows]
    lines = [json.dumps({"id": f"a{i}", "tools": tools, "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": (row["instruction"] + "\n" + row["input"]).strip()},
        {"role": "assistant", "content": row["output"]}]}) for i, row in enumerate(alpaca)]
    path.write_text("\n".join(lines) + "\n")
    return path


def per_turn_data(path: Path, rows: int) -> Path:
    """(b): the multi-turn reasoning / tool-use conversations as they are."""
    path.write_text("\n".join(REASONING.read_text().splitlines()[:rows]) + "\n")
    return path


def unique_tokens(model_dir: Path, data: Path, max_length: int) -> tuple[int, int, int]:
    """(distinct token prefixes, tokens emitted, rows) of the dataset's samples: what a perfect reuse computes."""
    from transformers import AutoTokenizer

    from specgen.data.prepare import prepare_rows
    from specgen.data.sources import iter_records
    from specgen.data.template import ChatTemplateTokenizer

    chat = ChatTemplateTokenizer(AutoTokenizer.from_pretrained(model_dir), max_length=max_length)
    samples = [s for row in prepare_rows(iter_records(data), chat) for s in row.samples]
    prefixes = {tuple(s.input_ids[:i]) for s in samples for i in range(1, len(s) + 1)}
    return len(prefixes), sum(len(s) for s in samples), len(samples)


def generate(model_dir: Path, data: Path, out_dir: Path, overrides: list[str], args) -> dict:
    from specgen.config import compose
    from specgen.generate import run

    manifest = run(compose("generate", [
        f"model.path={model_dir}", f"data.path={data}", f"output.dir={out_dir}", "data.max_rows=null",
        f"data.max_length={args.max_length}", f"capture.aux_layers={AUX_LAYERS}", "runtime.progress=false",
        f"capture.batch_tokens={args.batch_tokens}", "output.shard_size=1024", *overrides]))
    return {"computed": manifest["prefix_reuse"]["tokens_computed"], "emitted": manifest["prefix_reuse"]["tokens_emitted"],
            "seconds": manifest["last_run"]["seconds"], "bytes": manifest["prefix_reuse"]["bytes_stored"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows-a", type=int, default=64, help="conversations sharing the system prompt")
    parser.add_argument("--rows-b", type=int, default=24, help="multi-turn conversations (of 50)")
    parser.add_argument("--max-length", type=int, default=4096)
    parser.add_argument("--batch-tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if not TOKENIZER.exists():
        sys.exit(f"{TOKENIZER} is missing: this benchmark needs ../shared")
    torch.set_num_threads(args.threads)

    payload = 4 + 1 + (len(AUX_LAYERS) + 1) * HIDDEN * 2  # int32 id + int8 mask + 4 bf16 vectors, per token
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = tmp / "model"
        build_model(model_dir)
        datasets = {"(a) system prompt": system_prompt_data(tmp / "a.jsonl", args.rows_a),
                    "(b) per-turn rows": per_turn_data(tmp / "b.jsonl", args.rows_b)}
        lines = []
        for name, data in datasets.items():
            unique, emitted, rows = unique_tokens(model_dir, data, args.max_length)
            best: dict[str, dict] = {}
            for repeat, config in itertools.product(range(args.repeats), CONFIGS):
                result = generate(model_dir, data, tmp / f"out-{len(lines)}-{repeat}-{config}", CONFIGS[config], args)
                if config not in best or result["seconds"] < best[config]["seconds"]:
                    best[config] = result
            lines.append(f"\n{name}: {rows} rows, {emitted:,} tokens emitted, {unique:,} unique "
                         f"({emitted / unique:.2f}x repeated); payload {payload:,} B/token")
            lines.append(f"{'':<20}{'computed':>10}{'/unique':>9}{'seconds':>9}{'speedup':>9}"
                         f"{'MB stored':>11}{'/unique':>9}")
            base = best["no reuse"]["seconds"]
            for config, r in best.items():
                lines.append(f"{config:<20}{r['computed']:>10,}{r['computed'] / unique:>9.2f}{r['seconds']:>9.1f}"
                             f"{base / r['seconds']:>9.2f}{r['bytes'] / 2**20:>11.1f}"
                             f"{r['bytes'] / (unique * payload):>9.2f}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
