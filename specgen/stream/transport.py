"""Where captured batches travel from capture servers to trainers: named objects of tensors.

A transport stores an object under a batch's name (`put`), hands it over (`get`), and frees it (`delete`) once the
trainer has taken it. `FileTransport` keeps each object as a safetensors file in a folder: on one machine that
folder can be tmpfs (`/dev/shm`), across machines a shared filesystem (NFS, Lustre, GPFS), as speculators'
filesystem connector does. An object appears under its name only when complete (written under a temporary name of
the writer's own, then renamed), so a reader never sees half an object and two servers writing the same batch
cannot collide.
"""

import json
import os
import uuid
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from specgen.errors import SpecgenError

SUFFIX = ".safetensors"


class UnreadableObject(SpecgenError):
    """An object exists but cannot be read (damaged, or from an incompatible writer)."""


class FileTransport:
    """Objects as safetensors files in `root` (tensors plus a small JSON metadata dict)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def put(self, name: str, tensors: dict[str, torch.Tensor], meta: dict) -> int:
        """Store the object `name`; returns its size in bytes (measured before it appears: a trainer may take and
        delete it at once)."""
        path = self._path(name)
        tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex}.tmp")
        try:
            save_file({key: value.contiguous() for key, value in tensors.items()}, str(tmp),
                      metadata={"meta": json.dumps(meta)})
            size = tmp.stat().st_size
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return size

    def get(self, name: str) -> tuple[dict[str, torch.Tensor], dict] | None:
        """The object's tensors and metadata, or None while it is not there."""
        path = self._path(name)
        if not path.exists():
            return None
        try:
            with safe_open(str(path), framework="pt") as handle:  # one open for the tensors and the metadata
                meta = json.loads((handle.metadata() or {}).get("meta", "{}"))
                return {key: handle.get_tensor(key) for key in handle.keys()}, meta
        except FileNotFoundError:
            return None
        except (SafetensorError, OSError, ValueError) as error:
            raise UnreadableObject(f"{path} cannot be read ({error})") from error

    def has(self, name: str) -> bool:
        return self._path(name).exists()

    def delete(self, name: str) -> None:
        self._path(name).unlink(missing_ok=True)

    def nbytes(self) -> int:
        """Bytes of the objects stored now (temporary files of writes under way included)."""
        total = 0
        for path in self.root.iterdir():
            try:
                total += path.stat().st_size
            except FileNotFoundError:
                pass
        return total

    def _path(self, name: str) -> Path:
        return self.root / f"{name}{SUFFIX}"
