"""More from the same forward: what each captured sample stores besides its hidden states.

All of it comes from one capture (`CaptureOutput`) and the target's LM head; every option is off by default.

    outputs = SampleOutputs.from_settings(settings, capture)   # settings: OutputSettings (the configured keys)
    outputs.add_columns(rows, out, input_ids)   # hidden states (bf16 or fp8) + the optional columns, on the CPU

Conventions (public; docs/guides/generate.md "More from the same forward", recorded in the manifest):

* Hidden state t is computed from tokens 0..t and predicts token t+1.
* **Trainable positions** are the t with `loss_mask[t + 1] == 1`: the positions whose hidden state predicts a
  token the draft is trained on, i.e. where a distillation trainer needs the target's distribution (the EAGLE-3
  trainer scores position t against `lm_head(last_hidden_state[t])` exactly where `loss_mask[t + 1]` holds).
  `topk_values`/`topk_indices` and `logits` have one row per trainable position, in position order:
  row j belongs to position `trainable_positions(loss_mask)[j]`. The last position never qualifies.
* `token_logprobs[t] = log_softmax(logits[t] / temperature)[x[t + 1]]` for t < T-1 and NaN at t = T-1 (there is
  no next token); `mean_logprob` is its mean over the trainable positions: the mean log-prob of the trained tokens
  (NaN when there are none).
* `pooled_hidden_state` pools the final-norm state (or one captured aux layer) over all positions (`mean`), over
  the positions with `loss_mask[t] == 1` (`mean_trainable`: the trained tokens' own states) or takes t = T-1
  (`last`), in float32, from the exact hidden states (before any fp8 encoding).

Logits are `lm_head(last_hidden_state)` in the target's dtype, which is the whole logit computation for the
Llama family (Llama, Mistral, Qwen2/3, Qwen3-MoE: no soft-capping or scaling) and GPT-2; targets whose config
transforms the logits after the LM head are refused rather than silently mis-stored. The LM head runs only on
the positions needed and `lm_head_chunk_tokens` of them at a time, so a 150k vocabulary costs [chunk, V] floats.
"""

import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from specgen.capture.positions import position_chunks
from specgen.capture.target import CaptureOutput, TargetCapture
from specgen.errors import SpecgenError
from specgen.filters import SampleFilter
from specgen.store import fp8
from specgen.store.columns import LOGITS, POOLED


# Config entries of architectures that transform the logits after the LM head, with their no-op value.
_LOGIT_TRANSFORMS = {"final_logit_softcapping": None, "logit_scale": 1.0, "logits_scaling": 1.0,
                     "lm_head_multiplier": 1.0}

TRAINABLE_POSITIONS = "t with loss_mask[t + 1] == 1 (hidden state t predicts trained token t + 1), in position order"
TOKEN_LOGPROBS = "token_logprobs[t] = log_softmax(logits[t] / temperature)[input_ids[t + 1]]; NaN at t = T - 1"


def trainable_positions(loss_mask: torch.Tensor) -> torch.LongTensor:
    """The positions t with loss_mask[t + 1] == 1: row j of `topk_*` / `logits` belongs to position [j]."""
    return torch.nonzero(torch.as_tensor(loss_mask)[1:]).flatten()


@dataclass(frozen=True)
class OutputSettings:
    """The output options as configured (`output.codec`, `capture.logits` ... `capture.lm_head_chunk_tokens`),
    values as given: `SampleOutputs.from_settings` resolves and checks them, `identity` fingerprints them."""

    codec: str | None = None  # output.codec
    logits: str = "none"
    topk: int = 0
    token_logprobs: bool = False
    logprob_temperature: float = 1.0
    pooled: str = "none"
    pooled_layer: str | int = "last"
    lm_head_chunk_tokens: int = 1024


