"""Capture a work unit with shared-prefix reuse: every kept prefix runs through the target once, and every sample
continues from its prefix's KV cache.

`specgen.data.prefixes.plan_prefixes` gives the prefix tree. Because the model is causal, a prefix's states are the
same in every sample that starts with it, so a sample's row is its prefix chain's states followed by the states of
its own suffix, computed with the chain's keys and values as the past (`specgen.capture.kv`). Rows come out exactly
as a full forward would give them (within the dtype's rounding: a batch of other shapes runs other kernels).

Work runs in waves of whole prefix trees whose KV (the prefix segments, kept on the device until the wave ends)
fits `cache_tokens`; within a wave, level by level: level 0 runs the top-level prefixes and the samples that share
no prefix from position 0, level k the prefixes and sample suffixes that continue a level k-1 prefix. Each level is
split into batches like the plain path (longest first, `batch_tokens` bounding batch size x (past + new tokens), so
attention spans no more than the plain path's).
"""

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from specgen.capture.kv import LayerKV, PastKV
from specgen.capture.target import TargetCapture
from specgen.data.batching import pad_right
from specgen.data.prefixes import PrefixPlan
from specgen.data.sample import TokenizedSample


@dataclass(frozen=True)
class _Item:
    """One row of a forward batch: tokens [start, end) of `samples[source]`, continuing prefix node `past`."""

    source: int
    start: int
    end: int
    past: int | None
    node: int | None = None  # the prefix node whose segment this is (its KV and states are kept)

    def __len__(self) -> int:
        return self.end - self.start


def capture_with_prefix_reuse(capture: TargetCapture, samples: Sequence[TokenizedSample], plan: PrefixPlan, *,
                              batch_tokens: int, max_batch_size: int, cache_tokens: int, pad_id: int,
                              device: torch.device) -> Iterator[tuple[list[dict], int]]:
    """Yield (finished rows, padded tokens forwarded) per batch, like the plain path; rows hold full states."""
    run = _UnitRun(capture, samples, plan, batch_tokens, max_batch_size, pad_id, device)
    for wave, trees in enumerate(_waves(plan, cache_tokens)):
        yield from run.wave(trees, with_unshared=wave == 0)


def _waves(plan: PrefixPlan, cache_tokens: int) -> list[set[int]]:
    """Top-level prefixes grouped so that each group's prefix KV fits `cache_tokens` (a larger tree goes alone)."""
    cost: dict[int, int] = {}
    for index, node in enumerate(plan.nodes):
        top = plan.top_level(index)
        cost[top] = cost.get(top, 0) + node.end - node.start
    waves, used = [set()], 0
    for top, tokens in cost.items():
        if waves[-1] and used + tokens > cache_tokens:
            waves.append(set())
            used = 0
        waves[-1].add(top)
        used += tokens
    return waves


