"""What a shard stores: the column set, its Arrow types, and the self-describing spec.

A shard is an Arrow IPC file with one row per sample and no padding: per-token columns are
`list<...>` whose length is the sample's token count T. Hidden states are stored in the target's
own dtype; bfloat16 (which Arrow lacks) is stored as its raw uint16 bit patterns, so a round trip
is bit-exact and the reader can hand the bytes back to torch with a `.view(torch.bfloat16)`.

To add a column (fp8 codes and scales, top-k logits, token log-probs, pooled vectors): give
`ShardSpec` the field that turns it on and append a `Column` in `columns()`. The writer and reader
are generic over `Column`, and the spec travels in the schema metadata, so old shards keep loading.

The optional outputs (all off by default; see `specgen.capture.outputs` and `specgen.store.fp8`):

* codec "fp8": hidden states as float8 e4m3 codes (uint8 bit patterns) plus float32 scales,
  `aux_hidden_states_scale` [T, k] (one per token per aux layer) and `last_hidden_state_scale` [T];
* logits "topk": `topk_values` [n, K] (target dtype, descending) and `topk_indices` [n, K] (int32);
  logits "full": `logits` [n, V]; n counts the positions t with loss_mask[t + 1] == 1, in order;
* token_logprobs: `token_logprobs` [T] float32 (log p(x[t+1] | x[<=t]), NaN at t = T-1) and
  `mean_logprob` (float32 scalar, over the trainable tokens);
* pooled: `pooled_hidden_state` [H] float32.
"""

import dataclasses
import json
from dataclasses import dataclass

import pyarrow as pa
import torch

from specgen.errors import SpecgenError

# 2: the optional output fields of ShardSpec (codec, logits, token_logprobs, pooled); version 1
# shards have none of them and load with their defaults.
FORMAT_VERSION = 2
METADATA_KEY = b"specgen"

HIDDEN_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
CODECS = ("none", "fp8")  # none: hidden states bit-exact in `dtype`; fp8: e4m3 codes + per-token scales
LOGITS = ("none", "topk", "full")
POOLED = ("none", "mean", "mean_trainable", "last")

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
    auxiliary layers concatenated along the feature axis of `aux_hidden_states`. The remaining
    fields switch on optional columns and default to off, which is what version 1 shards hold.
    """

    hidden_size: int
    num_aux: int
    dtype: str
    codec: str = "none"          # how hidden states are stored (CODECS)
    logits: str = "none"         # target logits at the trainable positions (LOGITS)
    topk: int = 0                # K of `topk_values` / `topk_indices` when logits == "topk"
    vocab_size: int = 0          # width of `logits` when logits == "full"
    token_logprobs: bool = False  # `token_logprobs` [T] and `mean_logprob`
    pooled: str = "none"         # how `pooled_hidden_state` pools (POOLED)
    store_prefix_once: bool = False  # hidden states after prefix_len only; see specgen.store.prefix_layout

    def __post_init__(self):
        if self.dtype not in HIDDEN_DTYPES:
            raise SpecgenError(f"unsupported hidden-state dtype {self.dtype!r}: use one of {sorted(HIDDEN_DTYPES)}")
        if self.hidden_size < 1 or self.num_aux < 1:
            raise SpecgenError(f"invalid shard spec {self}: hidden_size and num_aux must be positive")
        for name, allowed in (("codec", CODECS), ("logits", LOGITS), ("pooled", POOLED)):
            if getattr(self, name) not in allowed:
                raise SpecgenError(f"invalid shard spec: {name}={getattr(self, name)!r}, use one of {list(allowed)}")
        if (self.logits == "topk") != (self.topk > 0) or (self.logits == "full") != (self.vocab_size > 0):
            raise SpecgenError(f"invalid shard spec {self}: topk > 0 goes with logits='topk' and vocab_size > 0 "
                               "with logits='full'")

    @property
    def torch_dtype(self) -> torch.dtype:
        return HIDDEN_DTYPES[self.dtype]

    @property
    def stored_dtype(self) -> torch.dtype:
        """The dtype of the stored hidden-state values: the target's, or float8 e4m3 codes."""
        return torch.float8_e4m3fn if self.codec == "fp8" else self.torch_dtype

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
    positions: which positions a per-token list covers: "all" (length T) or "trainable" (the
        positions t with loss_mask[t + 1] == 1, whose hidden state predicts a trained token).
    suffix_only: a per-token column holding only tokens [prefix_len, T) of the row (the store-once layout).
    """

    name: str
    dtype: torch.dtype | type[str]
    per_token: bool = True
    width: int | None = None
    load_as: torch.dtype | None = None
    positions: str = "all"
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
        Column("aux_hidden_states", spec.stored_dtype, width=spec.num_aux * spec.hidden_size, suffix_only=once),
        Column("last_hidden_state", spec.stored_dtype, width=spec.hidden_size, suffix_only=once),
    ] + _optional_columns(spec) + ([
        # The row's first prefix_len tokens have the states of row prefix_ref (-1: none) of the same shard.
        Column("prefix_ref", torch.int32, per_token=False),
        Column("prefix_len", torch.int32, per_token=False),
    ] if once else [])


def _optional_columns(spec: ShardSpec) -> list[Column]:
    optional = []
    if spec.codec == "fp8":  # scales travel with their hidden states, so store-once keeps only the suffix's too
        optional += [Column("aux_hidden_states_scale", torch.float32, width=spec.num_aux,
                            suffix_only=spec.store_prefix_once),
                     Column("last_hidden_state_scale", torch.float32, suffix_only=spec.store_prefix_once)]
    if spec.logits == "topk":
        optional += [Column("topk_values", spec.torch_dtype, width=spec.topk, positions="trainable"),
                     Column("topk_indices", torch.int32, width=spec.topk, positions="trainable",
                            load_as=torch.long)]
    if spec.logits == "full":
        optional.append(Column("logits", spec.torch_dtype, width=spec.vocab_size, positions="trainable"))
    if spec.token_logprobs:
        optional += [Column("token_logprobs", torch.float32), Column("mean_logprob", torch.float32, per_token=False)]
    if spec.pooled != "none":
        optional.append(Column("pooled_hidden_state", torch.float32, per_token=False, width=spec.hidden_size))
    return optional


def arrow_schema(spec: ShardSpec) -> pa.Schema:
    fields = [pa.field(column.name, column.arrow_type(), nullable=False) for column in columns(spec)]
    return pa.schema(fields, metadata=spec.to_metadata())
