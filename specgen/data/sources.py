"""Stream rows out of a dataset file without loading it whole.

Supported sources: `.json` (a JSON array, or JSON lines saved as .json), `.jsonl`, `.parquet`, a folder
written by `datasets.Dataset.save_to_disk` (memory-mapped), a folder of such files (read in name order as
one source, e.g. the `part-*.jsonl` files `specgen.regenerate` writes), and a Hugging Face hub dataset named
`org/name` that is not a local path (`datasets.load_dataset(name, subset, split=split, streaming=True)`: from the
local cache when offline, HF_HUB_OFFLINE=1). A list of such sources (`data.path=[a.jsonl,b/]`) is read one after
another as one source. Each row comes back as a
`SourceRecord`; a row that cannot be read (a line that is not JSON, a value that is not an object)
carries a `RowError` instead of a record so the caller can reject that row and go on.
"""

import hashlib
import itertools
import json
import logging
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import pyarrow as pa
import pyarrow.parquet as pq

from specgen.errors import RowError, SpecgenError
from specgen.store.commit import HASH_ALGORITHM, checksum_problems

SUPPORTED = (".json (array or JSON lines), .jsonl, .parquet, a datasets save_to_disk folder, "
             "or a folder of such files")
FILE_KINDS = ("json", "jsonl", "parquet")
JSON_WHITESPACE = " \t\n\r"
PARQUET_BATCH_ROWS = 1024
log = logging.getLogger(__name__)
HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # org/name, as the hub spells dataset repositories


@dataclass
class SourceRecord:
    index: int  # 0-based row position in the source
    record: dict | None
    error: RowError | None


def source_paths(path) -> list:
    """data.path as a list of sources: one path, or each of a list's (Hydra's `data.path=[a,b]`)."""
    if isinstance(path, str | Path):
        return [path]
    paths = list(path)
    if not paths:
        raise SpecgenError("data.path=[] names no source: give a file, a folder, org/name, or a list of them")
    return paths


def describe_path(path) -> str:
    """A source for a summary line: the resolved path, or the resolved paths of a list joined by ' + '."""
    return " + ".join(str(p) if is_hub_name(p) else str(Path(p).resolve()) for p in source_paths(path))


def iter_records(path, *, chunk_size: int = 1 << 20, split: str = "train",
                 subset: str | None = None) -> Iterator[SourceRecord]:
    """Rows of `path` in order, read lazily. `chunk_size` is the characters read at a time from a JSON array;
    `split` and `subset` (data.split, data.subset) choose the part of a hub dataset named `org/name`. A list of
    paths reads each in turn as one source (row indices continue across them).

    The paths are checked now (so a wrong `data.path` fails before any work); rows are read on demand.
    """
    paths = source_paths(path)
    if len(paths) > 1:
        return _concatenated([iter_records(p, chunk_size=chunk_size, split=split, subset=subset) for p in paths],
                             [str(p) for p in paths])
    path = paths[0]
    if is_hub_name(path):
        return _hub_records(_load_hub_dataset(str(path), split, subset))
    path = Path(path)
    kind = _source_kind(path)
    if kind == "folder":
        return _folder_records(_folder_files(path, warn=True), chunk_size)
    return _file_records(path, kind, chunk_size)


def _file_records(path: Path, kind: str, chunk_size: int) -> Iterator[SourceRecord]:
    if kind == "json" and _starts_with_array(path):
        return _json_array_records(path, chunk_size)
    if kind in ("json", "jsonl"):
        return _json_lines_records(path)
    if kind == "parquet":
        return _parquet_records(_open_parquet(path))
    return _saved_dataset_records(_load_saved_dataset(path))


