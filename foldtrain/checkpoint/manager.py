"""Checkpoints with torch.distributed.checkpoint (DCP): atomic, resumable, pruned.

Layout of ``<run>/checkpoints``::

    step_00000020/            a complete checkpoint (only ever appears by an atomic rename)
        .metadata, *.distcp   DCP: model, optimizer, LR schedule, loss scaler (sharded layouts work)
        rank{r}.pt            per-rank state that is not shared: RNG states
        meta.json             step, data position, world layout, model shape
    step_00000030.tmp/        a save in progress, or one a crash interrupted (ignored, removed later)

A save writes everything into ``step_X.tmp``, waits for all ranks, then rank 0 renames it to
``step_X``: a crash mid-save leaves the previous checkpoint as the latest usable one.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from foldtrain.errors import CheckpointError

_STEP_DIR = re.compile(r"^step_(\d{8})$")


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


@contextmanager
def _single_process_ok():
    """DCP warns that it assumes a single process when no process group exists: that is intended here."""
    with warnings.catch_warnings():
        if not dist.is_initialized():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


class CheckpointManager:
    def __init__(self, root: str | Path, keep: int = 3, process_group=None):
        self.root = Path(root)
        self.keep = keep
        self.process_group = process_group

    # ------------------------------------------------------------------ discovery
    def checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)]
        return sorted(found, key=lambda p: p.name)

    def latest(self) -> Path | None:
        ckpts = self.checkpoints()
        return ckpts[-1] if ckpts else None

    # ------------------------------------------------------------------ save
    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any], extra: dict[str, Any] | None = None) -> Path:
        """Save ``state`` (DCP, collective over all ranks) plus this rank's ``extra``; atomic."""
        final = self.root / f"step_{step:08d}"
        tmp = self.root / f"step_{step:08d}.tmp"
        if _rank() == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        _barrier()
        with _single_process_ok():
            dcp.save(state, checkpoint_id=str(tmp), process_group=self.process_group)
        torch.save({"rng": rng_state(), **(extra or {})}, tmp / f"rank{_rank()}.pt")
        _barrier()
        if _rank() == 0:
            (tmp / "meta.json").write_text(json.dumps({"step": step, **meta}, indent=1))
            _fsync_dir(tmp)
            if final.exists():  # re-saving a step (e.g. the final save after a periodic one)
                old = final.with_name(final.name + ".old")
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
            _fsync_dir(self.root)
            self._prune()
        _barrier()
        return final

    def _prune(self) -> None:
        ckpts = self.checkpoints()
        for old in ckpts[: max(0, len(ckpts) - self.keep)]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in self.root.glob("step_*.tmp"):  # left by a crash mid-save
            shutil.rmtree(stale, ignore_errors=True)

    # ------------------------------------------------------------------ load
    def load(self, path: Path, state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Load ``state`` in place from ``path``; returns (meta, this rank's extra). Restores RNG."""
        meta_file = path / "meta.json"
        if not (path / ".metadata").is_file() or not meta_file.is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete (no .metadata or meta.json); delete it to resume from an earlier one, or drop --resume")
        try:
            meta = json.loads(meta_file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CheckpointError(f"checkpoint {path} has a corrupt meta.json; delete it to resume from an earlier one, or drop --resume") from None
        try:
            with _single_process_ok():
                dcp.load(state, checkpoint_id=str(path), process_group=self.process_group)
        except (Exception, CheckpointException) as e:  # DCP raises many types (CheckpointException is a BaseException)
            raise CheckpointError(f"checkpoint {path} is corrupt or does not match this model ({_first_line(e)}); delete it to resume from an earlier one, or drop --resume") from None
        extra_file = path / f"rank{_rank()}.pt"
        if not extra_file.is_file():
            raise CheckpointError(f"checkpoint {path} has no state for rank {_rank()} (saved with another world size?); resume with the same layout")
        try:
            extra = torch.load(extra_file, weights_only=False)
        except Exception:
            raise CheckpointError(f"checkpoint {path}: {extra_file.name} is corrupt; delete the checkpoint to resume from an earlier one") from None
        set_rng_state(extra.pop("rng"))
        return meta, extra


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def load_model_weights(model: torch.nn.Module, path: Path | None) -> None:
    """Load only the model weights of a checkpoint (for eval/generate), on one process."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    if path is None or not (Path(path) / ".metadata").is_file():
        raise CheckpointError(f"no checkpoint at {path}; train first or pass --checkpoint DIR of a saved step")
    state = {"model": get_model_state_dict(model)}
    try:
        with _single_process_ok():
            dcp.load(state, checkpoint_id=str(path))
    except (Exception, CheckpointException) as e:
        raise CheckpointError(f"checkpoint {path} is corrupt or does not match this model ({_first_line(e)}); pass another --checkpoint") from None
    set_model_state_dict(model, state["model"])


def _first_line(e: BaseException) -> str:
    """The innermost meaningful line of a (possibly multi-rank, multi-line) DCP error."""
    lines = [l.strip() for l in str(e).splitlines() if l.strip() and not l.startswith((" ", "Traceback"))]
    msg = lines[-1] if lines else type(e).__name__
    return msg[:160]
