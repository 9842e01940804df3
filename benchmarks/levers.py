"""Data levers for EAGLE-3 draft training on a real target, several seeds each (issue #23's table).

    python benchmarks/levers.py --model M --prompts P.jsonl --out DIR [--recipe smollm2-135m]
        [--levers original regenerated synthesized mixed all resampled all-resampled redrawn resampled-redrawn
                  all-redrawn] [--rows N] [--regenerate-python PYTHON]
        [--seeds 0 1 2] [--jobs 1]
        [--methods eagle3 eagle3.1 p-eagle dflash] [--ks 3 5 7] [--ttt-length T] [--steps N] [--set KEY=VALUE ...]
        [--speculators PYTHON [--speculators-seeds S ...]]
        [--eval-prompts FILE] [--max-prompts N] [--max-new-tokens 64] [--eval-device cpu]
        [--vllm-python PYTHON [--vllm-seeds 0] [--counter vllm [--check-prompts 8]]] [--dry-run]

M is the target's model folder and P its prompt mix; for SmolLM2-135M-Instruct (recipe=smollm2-135m) both come
from `python -m specgen.assets.smollm2 --out M` and `... --prompts P.jsonl`. Every lever starts from the first
--rows rows of P (data.max_rows; default: the recipe's):
  original      the rows with their original responses;
  regenerated   every assistant turn rewritten by the target (specgen.regenerate; with --regenerate-python
                vLLM's venv python, by vLLM's engine: 32 new tokens/s on 2 CPU cores for SmolLM2, ~10x the HF
                engine there);
  synthesized   the user turns written by the target too (regenerate.user_turns=synthesize);
  mixed         row i of regenerated when i is even, of synthesized when odd, as many rows as the smaller has;
  all           every row the pipeline makes from those prompts: original, regenerated and synthesized together
                (generate's data.path=[P,REGENERATED,SYNTHESIZED], --rows of each; about 2.3x the tokens of the
                original lever: the other levers compare data at equal prompts and size, this one what the same
                prompts can give);
  resampled     regenerated again with another sampling seed (regenerate.seed=1): a second reply to every prompt;
  all-resampled all, plus the resampled rows (data.path=[P,REGENERATED,RESAMPLED,SYNTHESIZED]): the same prompts
                with two sampled replies each (the target samples at the recipe's temperature, 0.7);
  redrawn       regenerated with regenerate.on_loop=resample: a looping turn is sampled again (up to
                regenerate.resample_tries more times) instead of dropping its row;
  resampled-redrawn  resampled, with regenerate.on_loop=resample;
  all-redrawn   all-resampled with both replies redrawn (data.path=[P,REDRAWN,RESAMPLED-REDRAWN,SYNTHESIZED]).
Each lever's rows become shards (specgen.generate), on which every seed trains a draft (specgen.train,
runtime.seed=S, train.ttt_length=T (default: the largest K), train.max_steps=--steps when given, one thread each,
--jobs at once); --methods adds specgen's other draft methods (issue #24's axis: `draft.method=M`, named specgen-M
in the tables; DFlash with `draft.dflash.block_size` = T + 1). --speculators PYTHON also trains speculators' trainer
(benchmarks/speculators_demo.py, run by PYTHON, e.g. .venv-vllm/bin/python) on the regenerated shards, with the
train config's packing budget, draft vocabulary, epochs, lr, TTT length and --steps.

Every draft then decodes the first turns of --eval-prompts (MT-Bench's 80 by default; the first --max-prompts)
greedily, a chain of K draft tokens a round for each K in --ks (draft_quality.acceptance: specgen's speculative
decoding on the CPU, one thread, float32; --eval-device cuda on a GPU machine, though decoding one sequence at a
time is bound by Python there too: 80 prompts took ~220 s per K and draft on an H100 beside 11 other jobs).
Acceptance length = 1 + accepted draft tokens / verification rounds, pooled over the prompts (vLLM's counting).
--vllm-python also serves the drafts of --vllm-seeds on the same prompts in vLLM's CPU build
(served_acceptance.replay) and says whether vLLM's counters (drafts, accepted tokens) and output tokens equal
specgen's.

--counter vllm makes vLLM the counter of the table: every draft is served on every prompt at each K
(eval/NAME/served-kK.json), vLLM batching up to 8 sequences where specgen decodes one at a time (65 tokens/s for
the SmolLM2 target alone on one core, against ~19 for specgen's greedy on two), and every served output must equal
the target alone's in vLLM (eval/target.json: lossless). specgen's decoding then runs only for the --vllm-seeds
drafts on the first --check-prompts prompts, which vLLM also serves, and the table below says whether both
counted the same drafts and accepted tokens there.

Every regenerate, generate and train step is one `specgen run` (python -m specgen.run recipe=R run.dir=D
run.stages=[STAGE] ...; docs/guides/run.md) of one stage, whose folder D/01-STAGE is what later steps read: a
regenerate run's folder is generate's data.path, a generate run's is train's data.shards (and speculators'
--shards), a train run's is the draft that is evaluated and served. R is --recipe (its run.overrides apply
to the entries a run lists: a [generate] run gets generate's, replaced by the data.path levers passes). --set KEY=VALUE goes to every stage (regenerate,
generate, train) whose configuration holds KEY's parent, e.g. runtime.device=cuda to all three,
train.precision=fp32 to train only, regenerate.max_new_tokens=48 to regenerate only; a key no stage has is an
error. Every run's plan is made (specgen.runner.make_plan: its stage's config composed and checked against
specgen's schema) before anything runs.

Prints, per lever and trainer, acceptance mean ± std over seeds with each seed's value at every K (with --counter
vllm also vLLM's tokens/s and the share of rounds accepting each draft position), then the wall seconds of every
stage. DIR keeps everything: data/NAME/ for NAME in regenerated, resampled,
redrawn, resampled-redrawn, synthesized (a specgen run: the rows in data/NAME/01-regenerate/) and data/mixed.jsonl;
shards/LEVER/ (a specgen run: the shards in shards/LEVER/01-generate/); drafts/LEVER-TRAINER-seedS/ (specgen's: a
specgen run, the draft in its 01-train/; speculators': the draft itself); eval/LEVER-TRAINER-seedS/ (kK.json,
turns-kK.jsonl, vllm-kK.json, served-kK.json), eval/turns.jsonl and eval/target.json (--counter vllm);
logs/NAME.log (each step's output; a specgen run's stage also keeps its own stage.log); stages.json (the command
and wall seconds of the steps levers runs itself: mix, evaluations, speculators' training, vLLM serving; a specgen
run keeps its stage's in stage.json); results.jsonl (one line per lever, trainer, seed and K; rewritten as
evaluations finish). Re-running the same command goes on where a killed run stopped: every specgen run is started
again, and skips its finished stage at once or resumes the interrupted one (regenerate and generate keep their
finished parts, train resumes from its last checkpoint); a specgen run refuses a run.dir made with other settings
(another --rows, --steps, --set, ...: pass another --out). levers skips its own finished steps (data/mixed.jsonl,
a speculators draft with config.json + model.safetensors, an evaluation at the same K on the same prompts). A
failed step stops the drafts not yet started; the tables then show what finished, and the run exits non-zero.
--dry-run prints every command (a specgen run whose stage finished earlier as [done]) and runs nothing.

Cost on the shared 2-core CPU (SmolLM2-135M, float32; measured 2026-11-26): regeneration with vLLM's engine
(--regenerate-python) 765 s for 200 rows at the recipe's 256 new tokens a turn (56 new tokens/s); capture ~430
tokens/s; training a few minutes a draft since Muon iterates in float32 on such a CPU (speculators' too:
speculators_demo.py's patch 4); specgen's evaluation ~0.12 s per generated token at each K (80 prompts x 64
tokens: ~10 min per K and draft), vLLM's (--counter vllm) ~2 min per K and draft. --jobs 2 trains two drafts at
once, one thread each; export VLLM_CPU_OMP_THREADS_BIND=nobind OMP_NUM_THREADS=1 then, or both jobs' vLLM engines
bind core 0.
"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # this checkout's specgen, before an installed one
from common import SHARED  # noqa: E402
from draft_quality import REPO, _python_env, acceptance, speculators_command, speculators_missing  # noqa: E402
from served_acceptance import draft_flags, replay, write_turns  # noqa: E402

from specgen.runner.plan import override_value  # noqa: E402
from specgen.store.commit import write_json_atomic, write_text_atomic  # noqa: E402

LEVERS = ("original", "regenerated", "synthesized", "mixed", "all", "resampled", "all-resampled", "redrawn",
          "resampled-redrawn", "all-redrawn")
# the pooled levers' regenerate outputs (data/NAME/), after the prompts' own rows
POOLS = {"all": ("regenerated", "synthesized"), "all-resampled": ("regenerated", "resampled", "synthesized"),
         "all-redrawn": ("redrawn", "resampled-redrawn", "synthesized")}
METHODS = ("eagle3", "eagle3.1", "p-eagle", "dflash")
# regenerate outputs: data/NAME/, made by regenerate with these overrides (resampled: a second sampled reply)
SOURCES = {"regenerated": [], "synthesized": ["regenerate.user_turns=synthesize"], "resampled": ["regenerate.seed=1"],
           "redrawn": ["regenerate.on_loop=resample"],
           "resampled-redrawn": ["regenerate.seed=1", "regenerate.on_loop=resample"]}
STAGES = ("regenerate", "generate", "train")
MT_BENCH = SHARED / "datasets" / "mt_bench_questions.jsonl"


class Failed(Exception):
    """A stage or a setting that stops the run; main prints it as one line."""


@dataclass
class SpecgenRun:
    """One `specgen run` of one stage: its command, and its stage's folder (run.dir/01-STAGE, from the plan), which
    is what later steps read."""

    name: str  # regenerate-NAME, generate-LEVER, train-LEVER-TRAINER-seedS
    command: list[str]  # [python, -m, specgen.run, recipe=R, run.dir=D, run.stages=[STAGE], key=value ...]
    folder: Path  # the stage's output.dir
    cfg: object  # the stage's composed config (what it will run with)


def stage_record(folder: Path) -> dict | None:
    """The stage.json specgen run writes once a stage finished (None before)."""
    try:
        return json.loads((folder / "stage.json").read_text())
    except (OSError, ValueError):
        return None


class Stages:
    """Runs the steps (output in logs/NAME.log). A specgen run always runs (it skips its finished stage at once, and
    keeps its stage's command and wall seconds in stage.json); levers' own steps are skipped when finished and their
    command and wall seconds kept in stages.json."""

    def __init__(self, out: Path, dry_run: bool, specgen_runs: dict[str, SpecgenRun] | None = None):
        self.out, self.dry_run = out, dry_run
        self.specgen_runs = specgen_runs if specgen_runs is not None else {}
        self.path = out / "stages.json"
        self.record = json.loads(self.path.read_text()) if self.path.exists() else {}
        self.lock = threading.Lock()

    def specgen(self, run: SpecgenRun) -> bool:
        """Run one `specgen run`; whether its stage ran now (False: it had finished earlier, or --dry-run)."""
        shown = shlex.join(map(str, run.command))
        before = stage_record(run.folder)
        if self.dry_run:  # [done]: specgen run would skip the stage (stage.json), after checking run.json's settings
            say(f"{'[done]' if before else '[run] '} {run.name}: {shown}")
            return False
        say(f"[run]  {run.name}")
        log = self.out / "logs" / f"{run.name}.log"
        with open(log, "w") as handle:
            code = subprocess.run(run.command, stdout=handle, stderr=subprocess.STDOUT, env=_python_env(),
                                  cwd=REPO, check=False).returncode
        if code:
            raise Failed(f"{run.name} failed (exit {code}): {last_line(log)} [log: {log}; command: {shown}]")
        after = stage_record(run.folder)
        if after is None:
            raise Failed(f"{run.name} ended without {run.folder / 'stage.json'} (stopped?): {last_line(log)} "
                         f"[log: {log}]")
        ran = after != before
        say(f"       {run.name}: {after.get('wall_s', 0):.0f} s" if ran
            else f"[done] {run.name} (finished earlier: {run.folder / 'stage.json'})")
        return ran

    def run(self, name: str, done, command: list[str] | None = None, call=None, shown: str = "", made=None) -> bool:
        """Run `command` (or `call(log)`, described by `shown`) unless `done()` says its output is complete;
        whether it ran. After it ran, `made()` (default: `done()`) must say its output is there."""
        shown = shown or shlex.join(map(str, command))
        if done():
            earlier = self.record.get(name, {}).get("command")
            say(f"[done] {name}" + (" (made by another command; delete its output to redo it)"
                                    if earlier not in (None, shown) else ""))
            return False
        say(f"[run]  {name}: {shown}" if self.dry_run else f"[run]  {name}")
        if self.dry_run:
            return False
        log = self.out / "logs" / f"{name}.log"
        start = time.perf_counter()
        if command is not None:
            with open(log, "w") as handle:
                code = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, env=_python_env(),
                                      cwd=REPO, check=False).returncode
            if code:
                raise Failed(f"{name} failed (exit {code}): {last_line(log)} [log: {log}; command: {shown}]")
        else:
            call(log)
        if not (made or done)():  # a stage stopped by a signal can exit 0 (speculators_demo.py did) without output
            raise Failed(f"{name} ended without its output (stopped?): {last_line(log)} [log: {log}]")
        seconds = time.perf_counter() - start
        say(f"       {name}: {seconds:.0f} s")
        with self.lock:
            self.record[name] = {"command": shown, "seconds": seconds}
            write_json_atomic(self.path, self.record, indent=1)
        return True

    def seconds(self, name: str) -> float | None:
        """Wall seconds of a step: a specgen run's from its stage.json, levers' own from stages.json."""
        if name in self.specgen_runs:
            return (stage_record(self.specgen_runs[name].folder) or {}).get("wall_s")
        return self.record.get(name, {}).get("seconds")


def say(line: str, lock=threading.Lock()) -> None:
    """One line to stdout, whole (drafts train in threads)."""
    with lock:
        print(line, flush=True)


def last_line(log: Path) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


# ---- commands -----------------------------------------------------------------------------------------------


def routed(args, stage: str) -> list[str]:
    """The --set items whose key's parent (or the key, at top level) is in `stage`'s configuration."""
    return [item for item in args.set if stage in args.key_stages[item]]


def route_sets(args) -> dict[str, list[str]]:
    """{--set item: stages that take it}; an item no stage takes is an error."""
    from omegaconf import OmegaConf

    from specgen.config import compose

    placeholders = {"regenerate": ["model.path=M", "data.path=P"], "generate": ["model.path=M", "data.path=P"],
                    "train": ["data.shards=S"]}
    configs = {stage: compose(stage, placeholders[stage]) for stage in STAGES}
    stages = {}
    for item in args.set:
        key = item.split("=", 1)[0].lstrip("+~")
        parent = key.rsplit(".", 1)[0]
        stages[item] = [stage for stage, cfg in configs.items()
                        if OmegaConf.select(cfg, parent, default="<absent>") != "<absent>"]
        if "=" not in item or not stages[item]:
            raise Failed(f"--set {item}: no stage ({', '.join(STAGES)}) has the key {key}")
    return stages


def run_recipe(args) -> str:
    """recipe= of every specgen run: --recipe (a bundled name or a .yaml file). A run that lists some of the
    recipe's stages (run.stages=[STAGE]) uses the recipe's run.overrides of those entries only."""
    path = Path(args.recipe).expanduser()
    return str(path.resolve()) if args.recipe.endswith((".yaml", ".yml")) or path.parent != Path(".") else args.recipe


def cli_value(item) -> str:
    """A path (or a list of them) as specgen run's command line reads it back."""
    return override_value([str(i) for i in item] if isinstance(item, list | tuple) else str(item))


def specgen_run(args, name: str, run_dir: Path, stage: str, *keys: str, python: str | None = None) -> SpecgenRun:
    """`python -m specgen.run recipe=R run.dir=RUN_DIR run.stages=[STAGE] ...keys --set items`, its plan made (and
    so its stage's config composed and checked) before anything runs; registered in args.specgen_runs by name."""
    from specgen.errors import SpecgenError
    from specgen.runner import make_plan

    keys = [*keys, "runtime.progress=false", *routed(args, stage)]
    names = [key.split("=", 1)[0] for key in keys]
    keys = [key for i, key in enumerate(keys) if names[i] not in names[i + 1:]]  # a later KEY=VALUE wins
    argv = [f"recipe={args.run_recipe}", f"run.dir={cli_value(run_dir)}", f"run.stages=[{stage}]", *keys]
    try:
        plan = make_plan(argv)
    except SpecgenError as error:
        raise Failed(f"{name}: {error} [command: specgen run {shlex.join(argv)}]") from None
    (step,) = plan.steps
    run = SpecgenRun(name, [python or sys.executable, "-m", "specgen.run", *argv], step.folder, step.cfg)
    args.specgen_runs[name] = run
    return run


def rows_override(args) -> list[str]:
    return [f"data.max_rows={args.rows}"] if args.rows else []


def regenerated_dir(args, source: str) -> Path:
    """Where regenerate output `source` (regenerated, synthesized, ...) lies: its specgen run's stage folder."""
    return args.specgen_runs[f"regenerate-{source}"].folder


def shards_dir(args, lever: str) -> Path:
    """The lever's shards: its generate run's stage folder."""
    return args.specgen_runs[f"generate-{lever}"].folder


def draft_dir(args, lever: str, trainer: str, seed: int) -> Path:
    """A draft's folder: specgen's train run's stage folder, or speculators' output folder."""
    name = draft_name(lever, trainer, seed)
    if trainer.startswith("specgen"):
        return args.specgen_runs[f"train-{name}"].folder
    return args.out / "drafts" / name


def data_path(args, lever: str) -> Path | list[Path]:
    """What generate reads for `lever` (data.path)."""
    if lever == "original":
        return args.prompts
    if lever in POOLS:
        return [args.prompts, *(regenerated_dir(args, source) for source in POOLS[lever])]
    if lever == "mixed":
        return args.out / "data" / "mixed.jsonl"
    return regenerated_dir(args, lever)


def draft_name(lever: str, trainer: str, seed: int) -> str:
    return f"{lever}-{trainer}-seed{seed}"


def trainer_label(method: str) -> str:
    """specgen's trainer for `method` in the tables and folder names: `specgen` for EAGLE-3, else specgen-METHOD."""
    return "specgen" if method == "eagle3" else f"specgen-{method}"


def method_of_label(trainer: str) -> str:
    return "eagle3" if trainer == "specgen" else trainer.removeprefix("specgen-")


def train_run(args, lever: str, seed: int, trainer: str = "specgen") -> SpecgenRun:
    """specgen's draft of (lever, method, seed): a specgen run of train on the lever's shards (generate's folder)."""
    method = method_of_label(trainer)
    steps = [f"train.max_steps={args.steps}"] if args.steps else []
    # DFlash trains one block of ttt_length masks and is served with its first K (as benchmarks/draft_methods.py)
    method_keys = [f"draft.dflash.block_size={args.ttt_length + 1}"] if method == "dflash" else []
    name = draft_name(lever, trainer, seed)
    return specgen_run(args, f"train-{name}", args.out / "drafts" / name, "train",
                       f"run.overrides.train.data.shards={cli_value(shards_dir(args, lever))}",
                       f"runtime.seed={seed}", f"train.ttt_length={args.ttt_length}", *steps, "runtime.threads=1",
                       *([f"draft.method={method}"] if method != "eagle3" else []), *method_keys)


def speculators_flags(args) -> list[str]:
    """speculators_demo.py's settings from specgen's train config on the regenerated shards (equal data, equal
    budget: packing, draft vocabulary, epochs, lr, TTT steps, max steps, norm_before_residual). specgen's
    train.max_steps runs past train.epochs; speculators stops at whichever comes first, so it gets as many epochs
    as steps then (one batch an epoch at least)."""
    cfg = train_run(args, "regenerated", 0).cfg
    flags = ["--target", str(args.model), "--batch-tokens", str(cfg.train.batch_tokens),
             "--draft-vocab-size", str(cfg.draft.vocab_size), "--ttt-steps", str(cfg.train.ttt_length),
             "--epochs", str(cfg.train.max_steps or cfg.train.epochs), "--lr", str(cfg.train.lr)]
    if cfg.train.max_steps:
        flags += ["--max-steps", str(cfg.train.max_steps)]
    return flags + (["--norm-before-residual"] if cfg.draft.norm_before_residual else [])


# ---- data ---------------------------------------------------------------------------------------------------


def regenerated_rows(folder: Path) -> list[str]:
    """The JSON lines of a regenerate output, in its manifest's part order."""
    manifest = json.loads((folder / "manifest.json").read_text())
    return [line for part in manifest["parts"] for line in (folder / part).read_text().splitlines() if line]


def check_rows(folder: Path, name: str) -> None:
    stats = json.loads((folder / "manifest.json").read_text())["stats"]
    if not stats["rows"]:
        raise Failed(f"{name} kept none of its {stats['source_rows']} rows (dropped: {stats['dropped']}, rejected: "
                     f"{stats['rejected']}); raise regenerate.max_new_tokens or --set regenerate.on_truncated=keep")


def mix(args, log: Path) -> None:
    """data/mixed.jsonl: row i of regenerated when i is even, of synthesized when odd (the smaller one's count)."""
    first, second = (regenerated_rows(regenerated_dir(args, lever)) for lever in ("regenerated", "synthesized"))
    rows = [(first if i % 2 == 0 else second)[i] for i in range(min(len(first), len(second)))]
    write_text_atomic(data_path(args, "mixed"), "".join(row + "\n" for row in rows))
    log.write_text(f"{len(rows)} rows: {len(first)} regenerated, {len(second)} synthesized\n")


def data_steps(args) -> list[SpecgenRun | dict]:
    """The data side, in order: a specgen run of regenerate for each output in SOURCES that a lever needs (once),
    mix (Stages.run's arguments), then a specgen run of generate for every lever's shards."""
    steps: list[SpecgenRun | dict] = []
    sources = {lever for lever in args.levers if lever in SOURCES}
    if "mixed" in args.levers:
        sources |= {"regenerated", "synthesized"}
    sources |= {source for lever in args.levers for source in POOLS.get(lever, ())}
    for lever in sorted(sources):
        engine = ["engine=vllm"] if args.regenerate_python else []
        steps.append(specgen_run(  # with --regenerate-python, vLLM's venv runs specgen run and so its stage
            args, f"regenerate-{lever}", args.out / "data" / lever, "regenerate", f"model.path={cli_value(args.model)}",
            f"data.path={cli_value(args.prompts)}", *rows_override(args), *SOURCES[lever], *engine,
            python=args.regenerate_python))
    if "mixed" in args.levers:
        steps.append({"name": "mix", "done": data_path(args, "mixed").exists, "call": lambda log: mix(args, log),
                      "shown": f"{data_path(args, 'mixed')}: rows of {regenerated_dir(args, 'regenerated')} (even) "
                               f"and {regenerated_dir(args, 'synthesized')} (odd)"})
    for lever in args.levers:
        steps.append(specgen_run(
            args, f"generate-{lever}", args.out / "shards" / lever, "generate", f"model.path={cli_value(args.model)}",
            f"run.overrides.generate.data.path={cli_value(data_path(args, lever))}", *rows_override(args)))
    return steps


def make_data(args, stages: Stages, steps: list[SpecgenRun | dict]) -> None:
    for step in steps:
        if isinstance(step, dict):
            stages.run(**step)
            continue
        stages.specgen(step)
        if step.name.startswith("regenerate-") and not args.dry_run:
            check_rows(step.folder, step.name)


# ---- drafts -------------------------------------------------------------------------------------------------


def is_draft(folder: Path):
    return lambda: (folder / "config.json").exists() and (folder / "model.safetensors").exists()


def specgen_prompts(args) -> int | None:
    """How many prompts specgen's own decoding covers: all (--max-prompts) or, with --counter vllm, --check-prompts."""
    if args.counter == "vllm":
        return min(args.check_prompts, args.max_prompts or args.check_prompts)
    return args.max_prompts


def eval_settings(args) -> dict:
    device = {} if args.eval_device == "cpu" else {"device": args.eval_device}  # (CPU results predate the key)
    return {"prompts": str(Path(args.eval_prompts).resolve()), "max_prompts": specgen_prompts(args),
            "max_new_tokens": args.max_new_tokens, "turns": "first", **device}


def served_settings(args) -> dict:
    return {**eval_settings(args), "max_prompts": args.max_prompts, "counter": "vllm"}


def evaluated(args, name: str, k: int) -> dict | None:
    """The evaluation of draft `name` at K when it exists for this run's prompts."""
    path = args.out / "eval" / name / f"k{k}.json"
    result = json.loads(path.read_text()) if path.exists() else None
    return result if result and result["settings"] == eval_settings(args) else None


def draft_commands(args) -> dict[tuple[str, str, int], SpecgenRun | list[str]]:
    """The training of every draft, built (and checked) before anything runs: specgen's a specgen run of train,
    speculators' a command."""
    flags = speculators_flags(args) if args.speculators else []
    return {(lever, trainer, seed): train_run(args, lever, seed, trainer) if trainer.startswith("specgen")
            else speculators_command(args.speculators, shards_dir(args, lever), draft_dir(args, lever, trainer, seed),
                                     seed, *flags) for lever, trainer, seed in runs(args)}


def train_and_evaluate(args, stages: Stages, lever: str, trainer: str, seed: int) -> None:
    name = draft_name(lever, trainer, seed)
    ckpt = draft_dir(args, lever, trainer, seed)
    training = args.draft_commands[lever, trainer, seed]
    trained = (stages.specgen(training) if isinstance(training, SpecgenRun)
               else stages.run(f"train-{name}", is_draft(ckpt), training))
    if args.counter == "specgen" or seed in args.vllm_seeds:  # with --counter vllm: the check on --check-prompts
        missing = list(args.ks) if trained else [k for k in args.ks if evaluated(args, name, k) is None]
        command = [sys.executable, __file__, "--evaluate", str(ckpt), "--out", str(args.out / "eval" / name),
                   "--ks", *map(str, missing or args.ks), "--eval-prompts", str(args.eval_prompts),
                   "--max-new-tokens", str(args.max_new_tokens), "--eval-device", args.eval_device,
                   *(["--max-prompts", str(specgen_prompts(args))] if specgen_prompts(args) else [])]
        stages.run(f"evaluate-{name}", lambda: not missing, command,
                   made=lambda: all(evaluated(args, name, k) is not None for k in missing or args.ks))
    if args.counter == "vllm":
        count(args, stages, name, ckpt, fresh=trained)
    if not args.dry_run:
        with stages.lock:
            write_results(args, stages)


def train_all(args, stages: Stages) -> None:
    """Every draft, --jobs at once; the first failure cancels the drafts not yet started."""
    with ThreadPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(train_and_evaluate, args, stages, *run) for run in runs(args)]
        try:
            for future in as_completed(futures):
                future.result()
        except BaseException:
            for future in futures:
                future.cancel()
            raise


