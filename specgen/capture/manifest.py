"""What `specgen.generate` writes besides the shards: the manifest (identity, stats, prefix reuse, padding), the
token counts the draft vocabulary is built from, and the summary printed at the end."""

from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
from omegaconf import DictConfig

from specgen.capture.loading import positions_of
from specgen.capture.offline import Target
from specgen.capture.outputs import identity as output_identity
from specgen.capture.outputs import logprob_statistics
from specgen.capture.units import TARGET_TOP
from specgen.config import to_container
from specgen.draft.vocab import TARGET_TOKEN_COUNTS, TOKEN_COUNTS
from specgen.errors import SpecgenError
from specgen.progress import format_table, human_bytes
from specgen.settings import output_settings
from specgen.store.commit import write_json_atomic
from specgen.store.manifest import shard_checksums, summarize_shards
from specgen.store.prefix_layout import bytes_flat
from specgen.store.writer import finished_shards, read_sidecar, shard_name

AUX_LAYER_CONVENTION = ("aux layer i is the output of decoder layer i (0-based) before the final norm, "
                        "i.e. Hugging Face hidden_states[i + 1]")


def target_token_counts(out_dir: Path, shards: list[str]) -> dict[int, int] | None:
    """The target's top tokens at trainable positions, summed over the shards' sidecars (None when a shard was
    made without counting them)."""
    total: Counter = Counter()
    for name in shards:
        counts = read_sidecar(out_dir, int(name.split("-")[1].split(".")[0])).get(TARGET_TOP)
        if counts is None:
            return None
        total.update({int(token): count for token, count in counts.items()})
    return dict(total)


def count_trainable_token_ids(out_dir: Path, shards: list[str], vocab_size: int) -> np.ndarray:
    """How often each token id carries loss, read from the shards' token columns only (for the draft vocab)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for name in shards:
        with pa.memory_map(str(out_dir / name)) as source:
            table = pa.ipc.open_file(source).read_all().select(["input_ids", "loss_mask"])
        ids = table.column("input_ids").combine_chunks().flatten().to_numpy()
        mask = table.column("loss_mask").combine_chunks().flatten().to_numpy().astype(bool)
        counts += np.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
    return counts


def dataset_identity(cfg: DictConfig, model_config_hash: str, template_sha: str, target: Target) -> dict:
    """Everything that changes the bytes of the dataset (and nothing that only changes speed): besides the inputs,
    what computes the numbers (engine, attention kernel, the dtype model.dtype resolved to, the capture backend),
    so a dataset started with one never resumes with another and the manifest's backend holds for every shard."""
    return {"model.path": str(Path(cfg.model.path).resolve()), "model.config_hash": model_config_hash,
            "model.dtype": target.spec.dtype, "engine.name": cfg.engine.name,
            "model.attn_implementation": cfg.model.attn_implementation, "capture.backend": target.capture.backend,
            "tokenizer.path": str(Path(cfg.tokenizer.path).resolve()),
            "chat_template_sha256": template_sha, "data": to_container(cfg.data),
            "capture.aux_layers": to_container(cfg.capture).get("aux_layers"),
            "output.shard_size": cfg.output.shard_size, "output.store_prefix_once": cfg.output.store_prefix_once,
            **output_identity(output_settings(cfg), target.sample_filter)}


def build_manifest(cfg: DictConfig, out_dir: Path, target: Target, tokenizer, identity: dict) -> dict:
    shards = [shard_name(i) for i in sorted(finished_shards(out_dir))]
    capture = target.capture
    text_config = capture.model.config.get_text_config()
    counts = count_trainable_token_ids(out_dir, shards, text_config.vocab_size)
    stats = summarize_shards(out_dir)
    write_json_atomic(out_dir / TOKEN_COUNTS, {"vocab_size": int(text_config.vocab_size), "counts": {
        str(i): int(c) for i in np.flatnonzero(counts) for c in [counts[i]]}}, indent=None)
    top = target_token_counts(out_dir, shards)
    if top is not None:
        write_json_atomic(out_dir / TARGET_TOKEN_COUNTS, {"vocab_size": int(text_config.vocab_size), "counts": {
            str(token): count for token, count in sorted(top.items())}}, indent=None)
    else:
        (out_dir / TARGET_TOKEN_COUNTS).unlink(missing_ok=True)
    return {
        "format": "specgen.shards", "format_version": 1,
        "model": {"path": identity["model.path"], "config_hash": identity["model.config_hash"],
                  "architecture": type(capture.model).__name__, "num_layers": capture.num_layers,
                  "hidden_size": capture.hidden_size, "vocab_size": int(text_config.vocab_size)},
        "tokenizer": {"path": identity["tokenizer.path"], "chat_template_sha256": identity["chat_template_sha256"],
                      "vocab_size": len(tokenizer)},
        "capture": {"aux_layers": list(capture.aux_layers), "aux_layer_convention": AUX_LAYER_CONVENTION,
                    "last_hidden_state": "post_norm: output of the final norm, the input of lm_head",
                    "backend": capture.backend, "compiled": capture.compiled,
                    "max_positions": positions_of(text_config)},
        "dtype": target.spec.dtype, "hidden_size": target.spec.hidden_size, "num_aux": target.spec.num_aux,
        "codec": "fp8" if target.spec.codec == "fp8" else target.spec.dtype,
        "outputs": {**target.outputs.describe(), "filter": target.sample_filter.describe()},
        "shards": shards,
        "checksums": {name: checksum for name, checksum in shard_checksums(out_dir).items() if name in shards},
        "stats": {**stats,
                  **({"logprobs": logprob_statistics([out_dir / name for name in shards])}
                     if target.spec.token_logprobs else {})},
        "layout": "prefix_refs" if target.spec.store_prefix_once else "flat",
        "prefix_reuse": prefix_reuse_report(cfg, target, stats),
        "padding": padding_report(target, stats),
        "config": to_container(cfg),
    }


