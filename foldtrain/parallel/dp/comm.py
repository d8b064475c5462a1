"""What a data-parallel strategy measures about its communication, and how its failures read.

``CommStats`` is the one accumulator every strategy uses: per step it counts the bytes this
rank sent and received and the seconds it was blocked waiting on communication. The byte
counts are *algorithmic*, independent of what the backend does internally:

* all-reduce of ``n`` bytes over ``W`` ranks (ring): ``2(W-1)/W * n`` sent and as much received;
* reduce-scatter of an ``n``-byte input, all-gather into an ``n``-byte output: ``(W-1)/W * n``
  each way;
* point-to-point: the exact payload (a colocated server's message to itself is free).

``comm_wait_s`` is time spent blocked in ``Work.wait`` / blocking collectives; ``compute_s`` is
the rest of the step. On CUDA a wait blocks the device's stream rather than the CPU, so there the
blocked time is measured with CUDA events recorded around each wait and read at the end of the
step. A communication error becomes a :class:`~foldtrain.errors.DistributedError` naming the rank
to blame (found by :mod:`foldtrain.parallel.failures`).

The ``count_*`` methods only add to the byte counts: the strategy makes the call itself, through
:mod:`foldtrain.collectives`. ``isend`` / ``irecv`` both start the transfer and count it.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

from foldtrain import collectives
from foldtrain.errors import DistributedError
from foldtrain.parallel.failures import GRACE_S, CommFailure, is_comm_failure, register_process, unresponsive_ranks


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class CommStats:
    """Bytes and blocked time of one rank, per step; also the name of the operation in progress."""

    def __init__(self, rank: int, world: int, timeout_s: float, device: torch.device | None = None):
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.cuda = device is not None and device.type == "cuda"
        self._events: list = []  # (start, end) CUDA events around each wait of this step
        register_process(rank)
        self.p2p_group = None  # the group of ``isend`` / ``irecv`` (None: the default group)
        self.phase = "start-up"
        self.sent = self.recv = self.wait_s = self.step_s = 0.0
        self._t0 = time.perf_counter()

    # ------------------------------------------------------------------ per step
    def start_step(self) -> None:
        self.sent = self.recv = self.wait_s = 0.0
        self._t0 = time.perf_counter()

    def end_step(self) -> None:
        if self._events:
            self._events[-1][1].synchronize()
            self.wait_s += sum(start.elapsed_time(end) for start, end in self._events) / 1000.0
            self._events = []
        self.step_s = time.perf_counter() - self._t0

    def stats(self) -> dict[str, float]:
        return {
            "comm_bytes_sent": self.sent,
            "comm_bytes_recv": self.recv,
            "compute_s": max(0.0, self.step_s - self.wait_s),
            "comm_wait_s": self.wait_s,
        }

    # ------------------------------------------------------------------ byte model: counting only, no communication
    def count_all_reduce(self, t: torch.Tensor, world: int | None = None) -> None:
        """Count the bytes of a ring all-reduce of ``t`` over ``world`` ranks (default: all)."""
        w = world or self.world
        moved = 2 * (w - 1) / w * nbytes(t)
        self.sent += moved
        self.recv += moved

    def count_reduce_scatter(self, full: torch.Tensor) -> None:
        """Count the bytes of a reduce-scatter whose input is ``full``."""
        moved = (self.world - 1) / self.world * nbytes(full)
        self.sent += moved
        self.recv += moved

    count_all_gather = count_reduce_scatter  # same volume: (W-1)/W of the full (output) tensor each way

    def count_received(self, *tensors: torch.Tensor) -> None:
        """Count ``tensors`` as received (receives posted with ``irecv(..., count=False)``)."""
        self.recv += sum(nbytes(t) for t in tensors)

    # ------------------------------------------------------------------ point-to-point: communicate and count
    def isend(self, t: torch.Tensor, dst: int, tag: int) -> dist.Work:
        self.sent += nbytes(t)
        return collectives.isend(t, dst, group=self.p2p_group, tag=tag)

    def irecv(self, t: torch.Tensor, src: int, tag: int, count: bool = True) -> dist.Work:
        """Post a receive; ``count=False`` leaves the bytes to ``count_received`` (for receives completing in a
        later step)."""
        if count:
            self.recv += nbytes(t)
        return collectives.irecv(t, src, group=self.p2p_group, tag=tag)

    # ------------------------------------------------------------------ waiting
    @contextlib.contextmanager
    def blocked(self, phase: str, peer: int | None = None):
        """Time a blocking section as communication wait; tag a failure inside it with ``phase``/``peer``."""
        self.phase = phase
        t = time.perf_counter()
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        try:
            yield
        except Exception as e:
            if isinstance(e, CommFailure) or not is_comm_failure(e):
                raise
            raise CommFailure(phase, peer, e) from e
        finally:
            if self.cuda:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self._events.append((start, end))
            else:
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
        return DistributedError(
            f"{who} stopped responding during {phase} at step {step} (timeout {self.timeout_s:g} s); {tail}"
        )