def evaluate_here(args) -> None:
    """Internal (--evaluate CKPT): decode the prompts at each K; kK.json and turns-kK.jsonl into --out."""
    args.out.mkdir(parents=True, exist_ok=True)
    for k in args.ks:
        (args.out / f"vllm-k{k}.json").unlink(missing_ok=True)  # served on turns about to be replaced
        result = acceptance(args.evaluate, num_draft_tokens=k, max_new_tokens=args.max_new_tokens,
                            samples_out=str(args.out / f"turns-k{k}.jsonl"), prompts=str(args.eval_prompts),
                            first_turns=True, max_prompts=args.max_prompts, device=args.eval_device)
        write_json_atomic(args.out / f"k{k}.json", {**result, "k": k, "settings": eval_settings(args)}, indent=None)
        print(f"K={k}: acceptance {result['acceptance_length']:.3f} ({result['seconds']:.0f} s)", flush=True)


def target_alone(args, stages: Stages) -> None:
    """--counter vllm: the prompts' first turns (eval/turns.jsonl) and vLLM's greedy output of the target alone on
    them (eval/target.json), which every draft's served output must equal (lossless)."""
    turns, out = args.out / "eval" / "turns.jsonl", args.out / "eval" / "target.json"

    def made() -> bool:
        return out.exists() and json.loads(out.read_text()).get("settings") == served_settings(args)

    def call(log: Path) -> None:
        write_turns(str(args.model), str(args.eval_prompts), turns)
        if args.max_prompts:
            write_text_atomic(turns, "".join(turns.read_text().splitlines(keepends=True)[:args.max_prompts]))
        result = replay(args.vllm_python, turns, out, args.model, args.max_new_tokens)
        write_json_atomic(out, {**result, "settings": served_settings(args)}, indent=None)
        log.write_text(f"{len(result['output_token_ids'])} turns, {result['output_tokens_per_second']:.1f} tokens/s\n")

    stages.run("vllm-target", made, call=call,
               shown=f"{args.vllm_python} tests/vllm_replay.py {turns} {out} --target {args.model} "
                     f"--max-new-tokens {args.max_new_tokens}")


