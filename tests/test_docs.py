"""The documentation cannot drift from the code: the configuration reference is generated from the schema and the
YAML and covers every key with its shipped default; every key the docs or the README name exists; every `specgen`
command they write composes and validates against the schema (without running); the CLI prints the resolved config
it documents; and `specgen export` leaves no log file in the folder it runs from."""

import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from conftest import REPO
from specgen.config import CONF_DIR, compose
from specgen.errors import SpecgenError
from specgen.runner import make_plan
from specgen.schema import KEYS, REFERENCE

DOCS = REPO / "docs"
PAGES = sorted(DOCS.rglob("*.md")) + [REPO / "README.md"]
STAGES = ("generate", "train", "evaluate", "verify", "regenerate", "export", "capture_server", "run")
GROUPS = sorted({key.split(".")[0] for key in KEYS if "." in key})
DICT_KEYS = [key for key, spec in KEYS.items() if spec.kind == "dict"]
FILE_SUFFIXES = {"py", "yaml", "yml", "json", "jsonl", "safetensors", "arrow", "md", "ipynb", "bin", "log", "txt",
                 "jinja"}


def _generator():
    spec = importlib.util.spec_from_file_location("gen_config_reference", DOCS / "gen_config_reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def generator():
    return _generator()


@pytest.fixture(scope="module")
def rows(generator):
    return generator.rows()


def test_reference_page_is_generated_into_the_site():
    page = (DOCS / "reference" / "configuration.md").read_text()
    assert "<!-- config-reference -->" in page
    assert "docs/hooks.py" in (REPO / "mkdocs.yml").read_text()
    assert (REPO / REFERENCE).is_file()  # where the one-line config errors send the user


def test_reference_covers_every_key_with_type_default_and_comment(rows, generator):
    assert list(rows) == list(KEYS)
    no_default = [key for key, row in rows.items() if not row.defaults and not row.alternatives]
    no_comment = [key for key, row in rows.items() if not row.comment]
    assert not no_default, f"keys no stage or group option sets (add them to conf/): {no_default}"
    assert not no_comment, f"keys without a one-line comment in conf/: {no_comment}"
    rendered = generator.render()
    for key in KEYS:
        assert rendered.count(f"| `{key}` |") == 1, key


def _yaml_leaves(node, prefix=""):
    for name, value in node.items():
        dotted = f"{prefix}{name}"
        if dotted in KEYS:
            yield dotted, value
        elif isinstance(value, dict):
            yield from _yaml_leaves(value, f"{dotted}.")


@pytest.mark.parametrize("path", sorted(p for p in CONF_DIR.rglob("*.yaml") if "recipes" not in p.parts),
                         ids=lambda p: str(p.relative_to(CONF_DIR)))
def test_every_yaml_default_is_in_the_reference(path, rows):
    """Read independently of the generator: each value a conf file sets is a default the reference shows."""
    rel = path.relative_to(CONF_DIR)
    prefix = "" if len(rel.parts) == 1 else f"{rel.parts[0]}."
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    raw.pop("hydra", None), raw.pop("defaults", None)
    for key, value in _yaml_leaves(raw, prefix):
        shown = list(rows[key].defaults.values()) + list(rows[key].alternatives.values())
        assert value in shown, f"{rel}: {key}={value!r} is not among the reference's defaults {shown}"


def test_reference_shows_per_stage_defaults(rows):
    """The README errors this replaced: tokenizer.path had two defaults with no stage, engine.name said deepspeed."""
    assert rows["engine.name"].defaults == {"generate": "hf", "regenerate": "hf", "capture_server": "hf"}
    assert rows["engine.name"].alternatives == {"engine=deepspeed": "deepspeed", "engine=vllm": "vllm"}
    assert rows["tokenizer.path"].defaults["generate"] == "${model.path}"
    assert rows["tokenizer.path"].defaults["evaluate"] is None


# -- keys named in the docs ----------------------------------------------------------------------------------------

def _known(key: str) -> bool:
    return key in KEYS or key.startswith("hydra.") or any(key.startswith(f"{name}.") for name in DICT_KEYS)


def _named_keys(text: str) -> set[str]:
    """Dotted names the text uses as keys: `a.b=value` anywhere, and any dotted name that starts with a key group
    (`train.lr`, `output.dir`), leaving out module paths (`specgen.train`), paths (`conf/train.yaml`) and files."""
    found = set(re.findall(r"(?<![\w./$\[-])([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)+)(?==)", text))
    group = "|".join(GROUPS)
    for match in re.finditer(rf"(?<![\w./$\[-])((?:{group})(?:\.[a-z_][a-z0-9_]*)+)(?![\w(])", text):
        name = match.group(1)
        if name.rsplit(".", 1)[1] not in FILE_SUFFIXES:
            found.add(name)
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_key_named_in_the_docs_exists(page):
    unknown = sorted(name for name in _named_keys(page.read_text()) if not _known(name))
    assert not unknown, f"{page.relative_to(REPO)} names keys that do not exist: {unknown}"


def test_the_key_check_catches_the_old_readme_errors():
    assert not _known("eval.max_new_tokens") and "eval.max_new_tokens" in _named_keys("`eval.max_new_tokens=96`")
    assert _named_keys("`specgen.train` reads `conf/train.yaml` and `model.safetensors`") == set()


# -- commands written in the docs ----------------------------------------------------------------------------------

def _command_lines(text: str) -> list[str]:
    """Every line of a fenced block, and every inline code span, that runs a specgen stage."""
    lines = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
        lines += block.replace("\\\n", " ").splitlines()
    prose = re.sub(r"```[a-z]*\n.*?```", "", text, flags=re.S)
    lines += re.findall(r"`([^`\n]+)`", prose)
    return [line for line in lines if re.search(r"(^|\s)specgen (\w+)|-m specgen\.\w+", line)]


def _stage_args(line: str) -> tuple[str, list[str]] | None:
    """(stage, arguments) of a command line, or None for a generic form (`specgen STAGE ...`)."""
    argv = shlex.split(line, comments=True)
    for i, word in enumerate(argv):
        if word == "-m" and i + 1 < len(argv) and argv[i + 1].startswith("specgen."):
            stage, rest = argv[i + 1].removeprefix("specgen."), argv[i + 2:]
        elif word in ("specgen", "$(which") or word.endswith("/specgen"):
            at = i + 2 if word == "$(which" else i + 1  # `$(which specgen) generate`
            stage, rest = (argv[at] if at < len(argv) else None), argv[at + 1:]
        else:
            continue
        if stage in STAGES:
            return stage, rest
    return None


def _placeholder_value(key: str, value: str) -> str:
    """A documented placeholder (`N`, `F`, `DIR`) replaced by a value of the key's type."""
    spec = KEYS.get(key)
    if spec is None or not re.fullmatch(r"[A-Z][A-Z0-9_]*", value) or (spec.kind == "str" and not spec.choices):
        return value
    if spec.choices:
        return str(spec.choices[0])
    return {"int": "1", "float": "1.0", "bool": "true", "list": "[1]", "dict": "{}"}.get(spec.kind, value)


def documented_commands() -> list[tuple[str, str, str, list[str]]]:
    found = []
    for page in PAGES:
        for line in _command_lines(page.read_text()):
            parsed = _stage_args(line)
            if parsed is None:
                continue
            stage, rest = parsed
            args, skip = [], False
            for arg in rest:
                if skip:
                    skip = False
                elif arg == "--cfg":
                    skip = True
                elif "=" in arg and not arg.startswith(("-", "[")) and arg not in ("key=value", "recipe=NAME",
                                                                                    "GROUP=OPTION"):
                    key, value = arg.split("=", 1)
                    args.append(f"{key}={_placeholder_value(key, value)}")
            found.append((str(page.relative_to(REPO)), line.strip(), stage, args))
    return found


COMMANDS = documented_commands()


def test_commands_are_found():
    assert len(COMMANDS) > 40
    assert {stage for _, _, stage, _ in COMMANDS} == set(STAGES)


@pytest.mark.parametrize("page, line, stage, args", COMMANDS,
                         ids=[f"{page}:{stage}:{n}" for n, (page, _, stage, _) in enumerate(COMMANDS)])
def test_documented_command_composes(page, line, stage, args):
    """Composed and validated as the command line does, without running; a key the command leaves to the user
    (`draft.path` in an elided command) is filled in, a wrong key or value fails. `specgen run` composes every stage
    of its plan."""
    filled = list(args)
    if stage == "run" and not any(arg.startswith(("recipe=", "run.stages=")) for arg in args):
        filled.insert(0, "recipe=demo")  # the generic `specgen run recipe=NAME ...`, or the command named in prose
    for _ in range(4):
        try:
            make_plan(filled) if stage == "run" else compose(stage, filled)
            return
        except SpecgenError as error:
            missing = re.match(r"(?:stage \S+: )?(\S+) is required by specgen\.", str(error))
            if not missing:
                pytest.fail(f"{page}: `{line}`: {error}")
            filled.append(f"{missing.group(1)}=/placeholder")
    pytest.fail(f"{page}: `{line}` still misses keys after {filled}")


def test_a_wrong_key_in_a_documented_command_fails():
    """The README errors of issue 27, written as commands."""
    with pytest.raises(SpecgenError, match="output.dir is not a key of specgen.verify"):
        compose("verify", ["output.dir=DIR"])
    with pytest.raises(SpecgenError, match="unknown config key eval.max_new_tokens"):
        compose("evaluate", ["draft.path=/d", "eval.max_new_tokens=96"])


# -- the CLI as documented -------------------------------------------------------------------------------------------

def _run(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=cwd, capture_output=True, text=True)


def test_cfg_job_prints_the_resolved_config(tmp_path):
    proc = _run("-m", "specgen.generate", "--cfg", "job", "data.max_length=64", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    cfg = OmegaConf.create(proc.stdout)
    assert "???" not in proc.stdout and "${" not in proc.stdout
    assert Path(cfg.model.path).is_dir() and cfg.data.max_rows == 300 and cfg.data.max_length == 64
    assert cfg.tokenizer.path == cfg.model.path and cfg.output.dir.startswith("outputs/generate-")
    assert not list(tmp_path.iterdir())  # printed, nothing run
    bad = _run("-m", "specgen.train", "--cfg", "job", "train.lrr=1", cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: unknown config key train.lrr")


def test_export_leaves_no_log_in_the_working_folder(tmp_path):
    """Hydra's job log went to ./export.log (export runs in `.`); it logs to the terminal now (commit b3ec3d7 had
    committed such a stray empty export.log at the repository root)."""
    proc = _run("-m", "specgen.export", f"draft.path={tmp_path / 'absent'}", f"output.dir={tmp_path / 'out'}",
                cwd=tmp_path)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert not (REPO / "export.log").exists()
