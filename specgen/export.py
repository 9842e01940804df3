"""`python -m specgen.export draft.path=CKPT output.dir=DIR export.format=FORMAT`: a draft in an engine's layout.

Reads any layout specgen reads (`specgen.draft.checkpoint.load_draft`) and writes config.json + model.safetensors
in FORMAT (`specgen.draft.exports.FORMATS`): vllm (specgen.train's own), sglang, specforge or speculators. A format
that cannot represent the draft (aux layer count, layer variant) refuses with a one-line error.
"""

if __name__ == "__main__":  # a config error or `--cfg job` is answered before torch is imported (specgen.config)
    from specgen.config import check_command_line

    check_command_line("export")

import logging
from pathlib import Path

import torch
import transformers
from omegaconf import DictConfig

from specgen import methods
from specgen.config import stage_main
from specgen.draft import exports
from specgen.draft.aux import aux_layers_of
from specgen.draft.checkpoint import load_draft, read_raw_config, specgen_info
from specgen.errors import SpecgenError
from specgen.progress import format_table
from specgen.store.lease import hold_lease

log = logging.getLogger("specgen.export")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def run(cfg: DictConfig) -> dict:
    if cfg.draft.path is None:
        raise SpecgenError("pass draft.path=CKPT (a draft checkpoint) and output.dir=DIR")
    fmt = cfg.export.format
    out_dir = Path(cfg.output.dir)
    if (out_dir / exports.CONFIG).exists() and not cfg.output.overwrite:
        raise SpecgenError(f"{out_dir} already holds a checkpoint; pass output.overwrite=true or another output.dir")
    if out_dir.resolve() == Path(cfg.draft.path).resolve():
        raise SpecgenError("output.dir is draft.path: export into another folder")

    raw = read_raw_config(cfg.draft.path)
    methods.resolve(cfg.draft.method, raw, cfg.draft.path)  # a method mismatch fails here, before any loading
    info = specgen_info(raw)
    target = cfg.model.path or info.get("target", {}).get("path")
    target_config = transformers.AutoConfig.from_pretrained(target) if target and Path(target).is_dir() else None
    draft = load_draft(cfg.draft.path, target_config=target_config, foreign_ids=cfg.draft.foreign_aux_ids,
                       method=cfg.draft.method)
    tensors = {name: tensor for name, tensor in draft.state_dict().items() if name != "embed_tokens.weight"}
    if cfg.export.dtype is not None:
        dtype = DTYPES[cfg.export.dtype]
        tensors = {name: t.to(dtype) if t.is_floating_point() else t for name, t in tensors.items()}
    record = {**draft.config.specgen, "exported_from": str(Path(cfg.draft.path).resolve())}
    if target:
        record["target"] = {**record.get("target", {}), "path": str(target)}
    config, tensors = methods.of_model(draft).export(draft.config, tensors, fmt, info=record,
                                                     speculative_tokens=cfg.export.speculative_tokens,
                                                     verifier=target)
    with hold_lease(out_dir, stage="export"):  # another job writing output.dir is refused in one line
        exports.write_files(out_dir, config, tensors)
    method = methods.of_model(draft).name
    ids_key, ids, meaning = _ids_written(config, fmt)
    summary = {"format": fmt, "method": method, "output": str(out_dir), "aux_layers": aux_layers_of(draft.config),
               ids_key: ids, "dtype": exports.stored_dtype(tensors)}
    print(format_table([
        ("exported", f"{cfg.draft.path} -> {out_dir} ({fmt}, {method})"),
        ("aux layers", f"{summary['aux_layers']} (0-based decoder-layer outputs), written as {ids_key} "
                       f"{ids}: {meaning}"),
        ("weights", summary["dtype"]),
    ]))
    return summary


def _ids_written(config: dict, fmt: str) -> tuple[str, list[int], str]:
    """(field name, ids, what they mean) of the aux layers as the exported config.json records them."""
    if "dflash_config" in config:
        return ("target_layer_ids", config["dflash_config"]["target_layer_ids"],
                "dflash_config.target_layer_ids = the aux layers (vLLM reads them as eagle aux ids + 1)")
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or \
        config["eagle_aux_hidden_state_layer_ids"]
    return "eagle_aux_hidden_state_layer_ids", ids, exports.ID_MEANING[fmt]


main = stage_main("export")(run)

if __name__ == "__main__":
    main()