def _folder_files(path: Path, *, check: bool = True, warn: bool = False) -> list[Path]:
    """The data files of a folder source, in read order.

    A folder with a `manifest.json` listing `parts` (what `specgen.regenerate` writes) is read exactly as listed, so
    its sidecars, manifest and rejected rows are not taken for data, after checking the parts against the manifest's
    checksums. A `specgen.regenerate` output.dir without its manifest yet (a run still going, or stopped) gives its
    finished parts, checked against their sidecars (`warn`: and says so). Otherwise every data file (hidden files
    aside), in name order. `check=False` lists the same files without hashing them (for a kind check or a count:
    the read that follows checks them once).
    """
    manifest = path / "manifest.json"
    if manifest.exists():
        recorded = json.loads(manifest.read_text())
        if recorded.get("parts") is not None:
            files = {name: path / name for name in recorded["parts"]}
            return _checked_parts(path, files, recorded.get("checksums") or {}) if check else list(files.values())
    elif (finished := _finished_regeneration_parts(path, check)) is not None:
        if warn:
            log.warning("%s is an unfinished specgen.regenerate output (no manifest.json yet): reading its %d "
                        "finished parts (%s to %s) only; re-run specgen.regenerate with the same output.dir to "
                        "finish it", path, len(finished), finished[0].name, finished[-1].name)
        return finished
    return sorted(p for p in path.iterdir()
                  if p.is_file() and not p.name.startswith(".") and p.suffix.lower().lstrip(".") in FILE_KINDS)


def _finished_regeneration_parts(path: Path, check: bool = True) -> list[Path] | None:
    """The finished parts (a part and its sidecar) of a `specgen.regenerate` output.dir, in unit order, checked
    against the sidecars' checksums (when `check`); None when the folder holds none. A part being written (`*.tmp`)
    is not one."""
    from specgen.regen.parts import finished_parts, read_sidecar  # at call time: specgen.regen imports this module

    parts = finished_parts(path)
    if not parts:
        return None
    if not check:
        return list(parts.values())
    checksums = {part.name: read_sidecar(path, unit).get("checksum", {}).get(HASH_ALGORITHM)
                 for unit, part in parts.items()}
    return _checked_parts(path, {part.name: part for part in parts.values()}, checksums)


def _checked_parts(path: Path, files: dict[str, Path], checksums: dict[str, str | None]) -> list[Path]:
    damaged = checksum_problems(files, checksums)
    if damaged:
        raise SpecgenError(f"{path} has damaged parts: {'; '.join(damaged)}; delete them and re-run "
                           "specgen.regenerate with the same output.dir to regenerate them")
    return list(files.values())


def _folder_records(files: list[Path], chunk_size: int) -> Iterator[SourceRecord]:
    """The files' rows as one source: row indices continue across files; row errors name their file."""
    return _concatenated((_file_records(file, file.suffix.lower().lstrip("."), chunk_size) for file in files),
                         [file.name for file in files])  # each file opened when its turn comes


def _concatenated(sources: Iterable[Iterator[SourceRecord]], names: list[str]) -> Iterator[SourceRecord]:
    """Several sources' rows as one: row indices continue across them (over the rows each yields); row errors name
    their source."""
    offset = 0
    for source, name in zip(sources, names):
        count = 0
        for record in source:
            if record.error is not None:
                record.error = RowError(record.error.reason, f"{name} {record.error.message}")
            yield SourceRecord(offset + record.index, record.record, record.error)
            count = record.index + 1
        offset += count


def count_records(path, *, split: str = "train", subset: str | None = None) -> int | None:
    """Number of rows in `path` (all of a list's sources), cheaply, for a progress ETA; None when it cannot be known
    without failing."""
    paths = source_paths(path)
    if len(paths) > 1:
        counts = [count_records(p, split=split, subset=subset) for p in paths]
        return None if None in counts else sum(counts)
    path = paths[0]
    if is_hub_name(path):
        splits = _load_hub_dataset(str(path), split, subset).info.splits or {}
        return splits[split].num_examples if split in splits and splits[split].num_examples else None
    path = Path(path)
    kind = _source_kind(path)
    if kind == "folder":
        counts = [count_records(file) for file in _folder_files(path, check=False)]
        return None if None in counts else sum(counts)
    if kind == "json" and _starts_with_array(path):
        try:
            return sum(1 for _ in _json_array_records(path, 1 << 20))
        except SpecgenError:
            return None  # a broken array; iter_records reports where
    if kind in ("json", "jsonl"):
        with open(path, "rb") as f:
            return sum(1 for line in f if line.strip())
    if kind == "parquet":
        return _open_parquet(path).metadata.num_rows
    return len(_load_saved_dataset(path))


