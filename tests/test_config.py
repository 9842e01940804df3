"""The typed configuration: recipes compose for their stages, required keys are required, bad keys and values are
one-line errors naming the key, and the embedded default's row cap never leaks into a user's run."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from conftest import BUNDLED_CHAT, REPO
from specgen import cli
from specgen.config import CONF_DIR, RECIPES_DIR, compose
from specgen.errors import SpecgenError
from specgen.schema import KEYS, leaves

STAGES = ("generate", "train", "evaluate", "verify", "regenerate", "export")
TINY = REPO / "specgen" / "assets" / "tiny-target"
# What a user must add to each recipe for each stage it serves (the recipe's own `???` keys, and a draft).
REQUIRED = {"demo": {"generate": [], "train": ["data.shards=/tmp/s"], "evaluate": ["draft.path=/tmp/d"]},
            "llama3.1-8b": {"generate": ["model.path=/m", "data.path=/d.jsonl"], "train": ["data.shards=/tmp/s"],
                            "evaluate": ["draft.path=/tmp/d"]},
            "qwen3-8b": {"generate": ["model.path=/m", "data.path=/d.jsonl"], "train": ["data.shards=/tmp/s"],
                         "evaluate": ["draft.path=/tmp/d"]},
            "smollm2-135m": {"regenerate": ["model.path=/m", "data.path=/d.jsonl"],
                             "generate": ["model.path=/m", "data.path=/r"], "train": ["data.shards=/s"],
                             "evaluate": ["model.path=/m", "draft.path=/c"], "export": ["draft.path=/c"]}}


def test_every_recipe_is_tested():
    assert sorted(p.stem for p in RECIPES_DIR.glob("*.yaml")) == sorted(REQUIRED)


@pytest.mark.parametrize("recipe, stage", [(r, s) for r, stages in REQUIRED.items() for s in stages])
def test_recipes_compose_for_their_stages(recipe, stage):
    cfg = compose(stage, [f"recipe={recipe}", *REQUIRED[recipe][stage]])
    assert OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves


@pytest.mark.parametrize("recipe", ["llama3.1-8b", "qwen3-8b"])
def test_recipe_without_its_required_key_fails_naming_it(recipe):
    with pytest.raises(SpecgenError, match=r"^model.path is required by specgen.generate"):
        compose("generate", [f"recipe={recipe}", "data.path=/d.jsonl"])
    with pytest.raises(SpecgenError, match=r"^data.path is required by specgen.generate"):
        compose("generate", [f"recipe={recipe}", "model.path=/m"])


def test_every_key_of_every_stage_is_typed():
    """Documented too: the docs' configuration reference is generated from KEYS and the YAML (tests/test_docs.py)."""
    seen = set()
    for stage in STAGES:
        cfg = compose(stage, ["data.shards=/s"] if stage == "verify" else ["draft.path=/d"]
                      if stage in ("evaluate", "export") else [])
        seen |= set(leaves(cfg))
    assert seen <= set(KEYS)


def test_embedded_default_caps_only_itself():
    embedded = compose("generate")
    assert embedded.data.max_rows == 300 and Path(embedded.model.path) == TINY
    assert compose("generate", ["data.max_rows=null"]).data.max_rows is None  # asked for all rows: all rows
    mine = compose("generate", [f"model.path={TINY}", "data.path=/my/data.json"])
    assert mine.data.max_rows is None and mine.data.path == "/my/data.json"
    # the bundled target alone brings its own sample, uncapped
    assert compose("generate", [f"model.path={TINY}"]).data.max_rows is None
    assert compose("generate", ["recipe=demo"]).data.max_rows is None


@pytest.mark.parametrize("override, message", [
    ("data.max_row=5", "unknown config key data.max_row (did you mean data.max_rows?)"),
    ("capture.logits=foo", "capture.logits=foo is not one of none | topk | full"),
    ("data.max_length=0", "data.max_length=0 must be >= 1"),
    ("output.shard_size=abc", "output.shard_size='abc' must be an int"),
    ("train.lr=0.1", "train.lr is not a key of specgen.generate (it belongs to another stage); see"),
    ("train.batch_tokens=64", "train.batch_tokens is not a key of specgen.generate (it belongs to another stage; "
                              "here: capture.batch_tokens)"),
    ("data.path=/d.jsonl", "model.path is required by specgen.generate"),
    ("output.dir=", "output.dir is an empty string (an unset shell variable?): pass output.dir=VALUE"),
    ("model.path=/m data.path=[/d.jsonl,'']", "data.path is an empty string (an unset shell variable?): pass "
                                             "data.path=VALUE or null"),
])
def test_config_errors_name_the_key(override, message):
    with pytest.raises(SpecgenError, match=re.escape(message)):
        compose("generate", override.split())


def test_cli_config_error_is_one_line_before_anything_loads(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "specgen.generate", "data.max_lenght=5", f"output.dir={out}"],
                          cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: unknown config key data.max_lenght (did you mean data.max_length?); see docs/reference/configuration.md"]
    assert not out.exists()  # refused before Hydra made a run directory


