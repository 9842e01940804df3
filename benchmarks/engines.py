"""engine=hf against engine=vllm: capture and regeneration tokens/s on the same model and data, side by side.

Every configuration runs the real stage (`python -m specgen.generate` / `specgen.regenerate`) in its own process
from the vLLM venv (it has both engines), and the throughput is the stage's own measure from its manifest
(`last_run`: tokens captured, or new tokens generated, per second after the model is loaded). Capture runs with and
without prefix reuse (engine=hf: `capture.prefix_reuse`; engine=vllm: automatic prefix caching), on conversations
that share a ~300-token system prompt (as a deployment's traffic does). Regeneration is greedy.

The model is shaped like a small real LLM: hidden 512, 8 layers (head size 64), the real Llama-3.1 vocabulary and
tokenizer (needs ../shared), float32 (CPUs lack fast bf16 kernels).

  .venv-vllm/bin/python benchmarks/engines.py [--rows 48] [--max-new-tokens 32] [--regen-rows 16]
"""

import argparse
import itertools
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

from common import REPO, SHARED, build_llama

DATA = SHARED / "datasets" / "sharegpt_fastchat_dummy.json"


def build_model(out_dir: Path) -> Path:
    return build_llama(out_dir)  # float32: this CPU has no fast bf16 path


def write_data(path: Path, rows: int) -> Path:
    """The ShareGPT sample's conversations, each behind the same ~300-token system prompt."""
    from specgen.data.formats import normalize
    from specgen.data.sources import iter_records

    rng = random.Random(0)
    system = "You are the support assistant of a large shop. " + " ".join(
        rng.choice("policy refund order shipping account return warranty invoice".split()) for _ in range(280))
    lines = []
    for record in itertools.islice(iter_records(DATA), rows):
        item = normalize(record.record)
        messages = [{"role": "system", "content": system}] + [m for m in item.messages if m["role"] != "system"]
        lines.append(json.dumps({"id": item.id, "messages": messages}))
    path.write_text("\n".join(lines) + "\n")
    return path


def run_stage(stage: str, overrides: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    done = subprocess.run([sys.executable, "-m", f"specgen.{stage}", *overrides], cwd=REPO, env=env,
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{stage} {' '.join(overrides)} failed:\n{done.stderr[-4000:]}")
    out_dir = next(o.split("=", 1)[1] for o in overrides if o.startswith("output.dir="))
    return json.loads((Path(out_dir) / "manifest.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=48, help="conversations captured")
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--regen-rows", type=int, default=16, help="conversations regenerated")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()
    vllm = ["engine=vllm", "engine.distributed_executor_backend=uni"]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = build_model(tmp / "model")
        data = write_data(tmp / "data.jsonl", max(args.rows, args.regen_rows))
        common = [f"model.path={model}", f"data.path={data}", "runtime.progress=false", "model.dtype=float32",
                  f"data.max_length={args.max_length}"]
        capture = [("hf", "off", ["capture.prefix_reuse=false"]), ("hf", "on (prefix_reuse)", []),
                   ("vllm", "off", [*vllm, "engine.enable_prefix_caching=false"]),
                   ("vllm", "on (prefix caching)", vllm)]
        rows = []
        for i, (engine, prefix, extra) in enumerate(capture):
            manifest = run_stage("generate", [*common, f"data.max_rows={args.rows}", f"output.dir={tmp}/gen{i}",
                                              *extra])
            run, reuse = manifest["last_run"], manifest["prefix_reuse"]
            rows.append(("capture", engine, prefix, reuse["tokens_emitted"], reuse["tokens_computed"],
                         run["seconds"], reuse["tokens_emitted"] / run["seconds"]))
        regen = [("hf", "-", []), ("vllm", "off", [*vllm, "engine.enable_prefix_caching=false"]),
                 ("vllm", "on (prefix caching)", vllm)]
        for i, (engine, prefix, extra) in enumerate(regen):
            manifest = run_stage("regenerate", [*common, f"data.max_rows={args.regen_rows}", "regenerate.temperature=0",
                                                f"regenerate.max_new_tokens={args.max_new_tokens}",
                                                "regenerate.on_empty=keep", f"output.dir={tmp}/regen{i}", *extra])
            run = manifest["last_run"]
            rows.append(("regenerate", engine, prefix, run["new_tokens"], None, run["seconds"],
                         run["new_tokens_per_second"]))
    print(f"model: llama hidden 512, 8 layers, Llama-3.1 vocab, float32, CPU; capture {args.rows} conversations, "
          f"regenerate {args.regen_rows} (greedy, max_new_tokens={args.max_new_tokens}); engine start not timed")
    print("| stage | engine | prefix reuse | tokens | tokens computed | seconds | tokens/s | vs hf |")
    print("|---|---|---|---|---|---|---|---|")
    base = {stage: rate for stage, engine, _, _, _, _, rate in rows if engine == "hf"}  # last hf row per stage
    base["capture"] = rows[0][6]
    for stage, engine, prefix, tokens, computed, seconds, rate in rows:
        print(f"| {stage} | {engine} | {prefix} | {tokens:,} | {'' if computed is None else f'{computed:,}'} | "
              f"{seconds:.1f} | {rate:,.0f} | {rate / base[stage]:.2f}x |")


if __name__ == "__main__":
    main()
