"""sharded-ps' shard layout: the buckets, their slices, and the piece of each that every rank owns.

Buckets (:func:`~foldtrain.parallel.dp.buckets.fixed_plan`): the parameters in reverse model
order (about the order backward finishes them), cut after ``--dp.first_bucket_mb`` and then before
passing ``--dp.shard_bucket_mb`` (4 MB: smaller than DDP's 25 MB, so that the reduce-scatter overlaps
the backward and the all-gather the forward), a gradient of half a bucket or more in a bucket of its
own; the same on every rank since it depends only on the model.
A bucket's weight-decayed (>= 2-D) elements and the rest each form a stream (:class:`Part`), padded
to a multiple of W and cut into slices of at most ``--dp.shard_slice_mb``; rank r owns the r-th W-th
of every slice, and its row of the bucket is those pieces (decay ones, then the rest). Its
``decay_shard`` (a 1 x n row, filed under weight decay by ``build_optimizer``) is the concatenation
of its decay pieces, ``plain_shard`` that of the rest, so the AdamW groups are exactly the
single-process ones and optimizer memory is 1/W of the single-process engine's.

Nothing here communicates: :mod:`~foldtrain.parallel.dp.shard_scatter` reduce-scatters the slices,
:mod:`~foldtrain.parallel.dp.shard_gather` all-gathers the rows.
"""

from __future__ import annotations

import math

import torch

from foldtrain.parallel.dp.buckets import fixed_plan
from foldtrain.parallel.dp.comm import nbytes
from foldtrain.parallel.flat import flatten, unflatten_into