@dataclass(frozen=True)
class SampleOutputs:
    """The resolved output options and the code that turns one capture into shard rows."""

    capture: TargetCapture
    codec: str = "none"  # "none": hidden states bit-exact in the target's dtype | "fp8"
    logits: str = "none"
    topk: int = 0
    token_logprobs: bool = False
    temperature: float = 1.0
    pooled: str = "none"
    pooled_layer: str | int = "last"
    lm_head_chunk_tokens: int = 1024

    @classmethod
    def from_settings(cls, settings: OutputSettings, capture: TargetCapture) -> "SampleOutputs":
        c = settings
        outputs = cls(capture=capture, codec=resolve_codec(c.codec, capture.dtype), logits=c.logits,
                      topk=c.topk if c.logits == "topk" else 0, token_logprobs=bool(c.token_logprobs),
                      temperature=float(c.logprob_temperature), pooled=c.pooled, pooled_layer=c.pooled_layer,
                      lm_head_chunk_tokens=c.lm_head_chunk_tokens)
        outputs.validate()
        return outputs

    def validate(self) -> None:
        if self.logits not in LOGITS:
            raise SpecgenError(f"capture.logits={self.logits!r}: use one of {list(LOGITS)}")
        if self.logits == "topk" and not 0 < self.topk <= self.vocab_size:
            raise SpecgenError(f"capture.topk={self.topk} must lie in [1, {self.vocab_size}] (the target vocabulary) "
                               "with capture.logits=topk")
        if self.pooled not in POOLED:
            raise SpecgenError(f"capture.pooled={self.pooled!r}: use one of {list(POOLED)}")
        if self.pooled_layer != "last" and self.pooled_layer not in self.capture.aux_layers:
            raise SpecgenError(f"capture.pooled_layer={self.pooled_layer!r} is neither 'last' (the final-norm state) "
                               f"nor one of the captured aux layers {self.capture.aux_layers}")
        if not self.temperature > 0:
            raise SpecgenError(f"capture.logprob_temperature={self.temperature} must be positive")
        if self.lm_head_chunk_tokens < 1:
            raise SpecgenError(f"capture.lm_head_chunk_tokens={self.lm_head_chunk_tokens} must be positive")
        if self.logits != "none" or (self.token_logprobs and self.capture.backend != "vllm"):  # vLLM: its own
            self._check_plain_logits()
        if self.logits == "full":
            per_position = self.vocab_size * self.capture.dtype.itemsize
            hidden = (len(self.capture.aux_layers) + 1) * self.capture.hidden_size * self.capture.dtype.itemsize
            warnings.warn(f"capture.logits=full stores {self.vocab_size:,} logits per trainable position: "
                          f"{per_position / 1024:,.0f} KiB per trainable token, {per_position / hidden:.0f}x the "
                          "hidden states; capture.logits=topk keeps the top K for a fraction of that", stacklevel=2)

    def _check_plain_logits(self) -> None:
        config = self.capture.model.config.get_text_config()
        for key, no_op in _LOGIT_TRANSFORMS.items():
            value = getattr(config, key, no_op)
            if value is not None and value != no_op:
                raise SpecgenError(f"{type(self.capture.model).__name__} transforms its logits after the LM head "
                                   f"({key}={value}), which specgen does not reproduce; capture.logits and "
                                   "capture.token_logprobs support targets whose logits are lm_head(last_hidden_state)")

    @property
    def vocab_size(self) -> int:
        return self.capture.lm_head.weight.shape[0]

    @property
    def hidden_states_only(self) -> bool:
        """Nothing to compute on the device after the forward: the states can go straight to the host."""
        return self.codec != "fp8" and not self.uses_lm_head and self.pooled == "none"

    @property
    def uses_lm_head(self) -> bool:
        return self.logits != "none" or self.token_logprobs

    def spec_fields(self) -> dict:
        """The `ShardSpec` fields these options switch on."""
        return {"codec": self.codec, "logits": self.logits, "topk": self.topk,
                "vocab_size": self.vocab_size if self.logits == "full" else 0,
                "token_logprobs": self.token_logprobs, "pooled": self.pooled}

    def describe(self) -> dict:
        """The manifest's `outputs` entry: every option and the conventions needed to read its columns."""
        described = {"codec": self.codec}
        if self.codec == "fp8":
            described["fp8"] = {"format": "float8_e4m3fn codes stored as uint8 bit patterns",
                                "scales": "float32, one per token per aux layer (aux_hidden_states_scale [T, k]) and "
                                          "one per token (last_hidden_state_scale [T])",
                                "decode": "code.view(float8_e4m3fn).float() * scale (per layer slice of H values)"}
        described["logits"] = {"mode": self.logits, "topk": self.topk or None, "positions": TRAINABLE_POSITIONS,
                               "computed_as": "lm_head(last_hidden_state) in the target's dtype, no temperature"}
        described["token_logprobs"] = {"enabled": self.token_logprobs, "temperature": self.temperature,
                                       "convention": TOKEN_LOGPROBS,
                                       "mean_logprob": "mean of token_logprobs over the trainable positions"}
        described["pooled"] = {"mode": self.pooled, "layer": self.pooled_layer,
                               "positions": {"mean": "all t", "mean_trainable": "t with loss_mask[t] == 1",
                                             "last": "t = T - 1", "none": None}[self.pooled], "dtype": "float32"}
        return described

    def add_columns(self, rows: list[dict], out: CaptureOutput, input_ids: torch.LongTensor) -> None:
        """Fill the hidden-state columns and the optional ones into `rows` (CPU tensors), in place.

        rows[b] holds `input_ids` and `loss_mask` of row b of the right-padded batch `input_ids` [B, T] (on the
        capture's device) that produced `out`.
        """
        lengths = torch.tensor([len(row["input_ids"]) for row in rows], device=input_ids.device)
        loss_mask = torch.zeros(input_ids.shape, dtype=torch.bool)
        for b, row in enumerate(rows):
            loss_mask[b, : len(row["loss_mask"])] = torch.as_tensor(row["loss_mask"], dtype=torch.bool)
        loss_mask = loss_mask.to(input_ids.device)
        self._add_hidden_states(rows, out)
        if out.token_logprobs is not None and self.logits == "none":  # the engine's own (engine=vllm): no LM head
            self._add_logprob_columns(rows, out.token_logprobs.to(input_ids.device), lengths, loss_mask)
        elif self.uses_lm_head:
            self._add_lm_head_columns(rows, out.last_hidden_state, input_ids, lengths, loss_mask)
        if self.pooled != "none":
            self._add_pooled(rows, out, loss_mask)

    def _add_hidden_states(self, rows: list[dict], out: CaptureOutput) -> None:
        if self.codec == "fp8":  # encoded on the capture's device: a quarter of the bytes cross to the CPU
            aux, aux_scale = fp8.encode(out.aux_hidden_states, len(self.capture.aux_layers))
            last, last_scale = fp8.encode(out.last_hidden_state, 1)
            for b, row in enumerate(rows):
                length = len(row["input_ids"])
                row["aux_hidden_states"] = aux[b, :length].cpu()
                row["aux_hidden_states_scale"] = aux_scale[b, :length].cpu()
                row["last_hidden_state"] = last[b, :length].cpu()
                row["last_hidden_state_scale"] = last_scale[b, :length, 0].cpu()
            return
        for b, row in enumerate(rows):
            row["aux_hidden_states"] = out.aux_hidden_states[b, : len(row["input_ids"])].cpu()
            row["last_hidden_state"] = out.last_hidden_state[b, : len(row["input_ids"])].cpu()

    def _add_lm_head_columns(self, rows: list[dict], last_hidden_state: torch.Tensor, input_ids: torch.LongTensor,
                             lengths: torch.Tensor, loss_mask: torch.Tensor) -> None:
        """Run the LM head on the positions that need it, in chunks, and split the results per row."""
        batch, seq_len = input_ids.shape
        positions = torch.arange(seq_len, device=input_ids.device)
        has_next = positions < (lengths - 1).unsqueeze(1)  # [B, T]: real positions with a next token
        trainable = torch.zeros_like(has_next)
        trainable[:, :-1] = loss_mask[:, 1:] & has_next[:, :-1]
        needed = has_next if self.token_logprobs else trainable
        logprobs = torch.full((batch, seq_len), float("nan"), device=input_ids.device)
        kept = {name: [] for name in self._logit_columns()}
        for rows_at, positions_at in position_chunks(needed, self.lm_head_chunk_tokens):  # row-major order
            logits = self.capture.lm_head(last_hidden_state[rows_at, positions_at])
            if self.token_logprobs:
                scaled = logits.float() / self.temperature
                next_ids = input_ids[rows_at, positions_at + 1]
                logprobs[rows_at, positions_at] = (
                    scaled.gather(-1, next_ids.unsqueeze(-1)).squeeze(-1) - scaled.logsumexp(-1))
            if self.logits == "none":
                continue
            if self.token_logprobs:  # log-probs needed every position; logits are kept at trainable ones only
                logits = logits[trainable[rows_at, positions_at]]
            if self.logits == "topk":
                values, indices = logits.topk(self.topk, dim=-1)
                kept["topk_values"].append(values.cpu())
                kept["topk_indices"].append(indices.to(torch.int32).cpu())
            else:
                kept["logits"].append(logits.cpu())
        per_row = trainable.sum(dim=1).tolist()
        for name, parts in kept.items():
            values = torch.cat(parts) if parts else self._logit_columns()[name]
            for row, row_values in zip(rows, values.split(per_row)):
                row[name] = row_values
        if self.token_logprobs:
            self._add_logprob_columns(rows, logprobs, lengths, loss_mask)

    def _add_logprob_columns(self, rows: list[dict], logprobs: torch.Tensor, lengths: torch.Tensor,
                             loss_mask: torch.Tensor) -> None:
        """token_logprobs [B, T] (NaN where there is no next token) -> the token_logprobs and mean_logprob columns."""
        seq_len = logprobs.shape[1]
        has_next = torch.arange(seq_len, device=logprobs.device) < (lengths - 1).unsqueeze(1)
        trainable = torch.zeros_like(has_next)
        trainable[:, :-1] = loss_mask[:, 1:] & has_next[:, :-1]
        counts = trainable.sum(dim=1)
        means = torch.where(trainable, logprobs, 0.0).sum(dim=1) / counts  # 0/0 = NaN: no trainable token
        logprobs, means = logprobs.cpu(), means.cpu()
        for b, row in enumerate(rows):
            row["token_logprobs"] = logprobs[b, : len(row["input_ids"])]
            row["mean_logprob"] = means[b]

    def _logit_columns(self) -> dict[str, torch.Tensor]:
        """The logit columns this run stores, each mapped to its empty value (a batch with no trainable position)."""
        if self.logits == "topk":
            return {"topk_values": torch.empty(0, self.topk, dtype=self.capture.dtype),
                    "topk_indices": torch.empty(0, self.topk, dtype=torch.int32)}
        if self.logits == "full":
            return {"logits": torch.empty(0, self.vocab_size, dtype=self.capture.dtype)}
        return {}

    def _add_pooled(self, rows: list[dict], out: CaptureOutput, loss_mask: torch.Tensor) -> None:
        if self.pooled_layer == "last":
            source = out.last_hidden_state
        else:
            slot, hidden = self.capture.aux_layers.index(self.pooled_layer), self.capture.hidden_size
            source = out.aux_hidden_states[..., slot * hidden:(slot + 1) * hidden]
        for b, row in enumerate(rows):
            states = source[b, : len(row["input_ids"])]
            if self.pooled == "last":
                pooled = states[-1].float()
            elif self.pooled == "mean":
                pooled = states.float().mean(dim=0)
            else:
                pooled = states[loss_mask[b, : len(states)]].float().mean(dim=0)
            row["pooled_hidden_state"] = pooled.cpu()