def _source_kind(path: Path) -> str:
    if not path.exists():
        raise SpecgenError(f"data.path {path} does not exist; point it at a {SUPPORTED}, or name a hub dataset "
                           "org/name")
    if path.is_dir():
        if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
            return "saved_dataset"
        if _folder_files(path, check=False):
            return "folder"
        raise SpecgenError(f"data.path {path} is a folder with neither a datasets save_to_disk layout "
                           f"(state.json) nor .json/.jsonl/.parquet files; point it at a {SUPPORTED}")
    kind = path.suffix.lower().lstrip(".")
    if kind not in ("json", "jsonl", "parquet"):
        raise SpecgenError(f"data.path {path} has unsupported type '{path.suffix}'; use a {SUPPORTED}")
    return kind


def _as_record(index: int, value: Any, where: str) -> SourceRecord:
    if isinstance(value, dict):
        return SourceRecord(index, value, None)
    error = RowError("not_an_object", f"{where}: expected a JSON object, got {type(value).__name__}")
    return SourceRecord(index, None, error)


def _json_lines_records(path: Path) -> Iterator[SourceRecord]:
    """One row per non-blank line; lines are decoded one by one so a bad line (or bad bytes) rejects only itself."""
    with open(path, "rb") as f:
        index = 0
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as error:
                message = f"line {line_number}: not valid JSON ({error.msg} at column {error.colno})"
                yield SourceRecord(index, None, RowError("invalid_json", message))
            except UnicodeDecodeError as error:
                yield SourceRecord(index, None, RowError("invalid_json", f"line {line_number}: not UTF-8 ({error})"))
            else:
                yield _as_record(index, value, f"line {line_number}")
            index += 1


def _starts_with_array(path: Path) -> bool:
    with open(path, "rb") as f:
        while chunk := f.read(4096):
            stripped = chunk.lstrip(JSON_WHITESPACE.encode())
            if stripped:
                return stripped.startswith(b"[")
    return False


def _json_array_records(path: Path, chunk_size: int) -> Iterator[SourceRecord]:
    index = 0
    try:
        with open(path, encoding="utf-8") as f:
            for value in _iter_json_array(f, chunk_size):
                yield _as_record(index, value, f"element {index}")
                index += 1
    except (_BrokenJson, UnicodeDecodeError) as error:
        raise SpecgenError(f"data.path {path}: the JSON array is broken at element {index} ({error}); a JSON "
                           "array must be valid as a whole, so fix the file or save it as JSON lines, where a "
                           "bad line only rejects that row") from None


class _BrokenJson(Exception):
    """The JSON array cannot be parsed further."""


class _ChunkedText:
    """A read buffer over a text file: `text[pos:]` is what has been read but not consumed yet."""

    def __init__(self, f: TextIO, chunk_size: int):
        self.f, self.chunk_size = f, chunk_size
        self.text, self.pos, self.offset = "", 0, 0  # offset: file characters dropped before `text`

    def read_more(self) -> bool:
        """Append the next chunk; False at end of file.

        The chunk is at least as long as the unconsumed text, so re-parsing an element that spans
        many chunks costs linear, not quadratic, time.
        """
        chunk = self.f.read(max(self.chunk_size, len(self.text) - self.pos))
        if not chunk:
            return False
        self.offset += self.pos
        self.text, self.pos = self.text[self.pos:] + chunk, 0
        return True

    def next_char(self) -> str | None:
        """Skip whitespace and return the next character without consuming it; None at end of file."""
        while True:
            while self.pos < len(self.text) and self.text[self.pos] in JSON_WHITESPACE:
                self.pos += 1
            if self.pos < len(self.text):
                return self.text[self.pos]
            if not self.read_more():
                return None

    def error(self, message: str, pos: int | None = None) -> _BrokenJson:
        where = self.offset + (self.pos if pos is None else pos)
        return _BrokenJson(f"{message} at character {where}")


