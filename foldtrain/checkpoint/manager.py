"""Checkpoints with torch.distributed.checkpoint (DCP): atomic, verified, resumable, pruned.

Layout of ``<run>/checkpoints``::

    step_00000020/            a complete checkpoint (only ever appears by an atomic rename)
        .metadata, *.distcp   DCP: model, optimizer, LR schedule, loss scaler (sharded layouts work)
        rank{r}.pt            per-rank state that is not shared: RNG states (tensors and plain values only)
        meta.json             step, data position, world layout, model shape, and the size and sha256
                              of every other file; written last
    step_00000030.tmp/        a save in progress, or one a crash interrupted (ignored, removed later)

A save writes everything into ``step_X.tmp``; every rank hashes the files it wrote, rank 0 gathers
the digests, writes ``meta.json`` and renames the directory to ``step_X``: a crash mid-save leaves
the previous checkpoint as the latest usable one. A load verifies the checksums before anything is
unpickled or read into a model, and reads with the restricted loaders of ``safe_load.py``.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import BlockingAsyncStager

from foldtrain import faults
from foldtrain.checkpoint.integrity import HASH, META, damage, describe
from foldtrain.checkpoint.safe_load import (
    SafePlanner,
    SafeReader,
    UnsafePickle,
    load_metadata,
    load_rank_state,
    save_rank_state,
    set_rng_state,
)
from foldtrain.errors import CheckpointError

_STEP_DIR = re.compile(r"^step_(\d{8})$")


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
        self._verified: dict[Path, tuple[int, int]] = {}  # path -> meta.json (mtime_ns, size) when it was verified
        self._side_group = None  # gloo group of the background writes (never used by the training thread meanwhile)
        self._pending: threading.Thread | None = None  # the save being written in the background, at most one
        self._pending_error: BaseException | None = None

    # ------------------------------------------------------------------ discovery
    def checkpoints(self) -> list[Path]:
        """Complete (renamed) checkpoints, oldest first; intact or not."""
        if not self.root.is_dir():
            return []
        try:
            found = [p for p in self.root.iterdir() if _STEP_DIR.match(p.name) and p.is_dir()]
        except OSError as e:
            raise CheckpointError(
                f"cannot list checkpoints in {self.root} ({e.strerror}); fix its permissions or choose another --out"
            ) from None
        return sorted(found, key=lambda p: p.name)

    def latest(self) -> Path | None:
        ckpts = self.checkpoints()
        return ckpts[-1] if ckpts else None

    def damage(self, path: Path) -> str | None:
        """Why ``path`` is not intact (one phrase naming the file), or None; a verified path is not hashed twice."""
        stamp = _stamp(path)
        if stamp is not None and self._verified.get(path) == stamp:
            return None
        why = damage(path)
        if why is None and stamp is not None:
            self._verified[path] = stamp
        return why

    def newest_intact(self, below: Path | None = None) -> tuple[Path | None, list[tuple[Path, str]]]:
        """The newest intact checkpoint (older than ``below`` if given) and the damaged ones skipped on the way."""
        skipped = []
        for path in reversed(self.checkpoints()):
            if below is not None and path.name >= below.name:
                continue
            why = self.damage(path)
            if why is None:
                return path, skipped
            skipped.append((path, why))
        return None, skipped

    def require_intact(self, path: Path, fix: str) -> None:
        """Raise one line naming the damaged file and the newest intact checkpoint, if ``path`` is damaged."""
        why = self.damage(path)
        if why is None:
            return
        intact, _ = self.newest_intact(below=path)
        if intact is not None:
            hint = f"the newest intact checkpoint is {intact} (delete {path.name} to resume from it)"
        else:
            hint = "no intact checkpoint remains (start a new run with another --out)"
        raise CheckpointError(f"checkpoint {path} is corrupt: {why}; {hint}; {fix}")

    # ------------------------------------------------------------------ save
    def save(
        self,
        step: int,
        state: dict[str, Any],
        meta: dict[str, Any],
        extra: dict[str, Any] | None = None,
        background: bool = False,
    ) -> Path:
        """Save ``state`` (DCP, collective over all ranks) plus this rank's ``extra``; atomic and checksummed.

        ``extra`` may hold tensors, numbers, strings, lists and dicts (it is loaded with ``weights_only``).
        With ``background`` the state is staged to host memory here and written, hashed and renamed by a
        background thread (DCP's ``async_save``); :meth:`wait` completes it. A pending save is always
        completed before the next one starts.
        """
        self.wait()
        final = self.root / f"step_{step:08d}"
        tmp = self.root / f"step_{step:08d}.tmp"
        needed = self._needed(state)
        self._check_space(step, needed)
        try:
            self._prepare(tmp)
            save_rank_state(tmp / f"rank{_rank()}.pt", extra or {})
            if background:
                group = self._background_group()
                # DCP's default stager cannot copy a ShardedTensor (the distributed optimizer's slices); the
                # blocking one can, and stages here, as the default does for the others
                stager = {"async_stager": BlockingAsyncStager()} if _has_sharded(state) else {}
                with _single_process_ok():
                    future = dcp.async_save(
                        state, checkpoint_id=str(tmp), process_group=group, no_dist=not dist.is_initialized(), **stager
                    )
                self._pending = threading.Thread(
                    target=self._finish_background,
                    args=(future, step, tmp, final, meta, needed, group),
                    name=f"checkpoint-step-{step}",
                    daemon=True,  # a crash of the training loses this save, never the previous one
                )
                self._pending.start()
                return final
            with _single_process_ok():
                dcp.save(state, checkpoint_id=str(tmp), process_group=self.process_group)
            faults.point("save")
            self._commit(step, tmp, final, meta, self.process_group)
        except (OSError, CheckpointException) as e:  # DCP raises CheckpointException (a BaseException) on every rank
            raise self._save_error(e, step, tmp, final, needed) from None
        _barrier()
        return final

    def wait(self) -> None:
        """Complete the save in flight, if any; raise its error here, on the training thread."""
        if self._pending is None:
            return
        self._pending.join()
        self._pending = None
        error, self._pending_error = self._pending_error, None
        if error is not None:
            raise error

    @property
    def in_flight(self) -> bool:
        return self._pending is not None and self._pending.is_alive()

    def _prepare(self, tmp: Path) -> None:
        if _rank() == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        _barrier()

    def _background_group(self):
        """A gloo group of the checkpoint's ranks for the background writes: collectives of the training thread
        and of the writer must never share a group (their order would differ between ranks)."""
        if self._side_group is None and dist.is_initialized():
            ranks = None if self.process_group is None else dist.get_process_group_ranks(self.process_group)
            self._side_group = dist.new_group(ranks=ranks, backend="gloo")
        return self._side_group

    def _finish_background(self, future, step, tmp, final, meta, needed, group) -> None:
        try:
            future.result()
            faults.point("save")
            self._commit(step, tmp, final, meta, group)
            if dist.is_initialized():
                dist.barrier(group=group)  # every rank's wait() returns after the rename
        except (Exception, CheckpointException) as e:  # reported on the training thread by wait()
            self._pending_error = self._save_error(e, step, tmp, final, needed)

    def _commit(self, step: int, tmp: Path, final: Path, meta: dict[str, Any], group) -> None:
        """Hash every rank's files, write meta.json (rank 0) and rename ``tmp`` to ``final`` atomically."""
        digests = self._gather_digests(tmp, group)
        if _rank() != 0:
            return
        files = {k: v for part in digests for k, v in part.items()}
        missing = {p.name for p in tmp.iterdir()} - files.keys() - {META}
        files.update(describe(tmp, missing))  # anything no rank claimed (another DCP file naming)
        with open(tmp / META, "w") as f:
            f.write(json.dumps({"step": step, **meta, "hash": HASH, "files": dict(sorted(files.items()))}, indent=1))
            f.flush()
            os.fsync(f.fileno())
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

    def _save_error(self, e: BaseException, step: int, tmp: Path, final: Path, needed: int) -> CheckpointError:
        """One line for a failed save; nothing partial stays behind (a resume would ignore it anyway)."""
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        # a full disk shows as ENOSPC, or inside DCP as a torn file ("unexpected pos"): judge by the free space
        full = (isinstance(e, OSError) and e.errno == errno.ENOSPC) or _free_bytes(self.root) < needed
        if not full:
            why = e.strerror if isinstance(e, OSError) and e.strerror else _first_line(e)
            return CheckpointError(
                f"could not write checkpoint {final} ({why}); fix {self.root} or choose another --out"
            )
        return CheckpointError(
            f"no space left in {self.root} while saving step {step}: the checkpoint needs about "
            f"{_mib(needed)} ({_free(self.root)} free); the previous checkpoint is intact, "
            "free space or choose another --out, then --resume"
        )

    def _needed(self, state: dict[str, Any]) -> int:
        """Bytes a save will write: the newest checkpoint's size, or the tensors of ``state`` if there is none."""
        latest = self.latest()
        if latest is not None:
            try:
                files = json.loads((latest / META).read_text())["files"]
                return sum(int(f["bytes"]) for f in files.values())
            except (OSError, ValueError, KeyError, TypeError):
                pass
        return _state_bytes(state)

    def _check_space(self, step: int, needed: int) -> None:
        """Refuse a save of ``needed`` bytes that cannot fit, before anything is written."""
        try:
            probe = self.root if self.root.is_dir() else self.root.parent
            free = shutil.disk_usage(probe).free
        except OSError:
            return
        # no collective here: a save can run beside deferred reductions in flight on other groups, and a
        # rank's extra collective there stalled the pipeline's checkpoint tests; ranks writing to one
        # file system see the same free space and decide alike
        if needed > free:
            raise CheckpointError(
                f"not enough space in {self.root} to save step {step}: the checkpoint needs about {_mib(needed)}, "
                f"{_mib(free)} free; the previous checkpoint is intact, free space or choose another --out, "
                "then --resume"
            )

    def _gather_digests(self, tmp: Path, group) -> list[dict]:
        """Each rank hashes the files it wrote (DCP's ``__{r}_*``, its ``rank{r}.pt``, rank 0 ``.metadata``)."""
        pg_rank = dist.get_rank(group) if dist.is_initialized() else 0
        mine = {f"rank{_rank()}.pt"} | {p.name for p in tmp.glob(f"__{pg_rank}_*")}
        if pg_rank == 0:
            mine.add(".metadata")
        part = describe(tmp, mine)
        if not dist.is_initialized():
            return [part]
        parts: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, part, group=group)
        return parts

    def _prune(self) -> None:
        ckpts = self.checkpoints()
        for old in ckpts[: max(0, len(ckpts) - self.keep)]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in [*self.root.glob("step_*.tmp"), *self.root.glob("step_*.old")]:  # left by a crash mid-save
            shutil.rmtree(stale, ignore_errors=True)

    # ------------------------------------------------------------------ load
    def load(self, path: Path, state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Verify ``path``, then load ``state`` in place from it; returns (meta, this rank's extra). Restores RNG."""
        self.require_intact(path, "nothing was loaded")
        meta = json.loads((path / META).read_text())
        extra_file = path / f"rank{_rank()}.pt"
        if not extra_file.is_file():
            raise CheckpointError(
                f"checkpoint {path} has no state for rank {_rank()} (saved by {meta.get('world_size', '?')} ranks); "
                "resume with the same layout"
            )
        rng, extra = load_rank_state(extra_file)  # before DCP: it refuses code outright
        _dcp_load(state, path, self.process_group, "delete it to resume from an earlier one, or drop --resume")
        set_rng_state(rng)
        return meta, extra


def _is_sharded(obj) -> bool:
    """Whether ``obj`` is a ShardedTensor (the distributed optimizer's slices)."""
    return isinstance(obj, torch.Tensor) and callable(getattr(obj, "local_shards", None))


def _has_sharded(obj) -> bool:
    """Whether a (nested) state dict holds a ShardedTensor."""
    if isinstance(obj, dict):
        return any(_has_sharded(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_sharded(v) for v in obj)
    return _is_sharded(obj)


def _state_bytes(obj) -> int:
    """Bytes of the tensors in a (nested) state dict, this rank's shards only."""
    if isinstance(obj, torch.Tensor):
        if _is_sharded(obj):
            return sum(s.tensor.numel() * s.tensor.element_size() for s in obj.local_shards())
        local = getattr(obj, "_local_tensor", obj)
        return local.numel() * local.element_size()
    if isinstance(obj, dict):
        return sum(_state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_state_bytes(v) for v in obj)
    return 0


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _free_bytes(path: Path) -> int:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 1 << 62  # unknown: assume the failure was not a full disk


def _free(path: Path) -> str:
    free = _free_bytes(path)
    return _mib(free) if free < 1 << 62 else "unknown"


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        st = (path / META).stat()
        return st.st_mtime_ns, st.st_size
    except OSError:
        return None


def _dcp_load(state: dict, path: Path, process_group, fix: str) -> None:
    try:
        load_metadata((path / ".metadata").read_bytes())  # refused here, before DCP (which retries other files)
        with _single_process_ok():
            dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafePlanner(), process_group=process_group)
    except UnsafePickle as e:
        raise CheckpointError(
            f"checkpoint {path}: .metadata refers to {e}, which is not checkpoint metadata; "
            "refusing to load it (not written by foldtrain)"
        ) from None
    except (Exception, CheckpointException) as e:  # DCP raises many types (CheckpointException is a BaseException)
        unsafe = _unsafe_cause(e)
        if unsafe:
            raise CheckpointError(
                f"checkpoint {path}: {unsafe}; refusing to load it (not written by foldtrain)"
            ) from None
        raise CheckpointError(
            f"checkpoint {path} is corrupt or does not match this model ({_first_line(e)}); {fix}"
        ) from None


def _unsafe_cause(e: BaseException) -> str | None:
    """DCP wraps per-rank failures; find a refused pickle among them."""
    text = str(e)
    if "UnsafePickle" in text or "Unsupported global" in text or "Weights only load failed" in text:
        return "a stored value is not plain data (refused by the restricted unpickler)"
    return None


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
    """Load only the model weights of a verified checkpoint (for eval/generate), on one process."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    if path is None or not (Path(path) / ".metadata").is_file():
        raise CheckpointError(f"no checkpoint at {path}; train first or pass --checkpoint DIR of a saved step")
    path = Path(path)
    CheckpointManager(path.parent).require_intact(path, "pass another --checkpoint")
    state = {"model": get_model_state_dict(model)}
    _dcp_load(state, path, None, "pass another --checkpoint")
    set_model_state_dict(model, state["model"])


def _first_line(e: BaseException) -> str:
    """The innermost meaningful line of a (possibly multi-rank, multi-line) DCP error."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip() and not line.startswith((" ", "Traceback"))]
    msg = lines[-1] if lines else type(e).__name__
    return msg[:160]
