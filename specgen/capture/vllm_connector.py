"""specgen's KV connector for vLLM's `extract_hidden_states` method: states stay in memory, nothing goes to disk.

vLLM's `extract_hidden_states` speculative method (`ExtractHiddenStatesProposer`) runs, after every target forward,
a one-layer "draft" whose cache-only attention layer writes the requested target layers of every scheduled token
into a KV-cache group of its own ([tokens, num_layers, hidden] per slot). A KV connector then reads a finished
request's slots before its blocks are freed. vLLM's `ExampleHiddenStatesConnector` writes one safetensors file
per request (and on a CPU build fails: pinned memory without an accelerator, `event.query()` on the CPU event
placeholder). This subclass keeps its scheduler side (which blocks to read, and delaying their release) and replaces
its worker side: the states of a finished request are copied to host memory in the worker process and kept there,
keyed by the request's `kv_transfer_params["specgen_key"]`, until `SpecgenWorkerExtension.specgen_take_states`
(called through `LLM.collective_rpc`, so it works with the engine in another process and with tensor parallelism:
TP rank 0 holds them) hands them over.

This module imports vLLM; `specgen.capture.vllm` names it by path only, so the default install never imports it.
"""

from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    ExampleHiddenStatesConnectorMetadata,
    PendingSave,
    extract_from_kv_cache,
)

# Worker process: specgen key -> its states [tokens, num_layers, hidden] on the host, until taken.
_CAPTURED: dict[str, torch.Tensor] = {}


def pack(tensor: torch.Tensor) -> tuple[bytes, str, list[int]]:
    """A host tensor as (raw bytes, dtype name, shape): exact for every dtype, bfloat16 included."""
    tensor = tensor.contiguous()
    raw = tensor.view(-1).view(torch.uint8).numpy().tobytes()
    return raw, str(tensor.dtype).removeprefix("torch."), list(tensor.shape)


def unpack(packed: tuple[bytes, str, list[int]]) -> torch.Tensor:
    """The inverse of `pack`."""
    data, dtype, shape = packed
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape)


class SpecgenStatesConnector(ExampleHiddenStatesConnector):
    """Store-only connector: finished requests' hidden states go to host memory in the worker (module doc)."""

    def wait_for_save(self) -> None:
        """No lock files: nothing is written to disk."""

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Scheduler side: keep the blocks until the worker has read them (return True), no file path."""
        delay, _ = super().request_finished(request, block_ids)
        pending = self._pending_saves.get(request.request_id)
        if pending is not None:  # the caller's key: LLM.generate's request ids are not the engine's
            pending.specgen_key = (request.kv_transfer_params or {}).get("specgen_key", request.request_id)
        return delay, None

    def _submit_async_write(self, pending: PendingSave) -> None:
        """Worker side: read the request's slots and keep a host copy (synchronously: no pinned memory, no events)."""
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (blocks[:, None] * self._block_size + offsets[None, :]).flatten().to(self._kv_cache.device)
        states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0])
        _CAPTURED[getattr(pending, "specgen_key", pending.req_id)] = states.to("cpu", copy=True)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Read this step's finished requests, then report them all as sent so their blocks are freed."""
        done: set[str] = set()
        if not self._is_tp_rank_zero:  # only rank 0 reads and reports (get_finished_count() == 1)
            return None, None
        if self.has_connector_metadata():
            metadata = self._get_connector_metadata()
            if isinstance(metadata, ExampleHiddenStatesConnectorMetadata):
                for pending in metadata.pending_saves:
                    self._submit_async_write(pending)
                    done.add(pending.req_id)
        return done or None, None


class SpecgenWorkerExtension:
    """Mixed into vLLM's worker (`worker_extension_cls`): `collective_rpc("specgen_take_states", ...)`."""

    def specgen_take_states(self, keys: list[str]) -> dict[str, tuple[bytes, str, list[int]]]:
        """Hand over (and forget) the states of these requests (by specgen key) as `pack`ed bytes; a TP rank other
        than 0 holds none. Bytes, because vLLM's RPC reply turns a tensor into nested lists."""
        return {key: pack(_CAPTURED.pop(key)) for key in keys if key in _CAPTURED}

    def specgen_pending(self) -> int:
        """States captured but not taken yet (a leak check for tests)."""
        return len(_CAPTURED)