class _UnitRun:
    """The state of one work unit's capture: the plan, and the current wave's prefix KV (device) and states (CPU)."""

    def __init__(self, capture, samples, plan, batch_tokens, max_batch_size, pad_id, device):
        self.capture, self.samples, self.plan = capture, samples, plan
        self.batch_tokens, self.max_batch_size = batch_tokens, max_batch_size
        self.pad_id, self.device = pad_id, device
        self.kv: dict[int, list[LayerKV]] = {}  # prefix node -> its segment's keys/values per layer
        self.states: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # prefix node -> its segment's (aux, last)

    def wave(self, trees: set[int], with_unshared: bool) -> Iterator[tuple[list[dict], int]]:
        plan = self.plan
        nodes = [i for i in range(len(plan.nodes)) if plan.top_level(i) in trees]
        suffixes = [_Item(i, plan.prefix_length(i), len(sample), plan.sample_node[i])
                    for i, sample in enumerate(self.samples)
                    if (with_unshared if plan.sample_node[i] is None else plan.top_level(plan.sample_node[i]) in trees)]
        for level in range(max((plan.nodes[i].level for i in nodes), default=-1) + 2):
            segments = [_Item(plan.nodes[i].source, plan.nodes[i].start, plan.nodes[i].end, plan.nodes[i].parent, i)
                        for i in nodes if plan.nodes[i].level == level]
            for batch in self._batches(segments):
                _, _, padded = self._forward(batch, keep_kv=True)
                yield [], padded
            level_suffixes = [item for item in suffixes if self._level(item.past) == level]
            # A sample that is exactly a shared prefix (a duplicate, or a prefix of another sample) computes nothing.
            empty = [item for item in level_suffixes if not len(item)]
            if empty:
                yield [self._row(item, None) for item in empty], 0
            for batch in self._batches([item for item in level_suffixes if len(item)]):
                aux, last, padded = self._forward(batch, keep_kv=False)
                yield [self._row(item, (aux[b, :len(item)], last[b, :len(item)])) for b, item in enumerate(batch)], padded
        self.kv, self.states = {}, {}

    def _level(self, node: int | None) -> int:
        return 0 if node is None else self.plan.nodes[node].level + 1

    def _batches(self, items: list[_Item]) -> list[list[_Item]]:
        """Longest first; each batch keeps batch size x (longest past + longest new) within the token budget."""
        batches: list[list[_Item]] = []
        longest_past = 0
        for item in sorted(items, key=lambda it: (-len(it), -it.start, it.source)):
            if batches:
                batch = batches[-1]
                span = max(longest_past, item.start) + len(batch[0])
                if (len(batch) + 1) * span <= self.batch_tokens and len(batch) < self.max_batch_size:
                    batch.append(item)
                    longest_past = max(longest_past, item.start)
                    continue
            batches.append([item])
            longest_past = item.start
        return batches

    def _forward(self, batch: list[_Item], keep_kv: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Run one batch; return its states on the CPU and its padded size. With keep_kv, the prefix segments it
        computes keep their keys/values and states for the levels below."""
        lengths = [len(item) for item in batch]
        input_ids = pad_right([self.samples[item.source].input_ids[item.start:item.end] for item in batch],
                              self.pad_id)
        past = None
        if batch[0].past is not None:  # level 0 continues nothing, every deeper level continues a prefix
            past = PastKV(lengths=torch.tensor([item.start for item in batch], device=self.device),
                          layer=self._past_layer([item.past for item in batch]))
        result = self.capture(input_ids.to(self.device), torch.tensor(lengths, device=self.device), past=past,
                              keep_kv=keep_kv)
        aux, last = result.aux_hidden_states.cpu(), result.last_hidden_state.cpu()
        for b, item in enumerate(batch):
            if item.node is not None:
                n = len(item)
                self.kv[item.node] = [(keys[b, :, :n].clone(), values[b, :, :n].clone()) for keys, values in result.kv]
                self.states[item.node] = (aux[b, :n].clone(), last[b, :n].clone())
        return aux, last, len(batch) * max(lengths)

    def _past_layer(self, pasts: list[int]):
        """Layer -> the batch's past keys/values: each row's prefix chain concatenated, right-padded."""
        rows_by_node: dict[int, list[int]] = {}
        for b, node in enumerate(pasts):
            rows_by_node.setdefault(node, []).append(b)
        chains = {node: self.plan.chain(node) for node in rows_by_node}
        longest = max(self.plan.nodes[node].end for node in rows_by_node)

        def layer(index: int) -> LayerKV:
            first_keys = self.kv[pasts[0]][index][0]
            shape = (len(pasts), first_keys.shape[0], longest, first_keys.shape[2])
            keys, values = first_keys.new_zeros(shape), first_keys.new_zeros(shape)
            for node, rows in rows_by_node.items():
                chain_keys = torch.cat([self.kv[m][index][0] for m in chains[node]], dim=1)
                chain_values = torch.cat([self.kv[m][index][1] for m in chains[node]], dim=1)
                rows = torch.tensor(rows, device=keys.device)
                keys[rows, :, :chain_keys.shape[1]] = chain_keys
                values[rows, :, :chain_values.shape[1]] = chain_values
            return keys, values

        return layer

    def _row(self, item: _Item, suffix: tuple[torch.Tensor, torch.Tensor] | None) -> dict:
        """The sample's full row: its prefix chain's states followed by its own."""
        parts = [self.states[node] for node in self.plan.chain(item.past)] + ([suffix] if suffix is not None else [])
        sample = self.samples[item.source]
        return {"sample_id": sample.sample_id, "source_index": sample.source_index, "input_ids": sample.input_ids,
                "loss_mask": sample.loss_mask,
                "aux_hidden_states": torch.cat([aux for aux, _ in parts]),
                "last_hidden_state": torch.cat([last for _, last in parts])}
