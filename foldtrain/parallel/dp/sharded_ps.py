"""``--dp.strategy sharded-ps``: ZeRO-2. Every rank keeps 1/W of the gradients and of the optimizer.

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

During every micro-batch's backward a post-accumulate-grad hook marks a gradient ready; a bucket
whose gradients are all ready (and whose predecessors are launched: the launch order is the plan's
on every rank) is taken from the parameters (``p.grad = None``) and its slices are queued. Each
slice is one reduce-scatter that leaves each rank the sum of its piece, which is divided by W and
added to the rank's fp32 gradient shard. Two slices are in flight at a time; a slice that lies in
one gradient sends a view of it, others a packed copy, and a gradient is dropped as soon as every
slice over it is packed or has landed. Memory is held to one bucket (the plan's largest, or
``--dp.shard_budget_mb``): after each gradient the hook lands slices until the next gradient the plan
expects fits beside what is alive, so the backward runs ahead of the link by at most a bucket. A bucket that is one big gradient (the
embedding) is all views, and its slices ramp up (:class:`Part`) so that each receives into the part
of that gradient already reduced: only the first, 1/64 of a slice, needs a buffer of its own. A
bucket of small gradients launched with nothing in flight may still take one packed slice and its
receive buffer past the budget. So a rank holds its shards plus one bucket, plus at most two slices'
buffers (measured: one bucket + 16 KiB, docs/benchmarks.md §9g; ``grad_optim_mem_mb`` reports the
peak). The price is CPU where the link is fast: more collectives, and a backward that waits.

The reduce-scatter (``--dp.shard_collective``, default ``auto``) is the backend's own
(``reduce_scatter_tensor``: NCCL's ring) except on gloo, whose reduce-scatter is an all-reduce
followed by a slice: it puts 2(W-1)/W of the bucket on the wire instead of (W-1)/W (measured on
loopback, 4 ranks: 101 MB for a 16 MB tensor, like ``all_reduce``). There a slice's W pieces go
through one ``all_to_all_single`` (piece j to rank j, the bandwidth-optimal (W-1)/W) and each rank
sums the W pieces it received, in fp32: the receive buffer is a whole slice there, 1/W of one with
the reduce-scatter. ``all_to_all`` / ``reduce_scatter`` force either (the second is how the tests
run NCCL's bookkeeping on gloo).

Then: the gradient norm for clipping is the square root of the all-reduced sum of every rank's
squared shard norm; the fp16 loss scaler's skip decision is all-reduced (MIN) so every rank takes
the same one; AdamW steps the shard; and the updated rows come back bucket by bucket: one
asynchronous ``all_gather_into_tensor`` per bucket (in the model's dtype), issued in the order the
next forward needs them (the reverse of the bucket order), so the all-gathers overlap the next
forward. A forward pre-hook on every module that holds parameters waits for the buckets holding
them and unpacks them into the replica; anything else that reads the replica (export, checkpoint,
evaluation outside a forward) lands every pending bucket first.

Checkpoint: ``model`` is the full fp32 model under the single-process names (gathered from the
shards, so ``eval``/``generate`` read it like any other checkpoint); ``optim`` holds each rank's
moments under ``shard<r>of<W>``: resuming needs the same world size, bucket and slice sizes.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import math
import zlib

import torch
import torch.distributed as dist
import torch.nn as nn

from foldtrain.errors import CheckpointError
from foldtrain.optim import adamw_state, load_adamw_state
from foldtrain.parallel.dp.base import DataParallelStrategy
from foldtrain.parallel.dp.buckets import OrderedLauncher, fixed_plan
from foldtrain.parallel.dp.comm import nbytes
from foldtrain.parallel.flat import flatten, unflatten_into

# the names torch 2.12+ prefers (the *_tensor spellings warn as deprecated there)
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
MAX_IN_FLIGHT = 2  # reduce-scatter slices in flight: one on the wire while the next is queued behind it


def uses_all_to_all(choice: str) -> bool:
    """``--dp.shard_collective``: ``auto`` is the all-to-all on gloo (whose reduce-scatter is an
    all-reduce), the backend's reduce-scatter elsewhere (NCCL's ring)."""
    return choice == "all_to_all" or (choice == "auto" and dist.get_backend() == "gloo")


def recv_elems(world: int, width: int, a2a: bool) -> int:
    """Elements :func:`exchange_rows` receives for W x width rows: all of them by all-to-all, one row otherwise."""
    return world * width if a2a else width


def exchange_rows(
    rows: torch.Tensor, a2a: bool, into: torch.Tensor | None = None
) -> tuple[dist.Work, torch.Tensor, bool]:
    """Start the reduce-scatter of ``rows`` (W x width): (work, buffer, summed). After ``work.wait()``
    the buffer holds this rank's summed row (``summed``) or, by all-to-all (``a2a``), the W rows to
    sum (dim 0). ``into``: a flat buffer of :func:`recv_elems` elements to receive into (else a new one)."""
    if a2a:
        recv = torch.empty_like(rows) if into is None else into.view(rows.shape)
        return dist.all_to_all_single(recv, rows, async_op=True), recv, False
    out = torch.empty(rows.shape[1], dtype=rows.dtype, device=rows.device) if into is None else into
    return reduce_scatter(out, rows.reshape(-1), async_op=True), out, True


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
        """(a, b, col, q) per slice: stream range [a, b); each rank's piece is q = (b-a)/W long, at ``col`` of its row."""
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


