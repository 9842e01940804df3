"""Recipes run as written: every command in every bundled recipe's header comment runs, in order, on the bundled
tiny target (its paths pointed at the tiny target, its sample and a temporary folder; sizes cut to seconds), so a
recipe cannot drift from the code. And each stage of a recipe writes its own folder: no stage resolves its output
to another's. Each header leads with its `specgen run` line, whose stages (`run.stages`) are the header's commands,
in order, wired as the header wires them (tests/test_run.py runs one)."""

import importlib
import re
import shlex
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from conftest import BUNDLED_CHAT, REPO
from specgen.config import RECIPES_DIR, compose
from specgen.runner import make_plan

TINY = REPO / "specgen" / "assets" / "tiny-target"
HELDOUT = REPO / "specgen" / "assets" / "chat" / "heldout.jsonl"
COMMAND = re.compile(r"^#\s+(?:python -m specgen\.(\w+)|specgen (\w+))\s+(.*)$")
FOLDER_KEYS = ("output.dir", "data.shards", "draft.path")  # folders one command writes and the next reads
# Sizes for seconds on one CPU thread; the recipe's other keys stay as written.
SMALL = {
    "generate": {"data.max_rows": "12", "capture.aux_layers": "null", "output.shard_size": "8"},
    "regenerate": {"data.max_rows": "4", "regenerate.max_new_tokens": "8"},
    "train": {"train.max_steps": "2", "train.epochs": "1", "train.num_workers": "0", "train.eval_every": "0",
              "train.tensorboard": "false"},
    "evaluate": {"evaluate.max_prompts": "1", "evaluate.max_new_tokens": "8"},
    "export": {},
}
COMMON = {"runtime.device": "cpu", "runtime.threads": "1", "runtime.progress": "false"}  # every stage but export


def header_commands(recipe: Path, *, stages: bool = True) -> list[tuple[str, list[str]]]:
    """(stage, arguments) of every command written in the recipe's leading comment block, in order: the stages'
    commands, or (stages=False) its `specgen run` lines."""
    commands = []
    for line in recipe.read_text().splitlines():
        if not line.startswith("#"):
            break
        if match := COMMAND.match(line):
            stage = match.group(1) or match.group(2)
            if (stage != "run") == stages:
                commands.append((stage, shlex.split(match.group(3).split(" #")[0])))
    return commands


def runnable(stage: str, args: list[str], tmp: Path) -> list[str]:
    """The command's arguments with its placeholder paths pointed at the tiny target, its sample and `tmp`."""
    common = {} if stage == "export" else COMMON  # export loads no model: it has no runtime group
    out = []
    for arg in args:
        key, _, value = arg.partition("=")
        if key == "model.path":
            value = str(TINY)
        elif key == "data.path":
            value = str(HELDOUT if stage == "evaluate" else BUNDLED_CHAT)
        elif key in FOLDER_KEYS:
            value = str(tmp / value.strip("/").replace("/", "_"))
        if key not in SMALL[stage] and key not in common:
            out.append(f"{key}={value}" if _ else arg)
    return out + [f"{key}={value}" for key, value in {**SMALL[stage], **common}.items()]


RECIPES = sorted(RECIPES_DIR.glob("*.yaml"))


def test_every_recipe_writes_its_commands():
    assert all(header_commands(recipe) for recipe in RECIPES)
    for recipe in RECIPES:  # `specgen STAGE` is the same command as `python -m specgen.STAGE`
        assert all(stage in SMALL for stage, _ in header_commands(recipe)), recipe.name


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda path: path.stem)
def test_recipe_header_commands_run_in_order(recipe, tmp_path):
    outputs = []
    for stage, args in header_commands(recipe):
        cfg = compose(stage, runnable(stage, args, tmp_path))
        importlib.import_module(f"specgen.{stage}").run(cfg)
        outputs.append(Path(cfg.output.dir))
    assert len(set(outputs)) == len(outputs)  # no stage wrote into another's folder
    produced = {stage: folder for (stage, _), folder in zip(header_commands(recipe), outputs)}
    if "generate" in produced:
        assert (produced["generate"] / "manifest.json").is_file()
    if "train" in produced:
        assert (produced["train"] / "model.safetensors").is_file()
    if "evaluate" in produced:
        assert (produced["evaluate"] / "eval.json").is_file()


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda path: path.stem)
def test_recipe_header_leads_with_its_run_line(recipe):
    """The first command of the header is `specgen run recipe=NAME run.dir=R ...`; its plan runs the header's stage
    commands in their order, each reading the folder the header's earlier command wrote."""
    runs = header_commands(recipe, stages=False)
    assert len(runs) == 1, recipe.name
    first = next(line for line in recipe.read_text().splitlines() if COMMAND.match(line))
    assert first.split("#", 2)[1].strip().startswith(f"specgen run recipe={recipe.stem} run.dir="), recipe.name
    plan = make_plan(runs[0][1])
    stages = header_commands(recipe)
    assert [step.stage for step in plan.steps] == [stage for stage, _ in stages]
    written = {}  # the header's folder name -> the plan's folder for it
    for step, (stage, args) in zip(plan.steps, stages):
        keys = dict(arg.split("=", 1) for arg in args)
        written[keys["output.dir"]] = step.folder
        for key in ("data.shards", "draft.path"):
            if key in keys:
                assert OmegaConf.select(step.cfg, key) == str(written[keys[key]]), (recipe.name, stage, key)
        if stage == "generate" and keys.get("data.path", "").startswith("["):
            sources = keys["data.path"].strip("[]").split(",")
            assert list(step.cfg.data.path) == [str(written.get(s, s)) for s in sources]


@pytest.mark.parametrize("recipe", [path.stem for path in RECIPES])
def test_each_stage_of_a_recipe_defaults_to_its_own_folder(recipe):
    """Without output.dir, a recipe's stages write outputs/<stage>-<time>, never one shared folder."""
    required = {"generate": [f"model.path={TINY}", f"data.path={BUNDLED_CHAT}"], "train": ["data.shards=/s"],
                "evaluate": ["draft.path=/d"], "regenerate": [f"model.path={TINY}", f"data.path={BUNDLED_CHAT}"],
                "export": ["draft.path=/d"]}
    for stage, args in required.items():
        folder = Path(compose(stage, [f"recipe={recipe}", *args]).output.dir).name
        assert folder.startswith(f"{stage}-"), (stage, folder)
