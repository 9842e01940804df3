"""Hydra glue shared by every stage (`python -m specgen.<stage> recipe=NAME key=value ...`).

Each stage has a primary config `conf/<stage>.yaml` composed from the groups in `conf/` (model, data, capture,
output, ...). A recipe (`recipes/NAME.yaml`, `# @package _global_`) is a complete experiment: it is merged after
the stage's defaults and before command-line overrides, so `recipe=demo model.path=X` works as expected.
Both folders sit at the repository's top; the wheel carries them inside the package (`specgen/conf/` and
`specgen/conf/recipes/`, see setup.py), so a wheel installed anywhere runs every stage.
`recipe=` also takes a path to a recipe file of the user's own (`recipe=./my_recipe.yaml`).
"""

import difflib
import functools
import sys
from collections.abc import Callable
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from specgen.assets import asset_path
from specgen.errors import SpecgenError
from specgen.schema import KEYS, REFERENCE, closest_key, is_missing, leaves, settings, validate

# Nothing imported above imports torch: `check_command_line` answers a config error or `--cfg job` in about a second
# (tests/test_config.py checks it); torch, transformers and a stage's model code cost ~7 CPU-seconds to import.


def _config_dirs() -> tuple[Path, Path]:
    """(configs, recipes): inside the package when installed from a wheel, else the checkout's top folders."""
    packaged = Path(__file__).resolve().parent / "conf"
    if packaged.is_dir():
        return packaged, packaged / "recipes"
    checkout = Path(__file__).resolve().parent.parent
    return checkout / "conf", checkout / "recipes"


CONF_DIR, RECIPES_DIR = _config_dirs()

if not OmegaConf.has_resolver("asset"):
    OmegaConf.register_new_resolver("asset", asset_path)


def _hydra_argv(argv: list[str], stage: str) -> list[str]:
    """Translate the public `recipe=NAME` into Hydra's group syntax; refuse a key no stage knows, in one line.

    Hydra maps a config group to a folder of the same name; ours is `recipes/`, chosen as `recipe=NAME` on the
    command line, which reads better. `recipe=PATH.yaml` (a file of the user's own) puts the file's folder on the
    search path under a `recipes/` group of its own. The job is named after the stage (Hydra would name it after
    this module, so every stage's log would be `config.log`). Everything else passes through untouched.
    """
    out = [f"hydra.job.name={stage}"]
    for arg in argv:
        _check_override_key(arg)
        if arg.startswith("recipe="):
            name = arg.split("=", 1)[1]
            arg = f"+recipes@_global_={_recipe_name(name, out)}"
        out.append(arg)
    if RECIPES_DIR.parent != CONF_DIR and not any(arg.startswith("hydra.searchpath=") for arg in out):
        out.insert(0, f"hydra.searchpath=[file://{RECIPES_DIR.parent}]")  # a checkout: recipes/ beside conf/
    return out


def _check_override_key(arg: str) -> None:
    """`key=value` on the command line must name a key of the schema, a config group, or lie inside a free-form
    dict key."""
    if "=" not in arg or arg.startswith(("-", "hydra.", "+hydra.", "recipe=")):
        return
    key = arg.split("=", 1)[0].lstrip("+~")
    if (CONF_DIR / key).is_dir() and key != "recipes":  # a group choice: engine=vllm, distributed=zero2, ...
        return
    if key in KEYS or any(key.startswith(f"{name}.") and spec.kind == "dict" for name, spec in KEYS.items()):
        return
    raise SpecgenError(f"unknown config key {key}{closest_key(key)}; see {REFERENCE}")


def _recipe_name(name: str, out: list[str]) -> str:
    """The recipe group entry for `recipe=NAME` (bundled) or `recipe=PATH.yaml` (a user's file)."""
    path = Path(name).expanduser()
    if _is_recipe_file(name):
        if not path.is_file():
            raise SpecgenError(f"recipe={name}: no such file; pass a bundled recipe name or a path to a .yaml file")
        # Hydra looks up group `recipes` in every search-path entry: expose the file's folder as that group.
        out.insert(0, f"hydra.searchpath=[file://{_user_recipe_root(path.resolve())}]")
        return path.stem
    if not (RECIPES_DIR / f"{name}.yaml").exists():
        known = ", ".join(sorted(p.stem for p in RECIPES_DIR.glob("*.yaml")))
        raise SpecgenError(f"unknown recipe {name!r} (bundled: {known}); or pass a path: recipe=./my_recipe.yaml")
    return name