def _iter_json_array(f: TextIO, chunk_size: int) -> Iterator[Any]:
    """Yield the elements of a top-level JSON array one by one, holding about one element in memory."""
    decoder = json.JSONDecoder()
    buffer = _ChunkedText(f, chunk_size)
    if buffer.next_char() != "[":
        raise buffer.error("expected '['")
    buffer.pos += 1
    if buffer.next_char() == "]":
        return
    while True:
        yield _decode_element(buffer, decoder)
        separator = buffer.next_char()
        if separator == "]":
            return
        if separator != ",":
            raise buffer.error(f"expected ',' or ']' after the element, found {separator!r}")
        buffer.pos += 1
        buffer.next_char()


def _decode_element(buffer: _ChunkedText, decoder: json.JSONDecoder) -> Any:
    while True:
        try:
            value, end = decoder.raw_decode(buffer.text, buffer.pos)
        except json.JSONDecodeError as error:
            if buffer.read_more():
                continue  # the element runs past the buffer
            raise buffer.error(error.msg, error.pos) from None
        # A number or literal that ends exactly at the buffer's end may continue in the next chunk.
        if end == len(buffer.text) and buffer.read_more():
            continue
        buffer.pos = end
        return value


def _open_parquet(path: Path) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(path)
    except pa.ArrowException as error:
        raise SpecgenError(f"data.path {path} is not a readable Parquet file ({error})") from None


def _parquet_records(parquet: pq.ParquetFile) -> Iterator[SourceRecord]:
    index = 0
    for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS):
        for row in batch.to_pylist():
            yield SourceRecord(index, row, None)
            index += 1


def _load_saved_dataset(path: Path):
    import datasets  # imported here: it is slow to import and only this source needs it

    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        raise SpecgenError(f"data.path {path} holds a DatasetDict with splits {list(loaded)}; point data.path "
                           f"at one split's folder, e.g. {path / next(iter(loaded))}")
    return loaded


def is_hub_name(path: str | Path) -> bool:
    """Whether data.path names a hub dataset (`org/name`, not a local path, no data-file suffix)."""
    text = str(path)
    return (bool(HUB_NAME.match(text)) and not Path(text).exists()
            and Path(text).suffix.lower().lstrip(".") not in FILE_KINDS)


def _load_hub_dataset(name: str, split: str, subset: str | None):
    """The split of hub dataset `name`, streamed (rows are read as iterated, nothing is loaded whole); offline
    (HF_HUB_OFFLINE=1) from the local datasets cache."""
    import datasets  # imported here: it is slow to import and only these sources need it

    try:
        loaded = datasets.load_dataset(name, subset, split=split, streaming=True)
    except (FileNotFoundError, ConnectionError, ValueError, datasets.exceptions.DatasetNotFoundError) as error:
        cause = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise SpecgenError(f"data.path {name} is not a local path, nor a hub dataset found in the local datasets "
                           f"cache ({datasets.config.HF_DATASETS_CACHE}) or on the hub with data.subset={subset} "
                           f"data.split={split}: {cause}; point data.path at a {SUPPORTED}, or at a hub dataset "
                           "loaded once online") from None
    return loaded


def _hub_records(dataset) -> Iterator[SourceRecord]:
    for index, row in enumerate(dataset):
        yield _as_record(index, row, f"row {index}")