def counted(args, name: str, k: int) -> dict | None:
    """vLLM's count for draft `name` at K on every prompt, when it exists for this run's prompts."""
    path = args.out / "eval" / name / f"served-k{k}.json"
    result = json.loads(path.read_text()) if path.exists() else None
    return result if result and result.get("settings") == served_settings(args) else None


def served_flags(ckpt: Path, k: int) -> list[str]:
    """vllm_replay's flags for the draft at K (`served_acceptance.draft_flags`); before the draft exists (the plan of
    a run that trains it) the folder and K, which is what the plan can show."""
    return draft_flags(ckpt, k) if is_draft(ckpt)() else ["--draft", str(ckpt), "--k", str(k)]


def count(args, stages: Stages, name: str, ckpt: Path, fresh: bool) -> None:
    """--counter vllm: the draft served by vLLM's CPU build on every prompt's first turn at each K
    (eval/NAME/served-kK.json: vLLM's counters and outputs)."""
    turns = args.out / "eval" / "turns.jsonl"
    for k in args.ks:
        out = args.out / "eval" / name / f"served-k{k}.json"
        if fresh:
            out.unlink(missing_ok=True)  # served from a draft since retrained
        flags = served_flags(ckpt, k)

        def call(log: Path, out=out, k=k) -> None:  # flags read when it runs: the draft exists by then
            out.parent.mkdir(parents=True, exist_ok=True)
            try:
                result = replay(args.vllm_python, turns, out, args.model, args.max_new_tokens, *served_flags(ckpt, k))
            except SystemExit as error:
                log.write_text(str(error))
                raise Failed(f"count-{name} failed: {last_line(log)} [log: {log}]") from None
            write_json_atomic(out, {**result, "settings": served_settings(args)}, indent=None)
            log.write_text(f"acceptance {result.get('acceptance_length', float('nan')):.3f}, "
                           f"{result['output_tokens_per_second']:.1f} tokens/s\n")

        stages.run(f"count-{name}-k{k}", lambda k=k: counted(args, name, k) is not None, call=call,
                   shown=f"{args.vllm_python} tests/vllm_replay.py {turns} {out} --target {args.model} "
                         f"--max-new-tokens {args.max_new_tokens} {' '.join(flags)}")