def _is_recipe_file(name: str) -> bool:
    """`recipe=` names a user's file (a .yaml name or a path), not a bundled recipe."""
    return name.endswith((".yaml", ".yml")) or Path(name).expanduser().parent != Path(".")


def _user_recipe_root(path: Path) -> Path:
    """A folder whose `recipes/` subfolder holds the user's recipe file (its own folder when already so named)."""
    if path.parent.name == "recipes":
        return path.parent.parent
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="specgen-recipe-"))
    (root / "recipes").mkdir()
    (root / "recipes" / path.name).symlink_to(path)
    return root


# Stages that read a target and conversations: with neither model.path nor data.path given (and no recipe), they run
# the embedded default, the bundled tiny target on the bundled chat sample, cut at this many rows (None: all rows).
EMBEDDED_ROW_CAP = {"generate": 300, "regenerate": 300, "train": None}
EMBEDDED_MODEL, EMBEDDED_DATA = "tiny-target", "chat/train.jsonl"


_JOB_RECIPE: str | None = None  # the recipe of the config `finalize` made last in this process (job_recipe)


def finalize(cfg: DictConfig, stage: str, overrides: list[str]) -> DictConfig:
    """The embedded default where it applies, then the schema check: what every stage's `run` receives."""
    global _JOB_RECIPE
    _apply_embedded_default(cfg, stage, overrides)
    validate(cfg, stage)
    _JOB_RECIPE = _given_recipe(overrides)
    return cfg


def job_recipe() -> str | None:
    """The `recipe=` the config `finalize` made last in this process was composed with (None: no recipe): a bundled
    recipe's name, a user's file as an absolute path, so that a command a stage prints for the next stage (and a
    manifest recording it) names the same recipe from any folder."""
    return _JOB_RECIPE


def _given_recipe(overrides: list[str]) -> str | None:
    names = [arg.split("=", 1)[1] for arg in overrides if arg.startswith("recipe=")]
    if not names:
        return None
    return str(Path(names[-1]).expanduser().resolve()) if _is_recipe_file(names[-1]) else names[-1]


def _unset(cfg: DictConfig, key: str) -> bool:
    return is_missing(cfg, key) or OmegaConf.select(cfg, key) is None


def _apply_embedded_default(cfg: DictConfig, stage: str, overrides: list[str]) -> None:
    """No model.path, no data.path, no recipe: the bundled target and sample (row cap in EMBEDDED_ROW_CAP unless
    data.max_rows is given). model.path = the bundled target and no data.path: its bundled sample, all rows.
    Anything else is the user's run, whose required keys `validate` checks."""
    if stage not in EMBEDDED_ROW_CAP or (stage == "train" and cfg.mode == "offline"):
        return
    given = {arg.split("=", 1)[0].lstrip("+~") for arg in overrides if "=" in arg}
    embedded_model = asset_path(EMBEDDED_MODEL)
    if _unset(cfg, "model.path") and _unset(cfg, "data.path") and "recipe" not in given:
        cfg.model.path = embedded_model
        cfg.data.path = asset_path(EMBEDDED_DATA)
        if "data.max_rows" not in given and EMBEDDED_ROW_CAP[stage] is not None:
            cfg.data.max_rows = EMBEDDED_ROW_CAP[stage]
    elif (not _unset(cfg, "model.path") and Path(cfg.model.path).resolve() == Path(embedded_model)
          and _unset(cfg, "data.path")):
        cfg.data.path = asset_path(EMBEDDED_DATA)
    for key in ("model.path", "data.path"):
        if _unset(cfg, key):
            raise SpecgenError(f"{key} is required by specgen.{stage} (the bundled target and sample run only when "
                               f"neither model.path nor data.path is given): pass {key}=...")


def stage_main(config_name: str) -> Callable[[Callable[[DictConfig], object]], Callable[[], None]]:
    """Decorator turning `run(cfg)` into a Hydra command-line entry point with one-line user errors."""

    def decorate(run: Callable[[DictConfig], object]) -> Callable[[], None]:
        @hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name=config_name)
        def task(cfg: DictConfig) -> None:
            from transformers.utils import logging as hf_logging

            from specgen.runtime.reaper import guard_job  # specgen.runtime imports torch: not before the job runs

            hf_logging.disable_progress_bar()  # per-file weight-loading bars drown our own progress bar
            guard_job()  # whatever ends this job ends the processes it starts (specgen.runtime.reaper)
            try:
                run(finalize(cfg, config_name, user_args))
            except SpecgenError as err:
                print(f"error: {err}", file=sys.stderr)
                sys.exit(2)

        user_args: list[str] = []

        @functools.wraps(run)
        def main() -> None:
            check_command_line(config_name)
            user_args[:] = [arg for arg in sys.argv[1:] if not arg.startswith("-")]
            try:
                sys.argv = [sys.argv[0], *_hydra_argv(sys.argv[1:], config_name)]
            except SpecgenError as err:  # a command line with Hydra's flags, which check_command_line leaves alone
                print(f"error: {err}", file=sys.stderr)
                sys.exit(2)
            task()

        return main

    return decorate


