"""The configuration reference, generated from the typed schema and the shipped YAML, so a default cannot drift.

Types, choices and minimums come from `specgen/schema.py` (`KEYS`); defaults come from composing every stage's
config exactly as the command line does (with no overrides, then once per alternative of each config group it uses,
e.g. `engine=vllm`), and each key's one-line meaning is the comment beside it in `conf/**.yaml`.
`docs/hooks.py` puts `render()` into `docs/reference/configuration.md` when mkdocs builds the site;
`python docs/gen_config_reference.py` prints the same Markdown. `rows()` is what the tests check: one row per key of
`KEYS`, each with its defaults and its comment.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from specgen.config import CONF_DIR
from specgen.schema import KEYS, Key, leaves

STAGES = ("generate", "train", "evaluate", "regenerate", "export", "verify", "capture_server", "run")
SKIPPED_TOP = ("defaults", "hydra")
_KEY_LINE = re.compile(r"^(\s*)([A-Za-z_]\w*):(.*)$")


@dataclass
class Row:
    """One key of the reference: its schema entry, its default per stage and its YAML comments."""

    key: str
    spec: Key
    defaults: dict[str, object] = field(default_factory=dict)  # stage -> default (stage's own defaults)
    alternatives: dict[str, object] = field(default_factory=dict)  # "group=option" -> default under it
    comments: list[tuple[str, str]] = field(default_factory=list)  # (conf file, comment), group files first

    @property
    def comment(self) -> str:
        return self.comments[0][1] if self.comments else ""


def yaml_comments(conf_dir: Path = CONF_DIR) -> dict[str, list[tuple[str, str]]]:
    """Dotted key -> [(file relative to conf_dir, its one-line comment)] for every key a conf file sets with a
    comment. A comment-only line indented under a commented key continues that key's comment. Recipes (global
    packages, no comments of their own per key) and Hydra's own settings are skipped."""
    found: dict[str, list[tuple[str, str]]] = {}
    for path in sorted(conf_dir.rglob("*.yaml")):
        rel = path.relative_to(conf_dir)
        if rel.parts[0] == "recipes":
            continue
        prefix = "" if len(rel.parts) == 1 else f"{rel.parts[0]}."
        stack: list[tuple[int, str]] = []
        last: tuple[str, int] | None = None  # (key, comment column) of the previous commented key line
        for line in path.read_text().splitlines():
            match = _KEY_LINE.match(line)
            if not match:
                stripped = line.lstrip()
                if stripped.startswith("#") and last and len(line) - len(stripped) == last[1] > 0:
                    key, _ = last
                    source, text = found[key][-1]
                    found[key][-1] = (source, f"{text} {stripped.lstrip('#').strip()}")
                else:
                    last = None
                continue
            indent, name, rest = len(match.group(1)), match.group(2), match.group(3)
            while stack and stack[-1][0] >= indent:
                stack.pop()
            stack.append((indent, name))
            last = None
            if stack[0][1] in SKIPPED_TOP:
                continue
            dotted = prefix + ".".join(part for _, part in stack)
            comment = re.search(r"(?:^|\s)#\s?(.*)$", rest)
            if comment and dotted in KEYS:
                found.setdefault(dotted, []).append((str(rel), comment.group(1).strip()))
                last = (dotted, line.index("#", len(line) - len(rest)))
    for entries in found.values():  # group files (one folder down) first: they define a key for every stage
        entries.sort(key=lambda entry: "/" not in entry[0])
    return found


def _compose(stage: str, overrides: list[str]) -> tuple[DictConfig, dict[str, str]]:
    """A stage's config as composed from the command line (no validation, interpolations unresolved) and its
    group choices."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        cfg = compose(stage, overrides=overrides, return_hydra_config=True)
    choices = dict(cfg.hydra.runtime.choices)
    return cfg, {group: option for group, option in choices.items() if not group.startswith("hydra")}


def _raw(cfg: DictConfig, key: str):
    node = OmegaConf.to_container(cfg, resolve=False)
    for part in key.split("."):
        node = node[part]
    return node


def rows() -> dict[str, Row]:
    """Every key of schema.KEYS (in its order) with its defaults per stage and per group alternative."""
    table = {key: Row(key, spec) for key, spec in KEYS.items()}
    default_files = set()
    for stage in STAGES:
        cfg, choices = _compose(stage, [])
        default_files |= {f"{group}/{option}.yaml" for group, option in choices.items()}
        base = set(leaves(cfg))
        for key in base:
            if key in table:
                table[key].defaults[stage] = _raw(cfg, key)
        for group, chosen in choices.items():
            for option in sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml")):
                if option == chosen:
                    continue
                alt, _ = _compose(stage, [f"{group}={option}"])
                for key in leaves(alt):
                    value = _raw(alt, key)
                    if key in table and (key not in base or value != table[key].defaults.get(stage)):
                        table[key].alternatives.setdefault(f"{group}={option}", value)
    for key, comments in yaml_comments().items():
        # the file a stage composes by default speaks first (engine/hf.yaml, not engine/deepspeed.yaml)
        table[key].comments = sorted(comments, key=lambda entry: entry[0] not in default_files)
    return table


def _value(value, key: str) -> str:
    if value is None:
        return "`null`"
    if value == "???":
        return "required"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, dict):
        return "`{}`" if not value else "a config block (see the YAML file)"
    if isinstance(value, list):
        return f"`{json.dumps(value)}`"
    return f"`{value}`"


def _type(spec: Key) -> str:
    text = spec.kind if not spec.items else f"list of {spec.items}"
    if spec.choices:
        text = " / ".join(f"`{str(choice).lower() if isinstance(choice, bool) else choice}`" for choice in spec.choices)
    if spec.min is not None:
        text += f" ≥ {spec.min:g}"
    return text + (", or `null`" if spec.nullable else "")


def _defaults(row: Row, group_stages: list[str]) -> str:
    """The default, per stage where stages differ or where only some of the group's stages have the key."""
    by_value: dict[str, list[str]] = {}
    for stage, value in row.defaults.items():
        by_value.setdefault(_value(value, row.key), []).append(stage)
    if len(by_value) == 1 and list(row.defaults) == group_stages:
        parts = list(by_value)
    else:
        parts = [f"{value} ({', '.join(stages)})" for value, stages in by_value.items()]
    parts += [f"with `{choice}`: {_value(value, row.key)}" for choice, value in row.alternatives.items()]
    return "; ".join(parts)


def _cell(text: str) -> str:
    return text.replace("|", "&#124;")


def _meaning(row: Row) -> str:
    seen, lines = set(), []
    for source, comment in row.comments:
        if comment in seen:
            continue
        seen.add(comment)
        lines.append(_cell(comment) if not lines else f"*{source}*: {_cell(comment)}")
    return "<br>".join(lines)


def render() -> str:
    """The reference as Markdown: one table per top-level group, keys in schema order."""
    table = rows()
    out: list[str] = []
    group = None
    for key, row in table.items():
        top = key.split(".")[0]
        if top != group:
            group = top
            stages = sorted({s for r in table.values() if r.key.split(".")[0] == top for s in r.defaults},
                            key=STAGES.index)
            out += ["", f"## `{top}`", "", f"Stages: {', '.join(stages)}.", "",
                    "| key | type | default | meaning |", "|---|---|---|---|"]
        out.append(f"| `{key}` | {_cell(_type(row.spec))} | {_cell(_defaults(row, stages))} | {_meaning(row)} |")
    return "\n".join(out).lstrip("\n") + "\n"


if __name__ == "__main__":
    print(render(), end="")
