"""Deadline-ordered data-parallel reductions for the pipeline: urgent ones never wait behind deferred ones.

Every chunk reduction has a deadline: the action that needs its result. A chunk reduced and
stepped in the same iteration is *urgent* (deadline: its ``WR`` at the end of the iteration); a
chunk whose reduction ``--fold.defer_reduce`` moves into the next iteration is *deferred*
(deadline: its ``WR`` before the chunk's first forward of the next iteration, later still).

gloo and NCCL run one process group's collectives in the order they were issued, so one queue
per rank would make the urgent reduction of chunk 0 (launched last, needed first) wait behind the
deferred ones launched before it. Here:

* urgent reductions are issued the moment they are launched, on the mesh's data-parallel group;
* deferred reductions are cut into buckets of ``--fold.bucket_mb`` and go through a second group
  of the same ranks, one bucket in flight at a time, and no new deferred bucket is issued while
  an urgent reduction is in flight: an urgent bucket shares the link with at most one deferred
  bucket and the link still works on deferred buckets whenever nothing urgent is pending;
* :meth:`DeadlineQueue.pump` issues the next deferred bucket when the previous one completed; the
  executor calls it after every action and while it waits (pipeline receives, reductions);
* at the end of an iteration, once every rank of the run has finished it (after the engine's loss
  all-reduce, so no deferred bucket shares a node's link with another rank's urgent reduction),
  every rank agrees on how many deferred buckets have been issued (the largest count over the data-parallel
  group, which the engine's loss all-gather carries: a collective of its own would wait behind the bytes in
  flight on a slow link), issues the ones it lags behind, sorts
  the rest by deadline (chunk 1, needed first in the next iteration, goes first) and issues them
  all: the deferred group's FIFO then runs them in deadline order during the forward phase.

Holding a bucket back is safe only while nobody can be waiting for it: deferred buckets of an
iteration are waited on in the next iteration (after the agreement has issued all of them) or in
``flush`` (every rank issues all). With ``--optim.grad_clip`` every reduction is waited on at
the end of its own iteration, so nothing is held back then (:meth:`DeadlineQueue.hold_back`).

Collectives of one group must be issued in the same order on every rank. Within the deferred
group the order is the queue's: launch order (identical on every rank: same schedule), then, from
the agreement on, deadline order over an identical remainder. When a ``WR`` needs a deferred
chunk, every bucket up to its last is issued at once (``hurry``): the queue order is kept.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from foldtrain import collectives
from foldtrain.parallel.flat import flatten, unflatten_into
from foldtrain.parallel.wire import outbound

_GROUPS: dict = {}


def deferred_group(topo, timeout_s: float | None, purpose: str = "deferred"):
    """Another group over this rank's data-parallel replicas (created on every rank, same order), one per
    ``purpose``: its collectives run beside the data-parallel group's, not in its order."""
    from datetime import timedelta

    from foldtrain.parallel.mesh import global_rank

    key = (purpose, topo.dp, topo.pp, topo.tp, dist.get_world_size())
    if key not in _GROUPS:
        kw = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
        mine = None
        for p in range(topo.pp):
            for t in range(topo.tp):
                g = dist.new_group([global_rank(d, p, t, topo.pp, topo.tp) for d in range(topo.dp)], **kw)
                if (p, t) == (topo.pp_rank, topo.tp_rank):
                    mine = g
        _GROUPS[key] = mine
    return _GROUPS[key]


class ReductionBucket:
    """A piece of one chunk's gradients: packed, averaged over dp, all-reduced asynchronously."""

    def __init__(
        self,
        segment: int,
        index: int,
        grads: list[torch.Tensor],
        deadline: int,
        dp: int,
        wire: torch.dtype | None = None,
    ):
        self.segment, self.index, self.grads, self.deadline, self.dp = segment, index, grads, deadline, dp
        self.wire = wire  # --dp.compression: the dtype the packed gradients travel in (None: their own)
        self.work = self.flat = None
        self.t_issue = self.t_done = None
        self.order, self.by_deadline = -1, False  # issue counter on this rank; issued by the end-of-iteration sort

    def issue(self, group, clock) -> None:
        self.flat = outbound(flatten(self.grads, self.wire or self.grads[0].dtype), self.dp, self.wire)
        self.work = collectives.all_reduce(self.flat, group=group, async_op=True)
        self.t_issue = clock()

    def done(self, clock) -> bool:
        if self.t_done is None and self.work is not None and self.work.is_completed():
            self.t_done = clock()
        return self.t_done is not None

    def unpack(self) -> None:
        unflatten_into(self.flat, self.grads)
        self.flat = self.work = None


def split_buckets(grads: list[torch.Tensor], cap_bytes: float) -> list[list[torch.Tensor]]:
    """Consecutive gradients grouped up to ``cap_bytes`` each (a bigger tensor is a bucket alone)."""
    out, cur, used = [], [], 0
    for g in grads:
        cur.append(g)
        used += g.numel() * g.element_size()
        if used >= cap_bytes:
            out.append(cur)
            cur, used = [], 0
    if cur:
        out.append(cur)
    return out


