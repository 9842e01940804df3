"""mkdocs hook: the configuration reference page gets its tables from docs/gen_config_reference.py at build time,
so the published defaults, types and comments are always the shipped ones."""

import importlib.util
import sys
from pathlib import Path

MARKER = "<!-- config-reference -->"
PAGE = "reference/configuration.md"


def _generator():
    spec = importlib.util.spec_from_file_location("gen_config_reference", Path(__file__).with_name(
        "gen_config_reference.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def on_page_markdown(markdown: str, page, **_) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise ValueError(f"{PAGE} lost its {MARKER} marker: the generated reference has nowhere to go")
    return markdown.replace(MARKER, _generator().render())
