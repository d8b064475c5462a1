"""Loading checkpoint files without running code from them.

PyTorch 2.13's DCP unpickles two things on load: the ``.metadata`` file (``pickle.load`` in
``FileSystemReader.read_metadata``) and every non-tensor value of the state dict stored in the
``.distcp`` files (``torch.load(..., weights_only=False)`` in ``DefaultLoadPlanner.load_bytes``).
Either would run whatever a crafted file says. Here:

* ``.metadata`` is read by an unpickler that resolves only DCP's own metadata classes, ``torch.Size``,
  dtypes, layouts and paths — any other global (``os.system``, a ``__reduce__`` gadget) is refused;
* non-tensor values are read with ``torch.load(weights_only=True)`` (plain containers and numbers);
* the per-rank file ``rank{r}.pt`` holds only tensors, numbers and strings (RNG states converted to
  tensors) and is read with ``weights_only=True``.

On top of that, nothing is opened before the checkpoint's checksums are verified (``integrity.py``).
"""

from __future__ import annotations

import io
import pickle
import random
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element  # as DefaultLoadPlanner.load_bytes does
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from foldtrain.errors import CheckpointError

_DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}


class UnsafePickle(Exception):
    """A pickle asked for something other than plain checkpoint metadata."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == _DCP_METADATA_MODULE:
            obj = getattr(dcp_metadata, name, None)
            if (
                isinstance(obj, type)
                and obj.__module__ == _DCP_METADATA_MODULE
                and (hasattr(obj, "__dataclass_fields__") or issubclass(obj, Enum))
            ):
                return obj
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        elif (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise UnsafePickle(f"{module}.{name}")


def load_metadata(data: bytes) -> Metadata:
    """Unpickle DCP metadata allowing only metadata classes; raises ``UnsafePickle``."""
    md = _MetadataUnpickler(io.BytesIO(data)).load()
    if not isinstance(md, Metadata):
        raise UnsafePickle(type(md).__name__)
    return md


class SafeReader(FileSystemReader):
    """DCP's file-system reader with the restricted metadata unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        with self.fs.create_stream(self._get_metadata_path(rank), "rb") as f:
            md = load_metadata(f.read())
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class SafePlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor values with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


# ---------------------------------------------------------------------- per-rank state
def rng_state() -> dict[str, Any]:
    """This process's RNG states as tensors, numbers and strings only (loadable with weights_only)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        },
        "python": {"version": version, "internal": torch.tensor(internal, dtype=torch.int64), "gauss_next": gauss_next},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    n, p = state["numpy"], state["python"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    random.setstate((p["version"], tuple(int(v) for v in p["internal"].tolist()), p["gauss_next"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_rank_state(path: Path, extra: dict[str, Any]) -> None:
    torch.save({"rng": rng_state(), "extra": extra}, path)


def load_rank_state(path: Path) -> tuple[dict, dict]:
    """(rng state, extra) from ``rank{r}.pt``; refuses anything but tensors and plain values."""
    try:
        obj = torch.load(path, weights_only=True)
        return obj["rng"], obj["extra"]
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{path} holds more than tensors and plain values ({_first_line(e)}); "
            "it was not written by this foldtrain, refusing to load it"
        ) from None
    except Exception as e:
        raise CheckpointError(f"{path} is corrupt ({type(e).__name__}); resume from an earlier checkpoint") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    for line in text.splitlines():
        if "Unsupported global" in line or "GLOBAL" in line:
            return line.strip()[:160]
    return (text.splitlines() or [type(e).__name__])[0][:160]
