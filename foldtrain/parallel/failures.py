"""Who is to blame when communication fails: forensics through the rendezvous store and ``/proc``.

A communication error (a peer died, or stalled past ``--dp.timeout_s``) becomes one line naming
the rank: the peer of a failed point-to-point transfer; a peer on this host whose process has
exited; or the ranks that do not check in to the rendezvous store within a short grace period
after a failure (dead on another host, or stalled). Survivors agree on the culprit through the
store, which torchrun's agent hosts, so it outlives any worker.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import torch.distributed as dist

# how long survivors wait for each other to check in after a failure whose culprit is not a process
# that exited on this host: every survivor notices a dead peer's closed connections as soon as it
# next communicates, so a short wait suffices
GRACE_S = 2.0
_FAILURE_TEXT = ("connection closed", "connection reset", "timed out", "timeout", "broken pipe", "gloo", "nccl", "peer")


class CommFailure(RuntimeError):
    """A communication error with what we know about it (the operation; the peer, for point-to-point)."""

    def __init__(self, phase: str, peer: int | None, cause: BaseException):
        super().__init__(f"{phase}: {cause}")
        self.phase, self.peer, self.cause = phase, peer, cause


def is_comm_failure(exc: BaseException) -> bool:
    if isinstance(exc, (CommFailure, dist.DistError)):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(k in text for k in _FAILURE_TEXT)


def _key(name: str) -> str:
    return f"foldtrain/dp/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{name}"  # fresh per torchrun restart


def _store():
    return dist.distributed_c10d._get_default_store()


def register_process(rank: int) -> None:
    """Record this rank's host and pid in the rendezvous store, so that survivors can tell it exited."""
    try:
        _store().set(_key(f"pid/{rank}"), f"{socket.gethostname()} {os.getpid()}")
    except Exception:  # no store (a single process, or a launcher without one): fall back to the grace wait
        pass


def _exited(store, rank: int) -> bool:
    """Whether ``rank`` runs on this host and its process is gone (or a zombie its launcher has not reaped)."""
    key = _key(f"pid/{rank}")
    if not store.check([key]):
        return False
    host, pid = store.get(key).decode().split()
    if host != socket.gethostname():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def unresponsive_ranks(rank: int, world: int, grace_s: float, known: int | None = None) -> list[int]:
    """The ranks to blame for a failure this rank hit, agreed through the rendezvous store.

    The first survivor to find the culprit records it, and later ones repeat it: a survivor whose
    own link failed only because an earlier survivor gave up must not blame that survivor. A
    survivor finds the culprit as: the peer of its failed point-to-point transfer; else the peers
    on this host whose process has exited; else the ranks that have not checked in under
    ``alive/<rank>`` within ``grace_s`` (dead on another host, or stalled). torchrun's agent hosts
    the store, so it outlives any worker.
    """
    try:
        store = _store()
        store.set(_key(f"alive/{rank}"), "1")
        if store.check([_key("culprit")]):
            return [int(r) for r in store.get(_key("culprit")).decode().split(",")]
        found = [known] if known is not None else _missing(store, rank, world, grace_s)
        if found:
            store.compare_set(_key("culprit"), "", ",".join(map(str, found)))
        return found
    except Exception:
        return [known] if known is not None else []


def _missing(store, rank: int, world: int, grace_s: float) -> list[int]:
    deadline = time.monotonic() + grace_s
    missing = [r for r in range(world) if r != rank]
    while True:
        exited = [r for r in missing if _exited(store, r)]
        if exited:
            return exited
        missing = [r for r in missing if not store.check([_key(f"alive/{r}")])]
        if not missing or time.monotonic() >= deadline:
            return missing
        time.sleep(0.05)
