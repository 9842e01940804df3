"""Draft quality: acceptance length of the demo recipe's draft over several seeds, per training configuration.

    python benchmarks/draft_quality.py [--shards DIR] [--seeds 0 1 2] [--jobs 2]
        [--config NAME=KEY=VALUE,KEY=VALUE ...] [--speculators PYTHON] [--out DIR]

Each configuration is the demo recipe (`recipe=demo`, its shards generated once from chat/train.jsonl, or --shards)
plus its overrides; `demo` is the recipe as shipped. Every (configuration, seed) trains a draft with
`python -m specgen.train` (runtime.seed=SEED, runtime.threads=1; --jobs trainings at once) and evaluates it on the
79 held-out demo turns (chat/heldout.jsonl, K=4 drafts a round, greedy, 96 new tokens a turn) with
`specgen.draft.speculative`. Acceptance length is counted the way vLLM counts it: 1 + accepted draft tokens /
verification rounds, pooled over all turns. Printed: per configuration, mean ± std over seeds, each seed's value,
and the wall time of training and of evaluation; then each configuration's difference from the first one, paired by
seed. A seed fixes the draft's initialisation and the batch order, so two configurations trained with the same seeds
differ by less noise than their means do (on the demo, std ~0.07-0.14 per seed pair against ~0.13 between seeds).
--previous FILE adds the results.jsonl of an earlier run (its configurations and seeds) without training them again.

--speculators PYTHON also trains vLLM's `speculators` trainer with the interpreter PYTHON (one where
`pip install --no-deps speculators hs-connectors` works, e.g. .venv-vllm/bin/python) on the same shards, same
draft architecture as specgen's defaults (`norm_before_residual=true`) and vocabulary mapping, the demo recipe's
`train.batch_tokens` as its packing budget, 4 TTT steps, 2 epochs, lr 5e-3 (`benchmarks/speculators_demo.py`
applies and names its CPU patches) and evaluates it the same way. Issue 15's figure for it on this data
(`norm_before_residual=false`, 1024-token batches), printed for reference: 2.73 (mean of seeds 0 and 1).
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
SPECULATORS_REFERENCE = 2.73  # speculators 0.9, norm_before_residual=False, seeds 0 and 1 (issue 15)
EVAL = {"num_draft_tokens": 4, "max_new_tokens": 96}


def load_pair(draft_path: str, device: str = "cpu"):
    """(target model, draft, TargetRunner over the draft's aux layers, tokenizer), float32 on `device`; the target
    is the draft config's `specgen.target.path` (the bundled tiny target when it names none)."""
    from specgen.assets import ASSETS_DIR
    from specgen.capture.target import load_target
    from specgen.draft.aux import aux_layers_of
    from specgen.draft.checkpoint import load_draft, read_raw_config, specgen_info
    from specgen.draft.speculative import TargetRunner
    from specgen.runtime import load_tokenizer

    info = specgen_info(read_raw_config(draft_path))  # any method's config.json (DFlash is not EAGLE-3's layout)
    target_path = info.get("target", {}).get("path") or str(ASSETS_DIR / "tiny-target")
    model = load_target(target_path, dtype="float32", device=device, attn_implementation="sdpa")
    draft = load_draft(draft_path, embedding=model.get_input_embeddings().weight.detach().float(),
                       target_config=model.config).to(device).eval()
    # The draft's config holds serving ids (vLLM's reading, aux + 1); aux_layers_of turns them back into the
    # 0-based layer outputs the draft was trained on, exactly as specgen.evaluate does.
    return model, draft, TargetRunner(model, aux_layers_of(draft.config)), load_tokenizer(target_path)


def acceptance(draft_path: str, *, num_draft_tokens: int = 4, max_new_tokens: int = 96,
               samples_out: str | None = None, prompts: str | None = None, first_turns: bool = False,
               max_prompts: int | None = None, device: str = "cpu") -> dict:
    """Speculative decoding of the held-out demo turns (or of `prompts`, any file specgen.evaluate reads, its first
    `max_prompts`): {acceptance_length, rounds, accepted, turns, seconds}, on `device` (float32 everywhere: a
    CUDA device only speeds it up, at the cost of float rounding that can flip a near-tie between two tokens).

    Multi-turn prompts continue with the generated answer (the target's greedy output: speculative decoding is
    lossless, checked by specgen.evaluate and its tests); first_turns decodes each prompt's first turn only
    (specgen.evaluate's evaluate.turns=first). samples_out, if given, receives one JSON line per turn
    ({prompt_token_ids, output_token_ids}, specgen.evaluate's samples.jsonl fields) for a vLLM replay."""
    import torch

    from specgen.assets import ASSETS_DIR
    from specgen.data.prompts import chat_prompt_ids, read_prompts
    from specgen.draft.speculative import speculative_generate
    from specgen.runtime import stop_token_ids

    torch.set_num_threads(1)
    start = time.perf_counter()
    model, draft, target, tokenizer = load_pair(draft_path, device)
    eos_ids = set(stop_token_ids(model, tokenizer))  # the turn-ending tokens specgen.evaluate stops at
    rounds = accepted = turns = 0
    samples = []
    for prompt in read_prompts(prompts or str(ASSETS_DIR / "chat" / "heldout.jsonl"), max_prompts):
        messages = [{"role": "system", "content": prompt.system}] if prompt.system else []
        for text in prompt.user_turns[:1] if first_turns else prompt.user_turns:
            messages.append({"role": "user", "content": text})
            ids = chat_prompt_ids(tokenizer, messages)
            out = speculative_generate(target, draft, ids, num_draft_tokens=num_draft_tokens,
                                       max_new_tokens=max_new_tokens, eos_ids=eos_ids)
            rounds += out.verification_rounds
            accepted += sum(out.accepted)
            turns += 1
            samples.append({"prompt_token_ids": list(ids), "output_token_ids": list(out.tokens)})
            messages.append({"role": "assistant", "content": tokenizer.decode(out.tokens, skip_special_tokens=True)})
    if samples_out:
        Path(samples_out).write_text("".join(json.dumps(sample) + "\n" for sample in samples))
    return {"acceptance_length": 1 + accepted / max(rounds, 1), "rounds": rounds, "accepted": accepted,
            "turns": turns, "seconds": time.perf_counter() - start}


def _python_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def generate_shards(out: Path) -> Path:
    """The demo's training shards (chat/train.jsonl through the tiny target), once."""
    if not (out / "manifest.json").exists():
        subprocess.run([sys.executable, "-m", "specgen.generate", "recipe=demo", f"output.dir={out}",
                        "runtime.progress=false"], check=True, env=_python_env(), cwd=REPO)
    return out


def train_and_evaluate(name: str, overrides: list[str], seed: int, shards: Path, out: Path) -> dict:
    """One (configuration, seed): train with specgen.train, then measure acceptance in a fresh process."""
    ckpt = out / f"{name}-seed{seed}"
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "specgen.train", "recipe=demo", f"data.shards={shards}",
                    f"output.dir={ckpt}", f"runtime.seed={seed}", "runtime.threads=1", "runtime.progress=false",
                    "train.tensorboard=false", "output.overwrite=true", *overrides],
                   check=True, env=_python_env(), cwd=REPO, stdout=subprocess.DEVNULL)
    train_seconds = time.perf_counter() - start
    result = evaluate_in_subprocess(ckpt)
    result.update(name=name, seed=seed, train_seconds=train_seconds, checkpoint=str(ckpt), overrides=overrides)
    with open(out / "results.jsonl", "a") as f:  # as each finishes: an interrupted benchmark keeps its results
        f.write(json.dumps(result) + "\n")
    print(f"  {name} seed {seed}: acceptance {result['acceptance_length']:.3f} "
          f"(train {train_seconds:.0f}s, eval {result['seconds']:.0f}s)", flush=True)
    return result


