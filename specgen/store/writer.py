"""Write shards atomically: stream record batches to `<name>.tmp`, then rename on commit.

A shard exists under its final name only when it is complete: `commit` closes the Arrow file,
writes the sidecar `shard-NNNNN.json` (stats, rejected rows and the shard's checksum), fsyncs both,
and renames the shard last (`specgen.store.commit.commit_unit`, the protocol regenerate's parts share). A run killed at any point leaves only `*.tmp` files and possibly an orphan sidecar,
which `finished_shards` ignores and `remove_partial` deletes, so re-running the same command
resumes from the shards that are finished.
"""

import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch

from specgen.store.commit import (HashingFile, commit_unit, disk_errors, numbered_files, read_unit_sidecar,
                                  remove_unfinished, tmp_path)
from specgen.store.columns import Column, ShardSpec, arrow_schema, columns

_SHARD_PATTERN = re.compile(r"shard-(\d{5,})\.arrow")
_SIDECAR_PATTERN = re.compile(r"shard-(\d{5,})\.json")


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.arrow"


def sidecar_name(index: int) -> str:
    return f"shard-{index:05d}.json"


def _column_array(column: Column, values: list, sample_ids: list[str], join_views: bool = False,
                  scratch: dict[str, torch.Tensor] | None = None) -> pa.Array:
    """Build one column of a record batch from per-row values with at most one copy into Arrow.

    Rows are concatenated once (Arrow wants one contiguous values buffer per batch), or not at all where they
    already lie back to back in one tensor (`_joined`; join_views=False always copies); the tensor is then
    reinterpreted as its storage dtype and handed to Arrow without another copy. Given `scratch` (column name ->
    tensor), the concatenation reuses the buffer the previous batch used, whose pages are already mapped (a fresh
    one costs as much again in page faults); the caller must be done with the previous batch.
    """
    if column.dtype is str:
        return pa.array(values, pa.string())
    tensors = [_checked_tensor(column, value, sample_id) for value, sample_id in zip(values, sample_ids)]
    flat = _joined(tensors) if join_views else None
    if flat is None:
        parts = [tensor.reshape(-1) for tensor in tensors]
        if scratch is None:
            flat = torch.cat(parts)
        else:
            total = sum(part.numel() for part in parts)
            buffer = scratch.get(column.name)
            if buffer is None or buffer.numel() < total or buffer.dtype != parts[0].dtype:
                buffer = scratch[column.name] = torch.empty(total, dtype=parts[0].dtype)
            flat = torch.cat(parts, out=buffer[:total])
    array = pa.array(flat.view(column.storage_dtype).numpy())
    if column.width is not None:
        array = pa.FixedSizeListArray.from_arrays(array, column.width)
    if column.per_token:
        lengths = torch.tensor([0] + [len(tensor) for tensor in tensors], dtype=torch.int64)
        offsets = pa.array(lengths.cumsum(0).to(torch.int32).numpy())
        array = pa.ListArray.from_arrays(offsets, array)
    return array


