"""Hydra glue shared by every stage (`python -m specgen.<stage> recipe=NAME key=value ...`).

Each stage has a primary config `conf/<stage>.yaml` composed from the groups in `conf/` (model, data, capture,
output, ...). A recipe (`recipes/NAME.yaml`, `# @package _global_`) is a complete experiment: it is merged after
the stage's defaults and before command-line overrides, so `recipe=demo model.path=X` works as expected. The same
recipe serves every stage; keys a stage does not use are ignored by it.
"""

import functools
import sys
from collections.abc import Callable
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from specgen.assets import asset_path
from specgen.errors import SpecgenError

REPO_ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = REPO_ROOT / "conf"
RECIPES_DIR = REPO_ROOT / "recipes"

if not OmegaConf.has_resolver("asset"):
    OmegaConf.register_new_resolver("asset", asset_path)


def _hydra_argv(argv: list[str], stage: str) -> list[str]:
    """Translate the public `recipe=NAME` into Hydra's group syntax and put recipes/ on the search path.

    Hydra maps a config group to a folder of the same name; ours is `recipes/`, chosen as `recipe=NAME` on the
    command line, which reads better. The job is named after the stage (Hydra would name it after this module,
    so every stage's log would be `config.log`). Everything else passes through untouched.
    """
    out = [f"hydra.searchpath=[file://{REPO_ROOT}]", f"hydra.job.name={stage}"]
    for arg in argv:
        if arg.startswith("recipe="):
            name = arg.split("=", 1)[1]
            if not (RECIPES_DIR / f"{name}.yaml").exists():
                known = ", ".join(sorted(p.stem for p in RECIPES_DIR.glob("*.yaml")))
                raise SpecgenError(f"unknown recipe {name!r}: no {RECIPES_DIR}/{name}.yaml (known: {known})")
            arg = f"+recipes@_global_={name}"
        out.append(arg)
    return out


def stage_main(config_name: str) -> Callable[[Callable[[DictConfig], object]], Callable[[], None]]:
    """Decorator turning `run(cfg)` into a Hydra command-line entry point with one-line user errors."""

    def decorate(run: Callable[[DictConfig], object]) -> Callable[[], None]:
        @hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name=config_name)
        def task(cfg: DictConfig) -> None:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()  # per-file weight-loading bars drown our own progress bar
            try:
                run(cfg)
            except SpecgenError as err:
                print(f"error: {err}", file=sys.stderr)
                sys.exit(2)

        @functools.wraps(run)
        def main() -> None:
            if not CONF_DIR.is_dir():
                sys.exit(f"error: {CONF_DIR} not found; install specgen from a clone with `pip install -e .`")
            try:
                sys.argv = [sys.argv[0], *_hydra_argv(sys.argv[1:], config_name)]
            except SpecgenError as err:
                sys.exit(f"error: {err}")
            task()

        return main

    return decorate


def compose(config_name: str, overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """The config a stage would get from `python -m specgen.<stage> *overrides` (for tests, notebooks, benchmarks)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        return hydra_compose(config_name, overrides=_hydra_argv(list(overrides), config_name))


def to_container(cfg: DictConfig) -> dict:
    """The resolved config as plain Python (for manifests and fingerprints)."""
    return OmegaConf.to_container(cfg, resolve=True)