def evaluate_in_subprocess(ckpt: Path) -> dict:
    done = subprocess.run([sys.executable, __file__, "--evaluate", str(ckpt)], check=True, env=_python_env(),
                          cwd=REPO, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def parse_config(text: str) -> tuple[str, list[str]]:
    """NAME=KEY=VALUE,KEY=VALUE -> (NAME, [KEY=VALUE, ...]); `demo` alone is the recipe as shipped."""
    name, _, rest = text.partition("=")
    return name, [item for item in re.split(r",(?![^\[]*\])", rest) if item]  # commas inside [..] stay


def summarize(results: list[dict]) -> list[tuple[str, int, float, float, list[float], float, float]]:
    by_name: dict[str, list[dict]] = {}
    for result in results:
        by_name.setdefault(result["name"], []).append(result)
    rows = []
    for name, group in by_name.items():
        values = [r["acceptance_length"] for r in sorted(group, key=lambda r: r["seed"])]
        std = statistics.stdev(values) if len(values) > 1 else 0.0
        rows.append((name, len(values), statistics.mean(values), std, values,
                     statistics.mean(r["train_seconds"] for r in group), statistics.mean(r["seconds"] for r in group)))
    return rows


def paired_differences(results: list[dict]) -> list[tuple[str, str, list[int], float, float]]:
    """(name, baseline, seeds, mean, standard error) of each configuration's acceptance minus the first
    configuration's, over the seeds both trained (same seed: same initialisation and batch order)."""
    by_name: dict[str, dict[int, float]] = {}
    for result in results:
        by_name.setdefault(result["name"], {})[result["seed"]] = result["acceptance_length"]
    baseline, *others = by_name
    rows = []
    for name in others:
        seeds = sorted(set(by_name[name]) & set(by_name[baseline]))
        diffs = [by_name[name][seed] - by_name[baseline][seed] for seed in seeds]
        if diffs:
            error = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else float("nan")
            rows.append((name, baseline, seeds, statistics.mean(diffs), error))
    return rows


def print_table(rows, reference: float | None, paired=()) -> None:
    print(f"\n{'configuration':<34} {'seeds':>5} {'acceptance (mean ± std)':>24}  {'per seed':<22} "
          f"{'train s':>8} {'eval s':>7}")
    for name, n, mean, std, values, train_s, eval_s in rows:
        per_seed = " ".join(f"{v:.2f}" for v in values)
        print(f"{name:<34} {n:>5} {mean:>15.3f} ± {std:.3f}  {per_seed:<22} {train_s:>8.0f} {eval_s:>7.0f}")
    if reference is not None:
        print(f"{'speculators 0.9 (issue 15, 2 seeds)':<34} {2:>5} {reference:>15.3f}")
    for name, baseline, seeds, mean, error in paired:
        print(f"{name} - {baseline}, paired on seeds {' '.join(map(str, seeds))}: {mean:+.3f} ± {error:.3f} "
              "(standard error)")
    print("acceptance length = 1 + accepted draft tokens / verification rounds (vLLM's counting), 79 held-out "
          f"turns, K={EVAL['num_draft_tokens']}, greedy, {EVAL['max_new_tokens']} new tokens")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=Path, help="demo shards (recipe=demo generate output); made when absent")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--config", action="append", default=None,
                        help="NAME=KEY=VALUE,KEY=VALUE: train overrides on top of recipe=demo (repeatable); "
                             "default: demo")
    parser.add_argument("--jobs", type=int, default=2, help="trainings at once (each on one thread)")
    parser.add_argument("--speculators", metavar="PYTHON",
                        help="also train with speculators' trainer, run by this interpreter (where it is installed)")
    parser.add_argument("--previous", type=Path, action="append", default=[], metavar="FILE",
                        help="results.jsonl of an earlier run, shown (and paired) with this run's results")
    parser.add_argument("--out", type=Path, help="keep checkpoints and results.jsonl here (default: a temp dir)")
    parser.add_argument("--evaluate", help=argparse.SUPPRESS)  # internal: evaluate one checkpoint, print JSON
    args = parser.parse_args()
    if args.evaluate:
        print(json.dumps(acceptance(args.evaluate, **EVAL)))
        return

    # Read before training, so a wrong path fails at once; in the order given, so the first file's first
    # configuration is the baseline of the paired differences.
    previous = [json.loads(line) for path in args.previous for line in path.read_text().splitlines() if line]
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        shards = args.shards or generate_shards(out / "shards")
        configs = [parse_config(text) for text in (args.config or ["demo"])]
        jobs = [(name, overrides, seed) for name, overrides in configs for seed in args.seeds]
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            results = list(pool.map(lambda job: train_and_evaluate(*job, shards, out), jobs))
        if args.speculators:
            results += run_speculators(args.speculators, shards, out, args.seeds)
        results = previous + results
        print_table(summarize(results), SPECULATORS_REFERENCE, paired_differences(results))


