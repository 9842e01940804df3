"""Generate throughput, disk and memory: specgen vs the bare forward vs a naive baseline, side by side.

  (a) specgen      python -m specgen.generate (tokenize, capture 3 aux layers + final hidden state, Arrow shards)
  (b) bare forward the backbone forward over the same token batches: no capture, no lm_head, no I/O (the limit)
  (c) naive        the existing tools' style: output_hidden_states=True, full-vocab logits, fixed-size batches
                   padded to max_length in dataset order, one torch.save file per sample (padded tensors)

Each method runs in its own process (so peak RSS is its own) on the same model and rows. The model is shaped like
a small real LLM: hidden 512, 8 layers, the real Llama-3.1 vocabulary and tokenizer (needs ../shared).

  python benchmarks/generate.py [--rows 200] [--max-length 512] [--threads 2]
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("SPECGEN_SHARED", REPO.parent / "shared"))
TOKENIZER = SHARED / "tokenizers" / "llama-3.1"
DATA = SHARED / "datasets" / "sharegpt_fastchat_dummy.json"
AUX_LAYERS = [1, 3, 4]


def build_model(out_dir: Path) -> None:
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=128256, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096,
                            tie_word_embeddings=False)
    tf.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(out_dir)
    tf.AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(out_dir)


def tokenized_samples(model_dir: Path, rows: int, max_length: int):
    from transformers import AutoTokenizer

    from specgen.data.prepare import prepare_rows
    from specgen.data.sources import iter_records
    from specgen.data.template import ChatTemplateTokenizer

    import itertools

    chat = ChatTemplateTokenizer(AutoTokenizer.from_pretrained(model_dir), max_length=max_length)
    return [s for row in prepare_rows(itertools.islice(iter_records(DATA), rows), chat) for s in row.samples]


def run_specgen(model_dir: Path, work: Path, args) -> dict:
    from specgen.config import compose
    from specgen.generate import run

    manifest = run(compose("generate", [f"model.path={model_dir}", f"data.path={DATA}", f"output.dir={work}",
                                        f"data.max_rows={args.rows}", f"data.max_length={args.max_length}",
                                        f"capture.aux_layers={AUX_LAYERS}", f"capture.batch_tokens={args.batch_tokens}",
                                        "runtime.progress=false", "output.shard_size=64"]))
    return {"tokens": manifest["last_run"]["computed_tokens"], "seconds": manifest["last_run"]["seconds"],
            "bytes": manifest["stats"]["bytes_on_disk"]}


def run_bare(model_dir: Path, work: Path, args) -> dict:
    from transformers import AutoModelForCausalLM

    from specgen.data.batching import token_budget_batches

    samples = tokenized_samples(model_dir, args.rows, args.max_length)
    backbone = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).model.eval()
    start = time.perf_counter()
    with torch.inference_mode():
        for batch in token_budget_batches(samples, args.batch_tokens, 64):
            ids = torch.zeros(len(batch), max(len(s) for s in batch), dtype=torch.long)
            for b, s in enumerate(batch):
                ids[b, : len(s)] = torch.tensor(s.input_ids)
            backbone(input_ids=ids)
    return {"tokens": sum(len(s) for s in samples), "seconds": time.perf_counter() - start, "bytes": 0}


def run_naive(model_dir: Path, work: Path, args) -> dict:
    from transformers import AutoModelForCausalLM

    samples = tokenized_samples(model_dir, args.rows, args.max_length)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    batch_size = 4
    start = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, len(samples), batch_size):
            batch = samples[first: first + batch_size]
            ids = torch.zeros(len(batch), args.max_length, dtype=torch.long)
            mask = torch.zeros(len(batch), args.max_length, dtype=torch.long)
            for b, s in enumerate(batch):
                ids[b, : len(s)] = torch.tensor(s.input_ids)
                mask[b, : len(s)] = 1
            out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
            aux = torch.cat([out.hidden_states[i + 1] for i in AUX_LAYERS], dim=-1)
            for b, s in enumerate(batch):
                torch.save({"input_ids": ids[b].clone(), "loss_mask": torch.tensor(s.loss_mask),
                            "hidden_state": aux[b].clone(), "target": out.hidden_states[-1][b].clone()},
                           work / f"{first + b}.pt")
    return {"tokens": sum(len(s) for s in samples), "seconds": time.perf_counter() - start,
            "bytes": sum(p.stat().st_size for p in work.glob("*.pt"))}


METHODS = {"specgen": run_specgen, "bare forward": run_bare, "naive": run_naive}


def child(args) -> None:
    torch.set_num_threads(args.threads)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    result = METHODS[args.method](Path(args.model), work, args)
    result["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print("RESULT " + json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--batch-tokens", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--method", choices=list(METHODS), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.method:
        return child(args)
    if not TOKENIZER.exists():
        sys.exit(f"{TOKENIZER} is missing: this benchmark needs ../shared")

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        build_model(model_dir)
        results = {}
        for name in METHODS:
            cmd = [sys.executable, __file__, "--method", name, "--model", str(model_dir),
                   "--work", str(Path(tmp) / name.replace(" ", "_")), "--rows", str(args.rows),
                   "--max-length", str(args.max_length), "--batch-tokens", str(args.batch_tokens),
                   "--threads", str(args.threads)]
            out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
            line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"{name} failed:\n{out.stderr[-3000:]}")
            results[name] = json.loads(line[7:])

    payload = 4 + 1 + (len(AUX_LAYERS) + 1) * 512 * 2  # int32 id + int8 mask + 4 bf16 vectors of 512
    bare = results["bare forward"]["tokens"] / results["bare forward"]["seconds"]
    print(f"\nrows={args.rows} max_length={args.max_length} tokens={results['specgen']['tokens']:,} "
          f"threads={args.threads}; raw payload {payload:,} B/token")
    print(f"{'method':<14}{'tokens/s':>10}{'vs bare':>9}{'B/token':>10}{'vs payload':>12}{'peak RSS':>11}")
    for name, r in results.items():
        rate = r["tokens"] / r["seconds"]
        per_token = r["bytes"] / r["tokens"]
        print(f"{name:<14}{rate:>10,.0f}{rate / bare:>9.2f}{per_token:>10,.0f}"
              f"{(per_token / payload if r['bytes'] else float('nan')):>12.2f}{r['peak_rss'] / 2**20:>9,.0f}MB")


if __name__ == "__main__":
    main()