def serve(args, stages: Stages, lever: str, trainer: str, seed: int) -> None:
    """vLLM's CPU build on the turns specgen decoded for this draft, at each K (served_acceptance.replay)."""
    name = draft_name(lever, trainer, seed)
    ckpt, folder = draft_dir(args, lever, trainer, seed), args.out / "eval" / name
    for k in args.ks:
        turns, out = folder / f"turns-k{k}.jsonl", folder / f"vllm-k{k}.json"
        flags = served_flags(ckpt, k)

        def call(log: Path, turns=turns, out=out, k=k) -> None:  # flags read when it runs (the draft exists then)
            try:
                replay(args.vllm_python, turns, out, args.model, args.max_new_tokens, *served_flags(ckpt, k))
            except SystemExit as error:  # replay's message ends with vLLM's stderr
                log.write_text(str(error))
                raise Failed(f"vllm-{name}-k{k} failed: {last_line(log)} [log: {log}]") from None

        stages.run(f"vllm-{name}-k{k}", out.exists, call=call,
                   shown=f"{args.vllm_python} tests/vllm_replay.py {turns} {out} --target {args.model} "
                         f"--max-new-tokens {args.max_new_tokens} {' '.join(flags)}")
    if not args.dry_run:
        write_results(args, stages)


# ---- results ------------------------------------------------------------------------------------------------