def speculators_missing(python: str) -> str | None:
    """Why `python` cannot run speculators' trainer (one line), or None when it can."""
    if subprocess.run([python, "-c", "import speculators.train.cli"], capture_output=True, check=False).returncode:
        return (f"speculators is not importable by {python}: pip install --no-deps speculators hs-connectors there "
                "(and the small packages it imports) to compare")
    return None


def speculators_command(python: str, shards: Path, ckpt: Path, seed: int, *flags: str) -> list[str]:
    """benchmarks/speculators_demo.py run by `python` (its flags: --target, --batch-tokens, ...)."""
    return [python, str(REPO / "benchmarks" / "speculators_demo.py"), "--shards", str(shards), "--out", str(ckpt),
            "--seed", str(seed), *flags]


def run_speculators(python: str, shards: Path, out: Path, seeds: list[int]) -> list[dict]:
    """speculators' trainer on the same shards (see benchmarks/speculators_demo.py); skipped when not installed."""
    from specgen.config import RECIPES_DIR

    missing = speculators_missing(python)
    if missing:
        print(missing)
        return []
    recipe = yaml.safe_load((RECIPES_DIR / "demo.yaml").read_text())
    batch_tokens = recipe["train"]["batch_tokens"]  # the packing budget specgen's demo trains with
    results = []
    for seed in seeds:
        ckpt = out / f"speculators-seed{seed}"
        start = time.perf_counter()
        subprocess.run(speculators_command(python, shards, ckpt, seed, "--norm-before-residual",
                                           "--batch-tokens", str(batch_tokens)), check=True, env=_python_env(),
                       cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        train_seconds = time.perf_counter() - start
        result = evaluate_in_subprocess(ckpt)
        result.update(name="speculators 0.9 (measured)", seed=seed, train_seconds=train_seconds,
                      checkpoint=str(ckpt))
        print(f"  speculators seed {seed}: acceptance {result['acceptance_length']:.3f}", flush=True)
        results.append(result)
    return results


if __name__ == "__main__":
    main()
