"""Files the embedded default runs on, offline: a small chat corpus, a BPE tokenizer trained on it, and a tiny
target model. `python -m specgen.assets.build` rebuilds the corpus and tokenizer from ../shared."""

from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent


def asset_path(name: str) -> str:
    """Absolute path of a bundled asset (used by the `${asset:NAME}` config resolver)."""
    path = ASSETS_DIR / name
    if not path.exists():
        raise FileNotFoundError(f"bundled asset {name!r} is missing from {ASSETS_DIR}; reinstall specgen")
    return str(path)