def resolve_codec(codec: str | None, target_dtype: torch.dtype) -> str:
    """`output.codec` -> the ShardSpec codec: null, none or the target's own dtype name mean "none"."""
    dtype_name = str(target_dtype).removeprefix("torch.")
    if codec in (None, "none", dtype_name):
        return "none"
    if codec == "fp8":
        return "fp8"
    raise SpecgenError(f"output.codec={codec!r} is not supported: use null (the target's dtype, {dtype_name}, "
                       "bit-exact) or fp8 (e4m3 with per-token scales, about half the bytes)")


def identity(settings: OutputSettings, sample_filter: SampleFilter) -> dict:
    """The output and filter options that change the dataset's bytes, for the resume fingerprint. Options left at
    their defaults are omitted, so directories written before these options existed keep their fingerprint."""
    c = settings
    chosen = {"output.codec": "fp8" if c.codec == "fp8" else None,
              "capture.logits": None if c.logits == "none" else c.logits,
              "capture.topk": c.topk if c.logits == "topk" else None,
              "capture.token_logprobs": True if c.token_logprobs else None,
              "capture.logprob_temperature": c.logprob_temperature if c.token_logprobs else None,
              "capture.pooled": None if c.pooled == "none" else c.pooled,
              "capture.pooled_layer": c.pooled_layer if c.pooled != "none" else None,
              "filter.min_mean_logprob": sample_filter.min_mean_logprob,
              "filter.max_mean_logprob": sample_filter.max_mean_logprob}
    return {key: value for key, value in chosen.items() if value is not None}


