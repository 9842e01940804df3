"""Hydra glue shared by every stage (`python -m specgen.<stage> recipe=NAME key=value ...`).

Each stage has a primary config `specgen/conf/<stage>.yaml` composed from the groups in `specgen/conf/` (model,
data, capture, output, ...); the configs ship inside the package, so a wheel installed anywhere runs every stage.
A recipe (`specgen/conf/recipes/NAME.yaml`, `# @package _global_`) is a complete experiment: it is merged after
the stage's defaults and before command-line overrides, so `recipe=demo model.path=X` works as expected.
`recipe=` also takes a path to a recipe file of the user's own (`recipe=./my_recipe.yaml`).
"""

import functools
import sys
from collections.abc import Callable
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from specgen.assets import asset_path
from specgen.errors import SpecgenError

CONF_DIR = Path(__file__).resolve().parent / "conf"
RECIPES_DIR = CONF_DIR / "recipes"

if not OmegaConf.has_resolver("asset"):
    OmegaConf.register_new_resolver("asset", asset_path)


def _hydra_argv(argv: list[str], stage: str) -> list[str]:
    """Translate the public `recipe=NAME` into Hydra's group syntax.

    Hydra maps a config group to a folder of the same name; ours is `recipes/`, chosen as `recipe=NAME` on the
    command line, which reads better. `recipe=PATH.yaml` (a file of the user's own) puts the file's folder on the
    search path under a `recipes/` group of its own. The job is named after the stage (Hydra would name it after
    this module, so every stage's log would be `config.log`). Everything else passes through untouched.
    """
    out = [f"hydra.job.name={stage}"]
    for arg in argv:
        if arg.startswith("recipe="):
            name = arg.split("=", 1)[1]
            arg = f"+recipes@_global_={_recipe_name(name, out)}"
        out.append(arg)
    return out


def _recipe_name(name: str, out: list[str]) -> str:
    """The recipe group entry for `recipe=NAME` (bundled) or `recipe=PATH.yaml` (a user's file)."""
    path = Path(name).expanduser()
    if name.endswith((".yaml", ".yml")) or path.parent != Path("."):
        if not path.is_file():
            raise SpecgenError(f"recipe={name}: no such file; pass a bundled recipe name or a path to a .yaml file")
        # Hydra looks up group `recipes` in every search-path entry: expose the file's folder as that group.
        out.insert(0, f"hydra.searchpath=[pkg://specgen.conf,file://{_user_recipe_root(path.resolve())}]")
        return path.stem
    if not (RECIPES_DIR / f"{name}.yaml").exists():
        known = ", ".join(sorted(p.stem for p in RECIPES_DIR.glob("*.yaml")))
        raise SpecgenError(f"unknown recipe {name!r} (bundled: {known}); or pass a path: recipe=./my_recipe.yaml")
    return name


def _user_recipe_root(path: Path) -> Path:
    """A folder whose `recipes/` subfolder holds the user's recipe file (its own folder when already so named)."""
    if path.parent.name == "recipes":
        return path.parent.parent
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="specgen-recipe-"))
    (root / "recipes").mkdir()
    (root / "recipes" / path.name).symlink_to(path)
    return root


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
