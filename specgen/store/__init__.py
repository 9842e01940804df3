"""Arrow shards: one row per sample, no padding, written atomically, read memory-mapped."""

from specgen.store.manifest import (MANIFEST, merge_rejected, read_manifest, summarize_shards,
                                    write_manifest)
from specgen.store.reader import ShardDataset, open_shards
from specgen.store.columns import ShardSpec, arrow_schema
from specgen.store.writer import (ShardWriter, finished_shards, read_sidecar, remove_partial,
                                  shard_name)

__all__ = ["MANIFEST", "ShardDataset", "ShardSpec", "ShardWriter", "arrow_schema", "finished_shards",
           "merge_rejected", "open_shards", "read_manifest", "read_sidecar", "remove_partial",
           "shard_name", "summarize_shards", "write_manifest"]
