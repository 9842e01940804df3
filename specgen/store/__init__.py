"""Arrow shards: one row per sample, no padding, written atomically, read memory-mapped.

The names below are imported from their modules on first use (`specgen.lazy`): `specgen.store.commit` (atomic
writes, checksums) serves `specgen run` before any job, and importing it must not import torch."""

from specgen.lazy import lazy_exports

_WHERE = {"MANIFEST": "manifest", "merge_rejected": "manifest", "read_manifest": "manifest",
          "summarize_shards": "manifest", "write_manifest": "manifest", "ShardDataset": "reader", "open_shards": "reader",
          "ShardSpec": "columns", "arrow_schema": "columns", "ShardWriter": "writer", "finished_shards": "writer",
          "read_sidecar": "writer", "remove_partial": "writer", "shard_name": "writer"}
__getattr__ = lazy_exports(__name__, _WHERE)
__all__ = sorted(_WHERE)