class Part:
    """One bucket's weight-decayed (>= 2-D) or other parameters as one stream of elements (in bucket
    order), zero-padded to a multiple of W and cut into slices, each a multiple of W long and at most
    ``slice_elems`` (rounded down to one). Rank r owns the r-th W-th of every slice; its row (``width``
    long) is those pieces in slice order. One slice: the plain W x width split of the stream.

    A part that is one parameter larger than a slice (``ramp``: the embedding) starts with a slice
    1/64 as long and doubles up to the full length: each slice then receives into the part of that
    gradient already reduced, so only the first one needs a buffer of its own."""

    def __init__(self, idx: list[int], params: list[torch.Tensor], world: int, slice_elems: int):
        self.idx = idx
        sizes = [params[i].numel() for i in idx]
        self.starts = [sum(sizes[:k]) for k in range(len(sizes))]
        self.sizes = sizes
        self.n = sum(sizes)
        padded = math.ceil(self.n / world) * world
        step = max(world, slice_elems // world * world)
        self.world = world
        self.ramp = len(idx) == 1 and padded > step
        lengths, a = [], 0
        size = max(world, step // 64 // world * world) if self.ramp else step
        while a < padded:
            lengths.append(min(size, padded - a))
            a += lengths[-1]
            if self.ramp and len(lengths) >= 2:
                size = min(2 * size, step)
        self.slices = [(sum(lengths[:k]), sum(lengths[: k + 1])) for k in range(len(lengths))]  # stream ranges
        self.width = padded // world
        self.padded = padded
        # per slice, fixed by the layout (so computed once, not at every launch): the gradients it holds,
        # (parameter, first, last + 1) each, and where each piece goes in the slice
        self.covers = [self.covering(a, b) for a, b in self.slices]
        self.ats = [
            [self.starts[idx.index(i)] + lo - a for i, lo, _ in cov] for (a, _), cov in zip(self.slices, self.covers)
        ]

    def cols(self):
        """(a, b, col, q) per slice: stream range [a, b); each rank's piece is q = (b-a)/W long, at ``col``
        of its row."""
        col = 0
        for a, b in self.slices:
            q = (b - a) // self.world
            yield a, b, col, q
            col += q

    def to_rows(self, stream: torch.Tensor) -> torch.Tensor:
        """A padded stream as W x width rows."""
        return torch.cat([stream[a:b].view(self.world, q) for a, b, _, q in self.cols()], 1)

    def from_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """W x width rows back into the padded stream."""
        return torch.cat([rows[:, c : c + q].reshape(-1) for _, _, c, q in self.cols()])

    def covering(self, a: int, b: int) -> list[tuple[int, int, int]]:
        """The parameters in stream range [a, b): (parameter index, first element, last element + 1) of each."""
        return [
            (i, max(a - s, 0), min(b - s, n))
            for i, s, n in zip(self.idx, self.starts, self.sizes)
            if s < b and s + n > a
        ]


class ShardBucket:
    """One bucket's parameters (indices), split into its weight-decayed part (``decay``) and the rest
    (``plain``), and its place in this rank's shards: its decay pieces at ``decay_off`` of the decay
    shard, its plain pieces at ``plain_off`` of the plain shard, its whole row at ``col_off`` of the
    rank's row."""

    def __init__(
        self,
        index: list[int],
        params: list[torch.Tensor],
        world: int,
        decay_off: int,
        plain_off: int,
        col_off: int,
        slice_elems: int,
    ):
        self.decay = Part([i for i in index if params[i].dim() >= 2], params, world, slice_elems)
        self.plain = Part([i for i in index if params[i].dim() < 2], params, world, slice_elems)
        self.index = index
        self.decay_width, self.plain_width = self.decay.width, self.plain.width  # of one rank's row
        self.decay_off, self.plain_off, self.col_off = decay_off, plain_off, col_off
        self.width = self.decay_width + self.plain_width
        self.padded_bytes = (self.decay.padded + self.plain.padded) * params[index[0]].element_size()

    def parts(self):
        """(part, column offset in the row) for each non-empty part."""
        return [(pt, off) for pt, off in ((self.decay, 0), (self.plain, self.decay_width)) if pt.width]

    def rows(self, tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """``tensors`` (aligned with the parameters) packed as this bucket's W x width rows."""
        return torch.cat(
            [pt.to_rows(flatten([tensors[i] for i in pt.idx], dtype, pt.padded)) for pt, _ in self.parts()], 1
        )

    def unpack(self, rows: torch.Tensor, targets: list[torch.Tensor]) -> None:
        """The inverse of ``rows``: W x width rows into ``targets`` (aligned with the parameters)."""
        for pt, off in self.parts():
            unflatten_into(pt.from_rows(rows[:, off : off + pt.width]), [targets[i] for i in pt.idx])


class ShardLayout:
    """Every bucket of ``params`` and this rank's share: ``n_decay`` / ``n_plain`` elements of the
    decay / plain shards, a row of ``row`` elements (every bucket's row, in bucket order)."""

    def __init__(
        self,
        params: list[torch.Tensor],
        world: int,
        rank: int,
        first_bytes: float,
        cap_bytes: float,
        slice_bytes: float,
    ):
        self.world, self.rank = world, rank
        sizes = [nbytes(p) for p in params]
        order = list(reversed(range(len(params))))
        self.plan = fixed_plan(sizes, order, first_bytes, cap_bytes, alone_bytes=cap_bytes / 2)  # big ones: ramped
        slice_elems = max(1, int(slice_bytes) // max(1, params[0].element_size()))
        self.buckets: list[ShardBucket] = []
        d = pl = c = 0
        for index in self.plan:
            b = ShardBucket(index, params, world, d, pl, c, slice_elems)
            self.buckets.append(b)
            d, pl, c = d + b.decay_width, pl + b.plain_width, c + b.width
        self.n_decay, self.n_plain, self.row = d, pl, c
        self.total = sum(p.numel() for p in params)

    def my_part(self, tensors: list[torch.Tensor], which: str) -> torch.Tensor:
        """This rank's ``decay`` or ``plain`` pieces of every bucket of ``tensors``, concatenated (fp32)."""
        out = []
        for b in self.buckets:
            rows = b.rows(tensors, torch.float32)[self.rank]
            out.append(rows[: b.decay_width] if which == "decay" else rows[b.decay_width :])
        return torch.cat(out).clone()

    @torch.no_grad()
    def unpack(self, full: torch.Tensor, targets: list[torch.Tensor]) -> None:
        """Every rank's whole rows (W x ``row``) into ``targets`` (aligned with the parameters)."""
        for b in self.buckets:
            b.unpack(full[:, b.col_off : b.col_off + b.width], targets)
