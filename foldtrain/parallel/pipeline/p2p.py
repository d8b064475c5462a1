"""Point-to-point transport between pipeline ranks, and waits bounded by ``--dp.timeout_s``.

Transport: every message between pipeline ranks ``a -> b`` goes over the topology's direction
group for that pair (``p2p_up`` if ``a < b`` else ``p2p_down``) with a tag unique to
(kind, producing segment, micro-batch). gloo matches by tag, and ``isend`` never blocks the CPU.
With NCCL (no tags; one stream per communicator and pair, operations in posting order) each
(group, pair) carries one direction only, so a send never sits in front of a receive, and the
per-pair posting orders match because the schedules are validated for per-pair FIFO channels
(per kind, with the gradients' own groups, for the V placement: ``channels_of``);
receives are waited on without an explicit timeout there: every group carries ``--dp.timeout_s``
as its own timeout and ``TORCH_NCCL_BLOCKING_WAIT=1`` (set by ``foldtrain.distributed``) makes a wait
raise once it passes, so a stalled peer is named the same way as on gloo. The NCCL path is untested
(the test machines have no multi-GPU host); in particular, if a PyTorch version routes the P2P of an
eagerly initialised group through the group's single communicator instead of per-pair ones, sends and
receives of different peers would share one stream and interleaved / fold could stall: check there first.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch

from foldtrain import collectives
from foldtrain.errors import DistributedError


def local_part(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (a view that in-place ops write through), else the tensor."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _first_line(e: BaseException) -> str:
    for line in str(e).splitlines():
        if line.strip():
            return line.strip()[:200]
    return type(e).__name__


def bounded_wait(work, timeout_s: float, bounded: bool, problem, pump=None) -> None:
    """Wait for ``work`` at most ``timeout_s`` (where the backend supports a bounded wait); on a
    timeout or a broken connection raise one DistributedError line, ``problem(cause)``.

    ``pump`` (CPU only): called while waiting (it returns whether anything is left to issue), so deferred
    reductions keep being issued (:mod:`.deadlines`) while the executor is blocked on a collective.
    (Not for point-to-point receives: a gloo receive reports ``is_completed()`` only after ``wait()``.)"""
    try:
        if pump is not None and bounded:
            limit = time.perf_counter() + timeout_s
            while not work.is_completed() and pump():  # poll only while deferred buckets wait to be issued
                if time.perf_counter() > limit:
                    raise RuntimeError(f"timed out after {timeout_s:g} s")
                time.sleep(0.001)
        work.wait(timedelta(seconds=timeout_s)) if bounded else work.wait()
    except Exception as e:  # gloo: RuntimeError / DistBackendError on timeout or a closed connection
        raise DistributedError(problem(_first_line(e))) from None


class P2P:
    """Point-to-point transfers of one pipeline (see the module docstring)."""

    def __init__(self, topo, timeout_s: float, device: torch.device, pump=None):
        self.topo = topo
        self.timeout_s = float(timeout_s)
        self.device = device
        self.p = topo.pp_rank
        self.cpu_timeout = device.type != "cuda"
        self.pump = pump  # DeadlineQueue.pump: deferred reductions progress during collective waits

    def tag(self, kind: int, seg: int, mb: int, n_seg: int, n_mb: int) -> int:
        return (kind * n_seg + seg) * n_mb + mb

    def isend(self, t: torch.Tensor, dst_p: int, tag: int, grad: bool = False):
        group = self.topo.p2p_group(self.p, dst_p, grad)
        return collectives.isend(t, group=group, group_dst=dst_p, tag=tag)

    def recv(self, shape, dtype, src_p: int, tag: int, what: str, grad: bool = False) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        group = self.topo.p2p_group(src_p, self.p, grad)
        work = collectives.irecv(buf, group=group, group_src=src_p, tag=tag)
        self.wait(work, what, src_p)
        return buf

    def wait_collective(self, work, what: str) -> None:
        """Wait for a collective of this rank's pipeline group, bounded by ``--dp.timeout_s``."""
        bounded_wait(
            work,
            self.timeout_s,
            self.cpu_timeout,
            lambda cause: (
                f"pipeline rank {self.p} (global rank {self.topo.rank}) waited up to {self.timeout_s:g} s "
                f"for the {what}; another pipeline rank stalled or died ({cause}); check the other ranks' logs"
            ),
            self.pump,
        )

    def wait(self, work, what: str, peer_p: int) -> None:
        bounded_wait(
            work,
            self.timeout_s,
            self.cpu_timeout,
            lambda cause: (
                f"pipeline rank {self.p} (global rank {self.topo.rank}) waited up to {self.timeout_s:g} s "
                f"for {what} from pipeline rank {peer_p} (global rank {self.topo.pipeline_peer(peer_p)}); "
                f"that rank stalled or died ({cause}); check its log, or raise --dp.timeout_s if it is just slow"
            ),
        )
