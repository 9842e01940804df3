"""Read shards as a map-style torch Dataset backed by memory maps.

Hidden states come back as read-only tensors that point into the memory-mapped shard files, so
opening terabytes of data costs page faults, not RAM. Clone a tensor before modifying it in place.
"""

import bisect
import json
import os
import re
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import Dataset

from specgen.errors import SpecgenError
from specgen.store import fp8
from specgen.store.manifest import MANIFEST, read_manifest
from specgen.store.prefix_layout import reassemble_row
from specgen.store.columns import Column, ShardSpec, arrow_schema, columns
from specgen.store.commit import HASH_ALGORITHM, checksum_problems
from specgen.store.writer import finished_shards, sidecar_name

HIDDEN_STATES = ("aux_hidden_states", "last_hidden_state")
_SHARD_NUMBER = re.compile(r"shard-(\d{5,})\.arrow")


def _zero_copy_numpy(array: pa.Array) -> np.ndarray:
    """The values of a primitive Arrow array as a numpy view of its buffer (no copy)."""
    return array.to_numpy(zero_copy_only=True)


def _as_tensor(values: np.ndarray, column: Column) -> torch.Tensor:
    with warnings.catch_warnings():
        # The view is read-only because the mapping is; torch warns about that on every call.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        tensor = torch.from_numpy(values)
    if column.storage_dtype != column.dtype:
        tensor = tensor.view(column.dtype)
    return tensor.to(column.load_as) if column.load_as is not None else tensor


class _BatchColumns:
    """Zero-copy numpy views of one record batch's columns, sliced per sample on demand."""

    def __init__(self, batch: pa.RecordBatch, spec_columns: list[Column]):
        self._columns = spec_columns
        self._strings = {}
        self._values = {}
        self._offsets = {}
        for column in spec_columns:
            array = batch.column(column.name)
            if column.dtype is str:
                self._strings[column.name] = array
                continue
            if column.per_token:
                self._offsets[column.name] = _zero_copy_numpy(array.offsets)
                array = array.values
            if column.width is not None:
                values = _zero_copy_numpy(array.flatten()).reshape(-1, column.width)
            else:
                values = _zero_copy_numpy(array)
            self._values[column.name] = values

    def strings(self, name: str) -> list[str]:
        """Every row's value of the string column `name`."""
        return self._strings[name].to_pylist()

    def row(self, index: int) -> dict:
        item = {}
        for column in self._columns:
            if column.dtype is str:
                item[column.name] = self._strings[column.name][index].as_py()
                continue
            values = self._values[column.name]
            if column.per_token:
                offsets = self._offsets[column.name]
                values = values[offsets[index]:offsets[index + 1]]
            else:
                values = values[index, ...]  # a 0-d or 1-d view, never a numpy scalar: torch.from_numpy needs an array
            item[column.name] = _as_tensor(values, column)
        return item


def check_dataset_path(path: Path, key: str | None = None) -> None:
    """A dataset is a folder (a specgen output directory) or one shard file; anything else is refused here, naming
    `key` (the setting that gave the path, e.g. "data.shards") where there is one."""
    if not (path.is_file() or path.is_dir()):
        given = f"{key}={path}" if key else str(path)
        raise SpecgenError(f"{given} does not exist: pass a specgen output directory or one shard file")


def _shard_paths(path: Path) -> tuple[list[Path], dict | None]:
    check_dataset_path(path)
    if path.is_file():
        return [path], None
    if (path / MANIFEST).exists():
        manifest = read_manifest(path)
        if "shards" not in manifest:
            raise SpecgenError(f"{path / MANIFEST} has no 'shards' list: re-run the same command to rewrite it")
        shards = [path / name for name in manifest["shards"]]
        missing = [str(shard) for shard in shards if not shard.exists()]
        if missing:
            raise SpecgenError(f"{path / MANIFEST} lists shards that are missing: {', '.join(missing)}; "
                               "re-run the same command to regenerate them")
        return shards, manifest
    shards = list(finished_shards(path).values())
    if not shards:
        raise SpecgenError(f"no finished shards in {path}: finish it with specgen generate (the same command and "
                           "output.dir resume an interrupted run)")
    return shards, None


def _open_shard(path: Path) -> pa.ipc.RecordBatchFileReader:
    try:
        return pa.ipc.open_file(pa.memory_map(str(path)))
    except (pa.ArrowInvalid, OSError) as error:
        raise SpecgenError(f"cannot open shard {path} ({error}): it is damaged; delete it and re-run "
                           "the same command to regenerate it") from error