def logprob_statistics(shard_paths: list[Path]) -> dict:
    """Dataset-level log-prob statistics for the manifest, read from the `mean_logprob` and `loss_mask` columns."""
    means, counts = [np.zeros(0, dtype=np.float32)], [np.zeros(0, dtype=np.int64)]
    for path in shard_paths:
        with pa.memory_map(str(path)) as source:
            table = pa.ipc.open_file(source).read_all().select(["mean_logprob", "loss_mask"])
        means.append(table.column("mean_logprob").to_numpy())
        masks = table.column("loss_mask").combine_chunks()
        starts = masks.offsets.to_numpy()[:-1]
        values = masks.flatten().to_numpy().astype(np.int64)
        counts.append(np.add.reduceat(values, starts) - values[starts])  # trainable positions: loss_mask[1:]
    means, counts = np.concatenate(means), np.concatenate(counts).astype(np.float64)
    valid = ~np.isnan(means)
    if not valid.any():
        return {"mean_logprob": None, "samples": 0}
    per_sample = means[valid].astype(np.float64)
    quantiles = np.quantile(per_sample, [0.0, 0.05, 0.5, 0.95, 1.0])
    return {
        "mean_logprob": float((per_sample * counts[valid]).sum() / counts[valid].sum()),  # over trainable tokens
        "samples": int(valid.sum()),
        "per_sample_mean_logprob": dict(zip(["min", "p05", "p50", "p95", "max"], map(float, quantiles))),
    }
