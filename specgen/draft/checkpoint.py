"""Draft checkpoints in the layout vLLM's and SGLang's EAGLE-3 Llama loaders read (vLLM's reading of the ids).

    CKPT/config.json         LlamaConfig of the draft: architectures ["LlamaForCausalLMEagle3"], num_hidden_layers 1,
                             vocab_size (target), draft_vocab_size, target_hidden_size, norm_before_residual,
                             eagle_config.eagle_aux_hidden_state_layer_ids = specgen aux layers + 1 (vLLM reads them
                             as Hugging Face hidden_states indices), dtype = the stored weights' dtype, plus a
                             "specgen" section that loaders ignore: target path and config hash, aux_layers in
                             specgen's convention (0-based decoder-layer outputs), the format, training step, the weights'
                             sha256 in `checksums` (checked by load_draft)
    CKPT/model.safetensors   fc.weight, midlayer.*, norm.weight, lm_head.weight, d2t (int64), t2d (bool)

A training run's output.dir holds the latest draft in that layout (what evaluate, export and serving read; with
train.keep_best, the best probed one) and, under `checkpoints/`, the step-numbered checkpoints that
`train.resume=true` continues from (`Checkpoints`):

    OUT/checkpoints/step-000120/              config.json, model.safetensors, training_state/ (optimizer,
                                              scheduler and data position, to resume training exactly)
    OUT/checkpoints/latest                    the newest complete checkpoint's folder name
    OUT/checkpoints/best/                     train.keep_best: config.json and model.safetensors of the probed draft
                                              with the best figure (its step in config.json)

The token embedding is the target's and is not stored (as in the published EAGLE-3 drafts): both serving
engines, and `load_draft` here, take it from the target. Weights are stored in the training dtype (float32 master
weights) so resuming is exact; engines run the draft in the target's dtype. Other layouts (the SGLang, SpecForge
and speculators formats, the published EAGLE-3 drafts) are read through `specgen.draft.exports`.
"""

import json
import os
import re
import shutil
from pathlib import Path

import torch
from torch import nn
import transformers

from specgen import methods
from specgen.draft import exports
from specgen.draft.exports import CONFIG, WEIGHTS
from specgen.errors import SpecgenError
from specgen.store.commit import (
    TMP_SUFFIX,
    commit_file,
    fsync_dir,
    fsync_file,
    numbered_files,
    tmp_path,
    write_text_atomic,
)

TRAINING_STATE = "training_state"
CHECKPOINTS = "checkpoints"
LATEST = "latest"
BEST = "best"
_STEP = re.compile(r"step-(\d+)")
NOT_STORED = ("embed_tokens.weight",)  # the target's token embedding: every engine takes it from the target


def save_draft(draft: nn.Module, out_dir: str | Path, specgen_info: dict) -> None:
    """Write config.json and model.safetensors in the vllm format (each atomically), through the draft's method
    (`specgen.methods`), which records its name as config.json's `specgen.method`."""
    tensors = {name: tensor for name, tensor in draft.state_dict().items() if name not in NOT_STORED}
    config, tensors = methods.of_model(draft).export(draft.config, tensors, "vllm", info=specgen_info)
    exports.write_files(out_dir, config, tensors)


def read_raw_config(path: str | Path) -> dict:
    """config.json of a draft checkpoint folder, as stored."""
    folder = Path(path)
    if not (folder / CONFIG).is_file() or exports.weights_file(folder) is None:
        raise SpecgenError(f"draft.path {str(path)!r} is not a draft checkpoint (needs {CONFIG} and {WEIGHTS}); "
                           "point it at the output.dir of specgen.train")
    return json.loads((folder / CONFIG).read_text())


def read_draft_config(path: str | Path, *, target_config: transformers.PretrainedConfig | None = None,
                      foreign_ids: str = "layer_outputs") -> transformers.LlamaConfig:
    """The draft's config in specgen's form, from any supported layout (see `specgen.draft.exports`).

    `target_config` resolves the default aux layers of drafts that record none; `foreign_ids` says how to read the
    ids of a plain EAGLE-3 checkpoint specgen did not write.
    """
    num_layers = target_config.get_text_config().num_hidden_layers if target_config is not None else None
    return exports.canonical_config(read_raw_config(path), source=str(Path(path) / CONFIG),
                                    target_num_layers=num_layers, foreign_ids=foreign_ids)


def load_draft(path: str | Path, embedding: torch.Tensor | None = None, *,
               target_config: transformers.PretrainedConfig | None = None,
               foreign_ids: str = "layer_outputs", method: str | None = None) -> nn.Module:
    """Load a draft checkpoint through its method (`specgen.methods`); `embedding` is the target's input
    embedding (not stored in the checkpoint). `method` (draft.method), when set, must be the checkpoint's."""
    folder = Path(path)
    chosen = methods.resolve(method, read_raw_config(folder), folder)
    return chosen.load(folder, embedding=embedding, target_config=target_config, foreign_ids=foreign_ids)


def specgen_info(config: transformers.PretrainedConfig | dict) -> dict:
    """The "specgen" section of a draft config (or of a raw config.json dict)."""
    if isinstance(config, dict):
        return dict(config.get("specgen") or {})
    return dict(getattr(config, "specgen", None) or {})