_CHECKED: set[tuple[str, ...]] = set()  # (stage, *argv) already checked in this process


def check_command_line(stage: str) -> None:
    """What `python -m specgen.<stage> ...` answers before the job: `--cfg job` prints the config `run(cfg)` would
    get (embedded default applied, resolved, validated) and exits 0; a config error (an unknown key, a key of another
    stage, a missing required key, a value the schema refuses) exits 2 with one line, before Hydra makes a run dir.
    Each stage module calls it first when run as a script, before importing torch and its model code, so both take
    about a second; `stage_main`'s entry point calls it again (a no-op for the same command line)."""
    argv = sys.argv[1:]
    if (stage, *argv) in _CHECKED:
        return
    try:
        shown = _cfg_job_overrides(argv)
        if shown is not None:
            print(OmegaConf.to_yaml(compose(stage, shown), resolve=True), end="")
            sys.exit(0)
        if not any(arg.startswith(("-", "hydra.")) for arg in argv):  # Hydra's own flags go to Hydra
            compose(stage, argv)
    except SpecgenError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    _CHECKED.add((stage, *argv))


def _cfg_job_overrides(argv: list[str]) -> list[str] | None:
    """The overrides of `--cfg job [--resolve] key=value ...`, or None when argv asks for anything else (Hydra's own
    `--cfg hydra`, `--info`, ... go to Hydra). Hydra's `--cfg job` would print the config before the embedded default
    and unresolved (`???`, `${...}`); specgen prints what the stage would run with instead."""
    rest, asked, args = [], False, iter(argv)
    for arg in args:
        if arg in ("--cfg", "-c"):
            if next(args, None) != "job":
                return None
            asked = True
        elif arg != "--resolve":
            if arg.startswith("-"):
                return None
            rest.append(arg)
    return rest if asked else None


def compose(config_name: str, overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """The config a stage's `run` gets from `python -m specgen.<stage> *overrides`, validated (a one-line
    SpecgenError otherwise); for tests, notebooks, benchmarks."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        try:
            cfg = hydra_compose(config_name, overrides=_hydra_argv(list(overrides), config_name))
        except (HydraException, OmegaConfBaseException) as error:
            raise SpecgenError(_one_line(str(error), config_name,
                                         lambda: list(leaves(hydra_compose(config_name))))) from None
    return finalize(cfg, config_name, list(overrides))


def _one_line(message: str, stage: str, stage_keys: Callable[[], list[str]]) -> str:
    """Hydra's composition error as one line; a key of another stage says so, and names this stage's key of the
    nearest name (`data.max_rows` given to evaluate: `evaluate.max_prompts`), if one is near."""
    first = message.strip().splitlines()[0]
    if first.startswith("Could not override '"):
        key = first.split("'")[1]
        return (f"{key} is not a key of specgen.{stage} (it belongs to another stage{_nearest(key, stage_keys())}); "
                f"see {REFERENCE}")
    return first


def _nearest(key: str, stage_keys: list[str]) -> str:
    """'; here: X' for the key of `stage_keys` whose last part is nearest to `key`'s, or '' when none is near."""
    by_name = {}
    for name in stage_keys:
        by_name.setdefault(name.rsplit(".", 1)[-1], name)
    match = difflib.get_close_matches(key.rsplit(".", 1)[-1], list(by_name), n=1, cutoff=0.7)
    return f"; here: {by_name[match[0]]}" if match else ""


def to_container(cfg: DictConfig) -> dict:
    """The resolved config as plain Python (for manifests and fingerprints)."""
    return OmegaConf.to_container(cfg, resolve=True)


def settings_of(stage: str, overrides: list[str] | tuple[str, ...] = (), section: str = ""):
    """`compose(stage, overrides)` as typed settings (`specgen.schema.settings`): the whole tree, or one section
    ("draft", "train", "draft.dflash"); what components take, for tests, notebooks and benchmarks."""
    return settings(compose(stage, overrides), section)
