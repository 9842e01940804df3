"""`specgen run`: a recipe's stages in order as one resumable command. The demo recipe runs end to end on the bundled
tiny target (sizes cut to seconds) and a second invocation skips every stage; a run killed with -9 during training
resumes the training (not from scratch) and finishes; wiring, key routing and the one-line errors."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from conftest import BUNDLED_CHAT, REPO
from specgen.errors import SpecgenError
from specgen.runner import make_plan
from specgen.runner.plan import override_value

SPECGEN = Path(sys.executable).parent / "specgen"
HELDOUT = REPO / "specgen" / "assets" / "chat" / "heldout.jsonl"
# Seconds instead of minutes; every key is a key of some stage of the demo's run
SMALL = ["data.max_rows=40", "train.max_steps=6", "train.eval_every=0", "evaluate.max_prompts=2",
         "evaluate.max_new_tokens=16", "train.num_workers=0", "train.tensorboard=false", "runtime.progress=false"]


def specgen_run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    argv = [str(SPECGEN), "run", *args] if SPECGEN.exists() else [sys.executable, "-m", "specgen.run", *args]
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True)


def table_rows(stdout: str) -> dict[str, str]:
    """The closing table's stage rows: {folder name: the rest of the line}."""
    return {match.group(1): match.group(2) for match in re.finditer(r"^  (\d\d-[\w-]+)\s+(.*)$", stdout, re.M)}