def imported_modules(stderr: str) -> set[str]:
    """The modules a `python -X importtime` run imported, from its stderr."""
    return {line.rsplit("|", 1)[1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


@pytest.mark.parametrize("stage", ["generate", "train", "evaluate", "verify", "regenerate", "export", "capture_server"])
def test_a_config_error_is_answered_before_torch_is_imported(stage, tmp_path):
    """A typo costs half a second, not the ~7 CPU-seconds of importing torch, transformers and the stage's code."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", f"specgen.{stage}", "data.max_lenght=5"],
                          cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1].startswith("error: unknown config key data.max_lenght")
    imported = imported_modules(proc.stderr)
    assert "hydra" in imported and not imported & {"torch", "transformers"}


def test_cfg_job_the_console_command_and_specgen_run_answer_before_torch_is_imported(tmp_path):
    shown = subprocess.run([sys.executable, "-X", "importtime", "-m", "specgen.cli", "generate", "--cfg", "job",
                            "data.max_rows=3"], cwd=tmp_path, capture_output=True, text=True)
    assert shown.returncode == 0 and "max_rows: 3" in shown.stdout
    refused = subprocess.run([sys.executable, "-X", "importtime", "-m", "specgen.cli", "train", "train.epoch=2"],
                             cwd=tmp_path, capture_output=True, text=True)
    assert refused.returncode == 2 and "error: unknown config key train.epoch" in refused.stderr
    run = subprocess.run([sys.executable, "-X", "importtime", "-m", "specgen.run", "recipe=demo",
                          f"run.dir={tmp_path / 'r'}", "train.epoch=2"], cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 2 and "train.epoch" in run.stderr.splitlines()[-1]  # specgen run: its orchestrator
    for proc in (shown, refused, run):
        assert not imported_modules(proc.stderr) & {"torch", "transformers"}


def test_recipe_from_a_users_file(tmp_path):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("# @package _global_\ndata:\n  max_length: 77\n")
    cfg = compose("generate", [f"recipe={recipe}", f"model.path={TINY}", f"data.path={BUNDLED_CHAT}"])
    assert cfg.data.max_length == 77
    with pytest.raises(SpecgenError, match="no such file"):
        compose("generate", [f"recipe={tmp_path / 'absent.yaml'}"])
    with pytest.raises(SpecgenError, match="unknown recipe 'nope'"):
        compose("generate", ["recipe=nope"])


def test_a_users_file_of_more_than_300_rows_is_processed_whole(tmp_path):
    """The bug a user hit: model.path + data.path silently stopped at the embedded default's 300 rows."""
    from specgen.generate import run

    rows = [json.loads(line) for line in BUNDLED_CHAT.read_text().splitlines()][:320]
    data = tmp_path / "mine.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    manifest = run(compose("generate", [f"model.path={TINY}", f"data.path={data}", "data.max_length=32",
                                        f"output.dir={tmp_path / 'out'}", "runtime.progress=false",
                                        "output.shard_size=160"]))
    assert manifest["stats"]["source_rows"] == 320
    assert manifest["stats"]["samples"] + sum(manifest["stats"]["rejected"].values()) == 320  # every row counted


def test_console_command_runs_a_stage(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "specgen.cli", "verify"], cwd=tmp_path, capture_output=True,
                          text=True)
    assert proc.returncode != 0
    assert proc.stderr.strip() == "error: data.shards is required by specgen.verify: pass data.shards=..."
    help_text = subprocess.run([sys.executable, "-m", "specgen.cli", "--help"], capture_output=True, text=True)
    assert help_text.returncode == 0
    stage_rows = help_text.stdout.split("stages:\n")[1].splitlines()
    assert [row.split()[0] for row in stage_rows if row] == list(cli.STAGES)
    assert len({len(row) - len(row.split(maxsplit=1)[1]) for row in stage_rows if row}) == 1  # one description column


def test_configs_and_recipes_sit_at_the_top_of_a_checkout():
    """In a checkout conf/ and recipes/ are top-level folders (a wheel carries them inside the package: .ci/run
    installs one and runs a stage from another folder)."""
    assert CONF_DIR == REPO / "conf" and (CONF_DIR / "generate.yaml").is_file()
    assert RECIPES_DIR == REPO / "recipes" and (RECIPES_DIR / "demo.yaml").is_file()
    assert not (REPO / "specgen" / "conf").exists()


def test_a_key_of_another_stage_names_the_nearest_key_here():
    """What a user tries first: the first N rows for evaluate is evaluate.max_prompts (not data.max_rows, which `specgen
    run` gives to generate alone)."""
    with pytest.raises(SpecgenError, match=re.escape("data.max_rows is not a key of specgen.evaluate (it belongs to "
                                                     "another stage; here: evaluate.max_prompts)")):
        compose("evaluate", ["data.max_rows=3"])
