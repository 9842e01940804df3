"""specgen: training data and training for speculative-decoding drafts.

Stages (Hydra apps, `specgen.cli.STAGES`), each `specgen STAGE ...` or `python -m specgen.STAGE ...`: generate, train,
evaluate, verify, regenerate, export, capture_server (`specgen --help` says what each does); `specgen run recipe=NAME
run.dir=DIR` runs a recipe's stages in order as one resumable command (`specgen.run`).
Library entry point for readers: `specgen.open_shards(path)`.
"""

__version__ = "0.1.0"


def open_shards(path, **kwargs):
    """Open a generated dataset (an output dir or one shard file) as a map-style torch Dataset."""
    from specgen.store.reader import open_shards as _open_shards

    return _open_shards(path, **kwargs)


__all__ = ["open_shards", "__version__"]