def prefix_reuse_report(cfg: DictConfig, target: Target, stats: dict) -> dict:
    """Tokens run through the target against tokens emitted, bytes stored against a flat layout's."""
    return {"enabled": target.prefix_reuse or bool(getattr(target.capture, "prefix_caching", False)),
            "setting": cfg.capture.prefix_reuse, "decided": target.prefix_reuse_note,
            "min_tokens": cfg.capture.prefix_min_tokens,
            "store_prefix_once": target.spec.store_prefix_once,
            "tokens_computed": stats.get("tokens_computed", 0), "tokens_emitted": stats.get("tokens_emitted", 0),
            "bytes_stored": stats["bytes_on_disk"],
            "bytes_flat": bytes_flat(stats, target.spec) if stats["num_shards"] else 0}


def padding_report(target: Target, stats: dict) -> dict:
    """Tokens the target forwarded, padding included, against the real tokens it computed (every shard so far)."""
    forwarded, real = stats.get("padded_tokens", 0), stats.get("tokens_computed", 0)
    return {"packing": target.packing, "packing_off_because": target.packing_note,
            "forwarded_tokens": forwarded, "real_tokens": real, "ratio": round(forwarded / real, 4) if real else None}


def padding_summary(report: dict) -> str:
    how = "packed" if report["packing"] else f"padded ({report['packing_off_because'] or 'capture.packing=false'})"
    ratio = f" ({report['ratio']:.2f}x)" if report["ratio"] is not None else ""
    return f"{report['forwarded_tokens']:,} tokens forwarded for {report['real_tokens']:,} real{ratio}; {how}"


def prefix_reuse_summary(report: dict) -> str:
    computed, emitted = report["tokens_computed"], report["tokens_emitted"]
    stored, flat = report["bytes_stored"], report["bytes_flat"]
    compute = (f"{computed:,} tokens computed for {emitted:,} emitted ({emitted / max(computed, 1):.2f}x fewer)"
               if report["enabled"] else "off: every row computed in full")
    if report.get("decided"):  # how capture.prefix_reuse was decided (auto: by device)
        compute += f" ({report['decided']})"
    storage = (f"{human_bytes(stored)} stored vs {human_bytes(flat)} flat ({flat / max(stored, 1):.2f}x smaller)"
               if report["store_prefix_once"] else "flat layout")
    return f"{compute}; {storage}"


def beyond_positions(manifest: dict) -> bool:
    positions = manifest["capture"].get("max_positions")
    return bool(positions) and manifest["config"]["data"]["max_length"] > positions


def print_summary(manifest: dict, out_dir: Path, computed_tokens: int, seconds: float, processes: int = 1,
                  source_rows: str = "") -> None:
    stats = manifest["stats"]
    rejected = stats.get("rejected", {})
    rejected_text = f"{sum(rejected.values()):,}" + (
        f" ({', '.join(f'{k}: {v}' for k, v in sorted(rejected.items()))}; see rejected.jsonl)" if rejected else "")
    print(format_table([
        ("output", str(out_dir)),
        ("source", source_rows),
        ("target dtype", manifest.get("last_run", {}).get("dtype", manifest["dtype"])),
        ("samples", f"{stats['samples']:,} in {len(manifest['shards'])} shards"),
        ("tokens", f"{stats['tokens']:,} ({stats['trainable_tokens']:,} trainable)"),
        ("rejected rows", rejected_text),
        ("bytes on disk", f"{human_bytes(stats['bytes_on_disk'])} ({stats['bytes_per_token'] or 0:,.0f} B/token)"),
        ("prefix reuse", prefix_reuse_summary(manifest["prefix_reuse"])),
        ("padding", padding_summary(manifest["padding"])),
        *([("context", f"data.max_length={manifest['config']['data']['max_length']:,} is past the target's "
                       f"{manifest['capture']['max_positions']:,} positions: longer rows got states from outside "
                       "its trained context")]
          if beyond_positions(manifest) else []),
        ("throughput", f"{computed_tokens / max(seconds, 1e-9):,.0f} tokens/s over {computed_tokens:,} tokens "
                       f"captured in this run ({seconds:.1f}s, {processes} process{'es' * (processes > 1)}"
                       f"{'; decoder layers compiled' if manifest['capture'].get('compiled') else ''})"
                       if computed_tokens else
                       "nothing captured in this run (every unit already finished, or every row rejected)"),
    ]))


def require_samples(manifest: dict, out_dir: Path) -> None:
    """A dataset without a single sample is a failed run (a one-line error), not an empty success: the manifest and
    rejected.jsonl stay on disk to say why."""
    stats = manifest["stats"]
    if stats.get("samples", 0) == 0:
        rejected = stats.get("rejected", {})
        reasons = ", ".join(f"{reason}: {count}" for reason, count in sorted(rejected.items())) or "none rejected"
        raise SpecgenError(f"no usable sample in {out_dir}: {sum(rejected.values())} rows rejected ({reasons}); "
                           f"see {out_dir / 'rejected.jsonl'} for each row and its reason")
