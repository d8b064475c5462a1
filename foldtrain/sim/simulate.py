"""One configuration end to end: ``Config`` + cluster -> predicted step time, throughput, idle, memory.

:class:`RunCosts` gives the engine (:mod:`.events`) the cost of every action and adds, as
explicit costs, what the executor does that its action list does not show (see
``docs/simulator.md``): the TP all-reduces inside F and B (in :mod:`.costs`), the tied-embedding
reduction of the first and last segment launched with their ``LR`` (:meth:`RunCosts.tie`), the gradient-norm
all-reduce over the pipeline and the fp16 overflow vote before the first optimizer step (a
barrier), the wait for outstanding sends at the end of the iteration, and the loss all-reduce
over every rank after it (a barrier).

Data-parallel strategies (one process per worker, no pipeline), per step:
``allreduce`` / ``horovod`` / ``ddp``: ring all-reduce ``2 (N-1)/N`` of the gradient bytes, started
as buckets fill during the last backward (``--dp.fusion_mb`` / ``--dp.bucket_mb``); ``sharded-ps``:
reduce-scatter of gradients + all-gather of parameters, ``(N-1)/N`` each (a bandwidth-optimal
reduce-scatter: NCCL's, or gloo's all-to-all; ``--dp.shard_collective reduce_scatter`` on gloo is an
all-reduce, twice that, not modelled), optimizer on ``1/N``;
``ps``: the server's link receives ``N-1`` (colocated) or ``N/K`` (``K`` dedicated servers)
gradients, the server steps, and sends as many parameter copies back; with
``--dp.ps_staleness > 0`` a worker only waits for its own push and pull, and the step is
bounded below by the server's capacity (``N`` gradients in and out, ``N`` optimizer steps);
``dataparallel`` (one process driving ``N`` GPUs): :mod:`.dataparallel`; ``fsdp`` (FSDP2, per-unit
all-gathers and reduce-scatters): :mod:`.fsdp`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from foldtrain.errors import ConfigError
from foldtrain.model.presets import train_flops_per_token
from foldtrain.profile.analysis import summarize
from foldtrain.schedules import Op, Schedule, StepPolicy, build_schedule, step_policy

from .cluster import Cluster
from .costs import (
    CostModel,
    Placement,
    block_params,
    gathered_bytes,
    model_params,
    segment_params,
    segment_rank,
    split_gathered_bytes,
    stepped_share,
    tied_gathered_bytes,
    tied_params,
)
from .dataparallel import simulate_dataparallel
from .events import Sim, run_schedule
from .fsdp import simulate_fsdp
from .memory import GB, format_breakdown, rank_memory
from .pipeline_fsdp import REDUCE_BYTES, fsdp_host, gathering_actions, on_thread, prefetched, roots_gathered, units
from .setup import Setup, resolve_setup


class RunCosts:
    """The :class:`~foldtrain.sim.events.Costs` of a :class:`Setup` on a :class:`Cluster`."""

    def __init__(self, s: Setup, c: Cluster, sched: Schedule | None = None):
        """``sched``: the schedule the engine runs (needed with fsdp: which passes all-gather)."""
        self.s, self.c = s, c
        self.cm = CostModel(s, c)
        self.pl = Placement(s, c)
        self._red: dict[int, list] = {}
        self._tie: dict[tuple, dict] = {}
        self.last = s.segments - 1
        self.fsdp = s.strategy == "fsdp-3d" and s.dp > 1  # sharded chunks (.pipeline_fsdp)
        # chunks reduced across the iteration boundary (without the schedule: whatever --fold.defer_reduce asks)
        self.defers = any(sched.deferred_chunks(p) for p in range(s.pp)) if sched is not None else s.defer
        if self.fsdp:
            assert sched is not None, "fsdp in the 3D engine is simulated from its schedule"
            self._gathers = [gathering_actions(sched, p, s.reshard_after_forward) for p in range(s.pp)]
            self._roots = [roots_gathered(sched, p) for p in range(s.pp)]
        cm = self.cm
        self._compute = {
            Op.FORWARD: cm.forward,
            Op.BACKWARD: cm.backward,
            Op.BACKWARD_INPUT: cm.backward_input,
            Op.BACKWARD_WEIGHT: cm.backward_weight,
        }

    # -- compute
    def cpu_share(self):
        """``(cores, cap, weight, oversubscribed)`` when every rank shares the host's cores (an emulated
        cluster): a simulated rank stands for ``dp * tp`` identical ranks computing at once, each rank runs
        ``cores // world`` threads at most (the benches' thread split), and with twice as many busy ranks
        as cores the cores do ``oversubscribed`` of their work (``node.oversubscribed_efficiency``);
        ``None`` on real devices."""
        cores = self.c.shared_cores
        if cores <= 0:
            return None
        s = self.s
        return cores, float(max(1, int(cores) // max(s.world, 1))), float(s.dp * s.tp), self.c.oversubscribed

    def comm_cpu(self, nbytes: float) -> float:
        """Core-seconds a rank's communication threads spend to send ``nbytes`` of a collective (and receive
        and sum as many): on a cluster whose ranks share the host's cores they take them from compute."""
        return nbytes * self.c.comm_cpu if self.c.shared_cores > 0 else 0.0

    def steps(self, n: float, lat: float) -> tuple:
        """``n`` steps of a collective: a delay phase of ``n`` times their latency ``lat``, which on
        shared cores also takes ``node.collective_cpu_us`` core-seconds per step from compute."""
        cpu = n * self.c.collective_cpu if self.c.shared_cores > 0 else 0.0
        return ("delay", n * lat, cpu)

    def action_overhead(self) -> float:
        """The pipeline executor's own host work per action (``device.action_overhead_us``); the
        data-parallel engines run no action list."""
        return self.c.action_overhead if self.s.mode == "3d" else 0.0

    def overlap_slowdown(self) -> float:
        return self.c.overlap_slowdown

    def compute(self, p: int, a) -> float:
        t = self._compute[a.op](a.chunk)
        if not self.fsdp:
            return t
        gathers = (a.op, a.chunk, a.mb) in self._gathers[p]
        if not on_thread(self.c) and prefetched(a) and gathers:
            # FSDP2 prefetches the next unit while one computes: the pass lasts as long as the longer of the two
            block = self.all_gather(p, self.block_bytes(), self.slower("ag"))
            t = max(t, (self.s.layers[a.chunk] - 1) * self._seconds(block))
        root_params = units(self.s, a.chunk)[1] > 0
        layers = self.s.layers[a.chunk]
        return t + fsdp_host(self.c, layers, a.op, a.chunk, gathers, root_params, self.root_gathers(p, a))

    def root_gathers(self, p: int, a) -> bool:
        """Whether compute action ``a`` of rank ``p`` gathers its chunk's root: the chunk's first forward, where
        the root holds parameters."""
        return a.op is Op.FORWARD and units(self.s, a.chunk)[1] > 0 and (a.chunk, a.mb) in self._roots[p]

    # -- fsdp in the 3D engine (.pipeline_fsdp)
    def block_bytes(self) -> float:
        return block_params(self.s) * self.s.weight_bytes

    def all_gather(self, p: int, nbytes: float, slower: float = 1.0) -> list:
        """An all-gather of ``nbytes`` (unsharded) over rank ``p``'s data-parallel group: n-1 steps, (n-1)/n of
        the bytes on the link (``slower`` times that: :meth:`slower`)."""
        n = self.s.dp
        key, weight, _bw, lat = self.pl.dp_link(p)
        return [self.steps(n - 1, lat), ("flow", key, weight, (n - 1) / n * nbytes * slower)]

    def slower(self, kind: str) -> float:
        """How much longer than the link's all-reduce bus bandwidth says a reduce-scatter ("rs") or all-gather
        ("ag") of the dp group takes: its own bus bandwidth where the link has one (gloo's reduce-scatter is an
        all-reduce: 2), as bytes on the wire."""
        link = self.c.inter if self.pl.dp_spans_nodes() else self.c.intra
        own = link.rs_bw if kind == "rs" else link.ag_bw
        return link.bw / own if own > 0 else 1.0

    def _seconds(self, phases: list) -> float:
        """A phase list's length on an idle link."""
        return sum(ph[1] if ph[0] == "delay" else ph[3] / self.link_bw(ph[1]) for ph in phases)

    def unshard(self, p: int, a) -> list | None:
        """FSDP's all-gathers that compute action ``a`` waits for: its chunk's root at its first forward, the
        blocks where :func:`.pipeline_fsdp.gathering_actions` says they are sharded (on a GPU only the first
        block's: the rest are prefetched, :meth:`compute`; a split backward's ``I`` gathers them all first);
        ``None`` without fsdp."""
        if not self.fsdp:
            return None
        out: list = []
        k = self.slower("ag")
        if self.root_gathers(p, a):
            out += self.all_gather(p, units(self.s, a.chunk)[1] * self.s.weight_bytes, k)
        if (a.op, a.chunk, a.mb) in self._gathers[p]:
            blocks = (
                self.s.layers[a.chunk] if on_thread(self.c) or not prefetched(a) else min(1, self.s.layers[a.chunk])
            )
            for _ in range(blocks):
                out += self.all_gather(p, self.block_bytes(), k)
        return out or None

    def blocking_reduce(self, p: int, seg: int) -> list | None:
        """What the ``LR`` of segment ``seg`` waits for before it goes on: with fsdp every unit's fp32
        reduce-scatter (the root's final callback waits for them); ``None`` without."""
        if not self.fsdp:
            return None
        each = [block_params(self.s)] * self.s.layers[seg] + [units(self.s, seg)[1]]
        k = self.slower("rs")
        return [ph for n in each if n > 0 for ph in self.reduce_scatter(p, n * REDUCE_BYTES, k)]

    def send(self, p: int, a):
        key, weight, lat = self.pl.p2p_link(p, a.peer)
        return key, weight, lat, self.cm.activation_bytes() / (self.s.tp if self.s.p2p_scatter else 1)

    # -- data-parallel reduction of a chunk
    def server_link(self) -> tuple[float, float]:
        """The parameter server's link: bytes/s and a step's latency. Its transfers are sends and receives
        (``isend``/``irecv``), so the link's point-to-point bandwidth where known: on loopback gloo moves a
        send 3x as fast as a 4-rank all-reduce's bus bandwidth (2.3 against 0.77 GB/s)."""
        c = self.c
        link = c.intra if self.s.world <= c.gpus_per_node else c.inter
        return link.p2p_bw or link.bw, link.coll

    def reduce_phases(self, p: int, seg: int) -> list:
        """Every phase of segment ``seg``'s data-parallel reduction, one after another."""
        return [ph for _, phases in self.reduce_buckets(p, seg) for ph in phases]

    def reduce_buckets(self, p: int, seg: int) -> list[tuple[float | None, list]]:
        """Segment ``seg``'s reduction as ``(ready, phases)`` per collective, in launch order: ``ready`` is
        the fraction of the segment's last backward after which the bucket's gradients are all there
        (launched then, overlapping the rest of the backward: the data-parallel engines' buckets, the
        last layers' gradients first), ``None`` at the chunk's ``LR`` (the pipeline engine reduces a
        chunk as one flat buffer; a strategy's last bucket)."""
        if seg in self._red:
            return self._red[seg]
        if self.fsdp:  # the reduce-scatters block the LR (blocking_reduce); then the tied copy's shard is summed
            tie = self.fsdp_tie(p, seg)
            self._red[seg] = [(None, tie)] if tie else []
            return self._red[seg]
        s, cm = self.s, self.cm
        n = s.dp
        g = cm.grad_bytes(seg)
        w = segment_params(s, seg) * s.weight_bytes
        if self.tie(p, seg) is not None:  # the tied copy has its own reduction (tie)
            g -= tied_params(s) * s.grad_bytes
            w -= tied_params(s) * s.weight_bytes
        out: list = []
        if n > 1:
            key, weight, bw, lat = self.pl.dp_link(p)
            add = lambda b: (n - 1) / n * b * 3 / self.c.mem_bw  # noqa: E731 - summing the received parts
            if s.strategy in ("allreduce-3d", "allreduce", "ddp", "sharded-ps"):
                sizes = self.bucket_sizes(seg, g)
                done = 0.0
                for i, b in enumerate(sizes):
                    done += b
                    ready = done / g if i < len(sizes) - 1 else None  # the pipeline engine's one buffer: at the LR
                    if s.strategy == "sharded-ps":  # per bucket a reduce-scatter per slice, (n-1) steps each
                        phases = [
                            self.steps((n - 1) * math.ceil(b / s.slice_bytes), lat),
                            ("delay", add(b)),
                            ("flow", key, weight, (n - 1) / n * b),
                        ]
                    else:
                        phases = self.collective(p, b)
                    out.append((ready, phases))
                if (
                    s.strategy == "sharded-ps"
                ):  # then every bucket's all-gather of the updated parameters, (n-1) steps each
                    out.append((None, [self.steps((n - 1) * len(sizes), lat), ("flow", key, weight, (n - 1) / n * w)]))
            elif s.strategy == "ps":
                bw_s, lat_s = self.server_link()
                k = max(s.servers, 1)
                senders = n if s.servers else n - 1
                if s.staleness > 0:  # a worker waits for its own push and pull only
                    out = [
                        (None, [("delay", 2 * lat_s), ("flow", ("worker", p), 1.0, g), ("flow", ("worker", p), 1.0, w)])
                    ]
                else:
                    # No core-seconds beside the transfers: the point-to-point bandwidth was measured with a send
                    # and its receive, their processes' copies included, and while a server moves them no rank
                    # computes (every worker waits for its parameters). A collective's CPU per byte (ring steps
                    # and sums on every rank, weighted by all of them) made the reduction 2.4x as long as measured.
                    out = [
                        (
                            None,
                            [
                                ("delay", lat_s),
                                ("flow", ("srv-in",), 1.0, senders * g / k, 0.0),
                                ("delay", senders * g / k / self.c.mem_bw + self.cm.optim(seg, 1.0 / k)),
                                ("flow", ("srv-out",), 1.0, senders * w / k, 0.0),
                                ("delay", lat_s),
                            ],
                        )
                    ]
        self._red[seg] = out
        return out

    def deferred_buckets(self, p: int, seg: int) -> list[list] | None:
        """A deferred chunk's reduction (``--fold.defer_reduce``) as the pipeline engine's deadline queue
        sends it: ring all-reduces of ``--fold.bucket_mb`` each (``parallel/pipeline/deadlines.py``), one
        phase list per bucket; ``None`` without data parallelism (nothing to queue)."""
        s = self.s
        if s.dp <= 1:
            return None
        g = self.cm.grad_bytes(seg) - (tied_params(s) * s.grad_bytes if self.tie(p, seg) is not None else 0.0)
        cap = s.fold_bucket_bytes
        sizes = [cap] * int(g // cap) + ([g - cap * int(g // cap)] if g % cap > 0 else [])
        return [self.collective(p, b) for b in sizes]

    def collective(self, p: int, nbytes: float) -> list:
        """The 3D engine's reduction of ``nbytes``: a ring all-reduce, or with the distributed optimizer a
        reduce-scatter (its all-gather comes with the chunk's step: :meth:`optim`)."""
        return self.reduce_scatter(p, nbytes) if self.s.dist_optim else self.ring(p, nbytes)

    def reduce_scatter(self, p: int, nbytes: float, slower: float = 1.0) -> list:
        """A reduce-scatter of ``nbytes`` over rank ``p``'s data-parallel group: n-1 steps, the received
        parts summed at memory bandwidth, (n-1)/n of the bytes on the link (``slower`` times that: the link's
        own reduce-scatter bandwidth, :meth:`slower`)."""
        n = self.s.dp
        key, weight, _bw, lat = self.pl.dp_link(p)
        return [
            self.steps(n - 1, lat),
            ("delay", (n - 1) / n * nbytes * 3 / self.c.mem_bw),
            ("flow", key, weight, (n - 1) / n * nbytes * self.s.wire_factor * slower),
        ]

    def ring(self, p: int, nbytes: float) -> list:
        """A ring all-reduce of ``nbytes`` over rank ``p``'s data-parallel group: 2 (n-1) steps, the
        received parts summed at memory bandwidth, 2 (n-1)/n of the bytes (compressed) on the link."""
        n = self.s.dp
        key, weight, _bw, lat = self.pl.dp_link(p)
        return [
            self.steps(2 * (n - 1), lat),
            ("delay", (n - 1) / n * nbytes * 3 / self.c.mem_bw),
            ("flow", key, weight, 2 * (n - 1) / n * nbytes * self.s.wire_factor),
        ]

    def policy(self) -> StepPolicy:
        """The pipeline engine's step policy (:func:`foldtrain.schedules.step_policy`); the data-parallel
        engines step after everything, as without early steps."""
        s = self.s
        pol = step_policy(s.clip, s.fp16_scaler, s.tp)
        return pol if s.mode == "3d" else StepPolicy(early_steps=False, clip=pol.clip)

    def bucket_sizes(self, seg: int, g: float) -> list[float]:
        """The bytes of each collective a data-parallel engine issues for ``g`` gradient bytes per step,
        in launch order (the pipeline engine reduces a chunk as one flat buffer: ``[g]``). DDP: a first
        bucket of 1 MB (torch's), then ``--dp.bucket_mb``; ``sharded-ps``: ``--dp.first_bucket_mb``, then
        ``--dp.shard_bucket_mb``; ``allreduce``: ``--dp.first_bucket_mb``, then ``--dp.fusion_mb``, and the
        cycle time closes a bucket between two blocks' gradients at most once per block (a block's
        gradients arrive together): then the rest in equal parts."""
        s = self.s
        if s.mode != "dp" or s.strategy not in ("ddp", "sharded-ps", "allreduce"):
            return [g]
        first, rest = {
            "ddp": (2**20, s.bucket_bytes),
            "sharded-ps": (s.first_bytes, s.shard_bytes),
            "allreduce": (s.first_bytes, s.fusion_bytes),
        }[s.strategy]
        if g <= first:
            return [g]
        sizes = [first]
        left = g - first
        while left > 0:
            sizes.append(min(rest, left))
            left -= sizes[-1]
        if s.strategy == "allreduce" and s.cycle_s > 0:
            k = min(math.ceil(self.cm.backward(seg) / s.cycle_s), s.n_layer + 3)
            if k > len(sizes):
                sizes = [first] + [(g - first) / (k - 1)] * (k - 1)
        return sizes

    def fsdp_tie(self, p: int, seg: int) -> list:
        """fsdp: the all-reduce of the tied copy's shard between the pipeline's two ends (pipeline/fsdp.py),
        or ``[]`` where ``seg`` holds no split tie."""
        s = self.s
        if s.segments < 2 or seg not in (0, self.last) or segment_rank(s, 0) == segment_rank(s, self.last):
            return []
        key, weight, lat = self.pl.p2p_link(p, segment_rank(s, self.last if seg == 0 else 0))
        return [self.steps(2, lat), ("flow", key, weight, tied_params(s) / s.dp * REDUCE_BYTES)]

    def tie(self, p: int, seg: int):
        """The tied embedding's reduction (``foldtrain/parallel/pipeline/tie.py``) at the end that holds
        segment ``seg``: ``{"dp": phases, "send": phases}`` or ``None``.

        ``dp`` runs on the rank's reduction stream before the chunk's own reduction: the head's dense
        copy all-reduced over dp; the embedding's rows of the step's tokens only (dense when more than
        half the rows; the token ids were all-gathered at the start of the iteration, a few KB, not
        modelled). The union's size is that of ``T`` uniformly drawn tokens (``T`` = tokens of the
        global batch), ``V (1 - (1 - 1/V)^T)``: an upper bound for text, whose tokens repeat more.
        ``send`` is what this end sends the other once its ``dp`` phase is done, on the pair's link:
        the head its dense copy, the embedding its rows (count, indices, values). Both ends on one rank (the V
        placement): nothing sent, the embedding end all-reduces the dense sum (``tie.LocalTie``). With
        ``--optim.shard_tied`` only each dp rank's slice is needed (``tie.Slices``): the head's dense copy (the V
        placement's sum) is reduce-scattered, and a dense message is the slice."""
        s = self.s
        if s.mode != "3d" or s.segments < 2 or seg not in (0, self.last) or self.fsdp:
            return None
        if (p, seg) in self._tie:
            return self._tie[(p, seg)]
        n = s.dp
        rows, cols = s.vocab / s.tp, s.d_model
        union = rows * (1.0 - (1.0 - 1.0 / s.vocab) ** (s.dp * s.microbatches * s.micro_batch * s.seq))
        other = segment_rank(s, self.last if seg == 0 else 0)
        sliced = s.dist_optim and s.shard_tied and n > 1
        dense = self.reduce_scatter if sliced else self.ring  # the dense copy's dp reduction
        if other == p:  # both ends on this rank (the V placement): the embedding end reduces the dense sum
            phases = dense(p, rows * cols * s.grad_bytes) if n > 1 and seg == 0 else []
            self._tie[(p, seg)] = out = {"dp": phases, "send": []}
            return out
        sent = union if seg == 0 and 2 * union <= rows else rows
        nbytes = sent * cols * s.grad_bytes
        reduce = dense if seg != 0 else self.ring  # the embedding's rows (or dense copy) are all-reduced
        phases: list = reduce(p, nbytes) if n > 1 else []
        if sliced and sent == rows:  # the dense message is this rank's slice
            nbytes /= n
        extra = sent * 8 if sent < rows else 0.0  # the rows' indices
        self._tie[(p, seg)] = out = {"dp": phases, "send": self.pair_message(p, other, nbytes + extra)}
        return out

    def pair_message(self, p: int, other: int, nbytes: float) -> list:
        """``nbytes`` from pipeline rank ``p`` to ``other``, the tie's other end, on the pair's own stream of their
        link (beside the pipeline's transfers) where it is the pipeline's, else on the link between their nodes."""
        key, weight, lat = self.pl.p2p_link(p, other)
        if key[0] == "p2p":
            key = ("tie", p)
        hop = self.c.intra.coll if key[0] == "tie" else self.c.inter.coll
        return [self.steps(1, hop), ("flow", key, weight, nbytes)]

    def pair_gather(self, p: int, seg: int) -> list | None:
        """``tied_halves``: the other end's stepped half of the tied copy (an all-gather over the pair: each end
        receives the half it did not step), ``None`` where segment ``seg`` holds no split copy."""
        nbytes = split_gathered_bytes(self.s, seg)
        return self.pair_message(p, segment_rank(self.s, self.last if seg == 0 else 0), nbytes) if nbytes else None

    def optim(self, p: int, seg: int) -> float:
        s = self.s
        if s.strategy == "ps" and s.dp > 1:
            return 0.0  # the server steps (inside the reduction)
        return self.cm.optim(seg, stepped_share(s, seg), masters=not self.fsdp)

    def gather(self, p: int, seg: int, without_tied: bool = False) -> list | None:
        """The distributed optimizer's all-gather of the chunk's sharded weights: n-1 steps, (n-1)/n of the
        bytes on the link (the tied copy stepped whole or split between the ends: not gathered over dp; looked up
        only: its rows, ``gathered_bytes``)."""
        s = self.s
        if not s.dist_optim:
            return None
        return self.all_gather(p, gathered_bytes(s, seg, without_tied))

    def tied_gather(self, p: int, seg: int) -> list | None:
        if self.s.tied_halves:
            return self.pair_gather(p, seg)
        nbytes = tied_gathered_bytes(self.s, seg) if self.s.dp > 1 else 0.0
        return self.all_gather(p, nbytes) if nbytes else None

    def tied_gather_queued(self, p: int, seg: int) -> bool:
        """Whether :meth:`tied_gather` joins the deferred buckets by deadline (over dp), not at once (the pair's)."""
        return not self.s.tied_halves

    # -- barriers the action list does not show
    def before_steps(self):
        """The ranks' meeting before the first optimizer step, or ``None``. The pipeline engine: the
        gradient-norm all-reduce over the pipeline, the fp16 overflow vote over every rank. The
        data-parallel engines whose gradients differ between ranks: ``sharded-ps``'s gradient-norm
        all-reduce over every rank (each holds a shard; it runs even without clipping, the norm is
        logged) and the parameter server's over its servers; with fp16 loss scaling their overflow
        vote over every rank."""
        s = self.s
        if s.mode == "dp":
            if s.dp <= 1 or s.strategy not in ("sharded-ps", "ps") or (s.strategy == "ps" and s.staleness > 0):
                return None
            norm = (
                self.pl.world_latency()
                if s.strategy == "sharded-ps"
                else CostModel.tree_latency(s.servers, self.server_link()[1])
            )
            cost = norm + (self.pl.world_latency() if s.fp16_scaler else 0.0)
            return cost or None
        norm = self._norm_meeting()
        if norm is None and not s.fp16_scaler:
            return None
        return (norm or 0.0) + (self.pl.world_latency() if s.fp16_scaler else 0.0)

    def _norm_meeting(self) -> float | None:
        """The 3D engine's gradient-norm all-reduce before the steps: over every rank where each holds a shard
        (fsdp, the distributed optimizer), else over the pipeline; ``None`` where there is none (one pipeline and
        TP rank, or chunks the schedule defers and no clipping: the engine's norm would leave them out)."""
        s = self.s
        if self.defers and not s.clip:
            return None
        if self.fsdp or s.dist_optim:
            return self.pl.world_latency()
        return self.pl.pipeline_latency() if s.pp * s.tp > 1 else None

    def end_of_iteration(self):
        """The loss all-reduce over every rank after the step (a barrier) and the training loop's own
        collectives after it (``Setup.loop_meetings``), before the 3D engine issues its deferred buckets (the count
        its deadline queue agrees on rides on the loss's all-gather); the asynchronous parameter server's workers
        log their own loss."""
        s = self.s
        if s.mode == "dp" and (s.dp <= 1 or (s.strategy == "ps" and s.staleness > 0)):
            return None
        return self.pl.world_latency() * (1.0 + s.loop_meetings)

    def queue_cap(self, meeting: str) -> float:
        """The most a meeting's small collective (``"loss"``, ``"clip"``) waits behind the bulk bytes queued on the
        nodes' interfaces (``inter.queue_ms``); 0 where it stays inside a node."""
        s, pl = self.s, self.pl
        world = s.world > pl.G
        everyone = s.mode == "dp" or s.fp16_scaler or self.fsdp or s.dist_optim  # the norm or vote over every rank
        crosses = {
            "loss": world,
            "clip": (world and everyone) or (s.mode != "dp" and pl.pipeline_spans_nodes()),
        }[meeting]
        return self.c.inter.queue if crosses else 0.0

    def link_bw(self, key: tuple) -> float:
        if key[0] in ("srv-in", "srv-out"):
            return self.server_link()[0]
        if key[0] == "worker":
            return self.server_link()[0]
        return self.pl.link_bw(key)


@dataclass
class Result:
    setup: Setup
    cluster: Cluster
    step_time: float
    tokens_per_s: float
    mfu: float
    bubble: float
    all_rank_idle: float
    exposed_dp: float
    memory: list[dict[str, float]]
    events: list[list[dict[str, Any]]] = field(repr=False, default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def peak_mem(self) -> float:
        return max(m["total"] for m in self.memory)

    @property
    def fits(self) -> bool:
        return self.peak_mem <= self.cluster.memory

    def to_json(self) -> dict[str, Any]:
        s = self.setup
        return {
            "cluster": self.cluster.name,
            "layout": {
                "dp": s.dp,
                "pp": s.pp,
                "tp": s.tp,
                "virtual": s.virtual,
                "microbatches": s.microbatches,
                "micro_batch": s.micro_batch,
                "schedule": s.schedule if s.mode == "3d" else None,
                "dp_sync": s.dp_sync if s.mode == "3d" else None,
                "defer_reduce": s.defer,
                "strategy": s.strategy,
                "ps_servers": s.servers,
                "precision": s.dtype,
                "ac": s.ac,
                "world": s.world,
            },
            "step_time_s": self.step_time,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "bubble": self.bubble,
            "all_rank_idle": self.all_rank_idle,
            "exposed_dp_s": self.exposed_dp,
            "peak_mem_gb": self.peak_mem / GB,
            "device_mem_gb": self.cluster.memory / GB,
            "fits": self.fits,
            "memory_gb": [{k: v / GB for k, v in m.items()} for m in self.memory],
            "notes": self.notes,
        }


def _mfu(s: Setup, c: Cluster, step: float) -> float:
    flops = train_flops_per_token(model_params(s), s.n_layer, s.seq, s.d_model) * s.tokens_per_step
    return flops / (step * s.dp * s.pp * s.tp * c.peak(s.dtype)) if step > 0 else 0.0


PHASE_MODELS = {"dataparallel": simulate_dataparallel, "fsdp": simulate_fsdp}  # their own step, not the engine's


def _phase_result(s: Setup, c: Cluster, check_memory: bool, keep_events: bool) -> Result:
    """A strategy of :data:`PHASE_MODELS` (:mod:`.dataparallel`, :mod:`.fsdp`), as a :class:`Result`."""
    d = PHASE_MODELS[s.strategy](s, c, check_memory)
    summ = summarize(d.events, skip_first=False)[-1]
    return Result(
        setup=s,
        cluster=c,
        step_time=d.step_time,
        tokens_per_s=s.tokens_per_step / d.step_time,
        mfu=_mfu(s, c, d.step_time),
        bubble=summ["bubble_mean"],
        all_rank_idle=summ["all_idle"],
        exposed_dp=d.comm,
        memory=d.memory,
        events=d.events if keep_events else [],
        notes=d.notes,
    )


def simulate_setup(s: Setup, c: Cluster, *, check_memory: bool = True, keep_events: bool = False) -> Result:
    if s.strategy in PHASE_MODELS:
        return _phase_result(s, c, check_memory, keep_events)
    sched = build_schedule(
        "1f1b" if s.mode == "dp" else s.schedule, s.pp, s.virtual, s.microbatches, s.dp_sync, s.defer, s.dist_optim
    )
    costs = RunCosts(s, c, sched)
    mems = [
        rank_memory(s, costs.cm, sched, p, c.runtime, server=(s.strategy == "ps" and s.servers == 0 and p == 0))
        for p in range(s.pp)
    ]
    notes: list[str] = []
    if s.strategy == "ps" and s.servers:
        srv = rank_memory(s, costs.cm, sched, 0, c.runtime, server=True)
        srv["activations"] = 0.0
        srv["total"] = sum(v for k, v in srv.items() if k != "total")
        notes.append(f"dedicated server rank: {format_breakdown(srv)}")
    peak = max(m["total"] for m in mems)
    if check_memory and peak > c.memory:
        p = max(range(len(mems)), key=lambda i: mems[i]["total"])
        raise ConfigError(
            f"does not fit: pipeline rank {p} needs {peak / GB:.2f} GB "
            f"but a {c.name} device has {c.memory / GB:.2f} GB ({format_breakdown(mems[p])}); "
            f"use {'' if s.ac else '--ac full, '}a smaller micro-batch, more --parallel.pp/tp, "
            f"{'' if s.mode == '3d' else 'a sharded strategy, '}or a larger device (foldtrain plan finds one that fits)"
        )
    # Every iteration ends in the loss all-reduce (a barrier) with no reduction in flight, so one
    # iteration is the steady state; deferred reductions and the distributed optimizer's all-gathers cross
    # into the next one: simulate two.
    iters = 2 if s.defer or s.dist_optim else 1
    if keep_events:
        iters += 1
    sim: Sim = run_schedule(sched, costs, iterations=iters, record_from=0 if keep_events else iters - 1)
    step = sim.iter_end[-1] - (sim.iter_end[-2] if iters > 1 else 0.0)
    if s.strategy == "ps" and s.staleness > 0 and s.dp > 1:
        bw_s, _ = costs.server_link()
        k = max(s.servers, 1)
        tot_g = sum(costs.cm.grad_bytes(g) for g in range(s.segments))
        tot_w = sum(segment_params(s, g) for g in range(s.segments)) * s.weight_bytes
        server = max(s.dp * tot_g, s.dp * tot_w) / k / bw_s + s.dp / k * sum(
            costs.cm.optim(g) for g in range(s.segments)
        )
        if server > step:
            notes.append(f"async parameter server bound: the server needs {server:.4g} s per round of {s.dp} gradients")
            step = server
    evs = [r.events for r in sim.ranks]
    last = [[e for e in r if e["step"] == iters - 1] for r in evs]
    summ = summarize(last, skip_first=False)[-1] if any(last) else {}
    return Result(
        setup=s,
        cluster=c,
        step_time=step,
        tokens_per_s=s.tokens_per_step / step if step > 0 else 0.0,
        mfu=_mfu(s, c, step),
        bubble=summ.get("bubble_mean", 0.0),
        all_rank_idle=summ.get("all_idle", 0.0),
        exposed_dp=summ.get("reduce_wait_max", 0.0),
        memory=mems,
        events=evs if keep_events else [],
        notes=notes,
    )


def simulate(cfg, cluster: Cluster, *, check_memory: bool = True, keep_events: bool = False) -> Result:
    """Predict ``cfg`` (a resolved, validated Config) on ``cluster``."""
    return simulate_setup(resolve_setup(cfg), cluster, check_memory=check_memory, keep_events=keep_events)