def _saved_dataset_records(dataset) -> Iterator[SourceRecord]:
    for index, row in enumerate(dataset):  # memory-mapped Arrow: rows are read as they are iterated
        yield SourceRecord(index, row, None)


def work_units(records: Iterable[SourceRecord], shard_size: int) -> Iterator[tuple[int, list[SourceRecord]]]:
    """Split the stream into units of `shard_size` source rows; unit k always holds rows [k*S, (k+1)*S)."""
    for unit, group in itertools.groupby(records, key=lambda r: r.index // shard_size):
        yield unit, list(group)


SOURCE_DIGEST = "source_sha256"  # the sidecar entry of a unit's rows_digest


def rows_digest(records: Iterable[SourceRecord]) -> str:
    """sha256 of source rows as read (each row's position and JSON with sorted keys, or its read error): a finished
    unit's sidecar records it (`SOURCE_DIGEST`), so a re-run sees that the rows it was made from were edited."""
    digest = hashlib.sha256()
    for record in records:
        row = record.record if record.record is not None else {"error": str(record.error)}
        digest.update(json.dumps([record.index, row], sort_keys=True, ensure_ascii=False, default=str).encode())
        digest.update(b"\n")
    return digest.hexdigest()


def unit_rows(unit: int, shard_size: int, rows: float) -> float:
    """How many of a source's `rows` (math.inf: unbounded) work unit `unit` holds (`work_units`)."""
    return max(0, min(shard_size, rows - unit * shard_size))


@dataclass
class CappedSource:
    """A source read through `data.max_rows`: its records, the rows to expect and what the summary says."""

    records: Iterator[SourceRecord]
    expected_rows: int | None  # rows the run will read (None: unknown without reading the whole source)
    file_rows: int | None      # rows in the source
    max_rows: int | None
    sources: int = 1           # data.path's sources, read one after another (max_rows caps each)

    def describe(self, read: int) -> str:
        """'N source rows read (all)' or '... (stopped at data.max_rows=M; the source has K)'."""
        of = f" of {self.sources} sources" if self.sources > 1 else ""
        capped = self.max_rows is not None and (self.file_rows is None or self.expected_rows is None
                                                or self.file_rows > self.expected_rows)
        if capped:
            whole = f"; the source{'s have' if self.sources > 1 else ' has'} {self.file_rows:,}" \
                if self.file_rows is not None else ""
            each = " each" if self.sources > 1 else ""
            return f"{read:,} source rows read{of} (stopped at data.max_rows={self.max_rows}{each}{whole})"
        return f"{read:,} source rows read{of} (all of {self.file_rows:,})" if self.file_rows is not None else \
            f"{read:,} source rows read{of} (all)"


def capped_source(path, max_rows: int | None, *, split: str = "train", subset: str | None = None) -> CappedSource:
    """The records of `path`, the first `max_rows` when set (of each source, when `path` lists several); a wrong
    path fails here, before any model loads."""
    paths = source_paths(path)
    parts = [_capped_one(p, max_rows, split, subset) for p in paths]
    if len(parts) == 1:
        return parts[0]
    expected = [part.expected_rows for part in parts]
    file_rows = [part.file_rows for part in parts]
    return CappedSource(_concatenated([part.records for part in parts], [str(p) for p in paths]),
                        None if None in expected else sum(expected), None if None in file_rows else sum(file_rows),
                        max_rows, sources=len(parts))


def _capped_one(path, max_rows: int | None, split: str, subset: str | None) -> CappedSource:
    records = iter_records(path, split=split, subset=subset)
    file_rows = count_records(path, split=split, subset=subset)
    expected = file_rows
    if max_rows is not None:
        records = itertools.islice(records, max_rows)
        expected = min(file_rows, max_rows) if file_rows is not None else max_rows
    return CappedSource(records, expected, file_rows, max_rows)
