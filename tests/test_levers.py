"""benchmarks/levers.py as a sweep over `specgen run` (issue #41): its --dry-run prints every command; each regenerate,
generate and train step is one `python -m specgen.run` whose plan validates, and every later step reads the stage
folder an earlier run writes. Nothing trains or generates here."""

import json
import shlex
import subprocess
import sys

import pytest
from conftest import BUNDLED_CHAT, REPO, load_script
from omegaconf import OmegaConf

from specgen.runner import make_plan

SCRIPT = REPO / "benchmarks" / "levers.py"
TINY = REPO / "specgen" / "assets" / "tiny-target"
HELDOUT = REPO / "specgen" / "assets" / "chat" / "heldout.jsonl"


def dry_run(out, *flags: str) -> list[tuple[str, str, str]]:
    """(status, step name, what it shows) of every line --dry-run prints for a step."""
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", str(TINY), "--prompts", str(BUNDLED_CHAT),
                           "--eval-prompts", str(HELDOUT), "--out", str(out), *flags, "--dry-run"],
                          capture_output=True, text=True, cwd=REPO, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = []
    for line in proc.stdout.splitlines():
        if line.startswith(("[run]  ", "[done] ")):
            name, _, shown = line[7:].partition(": ")
            steps.append((line[1:5].rstrip("]"), name, shown))
    return steps


def plain(value):
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def test_every_data_and_train_step_is_a_specgen_run_that_reads_the_folder_an_earlier_run_writes(tmp_path):
    out = (tmp_path / "out").resolve()
    # generate-original finished earlier: specgen run would skip it, and --dry-run says so
    (out / "shards" / "original" / "01-generate").mkdir(parents=True)
    (out / "shards" / "original" / "01-generate" / "stage.json").write_text('{"wall_s": 1.0}')
    steps = dry_run(out, "--levers", "original", "regenerated", "mixed", "all", "--seeds", "0",
                    "--methods", "eagle3", "dflash", "--ks", "3", "--rows", "4", "--steps", "2", "--max-prompts", "2",
                    "--speculators", sys.executable,
                    "--set", "train.precision=fp32", "regenerate.max_new_tokens=8")
    shown = {name: text for _, name, text in steps}
    status = {name: state for state, name, _ in steps}
    specgen_runs = [name for name in shown if name.split("-")[0] in ("regenerate", "generate", "train")
                    and "speculators" not in name]
    assert sorted(specgen_runs) == sorted([
        "regenerate-regenerated", "regenerate-synthesized",
        "generate-original", "generate-regenerated", "generate-mixed", "generate-all",
        *(f"train-{lever}-{trainer}-seed0" for lever in ("original", "regenerated", "mixed", "all")
          for trainer in ("specgen", "specgen-dflash"))])
    assert status["generate-original"] == "done" and status["generate-regenerated"] == "run"

    folders, cfgs = {}, {}
    for name in specgen_runs:
        argv = shlex.split(shown[name])
        assert argv[:3] == [sys.executable, "-m", "specgen.run"], name
        assert argv[3] == "recipe=smollm2-135m"  # the bundled recipe: a run uses its overrides of the entries it lists
        plan = make_plan(argv[3:])  # composes and validates the stage's config (a SpecgenError on a bad key)
        (step,) = plan.steps
        stage = name.split("-")[0]
        assert step.stage == stage and step.folder == plan.run_dir / f"01-{stage}", name
        folders[name], cfgs[name] = step.folder, step.cfg

    regenerated, synthesized = folders["regenerate-regenerated"], folders["regenerate-synthesized"]
    assert regenerated == out / "data" / "regenerated" / "01-regenerate"
    assert cfgs["regenerate-synthesized"].regenerate.user_turns == "synthesize"
    assert cfgs["regenerate-regenerated"].regenerate.max_new_tokens == 8  # --set routed to regenerate
    mixed = out / "data" / "mixed.jsonl"
    assert shown["mix"] == f"{mixed}: rows of {regenerated} (even) and {synthesized} (odd)"
    inputs = {"original": str(BUNDLED_CHAT), "regenerated": str(regenerated), "mixed": str(mixed),
              "all": [str(BUNDLED_CHAT), str(regenerated), str(synthesized)]}
    for lever, data in inputs.items():
        cfg = cfgs[f"generate-{lever}"]
        assert plain(cfg.data.path) == data and cfg.data.max_rows == 4, lever
        for trainer in ("specgen", "specgen-dflash"):
            name = f"{lever}-{trainer}-seed0"
            cfg = cfgs[f"train-{name}"]
            assert cfg.data.shards == str(folders[f"generate-{lever}"]), name
            assert (cfg.runtime.seed, cfg.train.ttt_length, cfg.train.max_steps) == (0, 3, 2)
            assert cfg.train.precision == "fp32" and cfg.runtime.threads == 1
            if trainer.endswith("dflash"):
                assert cfg.draft.method == "dflash" and cfg.draft.dflash.block_size == 4
            else:
                assert cfg.draft.method in (None, "eagle3")  # the default method, EAGLE-3
            evaluate = shlex.split(shown[f"evaluate-{name}"])
            assert evaluate[evaluate.index("--evaluate") + 1] == str(folders[f"train-{name}"])  # the trained draft
    speculators = shlex.split(shown["train-regenerated-speculators-seed0"])
    assert speculators[speculators.index("--shards") + 1] == str(folders["generate-regenerated"])
    # nothing ran: nothing was written besides the stage.json planted above
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == [
        "shards/original/01-generate/stage.json"]


