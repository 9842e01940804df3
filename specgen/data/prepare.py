"""Source rows -> tokenized samples, with every unusable row accounted for as a `Rejection`."""

from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass

from specgen.data.formats import normalize, record_id
from specgen.data.sample import TokenizedSample
from specgen.data.sources import SourceRecord
from specgen.data.template import DROP_MESSAGES, ChatTemplateTokenizer
from specgen.errors import RowError, SpecgenError

ON_BAD_ROW = ("skip", "fail")


@dataclass
class Rejection:
    """One line of `rejected.jsonl`: which row (or per-turn sample) was left out and why."""

    source_index: int
    sample_id: str | None
    reason: str
    message: str

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class PreparedRow:
    source_index: int
    samples: list[TokenizedSample]
    rejections: list[Rejection]


def prepare_rows(records: Iterable[SourceRecord], tokenizer: ChatTemplateTokenizer, *,
                 on_bad_row: str = "skip") -> Iterator[PreparedRow]:
    """Normalise and tokenize each source row, in order, one `PreparedRow` per row.

    A bad row yields no samples and its rejection; with on_bad_row="fail" it raises `SpecgenError`
    instead. Per-turn rows dropped by truncation are logged as rejections but never fail the run:
    they are a consequence of max_length, not a malformed input.
    """
    if on_bad_row not in ON_BAD_ROW:
        raise SpecgenError(f"data.on_bad_row must be one of {list(ON_BAD_ROW)}, got {on_bad_row!r}")
    for source in records:
        sample_id = None if source.record is None else record_id(source.record)
        try:
            if source.error is not None:
                raise source.error
            result = tokenizer.tokenize(normalize(source.record), source.index)
        except RowError as error:
            if on_bad_row == "fail":
                raise SpecgenError(f"row {source.index} (id {sample_id}) is unusable: {error.reason}: "
                                   f"{error.message}; fix it or set data.on_bad_row=skip to log it in "
                                   "rejected.jsonl and go on") from None
            yield PreparedRow(source.index, [], [Rejection(source.index, sample_id, error.reason, error.message)])
            continue
        dropped = [Rejection(source.index, row_id, reason, DROP_MESSAGES[reason]) for row_id, reason in result.dropped]
        yield PreparedRow(source.index, result.samples, dropped)