class Checkpoints:
    """The step-numbered checkpoints of a training run: `OUT/checkpoints/step-NNNNNN/` (module docstring).

    A checkpoint is written into `step-NNNNNN.tmp/` (`staging`) and renamed to its final name only once complete
    (`commit`: every file fsync'd, the rename, the directory fsync'd), so a folder under a final name is always
    complete and a kill at any moment of a save leaves at worst a `.tmp` folder that the next run deletes. After the
    rename: the `latest` pointer (written atomically), then the draft published to OUT itself (config.json and
    model.safetensors, hard links to the checkpoint's files where the filesystem allows, each renamed into place),
    then checkpoints beyond the newest `keep` deleted (renamed to `.tmp` first, so a half-deleted one never looks
    complete). `latest()` is the newest complete checkpoint, whether or not the pointer was updated before a kill.
    Only the main process calls `begin` and `commit`; every process may write into `staging(step)` in between.
    """

    def __init__(self, out_dir: str | Path, keep: int = 2, *, publish_best: bool = False):
        if keep < 1:
            raise SpecgenError(f"train.keep_checkpoints must be at least 1 (the one to resume from), got {keep}")
        self.out_dir = Path(out_dir)
        self.root = self.out_dir / CHECKPOINTS
        self.keep = keep
        self.publish_best = publish_best  # train.keep_best: OUT gets checkpoints/best, not the newest checkpoint

    def complete(self) -> dict[int, Path]:
        """The complete checkpoints, by step (ascending)."""
        return numbered_files(self.root, _STEP) if self.root.is_dir() else {}

    def latest(self) -> Path | None:
        """The newest complete checkpoint (None: none)."""
        complete = self.complete()
        return complete[max(complete)] if complete else None

    def final(self, step: int) -> Path:
        return self.root / f"step-{step:06d}"

    def staging(self, step: int) -> Path:
        """Where the checkpoint of `step` is written before its commit."""
        return tmp_path(self.final(step))

    def remove_partial(self) -> None:
        """Delete what killed saves left: staging folders and checkpoints half-deleted by a prune."""
        if self.root.is_dir():
            for path in self.root.glob(f"*{TMP_SUFFIX}"):
                _remove(path)

    def begin(self, step: int) -> Path:
        """An empty staging folder for `step` (main process, before any process writes into it)."""
        staging = self.staging(step)
        _remove(staging)
        staging.mkdir(parents=True)
        return staging

    def commit(self, step: int) -> Path:
        """Make the complete staging folder of `step` the checkpoint of `step`; then the pointer, the published draft
        and the retention (class docstring). Returns the checkpoint's folder."""
        staging, final = self.staging(step), self.final(step)
        _fsync_tree(staging)
        if final.exists():  # the same step saved again (a resumed run re-reaching it): replace it
            _remove(final)
        commit_file(staging, final)
        self._write_latest(final)
        self._publish(self.best if self.publish_best and self.best.is_dir() else final)
        self._prune()
        return final

    @property
    def best(self) -> Path:
        """train.keep_best's folder: the draft of the best probe so far (not a checkpoint to resume from)."""
        return self.root / BEST

    def begin_best(self) -> Path:
        """An empty staging folder for a new best draft (main process)."""
        staging = tmp_path(self.best)
        _remove(staging)
        staging.mkdir(parents=True)
        return staging

    def commit_best(self) -> Path:
        """Make the complete staging folder the best draft, and publish it to OUT."""
        staging = tmp_path(self.best)
        _fsync_tree(staging)
        _remove(self.best)
        commit_file(staging, self.best)
        self._publish(self.best)
        return self.best

    def _write_latest(self, final: Path) -> None:
        write_text_atomic(self.root / LATEST, final.name + "\n")

    def _publish(self, final: Path) -> None:
        """The checkpoint's draft as OUT/model.safetensors + OUT/config.json (weights first: the config names
        their checksum)."""
        for name in (WEIGHTS, CONFIG):
            tmp = tmp_path(self.out_dir / name)
            tmp.unlink(missing_ok=True)
            try:
                os.link(final / name, tmp)
            except OSError:  # a filesystem without hard links
                shutil.copyfile(final / name, tmp)
            commit_file(tmp, self.out_dir / name)

    def _prune(self) -> None:
        for path in list(self.complete().values())[:-self.keep]:
            _remove(path)


def _remove(path: Path) -> None:
    """Delete a folder so that a kill midway never leaves it under a name that looks complete (a file, such as the
    `latest` pointer's temporary a kill left, is just unlinked)."""
    if not path.exists():
        return
    if not path.is_dir():
        path.unlink()
        return
    if not path.name.endswith(TMP_SUFFIX):
        doomed = path.with_name(path.name + ".old" + TMP_SUFFIX)
        _remove(doomed)
        os.replace(path, doomed)
        fsync_dir(path.parent)
        path = doomed
    shutil.rmtree(path)


def _fsync_tree(folder: Path) -> None:
    """Flush every file and folder below `folder` (DeepSpeed's own files are not fsync'd when written)."""
    for root, dirs, files in os.walk(folder):
        for name in files:
            fsync_file(Path(root) / name)
        fsync_dir(root)
