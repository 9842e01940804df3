"""The layout rules of the codebase, checked on the source: no import circle between specgen's modules, stage files
thin, functions short, benchmarks that call the product instead of re-assembling it."""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "specgen"
STAGES = ("generate", "train", "evaluate", "verify", "regenerate", "export", "capture_server", "run")
MAX_STAGE_LINES = 300
MAX_FUNCTION_LINES = 60


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def top_level_imports(path: Path, known: set[str]) -> set[str]:
    """The specgen modules `path` imports when it is imported (module level, not inside functions): for
    `from specgen.a import b`, specgen.a and, when b is a module, specgen.a.b; every parent package too (importing
    a module runs its packages' __init__)."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        for name in names:
            parts = name.split(".")
            for end in range(1, len(parts) + 1):
                prefix = ".".join(parts[:end])
                if prefix in known:
                    found.add(prefix)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph`, as the list of modules around it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for other in sorted(graph[node]):
            if state.get(other) == 1:
                return path[path.index(other):] + [other]
            if other not in state and (cycle := visit(other)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_one_and_only_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle_between_specgen_modules():
    found = modules()
    known = set(found)
    graph = {name: top_level_imports(path, known) - {name} for name, path in found.items()}
    # A package's __init__ importing its own submodules is how a package exposes them, not a circle.
    graph = {name: {other for other in deps if not (other.startswith(name + ".") and path.name == "__init__.py")}
             for (name, deps), path in zip(graph.items(), found.values())}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("stage", STAGES)
def test_stage_files_are_thin(stage):
    path = PACKAGE / f"{stage}.py"
    if not path.exists():
        pytest.skip(f"{path.name} is not in this tree")
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_STAGE_LINES, f"{path.name} has {lines} lines; move library code into its package"


def test_functions_are_short():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({length} lines)")
    assert not long, "functions over 60 lines: " + "; ".join(long)


def test_benchmarks_call_the_product():
    """No benchmark defines a trainer of its own or imports a private name of specgen."""
    problems = []
    for path in sorted((REPO / "benchmarks").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("specgen"):
                problems += [f"{path.name} imports {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                base = node.value
                while isinstance(base, ast.Attribute):
                    base = base.value
                if isinstance(base, ast.Name) and base.id == "specgen":
                    problems.append(f"{path.name} reads specgen...{node.attr}")
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) in (
                    "DraftTrainer", "DDPStrategy", "ZeroStrategy", "TTTObjective"):
                problems.append(f"{path.name}:{node.lineno} builds {ast.unparse(node.func)} itself")
    assert not problems, "; ".join(problems)


def test_benchmarks_import_only_names_their_siblings_define():
    """`from served_acceptance import X` in a benchmark names something served_acceptance.py defines at top level
    (a renamed helper otherwise breaks the scripts that share it, which only a run of each would show)."""
    scripts = {path.stem: ast.parse(path.read_text()) for path in sorted((REPO / "benchmarks").glob("*.py"))}

    def top_level(tree: ast.Module) -> set[str]:
        names = set()
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        return names

    defined = {name: top_level(tree) for name, tree in scripts.items()}
    missing = [f"{name}.py imports {node.module}.{alias.name}"
               for name, tree in scripts.items() for node in ast.walk(tree)
               if isinstance(node, ast.ImportFrom) and node.module in scripts
               for alias in node.names if alias.name not in defined[node.module]]
    assert not missing, "; ".join(missing)
