"""Capture a work unit with shared-prefix reuse: every kept prefix runs through the target once, and every sample
continues from its prefix's KV cache.

`specgen.data.prefixes.plan_prefixes` gives the prefix tree. Because the model is causal, a prefix's states are the
same in every sample that starts with it, so a sample's row is its prefix chain's states followed by the states of
its own suffix, computed with the chain's keys and values as the past (`specgen.capture.kv.GroupedPast`). Rows come
out as a full forward gives them, within the dtype's rounding (other batch shapes run other kernels, and the
attention over [past ; new] is merged from two fused calls).

Where the time goes, and how this path keeps it low (measured: docs/concepts/prefix-reuse.md):
  * attention stays on SDPA's fused kernel: the new tokens attend causally to themselves (`is_causal`, no mask) and
    each group of rows continuing one prefix attends, folded into one query sequence, to that prefix's keys (no
    mask); the halves are merged by log-sum-exp. No [B, 1, q, past + q] mask is ever built.
  * a prefix's keys and values are kept as its whole chain ([kv heads, prefix length, head dim] per layer, made
    once when the prefix is computed), which is what the attention call reads: nothing is gathered, padded or
    concatenated per batch, and a row never carries its past as padding.
  * one level of the tree is one set of batches: the prefix segments and the sample suffixes that continue the
    level above run together, longest first under `batch_tokens` (new tokens only, like the plain path), so batches
    are as full as the plain path's; rows are grouped by prefix within a batch.
  * a level's prefixes are dropped once the level below has run (only they continue them).

Work runs in waves of whole prefix trees whose chain KV fits `cache_tokens` (a larger tree goes alone).
"""

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from specgen.capture.kv import GroupedPast, LayerKV
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
    """Yield (finished rows, padded tokens forwarded) per batch, like the plain path; rows hold full states
    (`aux_hidden_states`, `last_hidden_state` as CPU tensors of the row's length)."""
    run = _UnitRun(capture, samples, plan, batch_tokens, max_batch_size, pad_id, device)
    for wave, trees in enumerate(_waves(plan, cache_tokens)):
        yield from run.wave(trees, with_unshared=wave == 0)


def _waves(plan: PrefixPlan, cache_tokens: int) -> list[set[int]]:
    """Top-level prefixes grouped so that each group's chain KV fits `cache_tokens` (a larger tree goes alone)."""
    cost: dict[int, int] = {}
    for index, node in enumerate(plan.nodes):
        top = plan.top_level(index)
        cost[top] = cost.get(top, 0) + node.end
    waves, used = [set()], 0
    for top, tokens in cost.items():
        if waves[-1] and used + tokens > cache_tokens:
            waves.append(set())
            used = 0
        waves[-1].add(top)
        used += tokens
    return waves