def _joined(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The rows' values as one flat view, without a copy, when they lie back to back in one storage: the rows of a
    packed batch are consecutive slices of one captured tensor. None when they do not (a copy is needed)."""
    present = [tensor for tensor in tensors if tensor.numel()]
    if not present:
        return None
    first, end = present[0], present[0].data_ptr()
    storage = first.untyped_storage().data_ptr()
    for tensor in present:  # contiguous (`_checked_tensor`), one dtype; each must start where the previous ends
        if tensor.data_ptr() != end or tensor.untyped_storage().data_ptr() != storage:
            return None
        end += tensor.numel() * tensor.element_size()
    total = sum(tensor.numel() for tensor in present)
    return first.as_strided((total,), (1,))


def _checked_tensor(column: Column, value: Any, sample_id: str) -> torch.Tensor:
    """Return `value` as a CPU tensor of the column's dtype and shape, or say what is wrong.

    Integer columns are cast (token ids arrive as int64) after a range check; floating columns
    must already be in the stored dtype so nothing is silently rounded.
    """
    where = f"sample {sample_id!r}, column {column.name!r}"
    tensor = value if isinstance(value, torch.Tensor) else torch.tensor(value)
    if tensor.device.type != "cpu":
        raise ValueError(f"{where}: tensor is on {tensor.device}; move it to the CPU before writing")
    if column.dtype.is_floating_point:
        if tensor.dtype != column.dtype:
            raise ValueError(f"{where}: dtype is {tensor.dtype}, the shard stores {column.dtype}")
    elif tensor.dtype != column.dtype:
        info = torch.iinfo(column.dtype)
        if tensor.numel() and (tensor.min() < info.min or tensor.max() > info.max):
            raise ValueError(f"{where}: values outside the {column.dtype} range [{info.min}, {info.max}]")
        tensor = tensor.to(column.dtype)
    layout = (["T"] if column.per_token else []) + ([column.width] if column.width is not None else [])
    if tensor.dim() != len(layout) or (column.width is not None and tensor.shape[-1] != column.width):
        raise ValueError(f"{where}: shape {list(tensor.shape)} does not match the stored layout {layout}")
    return tensor.contiguous()


class ShardWriter:
    """Stream rows into one shard; use as a context manager and call `commit` at the end.

    Leaving the context without a commit (an exception, or simply never committing) deletes the
    partial file, so an unfinished shard never appears under its final name.

    The file's bytes do not depend on the two speed switches (False: the path before issue #40): `overlap_hash`
    hashes the bytes on a helper thread while this one writes them (`HashingFile(background=True)`; False: one after
    the other, in this thread), and `fewer_copies` hands rows that lie back to back in memory (a packed batch) to
    Arrow without concatenating them, and concatenates other rows into the buffer the previous batch used.
    """

    def __init__(self, out_dir: str | Path, shard_index: int, spec: ShardSpec, *, overlap_hash: bool = True,
                 fewer_copies: bool = True):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.index = shard_index
        self.spec = spec
        self.path = self.out_dir / shard_name(shard_index)
        self.tmp_path = tmp_path(self.path)
        self._schema = arrow_schema(spec)
        self._columns = columns(spec)
        self._fewer_copies = fewer_copies
        self._scratch: dict[str, torch.Tensor] | None = {} if fewer_copies else None  # reused by each batch
        with disk_errors(self.out_dir, 1 << 16):
            # The checksum is computed as the bytes are written.
            self._file = HashingFile(self.tmp_path, background=overlap_hash)
            self._sink = pa.PythonFile(self._file, mode="w")
            # No compression: shards are memory-mapped by the reader, which needs the raw bytes.
            self._writer = pa.ipc.new_file(self._sink, self._schema)
        self.committed = False

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, *exc_info) -> None:
        if not self.committed:
            try:
                self._close()
            except OSError:  # closing writes the footer, which fails again on a full disk; the file goes anyway
                pass
            finally:
                self.tmp_path.unlink(missing_ok=True)

    def write(self, rows: list[dict]) -> None:
        """Append `rows` as one record batch (each row: a dict with every column of the schema)."""
        if not rows:
            return
        sample_ids = [row["sample_id"] for row in rows]
        for row in rows:
            self._check_token_counts(row)
        arrays = [_column_array(column, [row[column.name] for row in rows], sample_ids, self._fewer_copies,
                                self._scratch) for column in self._columns]
        batch = pa.RecordBatch.from_arrays(arrays, schema=self._schema)
        # A full disk: a one-line error naming the directory and what this shard needs (the tmp file is deleted).
        with disk_errors(self.out_dir, lambda: self._sink.tell() + batch.nbytes):
            try:
                self._writer.write_batch(batch)
            finally:
                self._file.drain()  # the batch may share the caller's memory: hashed before the caller gets it back

    def _check_token_counts(self, row: dict) -> None:
        counts = {column.name: len(row[column.name]) + (int(row["prefix_len"]) if column.suffix_only else 0)
                  for column in self._columns if column.per_token and column.positions == "all"}
        if len(set(counts.values())) > 1:
            raise ValueError(f"sample {row['sample_id']!r}: per-token columns disagree on the token count {counts}")
        # Lists over the trainable positions hold one entry per t with loss_mask[t + 1] == 1.
        over_trainable = [column for column in self._columns if column.positions == "trainable"]
        trainable = int(torch.as_tensor(row["loss_mask"])[1:].sum()) if over_trainable else 0
        for column in over_trainable:
            if len(row[column.name]) != trainable:
                raise ValueError(f"sample {row['sample_id']!r}: {column.name} has {len(row[column.name])} rows, "
                                 f"but loss_mask[1:] marks {trainable} trainable positions")

    def commit(self, stats: dict, rejected: list[dict], extra: dict | None = None) -> Path:
        """Finish the shard: close it, write its sidecar (with the shard's checksum and `extra`), then rename it
        into place (the commit point)."""
        with disk_errors(self.out_dir, 1 << 16):
            self._close()
            commit_unit(self.tmp_path, self.path, self.out_dir / sidecar_name(self.index),
                        {"stats": stats, "rejected": rejected, **(extra or {})}, checksum=self._file.hexdigest())
        self.committed = True
        return self.path

    def _close(self) -> None:
        if not self._sink.closed:
            try:
                self._writer.close()
            finally:
                self._sink.close()


def _footer_opens(path: Path) -> bool:
    """True when the Arrow file is complete (a truncated file has no valid footer)."""
    try:
        with pa.memory_map(str(path)) as source:
            pa.ipc.open_file(source)
        return True
    except (pa.ArrowInvalid, OSError):
        return False


def finished_shards(out_dir: str | Path) -> dict[int, Path]:
    """Complete shards by index: final name present, sidecar present, and the Arrow footer opens."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return {}
    return {index: path for index, path in numbered_files(out_dir, _SHARD_PATTERN).items()
            if (out_dir / sidecar_name(index)).exists() and _footer_opens(path)}


def remove_partial(out_dir: str | Path) -> list[Path]:
    """Delete what a killed run left behind and return it.

    That is: `*.tmp` files, sidecars whose shard is not finished, and shard files whose footer
    does not open (damaged; re-running regenerates them).
    """
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return []
    finished = finished_shards(out_dir)
    damaged = [path for index, path in numbered_files(out_dir, _SHARD_PATTERN).items() if index not in finished
               and not _footer_opens(path)]
    return remove_unfinished(out_dir, _SIDECAR_PATTERN, finished, damaged)


def read_sidecar(out_dir: str | Path, index: int) -> dict:
    return read_unit_sidecar(Path(out_dir) / sidecar_name(index), f"shard {index}")