class ShardDataset(Dataset):
    """All samples of a list of shards, in shard order; items are dicts of tensors (see `open_shards`)."""

    def __init__(self, shard_paths: list[Path], manifest: dict | None = None, dtype: torch.dtype | None = None):
        self.shard_paths = list(shard_paths)
        self.manifest = manifest
        self.dtype = dtype
        self.spec: ShardSpec | None = None
        self._batch_locations: list[tuple[int, int]] = []  # (shard, record batch) in order
        self._batch_starts: list[int] = []  # first sample index of each record batch
        self._lengths: list[int] = []
        self._shard_starts: list[int] = []  # first sample index of each shard (prefix_ref is shard-local)
        for shard, path in enumerate(self.shard_paths):
            reader = _open_shard(path)
            self._check_spec(reader.schema, path)
            self._shard_starts.append(len(self._lengths))
            for batch_index in range(reader.num_record_batches):
                offsets = _zero_copy_numpy(reader.get_batch(batch_index).column("input_ids").offsets)
                self._batch_locations.append((shard, batch_index))
                self._batch_starts.append(len(self._lengths))
                self._lengths.extend(np.diff(offsets).tolist())
        self._columns = columns(self.spec)
        self._reset_open_files()

    def _check_spec(self, schema: pa.Schema, path: Path) -> None:
        spec = ShardSpec.from_schema(schema, str(path))
        if self.spec is None:
            self.spec = spec
        elif spec != self.spec:
            raise SpecgenError(f"{path} was written with {spec}, but {self.shard_paths[0]} with {self.spec}: "
                               "read shards of one run together")
        if not schema.equals(arrow_schema(spec)):
            raise SpecgenError(f"{path} has columns that do not match its spec {spec}: "
                               "it was not written by this version of specgen")

    def _reset_open_files(self) -> None:
        # Memory maps belong to one process; a DataLoader worker re-opens its own on first use.
        self._pid = os.getpid()
        self._readers: dict[int, pa.ipc.RecordBatchFileReader] = {}
        self._batches: dict[tuple[int, int], _BatchColumns] = {}

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        for key in ("_readers", "_batches", "_pid"):
            del state[key]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._reset_open_files()

    def __len__(self) -> int:
        return len(self._lengths)

    def lengths(self) -> list[int]:
        """Token count of every sample (for length-bucketed batching); reads no hidden states."""
        return list(self._lengths)

    def sample_ids(self) -> list[str]:
        """`sample_id` of every sample, in order; reads no hidden states."""
        return [value for number in range(len(self._batch_locations))
                for value in self._batch(number).strings("sample_id")]

    def __getitem__(self, index: int) -> dict:
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"sample index {index} out of range for {len(self)} samples")
        item = self._stored_row(index)
        if self.spec.store_prefix_once:  # reassemble the stored codes first: fp8 scales travel with them
            shard_start = self._shard_starts[bisect.bisect_right(self._shard_starts, index) - 1]
            item = reassemble_row(item, lambda row: self._stored_row(shard_start + row),
                                  [column.name for column in self._columns if column.suffix_only])
        return self._hidden_in_dtype(item)

    def _stored_row(self, index: int) -> dict:
        batch_number = bisect.bisect_right(self._batch_starts, index) - 1
        return self._batch(batch_number).row(index - self._batch_starts[batch_number])

    def _hidden_in_dtype(self, item: dict) -> dict:
        """Decode fp8 hidden states (bf16 unless `dtype` says otherwise); cast others when `dtype` is given."""
        for name in HIDDEN_STATES:
            if self.spec.codec == "fp8":
                scales = item.pop(f"{name}_scale")
                scales = scales.unsqueeze(-1) if scales.dim() == 1 else scales
                item[name] = fp8.decode(item[name], scales, self.dtype or torch.bfloat16)
            elif self.dtype is not None:
                item[name] = item[name].to(self.dtype)
        return item

    def _batch(self, batch_number: int) -> _BatchColumns:
        if self._pid != os.getpid():
            self._reset_open_files()
        location = self._batch_locations[batch_number]
        if location not in self._batches:
            shard, batch_index = location
            if shard not in self._readers:
                self._readers[shard] = _open_shard(self.shard_paths[shard])
            self._batches[location] = _BatchColumns(self._readers[shard].get_batch(batch_index), self._columns)
        return self._batches[location]


def shard_checksum_problems(shard_paths: list[Path], manifest: dict | None) -> list[str]:
    """One line per shard whose bytes differ from the checksum recorded at commit (the manifest's, else the
    sidecar's); shards with no recorded checksum are not checked."""
    if manifest is not None:
        expected = manifest.get("checksums") or {}
    else:
        expected = {}
        for path in shard_paths:
            match = _SHARD_NUMBER.fullmatch(path.name)
            sidecar = path.with_name(sidecar_name(int(match.group(1)))) if match else None
            if sidecar is not None and sidecar.exists():
                expected[path.name] = json.loads(sidecar.read_text()).get("checksum", {}).get(HASH_ALGORITHM)
    return checksum_problems({path.name: path for path in shard_paths}, expected)


def open_shards(path: str | Path, dtype: torch.dtype | None = None, verify: bool = False) -> ShardDataset:
    """Open an output directory (its manifest's shards, else its finished shards) or one shard file.

    Items: `sample_id` (str), `input_ids` and `loss_mask` (LongTensor [T]), `aux_hidden_states`
    ([T, num_aux * hidden]) and `last_hidden_state` ([T, hidden]) in the stored dtype, memory-mapped,
    plus the optional columns the run stored (`ShardSpec`; e.g. `token_logprobs`, `topk_values`).
    Shards in the store-once layout (`output.store_prefix_once`) come back as the same full rows, reassembled
    from their stored prefix references (copies rather than views).

    dtype: the dtype the hidden states come back in. None keeps the stored dtype zero-copy; fp8
    shards are always decoded (a copy), to bfloat16 unless `dtype` asks for another.
    verify: first check every shard's bytes against the checksum recorded when it was committed (reads every
    byte once) and raise naming each damaged shard.
    """
    shard_paths, manifest = _shard_paths(Path(path))
    if verify:
        damaged = shard_checksum_problems(shard_paths, manifest)
        if damaged:
            raise SpecgenError(f"damaged shards in {path}: {'; '.join(damaged)}; delete them and re-run the "
                               "generate command with the same output.dir to regenerate them")
    return ShardDataset(shard_paths, manifest, dtype=dtype)
