"""Package exports imported on first use (PEP 562), so that importing a light module of a package does not import
the heavy ones beside it: `specgen.runtime.reaper` and `specgen.store.commit` are imported before any job runs (by
`specgen.config`, `specgen.run`), and must not pull in torch through their package's `__init__`."""

import importlib
from collections.abc import Callable


def lazy_exports(package: str, where: dict[str, str]) -> Callable[[str], object]:
    """The package's module-level `__getattr__`: `where` maps each exported name to the submodule defining it."""

    def __getattr__(name: str) -> object:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{where[name]}"), name)

    return __getattr__
