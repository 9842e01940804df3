"""The store-once layout (`output.store_prefix_once=true`): each shared prefix's hidden states are stored once.

Every row keeps its full `input_ids` and `loss_mask`, but its hidden-state columns hold only tokens [prefix_len, T).
The states of its first `prefix_len` tokens are those of row `prefix_ref` of the same shard, which starts with the
same tokens (and may itself borrow the start of its own from an earlier row; -1 means no reference). Rows claim
shared prefixes in write order: the first row written under a prefix stores it and every later one refers to it, so
a shard stores each prefix segment of the unit's `PrefixPlan` once and every row's own suffix once. References
always point to earlier rows of the same shard: a shard stays self-contained, written and renamed as one file.

`specgen.open_shards` reassembles full rows (copies, where flat rows are zero-copy views), so readers and the
trainer see no difference. Tools that read the Arrow files directly (pyarrow, `datasets.load_dataset("arrow")`) see
the stored layout: hidden-state lists shorter than `input_ids` by `prefix_len`.
"""

from collections.abc import Callable, Sequence

import torch

from specgen.data.prefixes import PrefixPlan
from specgen.store.columns import ShardSpec, columns


class PrefixRefEncoder:
    """Turns full rows (in the order they are written to one shard) into store-once rows."""

    def __init__(self, plan: PrefixPlan, sequences: Sequence[Sequence[int]], spec: ShardSpec):
        self.plan = plan
        self._suffix_columns = [column.name for column in columns(spec) if column.suffix_only]  # states (+ fp8 scales)
        # A row's prefix depends on its tokens only, so rows are matched to the plan by their token sequence.
        self._node_of = {tuple(tokens): plan.sample_node[i] for i, tokens in enumerate(sequences)}
        self._owner: dict[int, int] = {}  # prefix node -> the row that stores its segment
        self.rows = 0
        self.tokens_stored = 0

    def encode(self, rows: list[dict]) -> list[dict]:
        encoded = []
        for row in rows:
            chain = self.plan.chain(self._node_of[tuple(row["input_ids"])])
            # The prefixes already stored are the top of the chain: a row stores a prefix's ancestors with it.
            stored = 0
            while stored < len(chain) and chain[stored] in self._owner:
                stored += 1
            if stored:
                borrowed = chain[stored - 1]
                prefix_ref, prefix_len = self._owner[borrowed], self.plan.nodes[borrowed].end
            else:
                prefix_ref, prefix_len = -1, 0
            for node in chain[stored:]:
                self._owner[node] = self.rows
            encoded.append({**row, "prefix_ref": prefix_ref, "prefix_len": prefix_len,
                            **{name: row[name][prefix_len:] for name in self._suffix_columns}})
            self.rows += 1
            self.tokens_stored += len(row["input_ids"]) - prefix_len
        return encoded


def reassemble_row(item: dict, stored_row: Callable[[int], dict], columns: Sequence[str]) -> dict:
    """The full row of a store-once `item`, given `stored_row(i)`: row i of the same shard as stored.

    Row r stores tokens [prefix_len_r, T); it borrows [prefix_len_q, prefix_len_r) from q = prefix_ref_r, and so on
    back to a row that borrows nothing. Only the stored slices are read; the result is one copy of each column.
    """
    item = dict(item)
    end, ref = int(item.pop("prefix_len")), int(item.pop("prefix_ref"))
    pieces = {name: [item[name]] for name in columns}
    while end > 0:
        source = stored_row(ref)
        start = int(source["prefix_len"])
        for name in columns:
            pieces[name].append(source[name][: end - start])
        end, ref = start, int(source["prefix_ref"])
    return {**item, **{name: torch.cat(pieces[name][::-1]) if len(pieces[name]) > 1 else pieces[name][0]
                       for name in columns}}


def bytes_flat(stats: dict, spec: ShardSpec) -> int:
    """What the shards would take in the flat layout: the stored bytes plus the hidden states of borrowed tokens."""
    state_bytes = (spec.num_aux + 1) * spec.hidden_size * spec.torch_dtype.itemsize
    return stats["bytes_on_disk"] + (stats["tokens_emitted"] - stats["tokens_stored"]) * state_bytes
