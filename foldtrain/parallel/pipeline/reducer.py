"""A chunk's data-parallel gradient reduction (``LR`` launches it, ``WR`` waits for it)."""

from __future__ import annotations

import torch

from foldtrain.parallel.pipeline.deadlines import DeadlineQueue, ReductionBucket
from foldtrain.parallel.pipeline.p2p import bounded_wait, local_part
from foldtrain.parallel.pipeline.tie import LocalTie, TieSide


def _row_offset(tied) -> int:
    """First vocabulary row of this rank's shard of the tied weight (vocab-parallel under TP), else 0."""
    if tied is None or not hasattr(tied, "placements"):
        return 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _shape, offset = compute_local_shape_and_global_offset(tied.shape, tied.device_mesh, tied.placements)
    return int(offset[0])


class ChunkReducer:
    """A chunk's data-parallel gradient all-reduce, averaged over dp, async.

    Without a :class:`~foldtrain.parallel.pipeline.deadlines.DeadlineQueue` (one data-parallel
    replica) or for an urgent chunk it is one flat fused buffer issued at once; a deferred chunk's
    gradients go to the queue in buckets, issued in deadline order.

    ``tied`` (the embedding / output-projection copy this chunk holds when the pipeline splits the
    tie) is reduced separately (:mod:`.tie`): over dp first, issued before the chunk's own buckets,
    then summed with the other end's copy.
    """

    def __init__(
        self,
        segment: int,
        params: list,
        tied,
        topo,
        timeout_s: float,
        cpu_timeout: bool,
        queue: DeadlineQueue | None = None,  # dp > 1: the rank's deadline-ordered reductions
        local_tie: LocalTie | None = None,  # both ends of the tie on this rank (the V placement)
        wire: torch.dtype | None = None,  # --dp.compression: the dtype the tie's reduction crosses the link in
    ):
        self.segment = segment
        self.params = [p for p in params if p is not tied]
        self.tied = tied
        self.topo = topo
        self.dp = topo.dp
        self.timeout_s = timeout_s
        self.cpu_timeout = cpu_timeout
        self.queue = queue  # its buckets carry the chunk's own gradients in the wire dtype
        self.buckets: list[ReductionBucket] = []
        self.deferred = False
        if tied is None:
            self.tie = None
        elif local_tie is not None:
            self.tie = local_tie.end(head=segment != 0)
        else:
            self.tie = TieSide(segment != 0, topo, self._wait, _row_offset(tied), local_part(tied).detach(), wire)
        self.pending = False  # launched, not yet waited
        # --optim.distributed: the chunk's ChunkShards; its own gradients are then reduce-scattered into them
        self.shards = None

    def _grads(self, params) -> list[torch.Tensor]:
        """Local gradient tensors, in the parameters' own layouts.

        A DTensor parameter's gradient may come back in another layout (the vocab-parallel
        embedding's weight gradient is ``Replicate`` while the weight is ``Shard(0)``): it is
        redistributed to the parameter's placements first (Replicate -> Shard is a local slice), so
        every replica and both tied copies reduce tensors of the same shape.
        """
        out = []
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            g = p.grad
            if hasattr(g, "placements") and tuple(g.placements) != tuple(p.placements):
                g = g.redistribute(p.device_mesh, p.placements)
                p.grad = g
            out.append(local_part(g))
        return out

    def begin(self, xs: list[torch.Tensor], every: torch.Tensor | None = None) -> None:
        """Start of an iteration on micro-batches ``xs`` (the embedding end of the tie learns its rows; ``every``:
        every dp rank's token ids, where they were gathered already)."""
        if self.tie is not None:
            self.tie.begin(xs, every)

    def progress(self) -> None:
        """Between actions: the tie's hand-off, the moment its dp reduction landed (never blocks)."""
        if self.tie is not None:
            self.tie.progress()

    def reset(self) -> None:
        """Forget a launched reduction (before loading a checkpoint)."""
        if self.queue is not None:
            self.queue.drop(self.segment)
        self.pending, self.buckets = False, []
        if self.tie is not None:
            self.tie.reset()

    def launch_tie(self, deadline: int = 0) -> None:
        """Start the tied copy's reduction (once per iteration; where: :mod:`foldtrain.schedules.rules`)."""
        if self.tie is None or self.tie.state != "idle":
            return
        (g,) = self._grads([self.tied])
        self.tie.launch(g)
        if self.queue is not None and self.tie.dp_work is not None:  # urgent: the other end waits for it
            self.queue.track_urgent(self.segment, self.tie.dp_work, deadline)

    def launch(self, deadline: int = 0, deferred: bool = False) -> None:
        """Start the reduction of the chunk's own gradients (the tied copy's is :meth:`launch_tie`);
        ``deadline`` orders it against the others (the action that needs it)."""
        self.deferred = deferred and self.queue is not None and self.queue.group is not None
        if self.dp > 1:
            grads = self._grads(self.params)
            scatter = self.shards.scatter_buckets(self._grads, deadline, self.dp, self.segment) if self.shards else None
            if self.deferred:
                self.buckets = self.queue.submit_deferred(self.segment, grads, deadline, self.dp, scatter)
            else:  # the engine builds a deadline queue wherever dp > 1 (FSDP's chunks have their own reducer)
                one = scatter[0] if scatter else None
                if scatter and len(scatter) != 1:
                    raise RuntimeError(f"segment {self.segment}: an urgent reduction is one bucket, not {len(scatter)}")
                self.buckets = [
                    self.queue.launch_urgent(self.segment, grads, deadline, self.dp, self.topo.dp_group, one)
                ]
        self.pending = True

    def handoff(self) -> None:
        """The tied copy's sum with the other end, once its data-parallel reduction landed (:mod:`.tie`)."""
        if self.tie is not None:
            self.tie.handoff()

    def _wait(self, work, what: str, p2p: bool = False) -> None:
        """Bounded wait; a collective's wait keeps issuing deferred buckets. Not a point-to-point one's:
        a gloo send or receive reports ``is_completed()`` only after ``wait()``, so polling it would
        hold the wait until every deferred bucket is issued (up to 100 ms per step)."""
        queued = self.queue is not None and self.queue.group is not None and not p2p
        pump = self.queue.pump if queued else None
        bounded_wait(
            work,
            self.timeout_s,
            self.cpu_timeout,
            lambda cause: (
                f"global rank {self.topo.rank} waited up to {self.timeout_s:g} s "
                f"for the {what} of segment {self.segment}; a rank of that group stalled or died ({cause}); "
                f"check the other ranks' logs"
            ),
            pump,
        )

    def wait(self) -> None:
        if not self.pending:
            return
        self.handoff()  # the tie's sum runs while this waits for the chunk's buckets
        if self.deferred:
            self.queue.hurry(self.segment)
        for b in self.buckets:
            self._wait(b.work, "data-parallel gradient all-reduce")
            if self.queue is not None:
                b.done(self.queue.clock)
                self.queue.record(b, urgent=not self.deferred)
            b.unpack()
        self.buckets = []
        if self.tie is not None:
            self.tie.wait()
        self.pending = False