def test_demo_runs_end_to_end_then_skips_every_stage(tmp_path):
    run_dir = tmp_path / "run"
    first = specgen_run("recipe=demo", f"run.dir={run_dir}", *SMALL, cwd=tmp_path)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    folders = ["01-generate", "02-train", "03-evaluate"]
    assert sorted(p.name for p in run_dir.iterdir() if p.is_dir()) == folders
    assert (run_dir / "01-generate" / "manifest.json").is_file()
    assert (run_dir / "02-train" / "model.safetensors").is_file()
    report = json.loads((run_dir / "03-evaluate" / "eval.json").read_text())
    assert report["num_prompts"] == 2 and report["lossless"] and report["data"] == str(HELDOUT)
    for name in folders:  # each stage's command, wall time and headline, and its output in its log
        stage = json.loads((run_dir / name / "stage.json").read_text())
        assert stage["wall_s"] > 0 and stage["headline"] and stage["command"][:2] == ["python", "-m"]
        assert (run_dir / name / "stage.log").read_text().startswith(f"$ python -m specgen.{name[3:]} recipe=demo")
    train = json.loads((run_dir / "02-train" / "stage.json").read_text())["command"]
    assert f"data.shards={run_dir / '01-generate'}" in train and "train.max_steps=6" in train
    assert "evaluate.max_prompts=2" not in train  # a key goes only to the stages that have it
    rows = table_rows(first.stdout)
    assert list(rows) == folders and all(row.startswith("ran") for row in rows.values())
    assert "40 samples" in rows["01-generate"] and "step 6, loss" in rows["02-train"]
    assert re.search(r"acceptance length \d\.\d{3} \(K=4\), lossless yes", rows["03-evaluate"])

    logs = {name: (run_dir / name / "stage.log").stat().st_mtime_ns for name in folders}
    again = specgen_run("recipe=demo", f"run.dir={run_dir}", *reversed(SMALL), cwd=tmp_path)  # order: same run
    assert again.returncode == 0, again.stderr[-3000:]
    rows = table_rows(again.stdout)
    assert list(rows) == folders and all(row.startswith("skipped: finished earlier") for row in rows.values())
    assert "40 samples" in rows["01-generate"] and "all 3 stages finished earlier" in again.stdout
    assert logs == {name: (run_dir / name / "stage.log").stat().st_mtime_ns for name in folders}  # nothing ran

    other = specgen_run("recipe=demo", f"run.dir={run_dir}", *SMALL, "train.max_steps=7", cwd=tmp_path)
    assert other.returncode == 2 and other.stdout == ""
    assert other.stderr.startswith(f"error: run.dir={run_dir} holds a run with other settings (changed: keys")
    assert len(other.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_a_run_killed_during_training_resumes_it(tmp_path):
    run_dir, train_dir = tmp_path / "run", tmp_path / "run" / "02-train"
    args = ["recipe=demo", f"run.dir={run_dir}", "data.max_rows=40", "train.max_steps=20", "train.save_every=3",
            "train.log_every=1", "train.eval_every=0", "evaluate.max_prompts=1", "evaluate.max_new_tokens=8",
            "train.num_workers=0", "train.tensorboard=false", "runtime.progress=false"]
    argv = [sys.executable, "-m", "specgen.run", *args]
    with open(tmp_path / "first.log", "wb") as log:
        proc = subprocess.Popen(argv, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 300
        while not [p for p in (train_dir / "checkpoints").glob("step-*") if not p.name.endswith(".tmp")]:
            assert proc.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint within 5 minutes"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)  # the run and its train stage, at once
        proc.wait()
    assert not (train_dir / "stage.json").exists()
    killed_at = max(json.loads(line)["step"] for line in (train_dir / "metrics.jsonl").read_text().splitlines())
    assert killed_at < 20

    again = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    rows = table_rows(again.stdout)
    assert rows["01-generate"].startswith("skipped: finished earlier")
    assert rows["02-train"].startswith("ran (train.resume=true)") and "step 20, loss" in rows["02-train"]
    assert rows["03-evaluate"].startswith("ran")
    log = (train_dir / "stage.log").read_text()
    resumed = int(re.search(r"resumed at step (\d+)", log).group(1))
    assert 3 <= resumed <= killed_at
    steps = [json.loads(line)["step"] for line in (train_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 21))  # continued where the checkpoint was: no step twice, none missing
    assert json.loads((train_dir / "stage.json").read_text())["resumed_with"] == ["train.resume=true"]
    assert (run_dir / "03-evaluate" / "eval.json").is_file()


def test_a_failing_stage_stops_the_run_with_its_status_and_log(tmp_path):
    run_dir = tmp_path / "run"
    proc = specgen_run("run.stages=[export,evaluate]", f"run.dir={run_dir}", f"draft.path={tmp_path / 'absent'}",
                       cwd=tmp_path)
    log = run_dir / "01-export" / "stage.log"
    assert proc.returncode == 2
    assert proc.stderr.strip().endswith(f"error: stage 01-export failed (exit status 2); its log: {log}")
    assert "error:" in log.read_text().split("\n", 1)[1]  # the stage's own one-line error, in its log
    assert not (run_dir / "01-export" / "stage.json").exists() and not (run_dir / "02-evaluate").exists()


# -- the plan: wiring and key routing, without running -------------------------------------------------------------

def test_stages_are_wired_and_keys_routed(tmp_path):
    plan = make_plan(["recipe=smollm2-135m", f"run.dir={tmp_path}", "model.path=/m", "data.path=P.jsonl",
                      "train.max_steps=3", "runtime.threads=1", "run.overrides.export.export.format=speculators"])
    args = {step.entry: step.args for step in plan.steps}
    assert [step.label for step in plan.steps] == ["01-regenerate", "02-regenerate-synth", "03-generate",
                                                   "04-train", "05-evaluate", "06-export"]
    folder = {step.entry: str(step.folder) for step in plan.steps}
    assert "regenerate.user_turns=synthesize" in args["regenerate-synth"]
    generate = plan.steps[2].cfg
    assert list(generate.data.path) == ["P.jsonl", folder["regenerate"], folder["regenerate-synth"]]
    assert plan.steps[3].cfg.data.shards == folder["generate"] and plan.steps[3].cfg.train.max_steps == 3
    assert plan.steps[4].cfg.draft.path == folder["train"] and plan.steps[5].cfg.draft.path == folder["train"]
    assert plan.steps[4].cfg.data.path == "../shared/datasets/mt_bench_questions.jsonl"
    assert plan.steps[5].cfg.export.format == "speculators"
    assert all(step.cfg.output.dir == folder[step.entry] for step in plan.steps)
    assert ["train.max_steps=3" in step.args for step in plan.steps] == [False, False, False, True, False, False]
    assert ["runtime.threads=1" in step.args for step in plan.steps] == [True] * 5 + [False]  # export: no runtime


def test_several_regenerate_entries_feed_generate_a_list(tmp_path):
    plan = make_plan(["run.stages=[regenerate,regenerate-2,generate,verify]", f"run.dir={tmp_path}",
                      f"model.path={REPO / 'specgen' / 'assets' / 'tiny-target'}", f"data.path={BUNDLED_CHAT}"])
    generate, verify = plan.steps[2].cfg, plan.steps[3].cfg
    assert list(generate.data.path) == [str(tmp_path / "01-regenerate"), str(tmp_path / "02-regenerate-2")]
    assert verify.data.shards == str(tmp_path / "03-generate")


@pytest.mark.parametrize("args, message", [
    (["recipe=demo"], r"^run.dir is required by specgen.run: pass run.dir=\.\.\.$"),
    (["run.stages=[generate,bogus]"], r"^run.stages: unknown stage 'bogus'; one of regenerate, generate"),
    (["run.stages=[generate,generate]"], r"^run.stages names generate twice"),
    (["run.stages=[]"], r"^run.stages is empty"),
    (["recipe=demo", "train.lrr=1"], r"^unknown config key train.lrr \(did you mean train.lr\?\)"),
    (["recipe=demo", "verify.samples=2"], r"^verify.samples is not a key of any stage of this run \(generate, train"),
    (["recipe=demo", "output.dir=X"], r"^output.dir: specgen run gives each stage its own folder"),
    (["recipe=demo", "draft.path=X"], r"^draft.path is set by specgen run in every stage of this run that reads it"),
    (["recipe=demo", "run.overrides.export.export.format=sglang"], r"^run.overrides.export: export is not an entry"),
    (["recipe=demo", "evaluate.turns=sometimes"], r"^stage evaluate: evaluate.turns=sometimes is not one of"),
    (["recipe=demo", "--cfg"], r"^'--cfg' is not key=value"),
])
def test_errors_are_one_line_before_anything_runs(tmp_path, args, message):
    args = [*args, f"run.dir={tmp_path / 'run'}"] if args != ["recipe=demo"] else args
    with pytest.raises(SpecgenError, match=message):
        make_plan(args)
    assert not (tmp_path / "run").exists()


def test_a_recipe_without_run_stages_is_refused(tmp_path):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("# @package _global_\ntrain:\n  lr: 1.0e-3\n")
    with pytest.raises(SpecgenError, match=r"^recipe=.*mine.yaml lists no run.stages: add run.stages"):
        make_plan([f"recipe={recipe}", f"run.dir={tmp_path / 'run'}"])
    proc = specgen_run(f"recipe={recipe}", f"run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith("error: recipe=") and proc.stderr.count("\n") == 1
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("value", ["/tmp/a-b_c.d/x.jsonl", "x y", "it's", "123", "true", "null", "a,b", "a=b",
                                   "${asset:x}", "[a]", ["a", "/b c", 1, None], {"k": "v w", "n": 2}, 1.5, False])
def test_values_reach_the_stage_as_written(value):
    assert OverridesParser.create().parse_override(f"k={override_value(value)}").value() == value


def test_a_run_of_some_of_a_recipes_stages_uses_their_overrides_only(tmp_path):
    """smollm2-135m's run.overrides name regenerate-synth and evaluate; a run of its generate stage alone gets
    generate's override (the pooled data.path, here replaced on the command line) and ignores the others."""
    plan = make_plan(["recipe=smollm2-135m", f"run.dir={tmp_path}", "run.stages=[generate]", "model.path=/m",
                      "run.overrides.generate.data.path=P.jsonl"])
    (step,) = plan.steps
    assert step.stage == "generate" and step.cfg.data.path == "P.jsonl"
    with pytest.raises(SpecgenError, match="run.overrides.evaluate: evaluate is not an entry"):
        make_plan(["recipe=smollm2-135m", f"run.dir={tmp_path / 'b'}", "run.stages=[generate]", "model.path=/m",
                   "run.overrides.evaluate.data.path=P.jsonl"])