def runs(args) -> list[tuple[str, str, int]]:
    """(lever, trainer, seed) of every draft of this run, in --levers order; speculators' right after specgen's on
    the regenerated shards, so a run stopped early has the equal-data comparison first."""
    found = []
    for lever in args.levers:
        found += [(lever, trainer_label(method), seed) for method in args.methods for seed in args.seeds]
        if args.speculators and lever == "regenerated":
            found += [("regenerated", "speculators", seed) for seed in args.speculators_seeds]
    return found


def collect(args, stages: Stages) -> list[dict]:
    """One record per (lever, trainer, seed, K) counted so far (by specgen's decoding or, with --counter vllm, by
    vLLM's), with the check of vLLM against specgen where both decoded the same prompts."""
    records = []
    target = args.out / "eval" / "target.json"
    alone = json.loads(target.read_text())["output_token_ids"] if target.exists() else None
    for lever, trainer, seed in runs(args):
        name = draft_name(lever, trainer, seed)
        for k in args.ks:
            base = {"lever": lever, "trainer": trainer, "seed": seed, "k": k,
                    "eval_prompts": str(Path(args.eval_prompts).resolve()), "max_new_tokens": args.max_new_tokens,
                    "train_seconds": stages.seconds(f"train-{name}"),
                    "checkpoint": str(draft_dir(args, lever, trainer, seed))}
            result = evaluated(args, name, k)
            if args.counter == "vllm":
                served = counted(args, name, k)
                if served is None:
                    continue
                record = {**base, "counter": "vllm", "acceptance_length": served.get("acceptance_length"),
                          "rounds": served.get("num_drafts", 0), "accepted": served.get("num_accepted_tokens", 0),
                          "prompts": len(served["output_token_ids"]), "evaluate_seconds": served["generate_seconds"],
                          "tokens_per_second": served["output_tokens_per_second"],
                          "accepted_per_position": served.get("num_accepted_tokens_per_pos"),
                          "lossless": alone is not None and served["output_token_ids"] == alone}
            elif result is not None:
                record = {**base, "counter": "specgen", "acceptance_length": result["acceptance_length"],
                          "rounds": result["rounds"], "accepted": result["accepted"], "prompts": result["turns"],
                          "evaluate_seconds": result["seconds"]}
            else:
                continue
            check = args.out / "eval" / name / f"vllm-k{k}.json"
            if result is not None and check.exists():
                vllm = json.loads(check.read_text())
                turns = (args.out / "eval" / name / f"turns-k{k}.jsonl").read_text().splitlines()
                drafts, accepted = vllm.get("num_drafts", 0), vllm.get("num_accepted_tokens", 0)
                record["vllm"] = {"acceptance_length": vllm.get("acceptance_length", float("nan")),
                                  "specgen_acceptance_length": result["acceptance_length"], "prompts": len(turns),
                                  "num_drafts": drafts, "num_accepted_tokens": accepted,
                                  "tokens_per_second": vllm["output_tokens_per_second"],
                                  "counts_equal": (drafts, accepted)
                                  == (result["rounds"], result["accepted"]),
                                  "outputs_equal": vllm["output_token_ids"]
                                  == [json.loads(turn)["output_token_ids"] for turn in turns]}
            records.append(record)
    return records


