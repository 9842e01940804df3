"""The plan of a `specgen run`: every stage's command, wired and composed before anything runs (`specgen.run`).

`make_plan(argv)` splits the command line into the run's own keys (`recipe=`, `run.*`) and the stages' keys, gives
each key to every stage whose own config has it (`accepted_keys`), sets each entry's folder and what earlier entries
feed it (FEEDS), applies the recipe's `run.overrides` (placeholders `{entry}` and `{key}` substituted), and composes
every stage's command as the stage will (a one-line SpecgenError naming the stage otherwise).
"""

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from specgen.config import CONF_DIR, _check_override_key, compose
from specgen.errors import SpecgenError
from specgen.schema import KEYS, REFERENCE, leaves

# The stages a run may list, and where each one's folder goes in a later stage: {producer: {consumer: key}}.
RUNNABLE = ("regenerate", "generate", "verify", "train", "evaluate", "export")
FEEDS = {"regenerate": {"generate": "data.path"},
         "generate": {"verify": "data.shards", "train": "data.shards"},
         "train": {"evaluate": "draft.path", "export": "draft.path"}}
NO_OUTPUT_DIR = ("verify",)  # a stage that writes no folder of its own (its folder holds its log only)
_ENTRY = re.compile(r"([a-z_]+)(-[A-Za-z0-9_]+)*")
_PLACEHOLDER = re.compile(r"\{([A-Za-z0-9_.-]+)\}")


@dataclass
class Step:
    """One entry of run.stages: `entry` (regenerate-synth) runs `stage` (regenerate) in `folder` with `args`."""

    index: int
    entry: str
    stage: str
    folder: Path
    args: list[str]
    cfg: DictConfig | None = None  # the composed config of `args` (what the stage will run with)

    @property
    def label(self) -> str:
        return self.folder.name


@dataclass
class Plan:
    run_dir: Path
    steps: list[Step]
    identity: dict = field(default_factory=dict)  # run.json: what makes two invocations the same run


# -- the plan: every stage's command, composed and validated before anything runs ---------------------------------

def make_plan(argv: list[str]) -> Plan:
    """The stages' commands for `specgen run argv`, each composed and validated (a one-line SpecgenError else)."""
    run_args, stage_args, entry_args = _split(argv)
    recipe = next((arg.split("=", 1)[1] for arg in reversed(run_args) if arg.startswith("recipe=")), None)
    cfg = compose("run", run_args)
    run_dir = Path(cfg.run.dir).expanduser().resolve()
    entries = _entries(cfg.run.stages, recipe)
    folders = {entry: run_dir / f"{i + 1:02d}-{entry}" for i, entry in enumerate(entries)}
    overrides = _entry_overrides(cfg, entry_args, entries)
    steps = _steps(entries, folders, overrides, stage_args, recipe, cfg)
    for step in steps:
        try:
            step.cfg = compose(step.stage, step.args)
        except SpecgenError as error:
            raise SpecgenError(f"stage {step.entry}: {error}") from None
    identity = {"recipe": recipe, "stages": entries, "keys": sorted(stage_args),
                "overrides": {entry: {k: jsonable(v) for k, v in values.items()}
                              for entry, values in overrides.items()}}
    return Plan(run_dir, steps, identity)


def _split(argv: list[str]) -> tuple[list[str], list[str], list[str]]:
    """(the run's own keys: recipe= and run.*, the stages' keys, run.overrides.ENTRY.key=V), each key checked."""
    run_args, stage_args, entry_args = [], [], []
    for arg in argv:
        if "=" not in arg or arg.startswith("-"):
            raise SpecgenError(f"{arg!r} is not key=value; usage: specgen run recipe=NAME run.dir=DIR [key=value ...]")
        _check_override_key(arg)
        key = _key(arg)
        if key == "output.dir":
            raise SpecgenError("output.dir: specgen run gives each stage its own folder of run.dir; pass run.dir=DIR")
        if key.startswith("run.overrides."):
            entry_args.append(arg)
        elif key == "recipe" or key.startswith("run."):
            run_args.append(arg)
        else:
            stage_args.append(arg)
    return run_args, stage_args, entry_args


