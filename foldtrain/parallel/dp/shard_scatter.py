"""sharded-ps' backward: every gradient reduce-scattered into this rank's fp32 gradient shard, in slices,
within a memory budget of one bucket.

During every micro-batch's backward a post-accumulate-grad hook marks a gradient ready; a bucket
whose gradients are all ready (and whose predecessors are launched: the launch order is the plan's
on every rank) is taken from the parameters (``p.grad = None``) and its slices are queued. Each
slice is one reduce-scatter that leaves each rank the sum of its piece, which is divided by W and
added to the rank's fp32 gradient shard. Two slices are in flight at a time; a slice that lies in
one gradient sends a view of it, others a packed copy, and a gradient is dropped as soon as every
slice over it is packed or has landed. Memory is held to one bucket (the plan's largest, or
``--dp.shard_budget_mb``): after each gradient the hook lands slices until the next gradient the plan
expects fits beside what is alive, so the backward runs ahead of the link by at most a bucket. A
bucket that is one big gradient (the embedding) is all views, and its slices ramp up
(:class:`~foldtrain.parallel.dp.shard_layout.Part`) so that each receives into the part of that
gradient already reduced: only the first, 1/64 of a slice, needs a buffer of its own. A
bucket of small gradients launched with nothing in flight may still take one packed slice and its
receive buffer past the budget. So a rank holds its shards plus one bucket, plus at most two slices'
buffers (measured: one bucket + 16 KiB, docs/benchmarks.md, "Data-parallel strategies at 4 ranks";
``grad_optim_mem_mb`` reports the peak). The price is CPU where the link is fast: more collectives, and a
backward that waits.

The reduce-scatter (``--dp.shard_collective``, default ``auto``) is the backend's own except on gloo,
where it is an all-to-all and a local sum (:mod:`foldtrain.parallel.scatter`): the receive buffer is a
whole slice there, 1/W of one with the reduce-scatter. ``all_to_all`` / ``reduce_scatter`` force either
(the second is how the tests run NCCL's bookkeeping on gloo).
"""

from __future__ import annotations

import collections

import torch

from foldtrain.parallel.dp.buckets import OrderedLauncher
from foldtrain.parallel.dp.comm import CommStats, nbytes
from foldtrain.parallel.dp.shard_layout import Part, ShardLayout
from foldtrain.parallel.scatter import exchange_rows, recv_elems, summed_row

MAX_IN_FLIGHT = 2  # reduce-scatter slices in flight: one on the wire while the next is queued behind it


class Slice:
    """One reduce-scatter of a bucket: slice ``k`` of one part (stream range [a, b)), landing at ``offset``
    of the fp32 gradient shard."""

    def __init__(self, part: Part, k: int, offset: int, q: int):
        self.part, self.offset, self.q = part, offset, q
        self.a, self.b = part.slices[k]
        self.cover = part.covers[k]  # (parameter, first, last + 1) of each gradient it holds
        self.at = part.ats[k]  # where each piece goes in it
        self.work = self.send = self.recv = None
        self.summed = False
        self.view = False  # the send buffer is a view of one gradient (released when the slice lands)
        self.cost = 0  # bytes of buffers this slice allocated
        self.carve: tuple[int, int] | None = None  # receives into these elements of its (ramped) gradient


