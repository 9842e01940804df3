"""Shared token prefixes of a work unit: the prefix tree that lets capture compute (and store) each prefix once.

A causal model's state at token t depends on tokens 0..t only, so samples that start with the same tokens have the
same states there: one system prompt before every conversation, or one row per assistant turn, each repeating the
whole earlier conversation. Sorting the samples' token sequences puts samples with a common prefix next to each
other, and the longest common prefix (LCP) of sorted neighbours is all it takes to build the compressed prefix tree:
the samples sharing more than d tokens form runs of neighbours whose LCPs all exceed d.

A `PrefixNode` is a prefix shared by at least two samples. It continues the prefix of its parent node, so running it
costs only its own segment, tokens [start, end), given the parent's KV cache. A shared prefix is kept only when its
segment has at least `min_tokens` tokens (shorter ones cost an extra forward for little gain); samples and prefixes
under a dropped one continue from the nearest kept ancestor instead. The plan depends on the token sequences alone,
so it is the same for a work unit whatever process computes it.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from specgen.errors import SpecgenError


@dataclass(frozen=True)
class PrefixNode:
    """Tokens [0, end) shared by every sample below this node; [start, end) is its own segment."""

    start: int  # the parent's end (0 for a prefix that starts the sequence)
    end: int
    parent: int | None  # index of the node this one continues
    source: int  # a sample holding the prefix (where its tokens are read from)
    level: int  # number of kept ancestors


@dataclass
class PrefixPlan:
    """The kept shared prefixes of a list of samples and which one each sample continues from."""

    nodes: list[PrefixNode]  # parents come before their children
    sample_node: list[int | None]  # the longest kept prefix of each sample; None: it starts from scratch
    lengths: list[int]  # tokens of each sample

    def chain(self, node: int | None) -> list[int]:
        """The nodes from the top-level prefix down to `node` (empty for None)."""
        chain = []
        while node is not None:
            chain.append(node)
            node = self.nodes[node].parent
        return chain[::-1]

    def prefix_length(self, sample: int) -> int:
        """Tokens of `sample` covered by its reused prefix (0 when it has none)."""
        node = self.sample_node[sample]
        return 0 if node is None else self.nodes[node].end

    @property
    def tokens_computed(self) -> int:
        """Tokens run through the target: every kept prefix segment once, plus every sample's own suffix."""
        segments = sum(node.end - node.start for node in self.nodes)
        return segments + sum(length - self.prefix_length(i) for i, length in enumerate(self.lengths))

    @property
    def tokens_emitted(self) -> int:
        return sum(self.lengths)

    def top_level(self, node: int) -> int:
        while self.nodes[node].parent is not None:
            node = self.nodes[node].parent
        return node


def _common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def plan_prefixes(sequences: Sequence[Sequence[int]], min_tokens: int) -> PrefixPlan:
    """Build the prefix tree of `sequences` and keep the shared prefixes worth reusing (see the module doc)."""
    if min_tokens < 1:
        raise SpecgenError(f"capture.prefix_min_tokens must be at least 1, got {min_tokens}")
    order = sorted(range(len(sequences)), key=lambda i: sequences[i])  # stable: equal sequences keep input order
    # lcp[k]: tokens shared by the sorted neighbours k-1 and k
    lcp = [0] + [_common_prefix_length(sequences[order[k - 1]], sequences[order[k]]) for k in range(1, len(order))]
    nodes: list[PrefixNode] = []
    sample_node: list[int | None] = [None] * len(sequences)
    # Groups of sorted samples [lo, hi) that all share `shared` tokens and continue the kept node `parent`.
    groups = [(0, len(order), None, 0)]
    while groups:
        lo, hi, parent, shared = groups.pop()
        start = nodes[parent].end if parent is not None else 0
        level = nodes[parent].level + 1 if parent is not None else 0
        run_start = lo
        for k in range(lo + 1, hi + 1):
            if k < hi and lcp[k] > shared:
                continue  # sample k shares more than `shared` tokens with k-1: same run
            if k - run_start == 1:
                sample_node[order[run_start]] = parent
            else:
                deeper = min(lcp[run_start + 1:k])
                child = parent
                if deeper - start >= min_tokens:
                    nodes.append(PrefixNode(start, deeper, parent, order[run_start], level))
                    child = len(nodes) - 1
                groups.append((run_start, k, child, deeper))
            run_start = k
    return PrefixPlan(nodes, sample_node, [len(s) for s in sequences])
