"""The data stage: read rows, normalise formats, apply the chat template and loss mask, batch."""

from specgen.data.batching import padding_efficiency, token_budget_batches
from specgen.data.formats import Conversation, Pretokenized, normalize, record_id
from specgen.data.prepare import PreparedRow, Rejection, prepare_rows
from specgen.data.sample import TokenizedSample
from specgen.data.sources import SourceRecord, count_records, iter_records
from specgen.data.template import ChatTemplateTokenizer, TokenizeResult, chat_template_sha256

__all__ = [
    "ChatTemplateTokenizer", "Conversation", "PreparedRow", "Pretokenized", "Rejection", "SourceRecord",
    "TokenizeResult", "TokenizedSample", "chat_template_sha256", "count_records", "iter_records", "normalize",
    "padding_efficiency", "prepare_rows", "record_id", "token_budget_batches",
]
