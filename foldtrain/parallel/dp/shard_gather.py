"""sharded-ps' all-gathers: every rank's updated shards back into the replica, overlapped with the next forward.

After AdamW steps the shard, the updated rows come back bucket by bucket: one asynchronous
``all_gather_single`` per bucket (in the model's dtype), issued in the order the next forward needs
them (the reverse of the bucket order), so the all-gathers overlap the next forward. A forward
pre-hook on every module that holds parameters waits for the buckets holding them and unpacks them
into the replica; anything else that reads the replica (export, checkpoint, evaluation outside a
forward) lands every pending bucket first (:meth:`GatherQueue.land_all`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from foldtrain import collectives
from foldtrain.parallel.dp.comm import CommStats
from foldtrain.parallel.dp.shard_layout import ShardBucket, ShardLayout


class GatherQueue:
    """The all-gathers of ``layout``'s buckets from this rank's ``decay_shard`` (1 x n) and
    ``plain_shard`` into ``params`` (the replica), landed by forward pre-hooks on ``model``'s modules."""

    def __init__(
        self,
        layout: ShardLayout,
        params: list[torch.Tensor],
        decay_shard: torch.Tensor,
        plain_shard: torch.Tensor,
        comm: CommStats,
        model: nn.Module,
    ):
        self.layout, self.params, self.comm = layout, params, comm
        self.decay_shard, self.plain_shard = decay_shard, plain_shard
        # the all-gathers of the updated rows, in flight until a forward needs them: bucket -> (work, W x width rows)
        self._gathers: dict[int, tuple[dist.Work, torch.Tensor]] = {}  # at most one
        self._queue: list[tuple[int, torch.dtype]] = []  # the all-gathers still to issue, in order
        index = {id(p): i for i, p in enumerate(params)}
        bucket_of = {i: k for k, b in enumerate(layout.buckets) for i in b.index}
        for mod in model.modules():
            ks = sorted({bucket_of[index[id(p)]] for p in mod.parameters(recurse=False) if id(p) in index})
            if ks:
                mod.register_forward_pre_hook(lambda _m, _a, ks=ks: self.land(ks))

    def start(self, dtype: torch.dtype) -> None:
        """Queue every bucket's all-gather, the next forward's first bucket (the last one) first, and
        start it. One all-gather is in flight at a time: landing a bucket starts the next one (several
        concurrent collectives on one slow link only make TCP drop and stall)."""
        self.land_all()
        self._queue = [(k, dtype) for k in reversed(range(len(self.layout.buckets)))]
        self._issue_next()

    def _issue_next(self) -> None:
        if not self._queue:
            return
        k, dtype = self._queue.pop(0)
        b = self.layout.buckets[k]
        mine = torch.empty(b.width, dtype=dtype, device=self.decay_shard.device)
        self._fill_row(b, mine)
        rows = torch.empty(self.layout.world * b.width, dtype=dtype, device=mine.device)
        self.comm.count_all_gather(rows)
        work = collectives.all_gather_single(rows, mine, async_op=True)
        self._gathers[k] = (work, rows.view(self.layout.world, b.width))

    @torch.no_grad()
    def land(self, ks: list[int]) -> None:
        """Wait for the all-gathers of buckets ``ks`` (issuing queued ones in order until they are in
        flight) and unpack them into the replica."""
        for k in ks:
            while k not in self._gathers and any(q == k for q, _ in self._queue):
                self._land_oldest()
            got = self._gathers.pop(k, None)
            if got is not None:
                self.comm.wait(got[0], "all-gather")
                self.layout.buckets[k].unpack(got[1], self.params)
                self._issue_next()

    def _land_oldest(self) -> None:
        (k,) = list(self._gathers)  # one in flight
        self.land([k])

    def land_all(self) -> None:
        """Land every pending bucket: the replica is current."""
        while self._gathers:
            self._land_oldest()

    def _fill_row(self, b: ShardBucket, dst: torch.Tensor) -> None:
        """This rank's row of bucket ``b`` (its decay then plain shard pieces) into ``dst`` (``b.width`` long)."""
        dst[: b.decay_width] = self.decay_shard.detach()[0, b.decay_off : b.decay_off + b.decay_width]
        dst[b.decay_width :] = self.plain_shard.detach()[b.plain_off : b.plain_off + b.plain_width]

    def gather_rows(self, dtype: torch.dtype) -> torch.Tensor:
        """Every rank's whole rows, all-gathered in ``dtype`` in one blocking collective after landing the
        pending buckets: W x ``layout.row``."""
        self.land_all()
        row = self.layout.row
        mine = torch.empty(row, dtype=dtype, device=self.decay_shard.device)
        for b in self.layout.buckets:
            self._fill_row(b, mine[b.col_off : b.col_off + b.width])
        full = torch.empty(self.layout.world * row, dtype=dtype, device=mine.device)
        self.comm.count_all_gather(full)
        self.comm.wait(collectives.all_gather_single(full, mine, async_op=True), "all-gather")
        return full.view(self.layout.world, row)
