"""specgen: EAGLE-3 draft training data and training.

Stages (Hydra apps): `python -m specgen.generate`, `specgen.train`, `specgen.evaluate`, `specgen.verify`.
Library entry point for readers: `specgen.open_shards(path)`.
"""

__version__ = "0.1.0"


def open_shards(path, **kwargs):
    """Open a generated dataset (an output dir or one shard file) as a map-style torch Dataset."""
    from specgen.store.reader import open_shards as _open_shards

    return _open_shards(path, **kwargs)


__all__ = ["open_shards", "__version__"]