def _steps(entries: list[str], folders: dict[str, Path], overrides: dict[str, dict], stage_args: list[str],
           recipe: str | None, cfg: DictConfig) -> list[Step]:
    """Each entry's command: recipe=, the command line's keys its stage has (unless the run sets them there), its
    run.overrides, then its folder and what earlier entries feed it."""
    given = {_key(arg): arg.split("=", 1)[1] for arg in stage_args}
    accepted = {stage: _accepted_keys(stage, stage_args) for stage in {_stage_of(entry) for entry in entries}}
    takers: dict[str, list[str]] = {arg: [] for arg in stage_args}  # per key: the entries it goes to ("": set there)
    steps = []
    for index, entry in enumerate(entries):
        stage, folder = _stage_of(entry), folders[entry]
        own = {key: override_value(_substitute(value, folders, given, cfg, f"run.overrides.{entry}.{key}"))
               for key, value in overrides.get(entry, {}).items()}
        if "output.dir" in own:
            raise SpecgenError(f"run.overrides.{entry}.output.dir: each stage's folder is run.dir/{folder.name}; "
                               "pass another run.dir instead")
        # the entry's run.overrides win over what earlier stages feed it (a recipe pooling regenerated data)
        wired = {key: value for key, value in _wired(entry, entries[:index], folders).items() if key not in own}
        user = []
        for arg in (arg for arg in stage_args if _accepts(accepted[stage], arg)):
            free = _key(arg) not in own and _key(arg) not in wired
            takers[arg].append(entry if free else "")
            user += [arg] if free else []
        args = ([f"recipe={recipe}"] if recipe else []) + user + [f"{k}={v}" for k, v in {**own, **wired}.items()]
        steps.append(Step(index, entry, stage, folder, args))
    for arg, taken_by in takers.items():
        if not taken_by:
            raise SpecgenError(f"{_key(arg)} is not a key of any stage of this run ({', '.join(entries)}); "
                               f"see {REFERENCE}")
        if not any(taken_by):
            raise SpecgenError(f"{_key(arg)} is set by specgen run in every stage of this run that reads it (the "
                               "folder of an earlier stage, or the recipe's run.overrides); to change it for one "
                               f"stage pass run.overrides.ENTRY.{_key(arg)}=...")
    return steps


def _key(arg: str) -> str:
    return arg.split("=", 1)[0].lstrip("+~")


def _stage_of(entry: str) -> str:
    return entry.split("-", 1)[0]


def _entries(stages, recipe: str | None) -> list[str]:
    if stages is None:
        if recipe is None:
            raise SpecgenError("no stages to run: pass recipe=NAME (its run.stages) or run.stages=[generate,train,"
                               "evaluate]")
        raise SpecgenError(f"recipe={recipe} lists no run.stages: add run.stages: [generate, train, evaluate] to the "
                           "recipe or pass run.stages=[generate,train,evaluate]")
    entries = [str(entry) for entry in stages]
    if not entries:
        raise SpecgenError("run.stages is empty: name the stages to run, e.g. run.stages=[generate,train,evaluate]")
    for entry in entries:
        if not _ENTRY.fullmatch(entry) or _stage_of(entry) not in RUNNABLE:
            raise SpecgenError(f"run.stages: unknown stage {entry!r}; one of {', '.join(RUNNABLE)} (a -label suffix, "
                               "e.g. regenerate-synth, runs a stage again)")
    duplicates = sorted({entry for entry in entries if entries.count(entry) > 1})
    if duplicates:
        raise SpecgenError(f"run.stages names {duplicates[0]} twice: give the second one a -label suffix "
                           f"({duplicates[0]}-2) so that it has a folder of its own")
    return entries


