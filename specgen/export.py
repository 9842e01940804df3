"""`python -m specgen.export draft.path=CKPT output.dir=DIR export.format=FORMAT`: a draft in an engine's layout.

Reads any layout specgen reads (`specgen.draft.checkpoint.load_draft`) and writes config.json + model.safetensors
in FORMAT (`specgen.draft.formats.FORMATS`): vllm (specgen.train's own), sglang, specforge or speculators. A format
that cannot represent the draft (aux layer count, layer variant) refuses with a one-line error.
"""

import logging
from pathlib import Path

import torch
import transformers
from omegaconf import DictConfig

from specgen.config import stage_main
from specgen.draft import formats
from specgen.draft.checkpoint import load_draft, read_raw_config, specgen_info
from specgen.draft.dflash import method_of, require_method
from specgen.draft.dflash_serving import load_dflash, save_dflash
from specgen.draft.model import aux_layers_of
from specgen.errors import SpecgenError
from specgen.progress import format_table
from specgen.store.lease import hold_lease

log = logging.getLogger("specgen.export")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def run(cfg: DictConfig) -> dict:
    if cfg.draft.path is None:
        raise SpecgenError("pass draft.path=CKPT (a draft checkpoint) and output.dir=DIR")
    fmt = cfg.export.format
    if fmt not in formats.FORMATS:
        raise SpecgenError(f"export.format={fmt!r} is unknown; use one of {list(formats.FORMATS)}")
    if cfg.export.dtype is not None and cfg.export.dtype not in DTYPES:
        raise SpecgenError(f"export.dtype={cfg.export.dtype!r}; use one of {list(DTYPES)} or null")
    out_dir = Path(cfg.output.dir)
    if (out_dir / formats.CONFIG).exists() and not cfg.output.overwrite:
        raise SpecgenError(f"{out_dir} already holds a checkpoint; pass output.overwrite=true or another output.dir")
    if out_dir.resolve() == Path(cfg.draft.path).resolve():
        raise SpecgenError("output.dir is draft.path: export into another folder")

    raw = read_raw_config(cfg.draft.path)
    if cfg.draft.method is not None:
        require_method(raw, cfg.draft.method, str(cfg.draft.path), "specgen.export")
    if method_of(raw) == "dflash":
        return _export_dflash(cfg, out_dir)
    info = specgen_info(raw)
    target = cfg.model.path or info.get("target", {}).get("path")
    target_config = transformers.AutoConfig.from_pretrained(target) if target and Path(target).is_dir() else None
    draft = load_draft(cfg.draft.path, target_config=target_config, foreign_ids=cfg.draft.foreign_aux_ids)
    tensors = {name: tensor for name, tensor in draft.state_dict().items() if name != "embed_tokens.weight"}
    if cfg.export.dtype is not None:
        dtype = DTYPES[cfg.export.dtype]
        tensors = {name: t.to(dtype) if t.is_floating_point() else t for name, t in tensors.items()}
    record = {**draft.config.specgen, "exported_from": str(Path(cfg.draft.path).resolve())}
    if target:
        record["target"] = {**record.get("target", {}), "path": str(target)}
    config, tensors = formats.export_files(draft.config, tensors, fmt, info=record,
                                           speculative_tokens=cfg.export.speculative_tokens, verifier=target)
    with hold_lease(out_dir, stage="export"):  # another job writing output.dir is refused in one line
        formats.write_files(out_dir, config, tensors)
    summary = {"format": fmt, "output": str(out_dir), "aux_layers": aux_layers_of(draft.config),
               "eagle_aux_hidden_state_layer_ids": _ids_written(config), "dtype": formats.stored_dtype(tensors)}
    print(format_table([
        ("exported", f"{cfg.draft.path} -> {out_dir} ({fmt})"),
        ("aux layers", f"{summary['aux_layers']} (0-based decoder-layer outputs), written as "
                       f"{summary['eagle_aux_hidden_state_layer_ids']}: {formats.ID_MEANING[fmt]}"),
        ("weights", summary["dtype"]),
    ]))
    return summary


def _export_dflash(cfg: DictConfig, out_dir: Path) -> dict:
    """A DFlash draft in the one layout that serves it (vLLM `method="dflash"`, specgen.draft.dflash_serving)."""
    if cfg.export.format != "vllm":
        raise SpecgenError(f"{cfg.draft.path} is a DFlash draft: export.format={cfg.export.format} holds EAGLE-3 "
                           "drafts only; use export.format=vllm (served with method=dflash)")
    draft = load_dflash(cfg.draft.path)
    info = {**draft.config.specgen, "exported_from": str(Path(cfg.draft.path).resolve())}
    info.pop("checksums", None)
    if cfg.model.path:
        info["target"] = {**info.get("target", {}), "path": str(cfg.model.path)}
    with hold_lease(out_dir, stage="export"):
        save_dflash(draft, out_dir, info, dtype=DTYPES[cfg.export.dtype] if cfg.export.dtype else None)
    ids = draft.config.dflash_config["target_layer_ids"]
    print(format_table([
        ("exported", f"{cfg.draft.path} -> {out_dir} (DFlash, vLLM method=dflash)"),
        ("target layers", f"{ids} (0-based decoder-layer outputs = dflash_config.target_layer_ids)"),
    ]))
    return {"format": "vllm", "method": "dflash", "output": str(out_dir), "aux_layers": ids,
            "target_layer_ids": ids}


def _ids_written(config: dict) -> list[int]:
    return (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or \
        config["eagle_aux_hidden_state_layer_ids"]


main = stage_main("export")(run)

if __name__ == "__main__":
    main()