def write_results(args, stages: Stages) -> None:
    write_text_atomic(args.out / "results.jsonl", "".join(json.dumps(r) + "\n" for r in collect(args, stages)))


def shard_stats(args, lever: str) -> dict:
    path = shards_dir(args, lever) / "manifest.json"
    return json.loads(path.read_text())["stats"] if path.exists() else {}


def mean_std(values: list[float]) -> str:
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} ± {std:.3f}"


def print_tables(args, stages: Stages, records: list[dict]) -> None:
    groups = list(dict.fromkeys((r["lever"], r["trainer"]) for r in records))
    width = max(8, 6 * len(args.seeds) - 1)  # each seed's value: "1.234 "
    print(f"\n{'lever':<14} {'trainer':<16} {'rows':>5} {'trained tok':>11} {'seeds':>5}  "
          + "  ".join(f"{f'K={k} mean ± std':>15}  {'per seed':<{width}}" for k in args.ks))
    for lever, trainer in groups:
        stats = shard_stats(args, lever)
        cells = []
        for k in args.ks:
            values = [r["acceptance_length"] for r in records
                      if (r["lever"], r["trainer"], r["k"]) == (lever, trainer, k)]
            cells.append(f"{mean_std(values) if values else '-':>15}  "
                         f"{' '.join(f'{v:.3f}' for v in values):<{width}}")
        seeds = len({r["seed"] for r in records if (r["lever"], r["trainer"]) == (lever, trainer)})
        print(f"{lever:<14} {trainer:<16} {stats.get('samples', '-'):>5} {stats.get('trainable_tokens', '-'):>11} "
              f"{seeds:>5}  " + "  ".join(cells))
    prompts = records[0]["prompts"] if records else 0
    counter = ("vLLM's CPU build serving each draft (its own counters; float32, up to 8 sequences at once)"
               if args.counter == "vllm" else "specgen's speculative decoding")
    print(f"acceptance length = 1 + accepted / verification rounds (vLLM's counting), {counter}, "
          f"chain, greedy; first turns of {Path(args.eval_prompts).name} ({prompts} prompts), "
          f"{args.max_new_tokens} new tokens; drafts trained with train.ttt_length={args.ttt_length}")
    if args.counter == "vllm":
        lossy = [f"{r['lever']}-{r['trainer']}-seed{r['seed']} K={r['k']}" for r in records if not r["lossless"]]
        print("lossless: " + (f"every served output equals the target alone's ({len(records)} runs)" if not lossy
                              else f"{len(lossy)} runs differ from the target alone: {', '.join(lossy)}"))
    print_served(args, records)
    print_times(args, stages)
    served = [r for r in records if "vllm" in r]
    if served:
        print(f"\nvLLM's CPU build and specgen's decoding on the same {served[0]['vllm']['prompts']} prompts (float32, "
              "greedy, up to 8 sequences at once)")
        print(f"{'lever':<14} {'trainer':<16} {'seed':>4} {'K':>2} {'vLLM':>7} {'specgen':>7} {'tokens/s':>8}  "
              "counts (drafts, accepted)   output tokens")
        for r in served:
            v = r["vllm"]
            print(f"{r['lever']:<14} {r['trainer']:<16} {r['seed']:>4} {r['k']:>2} {v['acceptance_length']:>7.3f} "
                  f"{v['specgen_acceptance_length']:>7.3f} {v['tokens_per_second']:>8.1f}  "
                  f"{'equal to specgen' if v['counts_equal'] else 'DIFFER':<27} "
                  f"{'equal to specgen' if v['outputs_equal'] else 'DIFFER'}")