class Bucket:
    """One bucket's parameters (indices), split into decay / plain parts, and its place in the shards."""

    def __init__(
        self,
        index: list[int],
        params: list[torch.Tensor],
        world: int,
        dec_off: int,
        plain_off: int,
        col_off: int,
        slice_elems: int,
    ):
        self.decay = Part([i for i in index if params[i].dim() >= 2], params, world, slice_elems)
        self.plain = Part([i for i in index if params[i].dim() < 2], params, world, slice_elems)
        self.index = index
        self.dp, self.pp = self.decay.width, self.plain.width
        self.dec_off, self.plain_off, self.col_off = dec_off, plain_off, col_off
        self.width = self.dp + self.pp
        self.padded_bytes = (self.decay.padded + self.plain.padded) * params[index[0]].element_size()

    def parts(self):
        """(part, column offset in the row) for each non-empty part."""
        return [(pt, off) for pt, off in ((self.decay, 0), (self.plain, self.dp)) if pt.width]

    def rows(self, tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """``tensors`` (aligned with the parameters) packed as this bucket's W x width rows."""
        return torch.cat(
            [pt.to_rows(flatten([tensors[i] for i in pt.idx], dtype, pt.padded)) for pt, _ in self.parts()], 1
        )

    def unpack(self, rows: torch.Tensor, targets: list[torch.Tensor]) -> None:
        """The inverse of ``rows``: W x width rows into ``targets`` (aligned with the parameters)."""
        for pt, off in self.parts():
            unflatten_into(pt.from_rows(rows[:, off : off + pt.width]), [targets[i] for i in pt.idx])


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


class ShardedPSStrategy(DataParallelStrategy):
    def __init__(self, state, cfg):
        super().__init__(state, cfg)
        self.params = [p for _, p in self.named_params]
        self._index = {id(p): i for i, p in enumerate(self.params)}
        order = list(reversed(range(len(self.params))))
        sizes = [nbytes(p) for p in self.params]
        cap = cfg.dp.shard_bucket_mb * 2**20
        plan = fixed_plan(
            sizes, order, cfg.dp.first_bucket_mb * 2**20, cap, alone_bytes=cap / 2
        )  # big gradients: views, ramped
        slice_elems = max(1, int(cfg.dp.shard_slice_mb * 2**20) // max(1, self.params[0].element_size()))
        self.buckets: list[Bucket] = []
        d = pl = c = 0
        for index in plan:
            b = Bucket(index, self.params, self.world, d, pl, c, slice_elems)
            self.buckets.append(b)
            d, pl, c = d + b.dp, pl + b.pp, c + b.width
        self.n_decay, self.n_plain, self.row = d, pl, c  # this rank's shard: decay / plain elements
        self.total = sum(p.numel() for p in self.params)
        # transient budget: one bucket, the plan's largest (a single gradient bigger than the cap is a bucket alone),
        # or more (--dp.shard_budget_mb: the backward waits less for the link, memory grows)
        self.budget = max(max(b.padded_bytes for b in self.buckets), cfg.dp.shard_budget_mb * 2**20)
        self._next_size = {}  # parameter index -> bytes of the next gradient the plan order expects after it
        flat_order = [i for index in plan for i in index]
        for a, b in zip(flat_order, flat_order[1:] + [None]):
            self._next_size[a] = sizes[b] if b is not None else 0
        full = [p.detach().float() for p in self.params]
        self.decay_shard = nn.Parameter(self._my_part(full, "decay").reshape(1, -1))
        self.plain_shard = nn.Parameter(self._my_part(full, "plain"))
        self.shards = [self.decay_shard, self.plain_shard]
        state.set_optimizer(
            [("decay", self.decay_shard), ("plain", self.plain_shard)], masters=False
        )  # fp32 masters: the shard only
        self.launcher = OrderedLauncher(plan, self._launch)
        self._gacc: torch.Tensor | None = None  # fp32 gradient shard: [decay | plain]
        self._held: dict[int, torch.Tensor] = {}  # launched gradients, until every slice over them is packed or landed
        self._refs: dict[int, int] = {}  # their slices still to release
        self._todo: collections.deque[Slice] = collections.deque()  # launched buckets' slices, in plan order
        self._flight: list[Slice] = []  # issued, at most MAX_IN_FLIGHT
        self._live = 0  # bytes of full-size gradients and slice buffers alive now
        self.peak_transient = 0
        self._elem = torch.empty((), dtype=self.precision.param_dtype).element_size()  # bytes per gradient element
        self.a2a = uses_all_to_all(cfg.dp.shard_collective)  # the reduce-scatter as an all-to-all + local sum
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._grad_ready)
        # the all-gathers of the updated rows, in flight until a forward needs them: bucket -> (work, W x width rows)
        self._gathers: dict[int, tuple[dist.Work, torch.Tensor]] = {}  # at most one
        self._queue: list[tuple[int, torch.dtype]] = []  # the all-gathers still to issue, in order
        bucket_of = {i: k for k, b in enumerate(self.buckets) for i in b.index}
        for mod in self.model.modules():
            ks = sorted({bucket_of[self._index[id(p)]] for p in mod.parameters(recurse=False) if id(p) in self._index})
            if ks:
                mod.register_forward_pre_hook(lambda _m, _a, ks=ks: self._land(ks))

    def _my_part(self, tensors: list[torch.Tensor], which: str) -> torch.Tensor:
        """This rank's ``decay`` or ``plain`` pieces of every bucket of ``tensors``, concatenated (fp32)."""
        out = []
        for b in self.buckets:
            rows = b.rows(tensors, torch.float32)[self.rank]
            out.append(rows[: b.dp] if which == "decay" else rows[b.dp :])
        return torch.cat(out).clone()

    # ------------------------------------------------------------------ backward: bucket by bucket, slice by slice
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
        b = self.buckets[k]
        for i in b.index:
            p = self.params[i]
            if p.grad is not None:
                self._held[i] = p.grad
                p.grad = None  # the full gradient is not kept: only this rank's shard of it
        for pt, base in ((b.decay, b.dec_off), (b.plain, self.n_decay + b.plain_off)):
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
            if g is not None and g.dtype == self.precision.param_dtype and g.is_contiguous():
                return g.view(-1)[cover[0][1] : cover[0][2]].view(self.world, sl.q)
        return None

    def _pack(self, sl: Slice) -> None:
        """The slice's send buffer as a copy of its pieces (zeros where a gradient is missing or padding)."""
        buf = torch.zeros(sl.b - sl.a, dtype=self.precision.param_dtype, device=self.decay_shard.device)
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
            self.comm.reduce_scatter(sl.send)
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
        self.comm.wait(sl.work, "reduce-scatter")
        if self._gacc is None:
            self._gacc = torch.zeros(self.n_decay + self.n_plain, dtype=torch.float32, device=sl.recv.device)
        g = sl.recv.float() if sl.summed else sl.recv.float().sum(0)
        self._gacc[sl.offset : sl.offset + sl.q] += g.div_(self.world)
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

    def _end_backward(self) -> None:
        self.land_all()  # a module the forward skipped keeps its bucket pending: land it before the next step
        self.launcher.finish()
        self._issue()
        while self._flight:
            self._land_oldest_slice()
            self._issue()
        assert not self._todo and not self._held, "sharded-ps: a slice was left behind"
        self.launcher.reset()

    @contextlib.contextmanager
    def no_sync(self):
        yield  # ZeRO-2 reduces every micro-batch's gradients into the shard: nothing accumulates full-size
        self._end_backward()

    def sync_grads(self) -> None:
        self._end_backward()
        self.decay_shard.grad = self._gacc[: self.n_decay].view(1, -1)
        self.plain_shard.grad = self._gacc[self.n_decay :]

    # ------------------------------------------------------------------ the update
    def optimizer_params(self) -> list[torch.Tensor]:
        return self.shards

    def global_finite(self, finite: bool) -> bool:
        return self.all_true(finite, "loss-scaler all-reduce") if self.precision.scaler.enabled else finite

    def clip(self, params: list[torch.Tensor]) -> float:
        return self.clip_by_global_norm(params)

    def apply_update(self, grads_finite: bool) -> None:
        super().apply_update(grads_finite)  # clip, AdamW on this shard, LR schedule
        if grads_finite:
            self._start_gathers(self.precision.param_dtype)

    def _start_gathers(self, dtype: torch.dtype) -> None:
        """Queue every bucket's all-gather, the next forward's first bucket (the last one) first, and
        start it. One all-gather is in flight at a time: landing a bucket starts the next one (several
        concurrent collectives on one slow link only make TCP drop and stall)."""
        self.land_all()
        self._queue = [(k, dtype) for k in reversed(range(len(self.buckets)))]
        self._issue_next()

    def _issue_next(self) -> None:
        if not self._queue:
            return
        k, dtype = self._queue.pop(0)
        b = self.buckets[k]
        mine = torch.empty(b.width, dtype=dtype, device=self.decay_shard.device)
        self._fill_row(b, mine)
        rows = torch.empty(self.world * b.width, dtype=dtype, device=mine.device)
        self.comm.all_gather(rows)
        self._gathers[k] = (all_gather(rows, mine, async_op=True), rows.view(self.world, b.width))

    @torch.no_grad()
    def _land(self, ks: list[int]) -> None:
        """Wait for the all-gathers of buckets ``ks`` (issuing queued ones in order until they are in
        flight) and unpack them into the replica."""
        for k in ks:
            while k not in self._gathers and any(q == k for q, _ in self._queue):
                self._land_oldest()
            got = self._gathers.pop(k, None)
            if got is not None:
                self.comm.wait(got[0], "all-gather")
                self.buckets[k].unpack(got[1], self.params)
                self._issue_next()

    def _land_oldest(self) -> None:
        (k,) = list(self._gathers)  # one in flight
        self._land([k])

    def flush(self) -> None:
        self.land_all()

    def land_all(self) -> None:
        while self._gathers:
            self._land_oldest()

    def zero_grad(self) -> None:
        super().zero_grad()
        self.model.zero_grad(set_to_none=True)
        self._gacc = None
        self._live = 0

    def grad_optim_bytes(self) -> tuple[int, int]:
        """(persistent, peak transient) bytes: gradient shard + fp32 shard weights + AdamW state; and
        the most full-size gradients plus bucket buffers alive at once during the step."""
        persistent = sum(nbytes(s) for s in self.shards) + (
            nbytes(self._gacc) if self._gacc is not None else 4 * (self.n_decay + self.n_plain)
        )
        persistent += sum(nbytes(t) for st in self.optimizer.state.values() for t in st.values() if torch.is_tensor(t))
        return persistent, self.peak_transient

    def stats(self) -> dict[str, float]:
        persistent, transient = self.grad_optim_bytes()
        return {
            **super().stats(),
            "grad_optim_mem_mb": (persistent + transient) / 2**20,
            "dp_buckets": float(len(self.buckets)),
        }

    def _fill_row(self, b: Bucket, dst: torch.Tensor) -> None:
        """This rank's row of bucket ``b`` (its decay then plain shard pieces) into ``dst`` (``b.width`` long)."""
        dst[: b.dp] = self.decay_shard.detach()[0, b.dec_off : b.dec_off + b.dp]
        dst[b.dp :] = self.plain_shard.detach()[b.plain_off : b.plain_off + b.pp]

    def _gather(self, dtype: torch.dtype) -> torch.Tensor:
        """Every rank's rows, all-gathered in ``dtype``: W x (this rank's row length)."""
        mine = torch.empty(self.row, dtype=dtype, device=self.decay_shard.device)
        for b in self.buckets:
            self._fill_row(b, mine[b.col_off : b.col_off + b.width])
        full = torch.empty(self.world * self.row, dtype=dtype, device=mine.device)
        self.comm.all_gather(full)
        self.comm.wait(all_gather(full, mine, async_op=True), "all-gather")
        return full.view(self.world, self.row)

    @torch.no_grad()
    def _unpack(self, full: torch.Tensor, targets: list[torch.Tensor]) -> None:
        for b in self.buckets:
            b.unpack(full[:, b.col_off : b.col_off + b.width], targets)

    # ------------------------------------------------------------------ checkpoint and export
    def _fp32_full(self) -> dict[int, torch.Tensor]:
        """Parameter storage address -> its fp32 values (gathered from every rank's shard)."""
        self.land_all()
        values = [torch.empty(p.shape, dtype=torch.float32, device=p.device) for p in self.params]
        self._unpack(self._gather(torch.float32), values)
        return {p.data_ptr(): v for p, v in zip(self.params, values)}

    def model_optim_state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        views = self._fp32_full()
        model = {k: views.get(v.data_ptr(), v) for k, v in get_model_state_dict(self.model).items()}
        optim = {
            f"shard{self.rank}of{self.world}": {
                "decay": adamw_state(self.optimizer, self.decay_shard),
                "plain": adamw_state(self.optimizer, self.plain_shard),
            }
        }
        return {"model": model, "optim": optim, "shard_layout": self._layout()}

    def _layout(self) -> torch.Tensor:
        """Which element of which parameter every rank's shard holds, in four numbers: a CRC of the buckets'
        parameters and slices, the world size, the slice length, the number of buckets."""
        desc = [(b.decay.idx, b.decay.slices, b.plain.idx, b.plain.slices) for b in self.buckets]
        step = self.buckets[0].decay.slices[0] if self.buckets[0].decay.slices else (0, 0)
        return torch.tensor(
            [zlib.crc32(repr(desc).encode()), self.world, step[1] - step[0], len(self.buckets)], dtype=torch.int64
        )

    @torch.no_grad()
    def load_model_optim_state(self, sd: dict) -> None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        self.land_all()
        mine, saved = self._layout().tolist(), sd["shard_layout"].tolist()
        if saved != mine:
            raise CheckpointError(
                f"this checkpoint's sharded-ps shards (world {saved[1]}, {saved[3]} buckets, slices of {saved[2]} elements) are laid out "
                f"unlike this run's (world {mine[1]}, {mine[3]} buckets, slices of {mine[2]}); resume with the world size, "
                "--dp.first_bucket_mb, --dp.shard_bucket_mb and --dp.shard_slice_mb it was saved with"
            )
        by_ptr = {v.data_ptr(): sd["model"][k] for k, v in get_model_state_dict(self.model).items()}
        full = [by_ptr[p.data_ptr()].float() for p in self.params]
        self.decay_shard.copy_(self._my_part(full, "decay").view(1, -1))
        self.plain_shard.copy_(self._my_part(full, "plain"))
        for p, v in zip(self.params, full):
            p.copy_(v)
        saved = sd["optim"][f"shard{self.rank}of{self.world}"]
        for key, p in (("decay", self.decay_shard), ("plain", self.plain_shard)):
            load_adamw_state(self.optimizer, p, saved[key])

    def eval_model(self) -> nn.Module:
        self.land_all()
        if not self.precision.master:
            return self.model
        model = copy.deepcopy(self.model).float()  # collective: every rank gathers the fp32 masters
        self._unpack(self._gather(torch.float32), list(model.parameters()))
        return model