class ReduceScatterPipeline:
    """The backward's gradients, bucket by bucket and slice by slice, into ``grad_shard`` (fp32,
    [decay | plain] of ``layout``), holding the replica's gradients and slice buffers within ``budget``
    bytes (at least the layout's largest bucket). Registers a post-accumulate-grad hook on ``params``."""

    def __init__(
        self,
        layout: ShardLayout,
        params: list[torch.nn.Parameter],
        comm: CommStats,
        dtype: torch.dtype,
        budget_bytes: float,
        a2a: bool,
    ):
        self.layout, self.params, self.comm, self.dtype, self.a2a = layout, params, comm, dtype, a2a
        self.world = layout.world
        self.device = params[0].device
        self._index = {id(p): i for i, p in enumerate(params)}
        # transient budget: one bucket, the plan's largest (a single gradient bigger than the cap is a bucket alone),
        # or more (--dp.shard_budget_mb: the backward waits less for the link, memory grows)
        self.budget = max(max(b.padded_bytes for b in layout.buckets), budget_bytes)
        self._next_size = {}  # parameter index -> bytes of the next gradient the plan order expects after it
        flat_order = [i for index in layout.plan for i in index]
        for a, b in zip(flat_order, flat_order[1:] + [None]):
            self._next_size[a] = nbytes(params[b]) if b is not None else 0
        self.launcher = OrderedLauncher(layout.plan, self._launch)
        self.grad_shard: torch.Tensor | None = None  # fp32 gradient shard: [decay | plain]
        self._held: dict[int, torch.Tensor] = {}  # launched gradients, until every slice over them is packed or landed
        self._refs: dict[int, int] = {}  # their slices still to release
        self._todo: collections.deque[Slice] = collections.deque()  # launched buckets' slices, in plan order
        self._flight: list[Slice] = []  # issued, at most MAX_IN_FLIGHT
        self._live = 0  # bytes of full-size gradients and slice buffers alive now
        self.peak_transient = 0
        self._elem = torch.empty((), dtype=dtype).element_size()  # bytes per gradient element
        for p in params:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def _grad_ready(self, p: torch.nn.Parameter) -> None:
        i = self._index[id(p)]
        self._track(nbytes(p.grad))
        self.launcher.ready(i)
        self._progress()
        # memory: hold the backward until the gradient the plan expects next fits in the budget
        want = self._next_size.get(i, 0)
        while self._flight and self._live + want > self.budget:
            self._land_oldest_slice()
            self._issue()

    def _track(self, delta: int) -> None:
        self._live += delta
        self.peak_transient = max(self.peak_transient, self._live)

    def _launch(self, k: int) -> None:
        """Bucket ``k``'s gradients are all there (and its predecessors launched): take them from the
        parameters and queue its slices."""
        b = self.layout.buckets[k]
        for i in b.index:
            p = self.params[i]
            if p.grad is not None:
                self._held[i] = p.grad
                p.grad = None  # the full gradient is not kept: only this rank's shard of it
        for pt, base in ((b.decay, b.decay_off), (b.plain, self.layout.n_decay + b.plain_off)):
            for k, (_, _, col, q) in enumerate(pt.cols()):
                sl = Slice(pt, k, base + col, q)
                for i, _, _ in sl.cover:
                    self._refs[i] = self._refs.get(i, 0) + 1
                self._todo.append(sl)

    def _release(self, i: int) -> None:
        self._refs[i] -= 1
        if self._refs[i] == 0:
            del self._refs[i]
            g = self._held.pop(i, None)
            if g is not None:
                self._track(-nbytes(g))

    def _view_of(self, sl: Slice) -> torch.Tensor | None:
        """The slice's send buffer as a view (W x q) of the one gradient it lies in, if it lies in one."""
        cover = sl.cover
        if len(cover) == 1 and cover[0][2] - cover[0][1] == sl.b - sl.a:
            g = self._held.get(cover[0][0])
            if g is not None and g.dtype == self.dtype and g.is_contiguous():
                return g.view(-1)[cover[0][1] : cover[0][2]].view(self.world, sl.q)
        return None

    def _pack(self, sl: Slice) -> None:
        """The slice's send buffer as a copy of its pieces (zeros where a gradient is missing or padding)."""
        buf = torch.zeros(sl.b - sl.a, dtype=self.dtype, device=self.device)
        for (i, lo, hi), at in zip(sl.cover, sl.at):
            g = self._held.get(i)
            if g is not None:
                buf[at : at + hi - lo] = g.reshape(-1)[lo:hi]
        sl.send, sl.cost = buf.view(self.world, sl.q), nbytes(buf)
        for i, _, _ in sl.cover:
            self._release(i)

    def _cost(self, sl: Slice) -> tuple[int, torch.Tensor | None, torch.Tensor | None]:
        """(bytes of new buffers, send view, receive region) that issuing ``sl`` now would take."""
        view = self._view_of(sl)
        into = self._carve(sl, view)
        fresh = (0 if view is not None else sl.b - sl.a) + (
            0 if into is not None else recv_elems(self.world, sl.q, self.a2a)
        )
        return fresh * self._elem, view, into

    def _issue(self) -> None:
        """Start queued slices in plan order while at most MAX_IN_FLIGHT are in flight and their new
        buffers fit the budget (with nothing in flight the next always goes: waiting frees nothing)."""
        while self._todo and len(self._flight) < MAX_IN_FLIGHT:
            sl = self._todo[0]
            cost, view, into = self._cost(sl)
            if view is not None and sl.part.ramp and into is None and self._flight:
                return  # its gradient's reduced prefix is still too short: after the slice ahead lands
            if self._flight and self._live + cost > self.budget:
                return
            self._todo.popleft()
            if view is not None:
                sl.send, sl.view = view, True
            else:
                self._pack(sl)
            self.comm.count_reduce_scatter(sl.send)
            self.comm.phase = "reduce-scatter"
            sl.work, sl.recv, sl.summed = exchange_rows(sl.send, self.a2a, into)
            sl.cost += 0 if into is not None else nbytes(sl.recv)
            self._track(sl.cost)
            self._flight.append(sl)

    def _carve(self, sl: Slice, view: torch.Tensor | None) -> torch.Tensor | None:
        """For a view slice of a ramped part: room for its receive in the gradient's already reduced prefix
        (before every slice of it not landed yet), after the other slices receiving there; else None."""
        if view is None or not sl.part.ramp:
            return None
        pt = sl.part
        dead = min([x.a for x in self._flight if x.part is pt] + [x.a for x in self._todo if x.part is pt])
        lo = max([x.carve[1] for x in self._flight if x.part is pt and x.carve] + [0])
        hi = lo + recv_elems(self.world, sl.q, self.a2a)
        if hi > dead:
            return None
        sl.carve = (lo, hi)
        return self._held[pt.idx[0]].view(-1)[lo:hi]

    def _finish(self, sl: Slice) -> None:
        """Wait for slice ``sl`` and add this rank's piece of it, divided by W, into the gradient shard."""
        self.comm.wait(sl.work, "reduce-scatter")
        if self.grad_shard is None:
            n = self.layout.n_decay + self.layout.n_plain
            self.grad_shard = torch.zeros(n, dtype=torch.float32, device=sl.recv.device)
        g = summed_row(sl.recv, sl.summed)
        self.grad_shard[sl.offset : sl.offset + sl.q] += g.div_(self.world)
        self._track(-sl.cost)
        if sl.view:
            self._release(sl.cover[0][0])
        sl.work = sl.send = sl.recv = None

    def _progress(self) -> None:
        """Land the slices whose reduce-scatter is done, then start queued ones."""
        done = [sl for sl in self._flight if sl.work.is_completed()]
        for sl in done:
            self._flight.remove(sl)
            self._finish(sl)
        self._issue()

    def _land_oldest_slice(self) -> None:
        self._finish(self._flight.pop(0))

    def end_backward(self) -> None:
        """Launch the buckets still waiting (parameters that got no gradient) and land every slice."""
        self.launcher.finish()
        self._issue()
        while self._flight:
            self._land_oldest_slice()
            self._issue()
        assert not self._todo and not self._held, "sharded-ps: a slice was left behind"
        self.launcher.reset()

    def zero(self) -> None:
        """A new step: no gradient shard yet, nothing alive."""
        self.grad_shard = None
        self._live = 0

    def grad_shard_bytes(self) -> int:
        """Bytes of the fp32 gradient shard (allocated at the first slice that lands)."""
        n = self.layout.n_decay + self.layout.n_plain
        return nbytes(self.grad_shard) if self.grad_shard is not None else 4 * n