def print_served(args, records: list[dict]) -> None:
    """--counter vllm: per lever, trainer and K, vLLM's generated tokens/s (mean over seeds) and the share of
    verification rounds that accepted draft position 1, 2, ... (pooled over seeds)."""
    served = [r for r in records if r["counter"] == "vllm" and r.get("accepted_per_position")]
    if not served:
        return
    target = json.loads((args.out / "eval" / "target.json").read_text())
    print(f"\nserved by vLLM (target alone: {target['output_tokens_per_second']:.1f} tokens/s; timed beside whatever "
          "else ran): tokens/s mean over seeds, share of rounds accepting draft position 1, 2, ... pooled over seeds")
    for lever, trainer, k in dict.fromkeys((r["lever"], r["trainer"], r["k"]) for r in served):
        group = [r for r in served if (r["lever"], r["trainer"], r["k"]) == (lever, trainer, k)]
        rounds = sum(r["rounds"] for r in group)
        shares = [sum(column) / rounds for column in zip(*(r["accepted_per_position"] for r in group))]
        print(f"{lever:<14} {trainer:<16} K={k:<2} {statistics.mean(r['tokens_per_second'] for r in group):>7.1f}  "
              + " ".join(f"{share:.3f}" for share in shares))


def evaluate_seconds(args, stages: Stages, name: str) -> float | None:
    """Wall seconds counting a draft at every K: specgen's decoding, or (--counter vllm) vLLM's serving."""
    if args.counter == "specgen":
        return stages.seconds(f"evaluate-{name}")
    served = [stages.seconds(f"count-{name}-k{k}") for k in args.ks]
    return None if None in served else sum(served)


def print_times(args, stages: Stages) -> None:
    """Wall seconds of each stage (from stages.json: earlier runs' stages too)."""
    def show(value) -> str:
        return "-" if value is None else f"{value:.0f}"

    print(f"\n{'wall seconds':<29} {'regenerate':>10} {'generate':>8}  {'train (per seed)':<24} "
          "evaluate (per seed, all K)")
    for lever, trainer in dict.fromkeys((lv, tr) for lv, tr, _ in runs(args)):
        seeds = [s for lv, tr, s in runs(args) if (lv, tr) == (lever, trainer)]
        regenerate = stages.seconds(f"regenerate-{lever}") if trainer.startswith("specgen") else None
        generate = stages.seconds(f"generate-{lever}") if trainer.startswith("specgen") else None
        train = " ".join(show(stages.seconds(f"train-{draft_name(lever, trainer, s)}")) for s in seeds)
        evaluate = " ".join(show(evaluate_seconds(args, stages, draft_name(lever, trainer, s))) for s in seeds)
        print(f"{lever + ' ' + trainer:<29} {show(regenerate):>10} {show(generate):>8}  {train:<24} {evaluate}")
    if "mixed" in args.levers:
        print("mixed: regenerate is regenerated's and synthesized's; mixing took "
              f"{show(stages.seconds('mix'))} s")
    for lever in (lever for lever in POOLS if lever in args.levers):
        *others, last = (f"{source}'s" for source in POOLS[lever])
        print(f"{lever}: regenerate is {', '.join(others)} and {last}")
    served = [value for name, value in stages.record.items() if name.startswith("vllm-")]
    if served:
        print(f"vLLM serving: {len(served)} runs, {sum(v['seconds'] for v in served):.0f} s")


