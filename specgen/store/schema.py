"""What a shard stores: the column set, its Arrow types, and the self-describing spec.

A shard is an Arrow IPC file with one row per sample and no padding: per-token columns are
`list<...>` whose length is the sample's token count T. Hidden states are stored in the target's
own dtype; bfloat16 (which Arrow lacks) is stored as its raw uint16 bit patterns, so a round trip
is bit-exact and the reader can hand the bytes back to torch with a `.view(torch.bfloat16)`.

To add a column (fp8 codes and scales, top-k logits, token log-probs, pooled vectors): give
`ShardSpec` the field that turns it on and append a `Column` in `columns()`. The writer and reader
are generic over `Column`, and the spec travels in the schema metadata, so old shards keep loading.
"""

import dataclasses
import json
from dataclasses import dataclass

import pyarrow as pa
import torch

from specgen.errors import SpecgenError

FORMAT_VERSION = 1
METADATA_KEY = b"specgen"

HIDDEN_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# Torch dtypes Arrow cannot represent are stored as unsigned integers of the same width holding
# their bit patterns; everything else maps to the Arrow type of the same name.
_BIT_PATTERN_STORAGE = {torch.bfloat16: torch.uint16, torch.float8_e4m3fn: torch.uint8,
                        torch.float8_e5m2: torch.uint8}
_ARROW_TYPES = {torch.uint8: pa.uint8(), torch.uint16: pa.uint16(), torch.int8: pa.int8(),
                torch.int32: pa.int32(), torch.int64: pa.int64(), torch.float16: pa.float16(),
                torch.float32: pa.float32()}


@dataclass(frozen=True)
class ShardSpec:
    """Everything needed to interpret a shard; stored in every shard's schema metadata.

    dtype is the target model's torch dtype name for hidden states; num_aux is the number of
    auxiliary layers concatenated along the feature axis of `aux_hidden_states`.
    """

    hidden_size: int
    num_aux: int
    dtype: str
    store_prefix_once: bool = False  # hidden states after prefix_len only; see specgen.store.prefix_layout

    def __post_init__(self):
        if self.dtype not in HIDDEN_DTYPES:
            raise SpecgenError(f"unsupported hidden-state dtype {self.dtype!r}: use one of {sorted(HIDDEN_DTYPES)}")
        if self.hidden_size < 1 or self.num_aux < 1:
            raise SpecgenError(f"invalid shard spec {self}: hidden_size and num_aux must be positive")

    @property
    def torch_dtype(self) -> torch.dtype:
        return HIDDEN_DTYPES[self.dtype]

    def to_metadata(self) -> dict[bytes, bytes]:
        fields = {"format_version": FORMAT_VERSION, **dataclasses.asdict(self)}
        return {METADATA_KEY: json.dumps(fields).encode()}

    @classmethod
    def from_schema(cls, schema: pa.Schema, where: str) -> "ShardSpec":
        """Read the spec back from a shard's schema; `where` names the file for error messages."""
        raw = (schema.metadata or {}).get(METADATA_KEY)
        if raw is None:
            raise SpecgenError(f"{where} is not a specgen shard (no '{METADATA_KEY.decode()}' schema metadata)")
        fields = json.loads(raw)
        version = fields.pop("format_version")
        if version > FORMAT_VERSION:
            raise SpecgenError(f"{where} has shard format version {version}, newer than this specgen "
                               f"understands ({FORMAT_VERSION}): upgrade specgen")
        return cls(**fields)


@dataclass(frozen=True)
class Column:
    """One stored field and how its values are laid out.

    dtype: torch dtype of the values, or `str` for a string column.
    per_token: the row holds one entry per token (a list of length T) rather than one per sample.
    width: None for a scalar entry, else a fixed-size vector of `width` values (a hidden state).
    load_as: dtype the reader casts to (a copy); None keeps the stored dtype, zero-copy.
    suffix_only: a per-token column holding only tokens [prefix_len, T) of the row (the store-once layout).
    """

    name: str
    dtype: torch.dtype | type[str]
    per_token: bool = True
    width: int | None = None
    load_as: torch.dtype | None = None
    suffix_only: bool = False

    @property
    def storage_dtype(self) -> torch.dtype:
        """The dtype whose bytes go to disk (bf16 -> uint16 bit patterns)."""
        return _BIT_PATTERN_STORAGE.get(self.dtype, self.dtype)

    def arrow_type(self) -> pa.DataType:
        if self.dtype is str:
            value_type = pa.string()
        else:
            value_type = _ARROW_TYPES[self.storage_dtype]
        if self.width is not None:
            value_type = pa.list_(value_type, self.width)
        return pa.list_(value_type) if self.per_token else value_type


def columns(spec: ShardSpec) -> list[Column]:
    """The stored columns, in file order. This is the one place the column set is defined."""
    once = spec.store_prefix_once
    return [
        Column("sample_id", str, per_token=False),
        Column("input_ids", torch.int32, load_as=torch.long),
        Column("loss_mask", torch.int8, load_as=torch.long),
        Column("aux_hidden_states", spec.torch_dtype, width=spec.num_aux * spec.hidden_size, suffix_only=once),
        Column("last_hidden_state", spec.torch_dtype, width=spec.hidden_size, suffix_only=once),
    ] + ([
        # The row's first prefix_len tokens have the states of row prefix_ref (-1: none) of the same shard.
        Column("prefix_ref", torch.int32, per_token=False),
        Column("prefix_len", torch.int32, per_token=False),
    ] if once else [])


def arrow_schema(spec: ShardSpec) -> pa.Schema:
    fields = [pa.field(column.name, column.arrow_type(), nullable=False) for column in columns(spec)]
    return pa.schema(fields, metadata=spec.to_metadata())