class _UnitRun:
    """The state of one work unit's capture: the plan, the prefix chains' KV (device) and segment states (CPU)."""

    def __init__(self, capture, samples, plan, batch_tokens, max_batch_size, pad_id, device):
        self.capture, self.samples, self.plan = capture, samples, plan
        self.batch_tokens, self.max_batch_size = batch_tokens, max_batch_size
        self.pad_id, self.device = pad_id, device
        self.kv: dict[int, list[LayerKV]] = {}  # prefix node -> its whole chain's keys/values per layer
        self.states: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # prefix node -> its segment's (aux, last)

    def wave(self, trees: set[int], with_unshared: bool) -> Iterator[tuple[list[dict], int]]:
        plan = self.plan
        nodes = [i for i in range(len(plan.nodes)) if plan.top_level(i) in trees]
        suffixes = [_Item(i, plan.prefix_length(i), len(sample), plan.sample_node[i])
                    for i, sample in enumerate(self.samples)
                    if (with_unshared if plan.sample_node[i] is None else plan.top_level(plan.sample_node[i]) in trees)]
        for level in range(max((plan.nodes[i].level for i in nodes), default=-1) + 2):
            items = [_Item(plan.nodes[i].source, plan.nodes[i].start, plan.nodes[i].end, plan.nodes[i].parent, i)
                     for i in nodes if plan.nodes[i].level == level]
            items += [item for item in suffixes if self._level(item.past) == level]
            # A sample that is exactly a shared prefix (a duplicate, or a prefix of another sample) computes nothing.
            empty = [item for item in items if not len(item)]
            if empty:
                yield [self._row(item, None) for item in empty], 0
            for batch in self._batches([item for item in items if len(item)]):
                aux, last, padded = self._forward(batch)
                yield [self._row(item, (aux[b, :len(item)], last[b, :len(item)]))
                       for b, item in enumerate(batch) if item.node is None], padded
            for node in [node for node in self.kv if plan.nodes[node].level < level]:
                del self.kv[node]  # only the level just run continued them
        self.kv, self.states = {}, {}

    def _level(self, node: int | None) -> int:
        return 0 if node is None else self.plan.nodes[node].level + 1

    def _batches(self, items: list[_Item]) -> list[list[_Item]]:
        """Longest first under `batch_tokens` (batch size x longest new tokens) and `max_batch_size`, and a row joins a
        batch only while the batch's padding stays within MAX_PADDING of its real tokens (a level's rows range from
        whole samples to a few tokens: without this bound their padding costs more than the reuse saves); within a
        batch, rows continuing the same prefix are next to each other."""
        batches: list[list[_Item]] = []
        real = 0
        for item in sorted(items, key=lambda it: (-len(it), it.source, it.start)):
            if batches:
                size, longest = len(batches[-1]) + 1, len(batches[-1][0])
                if (size * longest <= self.batch_tokens and size <= self.max_batch_size
                        and size * longest <= (1 + MAX_PADDING) * (real + len(item))):
                    batches[-1].append(item)
                    real += len(item)
                    continue
            batches.append([item])
            real = len(item)
        return [sorted(batch, key=lambda it: -1 if it.past is None else it.past) for batch in batches]

    def _forward(self, batch: list[_Item]) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Run one batch; return its states on the CPU and its padded size. The prefix segments it computes keep
        their chain's keys/values (device) and their states (CPU) for the levels below."""
        lengths = [len(item) for item in batch]
        input_ids = pad_right([self.samples[item.source].input_ids[item.start:item.end] for item in batch],
                              self.pad_id)
        keep = any(item.node is not None for item in batch)
        past = self._grouped_past(batch, keep)
        result = self.capture(input_ids.to(self.device), torch.tensor(lengths), past=past, keep_kv=keep)
        aux, last = _to_host(result.aux_hidden_states, result.last_hidden_state)
        for b, item in enumerate(batch):
            if item.node is not None:
                n = len(item)
                parent = self.kv.get(item.past) if item.past is not None else None
                self.kv[item.node] = [
                    (keys[b, :, :n].contiguous(), values[b, :, :n].contiguous()) if parent is None else
                    (torch.cat([parent[layer][0], keys[b, :, :n]], dim=1),
                     torch.cat([parent[layer][1], values[b, :, :n]], dim=1))
                    for layer, (keys, values) in enumerate(result.kv)]
                self.states[item.node] = (aux[b, :n].clone(), last[b, :n].clone())
        return aux, last, len(batch) * max(lengths)

    def _grouped_past(self, batch: list[_Item], keep: bool) -> GroupedPast | None:
        """The batch's rows (already grouped by prefix) as groups continuing one prefix chain each; None when no
        row continues anything and no keys/values are kept (the plain forward)."""
        if all(item.past is None for item in batch) and not keep:
            return None
        bounds, lengths, kv = [0], [], []
        for b, item in enumerate(batch):
            if b and item.past == batch[b - 1].past:
                bounds[-1] = b + 1
                continue
            bounds.append(b + 1)
            lengths.append(0 if item.past is None else self.plan.nodes[item.past].end)
            kv.append(None if item.past is None else self.kv[item.past])
        return GroupedPast(bounds=bounds, lengths=lengths, kv=kv)

    def _row(self, item: _Item, suffix: tuple[torch.Tensor, torch.Tensor] | None) -> dict:
        """The sample's full row: its prefix chain's states followed by its own."""
        parts = [self.states[node] for node in self.plan.chain(item.past)] + ([suffix] if suffix is not None else [])
        sample = self.samples[item.source]
        return {"sample_id": sample.sample_id, "source_index": sample.source_index, "input_ids": sample.input_ids,
                "loss_mask": sample.loss_mask,
                "aux_hidden_states": torch.cat([aux for aux, _ in parts]),
                "last_hidden_state": torch.cat([last for _, last in parts])}


def _to_host(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors on the CPU with one wait for the device: on CUDA every copy is queued (into pinned memory) and
    the stream synchronized once, instead of one blocking `.cpu()` per tensor. The same values either way."""
    if tensors[0].device.type != "cuda":
        return [tensor.cpu() for tensor in tensors]
    host = [tensor.to("cpu", non_blocking=True) for tensor in tensors]
    torch.cuda.current_stream(tensors[0].device).synchronize()
    return host


# A batch's padded tokens stay within this share of its real tokens, so a unit forwards at most 1.05 tokens per
# token computed. 0.05 also ran faster than 0.1 (glaive, 200 rows: 41-42 s vs 45-52 s; docs/concepts/prefix-reuse.md).
MAX_PADDING = 0.05

# Reuse a unit's prefixes only when they save at least this share of its tokens. Below it the reuse path's own
# costs (a level's batches split from the next, two attention calls merged per layer, rows assembled from parts)
# outweigh the saving, and the plain path gives the same rows (docs/concepts/prefix-reuse.md, the reuse rule).
MIN_SAVING = 0.05


# capture.prefix_reuse=auto reuses prefixes on these device types only: where it measured faster than full rows. The
# CPU: 1.1-1.3x faster (docs/concepts/prefix-reuse.md). CUDA: 2.5x SLOWER (H200, Llama-3.1-8B shape, 600 alpaca rows,
# issue 40): its per-group attention falls back to masked SDPA calls and its per-batch work is small and synchronous.
AUTO_REUSE_DEVICES = ("cpu",)


def resolve_prefix_reuse(setting: bool | str, device: torch.device | str) -> tuple[bool, str]:
    """capture.prefix_reuse (true, false or auto) decided for the runtime `device`: (reuse, why), the why for the
    run's log line and summary. auto reuses on the device types of AUTO_REUSE_DEVICES (the CPU) and not elsewhere."""
    device = torch.device(device)
    if isinstance(setting, str):
        if setting != "auto":
            raise ValueError(f"capture.prefix_reuse={setting!r}: use true, false or auto")
        reuse = device.type in AUTO_REUSE_DEVICES
        faster = "reuse is the faster path there" if reuse else "full rows are the faster path there"
        return reuse, f"capture.prefix_reuse=auto on {device.type}: {faster}"
    return bool(setting), f"capture.prefix_reuse={str(bool(setting)).lower()}"


def reuse_pays(plan: PrefixPlan) -> bool:
    """Whether capturing with `plan` is expected to beat the plain path: it saves at least MIN_SAVING of the tokens."""
    return bool(plan.nodes) and plan.tokens_computed <= (1 - MIN_SAVING) * plan.tokens_emitted
