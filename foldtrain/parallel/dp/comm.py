"""What a data-parallel strategy measures about its communication, and how its failures read.

``CommStats`` is the one accumulator every strategy uses: per step it counts the bytes this
rank sent and received and the seconds it was blocked waiting on communication. The byte
counts are *algorithmic*, independent of what the backend does internally:

* all-reduce of ``n`` bytes over ``W`` ranks (ring): ``2(W-1)/W * n`` sent and as much received;
* reduce-scatter of an ``n``-byte input, all-gather into an ``n``-byte output: ``(W-1)/W * n``
  each way;
* point-to-point: the exact payload (a colocated server's message to itself is free).

``comm_wait_s`` is time spent blocked in ``Work.wait`` / blocking collectives; ``compute_s`` is
the rest of the step. A communication error (a peer died, or stalled past ``--dp.timeout_s``)
becomes a :class:`~foldtrain.errors.DistributedError` naming the rank (see
:func:`unresponsive_ranks`): the peer of a failed point-to-point transfer; a peer on this host
whose process has exited; or the ranks that do not check in to the rendezvous store within a
short grace period after a failure (dead on another host, or stalled).
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist

from foldtrain.errors import DistributedError

# how long survivors wait for each other to check in after a failure whose culprit is not a process
# that exited on this host: every survivor notices a dead peer's closed connections as soon as it
# next communicates, so a short wait suffices
GRACE_S = 2.0
_FAILURE_TEXT = ("connection closed", "connection reset", "timed out", "timeout", "broken pipe", "gloo", "nccl", "peer")


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


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


class CommStats:
    """Bytes and blocked time of one rank, per step; also the name of the operation in progress."""

    def __init__(self, rank: int, world: int, timeout_s: float):
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        register_process(rank)
        self.phase = "start-up"
        self.sent = self.recv = self.wait_s = self.step_s = 0.0
        self._t0 = time.perf_counter()

    # ------------------------------------------------------------------ per step
    def start_step(self) -> None:
        self.sent = self.recv = self.wait_s = 0.0
        self._t0 = time.perf_counter()

    def end_step(self) -> None:
        self.step_s = time.perf_counter() - self._t0

    def stats(self) -> dict[str, float]:
        return {
            "comm_bytes_sent": self.sent,
            "comm_bytes_recv": self.recv,
            "compute_s": max(0.0, self.step_s - self.wait_s),
            "comm_wait_s": self.wait_s,
        }

    # ------------------------------------------------------------------ byte model
    def all_reduce(self, t: torch.Tensor, world: int | None = None) -> None:
        w = world or self.world
        moved = 2 * (w - 1) / w * nbytes(t)
        self.sent += moved
        self.recv += moved

    def reduce_scatter(self, full: torch.Tensor) -> None:
        moved = (self.world - 1) / self.world * nbytes(full)
        self.sent += moved
        self.recv += moved

    all_gather = reduce_scatter  # same volume: (W-1)/W of the full tensor each way

    def isend(self, t: torch.Tensor, dst: int, tag: int) -> dist.Work:
        self.sent += nbytes(t)
        return dist.isend(t, dst, tag=tag)

    def irecv(self, t: torch.Tensor, src: int, tag: int, count: bool = True) -> dist.Work:
        """Post a receive; ``count=False`` leaves the bytes to ``received`` (for receives completing in a later step)."""
        if count:
            self.recv += nbytes(t)
        return dist.irecv(t, src, tag=tag)

    def received(self, *tensors: torch.Tensor) -> None:
        self.recv += sum(nbytes(t) for t in tensors)

    # ------------------------------------------------------------------ waiting
    @contextlib.contextmanager
    def blocked(self, phase: str, peer: int | None = None):
        """Time a blocking section as communication wait; tag a failure inside it with ``phase``/``peer``."""
        self.phase = phase
        t = time.perf_counter()
        try:
            yield
        except Exception as e:
            if isinstance(e, CommFailure) or not is_comm_failure(e):
                raise
            raise CommFailure(phase, peer, e) from e
        finally:
            self.wait_s += time.perf_counter() - t

    def wait(self, work: dist.Work, phase: str, peer: int | None = None) -> None:
        with self.blocked(phase, peer):
            work.wait()

    # ------------------------------------------------------------------ failures
    def failure(self, exc: BaseException, step: int) -> DistributedError:
        """The one-line error for a communication failure ``exc`` at (1-based) ``step``."""
        phase = exc.phase if isinstance(exc, CommFailure) else self.phase
        peer = exc.peer if isinstance(exc, CommFailure) else None
        dead = unresponsive_ranks(self.rank, self.world, min(GRACE_S, self.timeout_s), known=peer)
        if dead:
            who = f"rank {dead[0]}" if len(dead) == 1 else "ranks " + ", ".join(map(str, dead))
            tail = "check that rank's log" if len(dead) == 1 else "check those ranks' logs"
        else:
            who, tail = "a peer rank", "check the other ranks' logs"
        return DistributedError(f"{who} stopped responding during {phase} at step {step} (timeout {self.timeout_s:g} s); {tail}")


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