def _entry_overrides(cfg: DictConfig, entry_args: list[str], entries: list[str]) -> dict[str, dict]:
    """{entry: {dotted key: value}}: the recipe's run.overrides, then the command line's run.overrides.ENTRY.key=V."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    raw = OmegaConf.to_container(cfg.run.overrides, resolve=True) or {}
    out: dict[str, dict] = {}
    for entry, values in raw.items():
        if entry not in entries:  # the recipe's overrides of an entry this run does not list (run.stages=[...])
            continue
        if not isinstance(values, dict):
            raise SpecgenError(f"run.overrides.{entry} must be a mapping of keys to values, got {values!r}")
        out[entry] = dict(_flatten(values))
    parser = OverridesParser.create()
    for arg in entry_args:
        key, value = arg.split("=", 1)
        rest = key.lstrip("+~").removeprefix("run.overrides.")
        entry, _, name = rest.partition(".")
        if not name:
            raise SpecgenError(f"{key}: pass run.overrides.ENTRY.KEY=VALUE (e.g. run.overrides.evaluate.data.path=P)")
        out.setdefault(entry, {})[name] = parser.parse_override(f"v={value}").value()
    for entry, values in out.items():
        if entry not in entries:  # only the command line's can be: the recipe's were filtered above
            raise SpecgenError(f"run.overrides.{entry}: {entry} is not an entry of run.stages ({', '.join(entries)})")
        for name in values:
            _check_override_key(f"{name}=")
    return out


def _flatten(values: dict, prefix: str = "") -> list[tuple[str, object]]:
    """Nested {data: {path: X}} as [("data.path", X)]; a schema key of kind dict stays whole."""
    items = []
    for name, value in values.items():
        dotted = f"{prefix}{name}"
        spec = KEYS.get(dotted)
        if isinstance(value, dict) and not (spec and spec.kind == "dict"):
            items += _flatten(value, f"{dotted}.")
        else:
            items.append((dotted, value))
    return items


def _wired(entry: str, earlier: list[str], folders: dict[str, Path]) -> dict[str, str]:
    """The keys the run sets for an entry: its folder as output.dir, and what earlier entries feed it (FEEDS)."""
    stage = _stage_of(entry)
    wired = {} if stage in NO_OUTPUT_DIR else {"output.dir": override_value(str(folders[entry]))}
    for producer, consumers in FEEDS.items():
        if stage not in consumers:
            continue
        sources = [str(folders[entry]) for entry in earlier if _stage_of(entry) == producer]
        if not sources:
            continue
        # generate reads every regenerated folder before it (a list pools them); the others read the latest source
        value = sources[0] if len(sources) == 1 else sources if producer == "regenerate" else sources[-1]
        wired[consumers[stage]] = override_value(value)
    return wired


def _accepted_keys(stage: str, stage_args: list[str]) -> tuple[set[str], set[str]]:
    """(leaf keys, config groups) of the stage's own config (no recipe), with the command line's group choices that
    the stage has applied (engine=vllm adds engine.max_num_seqs)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        base = hydra_compose(stage, overrides=[], return_hydra_config=True)
        groups = {name for name in base.hydra.runtime.choices if not name.startswith("hydra")}
        choices = [arg for arg in stage_args if (CONF_DIR / _key(arg)).is_dir() and _key(arg) in groups]
        cfg = hydra_compose(stage, overrides=choices, return_hydra_config=True) if choices else base
    return set(leaves(cfg)), groups


def _accepts(accepted: tuple[set[str], set[str]], arg: str) -> bool:
    keys, groups = accepted
    key = _key(arg)
    if key.startswith("hydra."):
        return True
    if (CONF_DIR / key).is_dir():
        return key in groups
    return key in keys or any(key.startswith(f"{name}.") and KEYS.get(name) is not None and KEYS[name].kind == "dict"
                              for name in keys)


def _substitute(value, folders: dict[str, Path], given: dict[str, str], cfg: DictConfig, where: str):
    """`{entry}` -> that entry's folder, `{key}` -> the command line's (else the recipe's) value of key; a list item
    that is one placeholder of a list value is replaced by its items."""
    if isinstance(value, list):
        out = []
        for item in value:
            whole = isinstance(item, str) and _PLACEHOLDER.fullmatch(item)
            got = _lookup(whole.group(1), folders, given, cfg, where) if whole else _substitute(item, folders, given,
                                                                                                   cfg, where)
            out.extend(got if whole and isinstance(got, list) else [got])
        return out
    if isinstance(value, dict):
        return {k: _substitute(v, folders, given, cfg, where) for k, v in value.items()}
    if isinstance(value, str):
        whole = _PLACEHOLDER.fullmatch(value)
        if whole:
            return _lookup(whole.group(1), folders, given, cfg, where)
        return _PLACEHOLDER.sub(lambda m: str(_lookup(m.group(1), folders, given, cfg, where)), value)
    return value


def _lookup(name: str, folders: dict[str, Path], given: dict[str, str], cfg: DictConfig, where: str):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if name in folders:
        return str(folders[name])
    if name in given:
        return OverridesParser.create().parse_override(f"v={given[name]}").value()
    if name in KEYS and OmegaConf.select(cfg, name, default=None) is not None:
        value = OmegaConf.select(cfg, name)
        return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
    if name in KEYS:
        raise SpecgenError(f"{where} reads {{{name}}}, which neither the command line nor the recipe sets: "
                           f"pass {name}=...")
    raise SpecgenError(f"{where}: {{{name}}} is neither an entry of run.stages ({', '.join(folders)}) nor a key")


_PLAIN = re.compile(r"[A-Za-z0-9_./:@+-]+")


def override_value(value) -> str:
    """A value as Hydra's override grammar reads it back (strings quoted where they would parse otherwise)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ",".join(override_value(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{override_value(v)}" for k, v in value.items()) + "}"
    text = str(value)
    if _PLAIN.fullmatch(text) and not re.fullmatch(r"[-+]?[0-9._]+(e[-+]?[0-9]+)?|true|false|null|nan|inf",
                                                   text, re.I):
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def jsonable(value):
    return json.loads(json.dumps(value, default=str))