@pytest.fixture()
def levers(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    return load_script(SCRIPT)


def test_wall_seconds_of_a_specgen_run_come_from_its_stage_json(levers, tmp_path):
    folder = tmp_path / "drafts" / "x" / "01-train"
    folder.mkdir(parents=True)
    run = levers.SpecgenRun("train-x", [sys.executable, "-m", "specgen.run"], folder, None)
    stages = levers.Stages(tmp_path, dry_run=False, specgen_runs={"train-x": run})
    assert stages.seconds("train-x") is None  # not finished
    (folder / "stage.json").write_text(json.dumps({"wall_s": 12.5}))
    assert stages.seconds("train-x") == 12.5
    stages.record["mix"] = {"command": "mix", "seconds": 3.0}  # levers' own steps: stages.json
    assert stages.seconds("mix") == 3.0


def test_a_specgen_run_runs_every_time_and_says_whether_its_stage_ran(levers, tmp_path):
    """levers keeps no done-marker of its own for a specgen run: it starts it, and reads the stage's stage.json."""
    (tmp_path / "logs").mkdir()
    folder = tmp_path / "run" / "01-train"
    like_specgen_run = ("import json, pathlib, sys; f = pathlib.Path(sys.argv[1]) / 'stage.json'; "
                        "f.parent.mkdir(parents=True, exist_ok=True); "
                        "f.exists() or f.write_text(json.dumps({'wall_s': 2.0}))")  # skips a finished stage
    run = levers.SpecgenRun("train-x", [sys.executable, "-c", like_specgen_run, str(folder)], folder, None)
    stages = levers.Stages(tmp_path, dry_run=False, specgen_runs={"train-x": run})
    assert stages.specgen(run) is True and stages.seconds("train-x") == 2.0
    assert stages.specgen(run) is False  # finished earlier: started again, skipped by the run itself
    assert not (tmp_path / "stages.json").exists()  # its wall seconds live in its stage.json
    failing = levers.SpecgenRun("train-y", [sys.executable, "-c", "print('error: boom'); raise SystemExit(2)"],
                                tmp_path / "other" / "01-train", None)
    with pytest.raises(levers.Failed, match=r"train-y failed \(exit 2\): error: boom"):
        stages.specgen(failing)
