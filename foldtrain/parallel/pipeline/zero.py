"""The 3D engine's distributed optimizer (``--optim.distributed``): ZeRO-1 over the data-parallel group.

Each chunk's parameters (their tensor-parallel local parts) are laid end to end in flat *buckets*, each
padded to a multiple of ``dp``; data-parallel rank ``r`` owns the ``r``-th of ``dp`` equal slices of
every bucket. AdamW steps only those elements: one optimizer tensor per piece of a parameter inside the
slice (a *segment*), so weight decay follows the parameter's group as in the single-process optimizer.
The segments are views into the chunk's fp32 weights, or, where the chunk holds half-precision weights
(the master precisions), fp32 copies of those elements: a rank holds 1/dp of the chunk's moments and
masters.

A chunk's own buckets are reduce-scattered (:class:`ScatterBucket`, in place of the all-reduce; on gloo
an all-to-all and a local sum, :mod:`foldtrain.parallel.scatter`): the chunk's gradients are freed once
packed, and each rank receives only its slice, averaged. The tied weight's copy is all-reduced with the
other end's (:mod:`.tie`), so each end has the whole sum: by default the two ends each step half of the copy and
all-gather the halves over the tie's pair (``tied_halves``, where :func:`~foldtrain.schedules.splits_tied_state`
allows it; else every rank steps it whole, its moments unsharded, with no all-gather), or with
``--optim.shard_tied`` each dp rank steps only its slice, taken from the result (``pull``). A step then steps the
segments and all-gathers the slices into the chunk's weights (``push``): the bytes of one all-reduce in all, as
Megatron's distributed optimizer. The gradient norm is a sum over every rank's segments: their elements
weigh 1, those of a parameter replicated over the TP ranks ``1/tp`` (each TP rank holds an equal copy),
the head's whole copy of the tied weight 0 (the embedding's counts it), each end's half ``1/dp``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn as nn

from foldtrain import collectives
from foldtrain.parallel.flat import flatten
from foldtrain.parallel.pipeline.deadlines import ReductionBucket, split_buckets
from foldtrain.parallel.pipeline.p2p import local_part
from foldtrain.parallel.scatter import exchange_rows, summed_row, uses_all_to_all


def reduce_scatter_mean(tensors: list[torch.Tensor], world: int, width: int, group=None) -> tuple:
    """Start the reduce-scatter of ``tensors`` laid end to end, zero-padded to ``world`` rows of ``width`` and averaged
    over the ranks: :func:`~foldtrain.parallel.scatter.exchange_rows`' (work, buffer, summed) and the packed input, to
    keep alive until the work is done (``summed_row`` then gives this rank's row)."""
    packed = flatten(tensors, tensors[0].dtype, size=world * width).div_(world)
    work, buf, summed = exchange_rows(packed.view(world, width), uses_all_to_all("auto"), group=group)
    return work, buf, summed, packed


def _replicated(p) -> bool:
    placements = getattr(p, "placements", None)
    return placements is None or all(pl.is_replicate() for pl in placements)


def _flat(p) -> torch.Tensor:
    """The flattened local part of ``p``, sharing its storage, outside autograd."""
    return local_part(p).detach().view(-1)


@dataclass
class Segment:
    """Elements ``start:end`` of parameter ``index``'s flattened local part: ``tensor`` is what AdamW steps
    (a view into the parameter, or its fp32 master copy); ``weight``: the elements' weight in the squared
    norm; ``decay``: a matrix's elements."""

    index: int
    start: int
    end: int
    at: int  # where the piece starts in this rank's slice
    tensor: torch.Tensor
    weight: float
    decay: bool


class FlatShard:
    """One bucket of a chunk's parameters and this rank's segments of it (see the module docstring)."""

    def __init__(
        self,
        params: list,
        dp: int,
        dp_rank: int,
        group,
        tp: int,
        head_copy=None,
        whole: bool = False,
        share: float | None = None,
    ):
        """``whole``: every data-parallel rank steps all of the bucket (the tied weight's copy, whose gradient
        every rank has in full): no collective, and each element weighs 1/dp in the norm's sum over ranks.
        ``dp``, ``dp_rank`` and ``group`` name the ranks the bucket is sliced over (the tie's pair, for a copy split
        between the pipeline's ends); ``share``: each element's weight in that sum, where not 1 (or 1/dp whole)."""
        share = share if share is not None else 1.0 / dp if whole else 1.0
        self.whole = whole
        dp, dp_rank = (1, 0) if whole else (dp, dp_rank)
        self.params, self.dp, self.group = params, dp, group
        self.rows_group = None  # where start_rows' collectives go (ChunkShards: beside the all-gathers)
        self.offsets = list(itertools.accumulate([0] + [local_part(p).numel() for p in params]))
        self.length = -(-self.offsets[-1] // dp)  # elements per rank (the bucket padded to dp slices)
        self.dtype = local_part(params[0]).dtype
        lo, hi = dp_rank * self.length, (dp_rank + 1) * self.length
        self.segments: list[Segment] = []
        for i, p in enumerate(params):
            a, b = max(lo, self.offsets[i]) - self.offsets[i], min(hi, self.offsets[i + 1]) - self.offsets[i]
            if a >= b:
                continue
            view = _flat(p)[a:b]
            tensor = view if view.dtype == torch.float32 else view.float()  # half weights: an fp32 master
            weight = 0.0 if p is head_copy else share * (1.0 / tp if tp > 1 and _replicated(p) else 1.0)
            at = self.offsets[i] + a - lo
            self.segments.append(Segment(i, a, b, at, tensor, weight, p.dim() >= 2))
        self.pad = self.length - sum(sg.end - sg.start for sg in self.segments)

    @property
    def owns_copies(self) -> bool:
        return self.dtype != torch.float32

    @torch.no_grad()
    def pull(self) -> None:
        """This rank's slice of the (reduced) gradients becomes the segments'; the chunk's are freed."""
        if all(p.grad is None for p in self.params):
            return  # already pulled
        for sg in self.segments:
            g = self.params[sg.index].grad
            part = _flat(g)[sg.start : sg.end] if g is not None else torch.zeros_like(sg.tensor)
            sg.tensor.grad = part.to(torch.float32, copy=True)
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def receive(self, mine: torch.Tensor) -> None:
        """This rank's slice of the reduced gradients (a reduce-scatter's output) becomes the segments'."""
        for sg in self.segments:
            sg.tensor.grad = mine[sg.at : sg.at + sg.end - sg.start].to(torch.float32, copy=True)

    def grads(self) -> list[torch.Tensor]:
        return [sg.tensor.grad for sg in self.segments if sg.tensor.grad is not None]

    def norm_sq(self) -> torch.Tensor:
        """This rank's weighted share of the squared gradient norm (fp32)."""
        total = torch.zeros((), dtype=torch.float32, device=self.params[0].device)
        for sg in self.segments:
            if sg.weight and sg.tensor.grad is not None:
                total += sg.weight * sg.tensor.grad.pow(2).sum()
        return total

    def _slice(self, tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """``tensors`` (one per segment) end to end, padded to the slice's length."""
        parts = [t.detach().reshape(-1).to(dtype) for t in tensors]
        device = self.params[0].device
        return torch.cat([*parts, torch.zeros(self.pad, dtype=dtype, device=device)])

    def gather(self, tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """Every rank's slice of a bucket-shaped quantity (``tensors``: this rank's, one per segment), in
        bucket order (a collective over dp)."""
        work, full = self.gather_async(tensors, dtype)
        if work is not None:
            work.wait()
        return full

    def gather_async(self, tensors: list[torch.Tensor], dtype: torch.dtype, group=None):
        """:meth:`gather` started (over ``group``, the bucket's dp group by default): ``(work or None, the buffer it
        fills)``."""
        mine = self._slice(tensors, dtype)
        if self.dp == 1:
            return None, mine
        full = torch.empty(self.dp * self.length, dtype=dtype, device=mine.device)
        return collectives.all_gather_single(full, mine, group=group or self.group, async_op=True), full

    @torch.no_grad()
    def unpack(self, full: torch.Tensor, into: list) -> None:
        """A gathered bucket into ``into`` (the bucket's parameters, or tensors shaped as them)."""
        for i, t in enumerate(into):
            _flat(t).copy_(full[self.offsets[i] : self.offsets[i + 1]])

    def push(self, group=None):
        """Start the all-gather of the stepped slices (over ``group``, by default the bucket's); returns what
        :meth:`land` takes, or None where the chunk's weights are already the stepped ones (views into them, not
        split over dp)."""
        if self.dp == 1 and not self.owns_copies:
            return None
        return self.gather_async([sg.tensor for sg in self.segments], self.dtype, group)

    def land(self, pushed, wait) -> None:
        """The gathered slices become the chunk's weights (in their dtype); ``wait(work)`` bounds the wait."""
        work, full = pushed
        if work is not None:
            wait(work)
        self.unpack(full, self.params)

    @torch.no_grad()
    def start_rows(self, rows: torch.Tensor):
        """Start landing the rows ``rows`` (sorted, the same on every dp rank) of this bucket's one matrix (the
        embedding's copy of the tied weight), stepped: the rows' elements each rank's slice holds, all-reduced over
        dp (each element is in one slice). Returns what :meth:`land_rows` takes."""
        width = local_part(self.params[0]).shape[1]
        elems = rows.unsqueeze(1) * width + torch.arange(width, device=rows.device)  # their flat positions
        buf = torch.zeros(elems.shape, dtype=torch.float32, device=rows.device)
        for sg in self.segments:  # (one: the slice's part of the matrix, or none: padding only)
            mine = (elems >= sg.start) & (elems < sg.end)
            buf[mine] = sg.tensor[elems[mine] - sg.start].float()
        return collectives.all_reduce(buf, group=self.rows_group or self.group, async_op=True), rows, buf

    @torch.no_grad()
    def land_rows(self, started, wait) -> None:
        """The rows :meth:`start_rows` started become the chunk's on every dp rank; the other rows stay as they
        were. ``wait(work)`` bounds the wait."""
        work, rows, buf = started
        wait(work)
        weight = local_part(self.params[0])
        weight[rows] = buf.to(weight.dtype)


class ScatterBucket(ReductionBucket):
    """A bucket of a chunk's gradients reduce-scattered over dp into this rank's slice of ``shard``."""

    def __init__(self, segment: int, index: int, shard: FlatShard, grads: list[torch.Tensor], deadline: int, dp: int):
        super().__init__(segment, index, grads, deadline, dp)
        self.shard = shard

    def issue(self, group, clock) -> None:
        sh = self.shard  # (its dp is the bucket's: the chunk's slices are never whole)
        self.work, self.flat, self.summed, self.packed = reduce_scatter_mean(self.grads, sh.dp, sh.length, group)
        for p in sh.params:  # packed: the chunk's gradients are no longer needed
            p.grad = None
        self.grads = []
        self.t_issue = clock()

    def unpack(self) -> None:
        # all-to-all: the dp pieces of this rank's slice, summed here (in fp32, as the segments keep them)
        self.shard.receive(summed_row(self.flat, self.summed))
        self.flat = self.work = self.packed = None


class GatherBucket(ReductionBucket):
    """The all-gather of a bucket's stepped slices as a deferred bucket of the deadline queue, which issues it in
    deadline order among the reductions (the tied copy's, stepped apart: :meth:`ChunkShards.step_tied`)."""

    def __init__(self, segment: int, shard: FlatShard, deadline: int):
        super().__init__(segment, -1, [], deadline, shard.dp)
        self.shard = shard
        self.full = None

    def issue(self, group, clock) -> None:
        self.work, self.full = self.shard.push(group)
        self.t_issue = clock()

    def started(self):
        """What :meth:`FlatShard.land` takes: ``(work, buffer)``."""
        if self.work is None:
            raise RuntimeError(f"chunk {self.segment}: the tied copy's all-gather was never issued by the queue")
        return self.work, self.full

    def unpack(self) -> None:
        """Nothing: the chunk's weights take the buffer when they are next read (:meth:`ChunkShards.land`)."""


def looked_up_only(chunk: nn.Module, tied, topo) -> bool:
    """Whether the chunk reads ``tied`` only as an embedding table (its ``Embedding``'s ``wte``, no head using it),
    without tensor parallelism (whose vocabulary-sharded lookup reads rows by another rule)."""
    from foldtrain.model.gpt import Embedding, Head

    if tied is None or topo.tp > 1:
        return False
    looks_up = any(isinstance(m, Embedding) and m.wte.weight is tied for m in chunk.modules())
    projects = any(isinstance(m, Head) and m.lm_head.weight is tied for m in chunk.modules())
    return looks_up and not projects


def ensure_state(optimizer: torch.optim.Optimizer, t: torch.Tensor) -> dict:
    """AdamW's state of ``t``, made (zero) if it has not stepped yet (AdamW makes it at its first step)."""
    st = optimizer.state[t]
    if not st:
        st.update(step=torch.zeros((), device=t.device), exp_avg=torch.zeros_like(t), exp_avg_sq=torch.zeros_like(t))
    return st


class ChunkShards:
    """A chunk's buckets (its own parameters, in the reducer's buckets; the tied weight's copy alone) and the
    AdamW of their segments. ``bucket_bytes``: a deferred chunk's reduction goes in buckets of this size
    (:class:`~foldtrain.parallel.pipeline.deadlines.DeadlineQueue`), else in one."""

    def __init__(
        self,
        chunk: nn.Module,
        tied,
        topo,
        optim_cfg,
        head_copy=None,
        bucket_bytes: float | None = None,
        rows_group=None,
        tied_halves: bool = False,
    ):
        """``optim_cfg.shard_tied``: the tied weight's copy sliced over dp like the rest (the tie exchanges only its
        slice of the gradient, :attr:`tied_slice`; the stepped slices all-gathered); else ``tied_halves``: split in two
        halves between the pipeline's two ends, each stepping one (:meth:`_halved`); else stepped whole.
        ``rows_group``: a second group over the dp ranks for the lookup-only copy's rows (:meth:`start_rows`), so
        they do not queue behind the all-gathers of the chunks stepped before them."""
        self.tied, self.segment = tied, getattr(chunk, "segment", -1)
        params = [p for p in chunk.parameters() if p is not tied]
        if not params:
            own = []
        elif bucket_bytes:  # the deadline queue's split, on the parameters' sizes (the gradients' are the same)
            local = {id(local_part(p)): p for p in params}
            own = [[local[id(t)] for t in b] for b in split_buckets([local_part(p) for p in params], bucket_bytes)]
        else:
            own = [params]
        self.index = {id(p): i for i, p in enumerate(chunk.parameters())}  # a parameter's place in the chunk
        make = lambda g, whole=False: FlatShard(g, topo.dp, topo.dp_rank, topo.dp_group, topo.tp, head_copy, whole)  # noqa: E731
        self.own = [make(g) for g in own]
        # the tied copy: its gradient is all-reduced in full for the tie, so every rank may step all of it (its moments
        # unsharded, no all-gather), or half of it, the other end the other half (tied_halves: an all-gather over the
        # pair); shard_tied slices it over dp (a reduce-scatter, then an all-gather)
        self.tied_halves = tied_halves and tied is not None
        self.tied_over_dp = tied is not None and not self.tied_halves and optim_cfg.shard_tied
        if tied is None:
            self.buckets = self.own
        elif self.tied_halves:
            self.buckets = self.own + [self._halved(tied, topo)]
        else:
            self.buckets = self.own + [make([tied], whole=not self.tied_over_dp)]
        self.pushed: list = []  # (bucket, all-gather in flight) since the step, until the next forward
        self.held: list = []  # buckets stepped whose all-gathers wait for start_gathers
        # shard_tied: the embedding's copy, where nothing else in the chunk reads it, is only looked up: after a
        # step the next forward takes the rows its step's token ids name (lookup_rows), and a full all-gather waits
        # for whoever reads the whole weight (an evaluation, a checkpoint, a flush)
        self.lookup_only = self.buckets[-1] if self.tied_over_dp and looked_up_only(chunk, tied, topo) else None
        if self.lookup_only is not None:
            self.lookup_only.rows_group = rows_group
        self.tied_stepped = False  # the tied copy's slice stepped apart (step_tied) since the chunk's last step
        self.behind = False  # the lookup-only copy is behind its last step (rows not looked up, or all of it)
        self.rows_due = False  # ... and the rows of the next training forward have not landed yet
        self.rows_started = None  # their landing in flight (start_rows)
        segments = [sg for b in self.buckets for sg in b.segments]
        device = next(chunk.parameters()).device
        decay = [sg.tensor for sg in segments if sg.decay]
        # a rank whose slices hold nothing of a group still needs a tensor there (a slice of padding only)
        no_decay = [sg.tensor for sg in segments if not sg.decay] or [torch.zeros(0, device=device)]
        groups = [{"params": decay, "weight_decay": optim_cfg.weight_decay}] if decay else []
        groups.append({"params": no_decay, "weight_decay": 0.0})
        self.optimizer = torch.optim.AdamW(
            groups,
            lr=optim_cfg.lr,
            betas=(optim_cfg.beta1, optim_cfg.beta2),
            eps=optim_cfg.eps,
            **({"fused": True} if device.type in ("cpu", "cuda") else {"foreach": True}),
        )

    @staticmethod
    def _halved(tied, topo) -> FlatShard:
        """The tied copy split between the pipeline's two ends (the tie's pair, whose group ranks are the embedding's
        end, then the head's): each end steps its half, and each element weighs 1/dp in the norm, held once by every
        replica (so the head's half counts, where a whole copy at the head weighs 0)."""
        return FlatShard([tied], 2, 0 if topo.pp_rank == 0 else 1, topo.tie_group, topo.tp, share=1.0 / topo.dp)

    @property
    def tied_slice(self) -> int | None:
        """Elements of this rank's slice of the tied copy, where it is sliced over dp (``--optim.shard_tied``), else
        None."""
        return self.buckets[-1].length if self.tied_over_dp else None

    @property
    def steps_tied_apart(self) -> bool:
        """Whether the tied copy is sliced (over dp, or between the ends), so a deferred chunk can step it alone at
        the iteration's end (the rules' ``early_tie``) and its all-gather can start there."""
        return self.tied_over_dp or self.tied_halves

    def pull(self) -> None:
        """Slices of gradients that were all-reduced (the tied copy's) taken from the chunk's."""
        for b in self.buckets:
            b.pull()

    def scatter_buckets(self, grads_of, deadline: int, dp: int, segment: int) -> list[ScatterBucket]:
        """The chunk's own reduction as reduce-scatters; ``grads_of(params)``: their gradients' local parts."""
        return [ScatterBucket(segment, k, b, grads_of(b.params), deadline, dp) for k, b in enumerate(self.own)]

    def grads(self) -> list[torch.Tensor]:
        return [g for b in self.buckets for g in b.grads()]

    def norm_sq(self) -> torch.Tensor:
        return sum((b.norm_sq() for b in self.buckets[1:]), self.buckets[0].norm_sq())

    def step(self, hold: bool = False) -> None:
        """Step the slices and start the all-gathers of the chunk's weights (:meth:`land` completes them; a
        lookup-only copy's rows wait for the next forward's ids). ``hold``: those over dp wait for
        :meth:`start_gathers` (the rules' ``gather_order``); a half's, over the tie's pair, starts now (the other
        end's forward needs it, in order with the tie's exchange on the pair)."""
        self.optimizer.step()  # (a tied slice stepped apart has no gradient now: AdamW skips it)
        done = (self.lookup_only, self.buckets[-1] if self.tied_stepped else None)
        todo = [b for b in self.buckets if b not in done]
        half = self.buckets[-1] if self.tied_halves else None
        self.held = [b for b in todo if hold and b is not half]
        self.pushed += [(b, x) for b in todo if b not in self.held and (x := b.push()) is not None]
        self.tied_stepped = False
        self.behind = self.rows_due = self.lookup_only is not None

    def start_gathers(self) -> None:
        """Start the all-gathers :meth:`step` held."""
        held, self.held = self.held, []
        self.pushed += [(b, x) for b in held if (x := b.push()) is not None]

    def step_tied(self, queue, deadline: int) -> None:
        """Step only the tied copy's slice, its gradient final before the chunk's own (still in flight: their
        segments have no gradient, which AdamW skips), and queue its all-gather in ``queue``'s deferred buckets
        with ``deadline`` (a :class:`GatherBucket`). The chunk's :meth:`step` then steps the rest."""
        b = self.buckets[-1]
        if any(sg.tensor.grad is not None for o in self.own for sg in o.segments):
            raise RuntimeError("the tied copy stepped apart while the chunk's own gradients were there")
        b.pull()
        self.optimizer.step()
        for sg in b.segments:
            sg.tensor.grad = None
        if b is not self.lookup_only and b.dp > 1 and self.tied_over_dp:  # (the halves' gather: on the pair, at once)
            (gather,) = queue.submit_deferred(  # issued by the queue's end_iteration, in deadline order
                self.segment, [], deadline, b.dp, [GatherBucket(self.segment, b, deadline)], pump=False
            )
            self.pushed.append((b, gather))
        elif b is not self.lookup_only and (x := b.push()) is not None:
            self.pushed.append((b, x))
        self.tied_stepped = True

    def start_rows(self, ids: list[torch.Tensor]) -> torch.Tensor | None:
        """Where the lookup-only copy still owes the next training forward its rows: gather every dp rank's token
        ids of the step (``ids``: this rank's micro-batches; every rank has as many) and start landing their rows;
        returns every rank's ids (the tie's embedding end needs them too), else None. Called when the iteration
        starts, so the rows travel ahead of the all-gathers of the chunks that step before this one's forward."""
        if not self.rows_due or self.rows_started is not None:
            return None
        b, ids = self.lookup_only, torch.cat([t.reshape(-1) for t in ids])
        every = torch.empty(b.dp * ids.numel(), dtype=ids.dtype, device=ids.device)
        collectives.all_gather_single(every, ids, group=b.rows_group or b.group)
        self.rows_started = b.start_rows(every.unique())
        return every

    def pending(self, ids: list[torch.Tensor] | None = None) -> bool:
        """Whether what reads the chunk's weights must first :meth:`land` (``ids``: its training forward, which
        needs only their rows of a lookup-only copy)."""
        return bool(self.pushed or self.held) or (self.rows_due if ids is not None else self.behind)

    def land(self, wait, ids: list[torch.Tensor] | None = None) -> None:
        """Before the chunk's weights are read: the all-gathers started by :meth:`step` complete into them. ``ids``:
        the token ids of the step's micro-batches, when the reader is its training forward, which needs only those
        rows of a lookup-only copy; else (an evaluation, a checkpoint) the whole of it is all-gathered."""
        self.start_gathers()  # (none held by now in a schedule: every chunk before it in the order has stepped)
        pushed, self.pushed = self.pushed, []
        for b, x in pushed:
            b.land(x.started() if isinstance(x, GatherBucket) else x, wait)
        b = self.lookup_only
        if self.rows_due and (ids is not None or self.rows_started is not None):
            if self.rows_started is None:
                self.start_rows(ids)
            b.land_rows(self.rows_started, wait)
            self.rows_due, self.rows_started = False, None  # the other rows stay behind until a whole read
        if ids is None and self.behind:
            b.land(b.push(), wait)
            self.behind = False

    # ------------------------------------------------------------------ checkpoint views
    def _bucket_view(self, b: FlatShard, module: nn.Module) -> list:
        view_params = list(module.parameters())
        return [view_params[self.index[id(p)]] for p in b.params]

    def fill_view(self, module: nn.Module, optimizer: torch.optim.Optimizer | None, adamw_state) -> None:
        """Collective over dp: ``module`` (an fp32 copy of the chunk) takes the full weights of record, and
        ``optimizer`` (a plain AdamW over it; None: the weights alone) the moments, gathered from every rank's
        slices (after :meth:`land`)."""
        state = self.optimizer.state
        if optimizer is not None:
            hyper = {k: v for k, v in self.optimizer.param_groups[-1].items() if k not in ("params", "weight_decay")}
            for g in optimizer.param_groups:  # the current learning rate and the schedule's keys, as the chunk's
                g.update(hyper)
        stepped = [st["step"] for st in state.values() if st]
        step = stepped[0] if stepped else torch.zeros(())
        for b in self.buckets:
            mine = self._bucket_view(b, module)
            b.unpack(b.gather([sg.tensor for sg in b.segments], torch.float32), mine)
            if optimizer is None:
                continue
            for key in ("exp_avg", "exp_avg_sq"):
                pieces = [
                    state[sg.tensor][key] if state.get(sg.tensor) else torch.zeros_like(sg.tensor) for sg in b.segments
                ]
                b.unpack(b.gather(pieces, torch.float32), [adamw_state(optimizer, v)[key] for v in mine])
            for v in mine:
                adamw_state(optimizer, v)["step"].copy_(step)

    @torch.no_grad()
    def load_view(self, module: nn.Module, optimizer: torch.optim.Optimizer, adamw_state) -> None:
        """This rank's segments from ``module`` and ``optimizer`` (full, as loaded from a checkpoint); the
        chunk takes the weights."""
        for b in self.buckets:
            mine = self._bucket_view(b, module)
            for p, v in zip(b.params, mine):
                local_part(p).copy_(local_part(v))
            for sg in b.segments:
                v = mine[sg.index]
                sg.tensor.copy_(_flat(v)[sg.start : sg.end])  # a view: already written through the chunk
                st = ensure_state(self.optimizer, sg.tensor)  # a load before the first step creates it
                saved = adamw_state(optimizer, v)
                for key in ("exp_avg", "exp_avg_sq"):
                    st[key].copy_(_flat(saved[key])[sg.start : sg.end])
                st["step"].copy_(saved["step"])