class DeadlineQueue:
    """One rank's deferred buckets and in-flight urgent reductions (see the module docstring)."""

    def __init__(
        self, topo, timeline, bucket_bytes: float, timeout_s: float | None, defer: bool, wire: torch.dtype | None = None
    ):
        self.group = deferred_group(topo, timeout_s) if defer else None
        self.dp_group = topo.dp_group
        self.device = None
        self.tl = timeline
        self.bucket_bytes = bucket_bytes
        self.queued: list[ReductionBucket] = []  # deferred, not issued yet, in issue order
        self.current: ReductionBucket | None = None  # the deferred bucket in flight
        self.urgent: list[ReductionBucket] = []  # in-flight urgent reductions
        self.issued = 0  # deferred buckets issued since the last agreement
        self.order = 0  # issue counter (for the trace)
        self.window = True  # one deferred bucket in flight, none while an urgent one is
        self.wire = wire  # --dp.compression: the dtype the buckets travel in (None: the gradients' own)

    def clock(self) -> float:
        return self.tl.clock()

    # ------------------------------------------------------------------ submitting
    def submit_deferred(
        self,
        segment: int,
        grads: list[torch.Tensor],
        deadline: int,
        dp: int,
        buckets: list | None = None,
        pump: bool = True,
    ) -> list[ReductionBucket]:
        """Queue a chunk's deferred reduction: ``grads`` in buckets of ``bucket_bytes`` all-reduced, or the
        ``buckets`` given (made with the same split: the distributed optimizer's reduce-scatters); ``pump``: issue
        the next bucket now if its time has come (not between the count :meth:`end_iteration` agrees on and the
        agreement)."""
        if grads:
            self.device = grads[0].device
        if buckets is None:
            buckets = [
                ReductionBucket(segment, k, gs, deadline, dp, self.wire)
                for k, gs in enumerate(split_buckets(grads, self.bucket_bytes))
            ]
        self.queued += buckets
        if pump:
            self.pump()
        return buckets

    def launch_urgent(
        self, segment: int, grads: list[torch.Tensor], deadline: int, dp: int, group, bucket=None
    ) -> ReductionBucket:
        """Issue a chunk's urgent reduction at once: ``grads`` all-reduced as one buffer, or ``bucket``."""
        b = bucket or ReductionBucket(segment, 0, grads, deadline, dp, self.wire)
        b.issue(group, self.clock)
        b.order = self.order
        self.order += 1
        self.urgent.append(b)
        return b

    def track_urgent(self, segment: int, work, deadline: int) -> None:
        """A collective issued elsewhere that is just as urgent (the tied embedding's dp reduction,
        :mod:`.tie`): deferred buckets wait while it is in flight, and the trace shows it as ``AR cX tie``."""
        b = ReductionBucket(segment, -1, [], deadline, 1)
        b.work, b.t_issue, b.order = work, self.clock(), self.order
        self.order += 1
        self.urgent.append(b)

    # ------------------------------------------------------------------ progress
    def pump(self) -> bool:
        """Issue the next deferred bucket if the previous one is done and nothing urgent is in flight;
        returns whether deferred buckets are still waiting to be issued."""
        for b in self.urgent:
            if b.done(self.clock) and b.index < 0:
                self.record(b, urgent=True)
        self.urgent = [b for b in self.urgent if not b.done(self.clock)]
        if not self.window:
            while self.queued:
                self._issue(self.queued.pop(0))
            return False
        if self.queued and not self.urgent and (self.current is None or self.current.done(self.clock)):
            self._issue(self.queued.pop(0))
        return bool(self.queued)

    def _issue(self, b: ReductionBucket) -> None:
        b.issue(self.group, self.clock)
        b.order = self.order
        self.order += 1
        self.issued += 1
        self.current = b

    def hurry(self, segment: int) -> None:
        """Issue every queued bucket up to the last of ``segment`` (its deadline has come)."""
        last = max((i for i, b in enumerate(self.queued) if b.segment == segment), default=-1)
        for b in self.queued[: last + 1]:
            self._issue(b)
        del self.queued[: last + 1]

    def count(self) -> int | None:
        """What :meth:`end_iteration` agrees on over the data-parallel group: the deferred buckets issued since the
        last agreement; None where nothing is deferred."""
        return None if self.group is None else self.issued

    def end_iteration(self, agreed: int | None) -> None:
        """Every rank issues the same prefix of the queue, then all the rest at once, by deadline. ``agreed``: the
        largest :meth:`count` over the data-parallel group, gathered with the step's loss while nothing was issued
        since (None only where nothing is deferred).

        From here until the next iteration's backward nothing urgent competes, so nothing is held
        back: no rank ever waits on a deferred bucket another rank is still holding (the waits for
        deferred reductions are in the next iteration's forward phase, or in ``flush``, which
        issues everything on every rank)."""
        if self.group is None:
            return
        if agreed is None:
            raise RuntimeError("the deadline queue's end_iteration needs the dp group's agreed count (count())")
        for _ in range(agreed - self.issued):
            self._issue(self.queued.pop(0))
        self.queued.sort(key=lambda b: (b.deadline, b.segment, b.index))
        for b in self.queued:
            b.by_deadline = True
            self._issue(b)
        self.queued = []
        self.issued = 0

    def hold_back(self, on: bool) -> None:
        """``False``: issue deferred buckets as soon as they are submitted (with clipping, every
        reduction must land before the first step anyway, so there is nothing to reorder)."""
        self.window = on

    def drop(self, segment: int) -> None:
        self.queued = [b for b in self.queued if b.segment != segment]

    def record(self, b: ReductionBucket, urgent: bool = False) -> None:
        """The bucket's flight, issue -> first seen complete, in the --profile trace."""
        end = b.t_done if b.t_done is not None else self.clock()
        self.tl.record(
            f"AR c{b.segment} " + (f"b{b.index}" if b.index >= 0 else "tie"),
            "reduce",
            b.t_issue,
            max(end, b.t_issue),
            chunk=b.segment,
            bucket=b.index,
            deadline=b.deadline,
            deferred=not urgent,
            order=b.order,
            by_deadline=b.by_deadline,
        )