# ---- main ---------------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="the target's model folder")
    parser.add_argument("--prompts", type=Path, help="the prompt rows (conversations) every lever starts from")
    parser.add_argument("--out", type=Path, required=True, help="everything the run makes; re-run to resume")
    parser.add_argument("--recipe", default="smollm2-135m")
    parser.add_argument("--levers", nargs="+", choices=LEVERS, default=list(LEVERS))
    parser.add_argument("--rows", type=int, help="data.max_rows of regenerate and generate (default: the recipe's)")
    parser.add_argument("--regenerate-python", metavar="PYTHON",
                        help="regenerate with vLLM's engine (engine=vllm), run by this python (vLLM's venv)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=["eagle3"],
                        help="draft methods specgen trains on every lever (issue #24's axis)")
    parser.add_argument("--jobs", type=int, default=1, help="drafts trained (and evaluated) at once, one thread each")
    parser.add_argument("--ks", type=int, nargs="+", default=[3, 5, 7])
    parser.add_argument("--ttt-length", type=int, help="train.ttt_length (default: the largest K)")
    parser.add_argument("--steps", type=int, help="train.max_steps (default: the recipe's epochs)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides for the stages")
    parser.add_argument("--speculators", metavar="PYTHON", help="also train speculators' trainer with this python")
    parser.add_argument("--speculators-seeds", type=int, nargs="+", help="default: --seeds")
    parser.add_argument("--eval-prompts", type=Path, default=MT_BENCH)
    parser.add_argument("--max-prompts", type=int, help="evaluate on the first N prompts only")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--eval-device", default="cpu",
                        help="where specgen's decoding counts acceptance (float32): cpu, or cuda on a GPU machine")
    parser.add_argument("--vllm-python", help="vLLM's venv python: also serve the drafts in vLLM")
    parser.add_argument("--vllm-seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--counter", choices=("specgen", "vllm"), default="specgen",
                        help="who counts the table's acceptance: specgen's decoding, or vLLM serving every draft on "
                             "every prompt (needs --vllm-python; specgen then decodes --check-prompts for the "
                             "--vllm-seeds drafts, and vLLM the same, to check the counts agree)")
    parser.add_argument("--check-prompts", type=int, default=8)
    parser.add_argument("--dry-run", action="store_true", help="print every command, run none")
    parser.add_argument("--evaluate", help=argparse.SUPPRESS)  # internal: evaluate one draft into --out
    args = parser.parse_args()
    args.ttt_length = args.ttt_length or max(args.ks)
    args.speculators_seeds = args.speculators_seeds or args.seeds
    return args


def check(args) -> None:
    """Paths and interpreters before anything runs, each a one-line error."""
    for flag in ("model", "prompts"):
        if getattr(args, flag) is None or not getattr(args, flag).exists():
            raise Failed(f"--{flag} {getattr(args, flag)} does not exist")
    if not args.eval_prompts.exists():
        raise Failed(f"--eval-prompts {args.eval_prompts} does not exist (SPECGEN_SHARED names ../shared)")
    if args.speculators and "regenerated" not in args.levers:
        raise Failed("--speculators trains on the regenerated shards: add regenerated to --levers")
    missing = args.speculators and not args.dry_run and speculators_missing(args.speculators)
    if missing:
        raise Failed(missing)
    if args.counter == "vllm" and not args.vllm_python:
        raise Failed("--counter vllm serves every draft in vLLM: pass --vllm-python (vLLM's venv python)")
    if args.ttt_length < max(args.ks):
        print(f"note: train.ttt_length={args.ttt_length} is below the largest K={max(args.ks)}")


def main() -> None:
    args = parse_args()
    if args.evaluate:
        return evaluate_here(args)
    from specgen.errors import SpecgenError

    stages = None
    try:
        check(args)
        args.model, args.prompts, args.eval_prompts = (path.resolve() for path in (args.model, args.prompts,
                                                                                  args.eval_prompts))
        args.out = args.out.resolve()
        for flag in ("speculators", "vllm_python"):  # absolute, not resolved: a venv's python is a symlink
            setattr(args, flag, getattr(args, flag) and os.path.abspath(getattr(args, flag)))
        for folder in ("logs", "data", "shards", "drafts", "eval") if not args.dry_run else ():
            (args.out / folder).mkdir(parents=True, exist_ok=True)
        args.key_stages = route_sets(args)
        args.run_recipe, args.specgen_runs = run_recipe(args), {}
        steps, args.draft_commands = data_steps(args), draft_commands(args)  # every command's plan made up front
        stages = Stages(args.out, args.dry_run, args.specgen_runs)
        make_data(args, stages, steps)
        if args.counter == "vllm":
            target_alone(args, stages)
        train_all(args, stages)
        if args.vllm_python:
            for lever, trainer, seed in runs(args):
                if seed in args.vllm_seeds:
                    serve(args, stages, lever, trainer, seed)
    except (Failed, SpecgenError) as error:
        if stages is None or args.dry_run:
            raise SystemExit(f"levers: {error}") from None
        failure = error  # what did finish is still reported, then the run fails
    else:
        failure = None
    if not args.dry_run:
        write_results(args, stages)
        print_tables(args, stages, collect(args, stages))
    if failure is not None:
        raise SystemExit(f"levers: {failure} (the tables above hold what finished; the same command goes on)")


if __name__ == "__main__":
    main()
