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
reduce-scatter of gradients + all-gather of parameters, ``(N-1)/N`` each, optimizer on ``1/N``;
``ps``: the server's link receives ``N-1`` (colocated) or ``N/K`` (``K`` dedicated servers)
gradients, the server steps, and sends as many parameter copies back; with
``--dp.ps_staleness > 0`` a worker only waits for its own push and pull, and the step is
bounded below by the server's capacity (``N`` gradients in and out, ``N`` optimizer steps).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from foldtrain.errors import ConfigError
from foldtrain.profile.analysis import summarize
from foldtrain.schedules import Op, build_schedule

from .cluster import Cluster
from .costs import CostModel, Placement, model_params, segment_params
from .events import Sim, run_schedule
from .memory import GB, format_breakdown, rank_memory
from .setup import Setup, resolve_setup


class RunCosts:
    def __init__(self, s: Setup, c: Cluster):
        self.s, self.c = s, c
        self.cm = CostModel(s, c)
        self.pl = Placement(s, c)
        self._red: dict[int, list] = {}
        self._tie: dict[tuple, dict] = {}
        self.last = s.segments - 1

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

    def action_overhead(self) -> float:
        """The pipeline executor's own host work per action (``device.action_overhead_us``); the
        data-parallel engines run no action list."""
        return self.c.action_overhead if self.s.mode == "3d" else 0.0

    def compute(self, p: int, a) -> float:
        return self.cm.forward(a.chunk) if a.op is Op.FORWARD else self.cm.backward(a.chunk)

    def send(self, p: int, a):
        key, weight, lat = self.pl.p2p_link(p, a.peer)
        return key, weight, lat, self.cm.activation_bytes() / (self.s.tp if self.s.p2p_scatter else 1)

    # -- data-parallel reduction of a chunk
    def server_link(self) -> tuple[float, float]:
        c = self.c
        return (c.intra.bw, c.intra.coll) if self.s.world <= c.gpus_per_node else (c.inter.bw, c.inter.coll)

    def reduce_phases(self, p: int, seg: int) -> list:
        if seg in self._red:
            return self._red[seg]
        s, cm = self.s, self.cm
        n = s.dp
        g = cm.grad_bytes(seg)
        w = segment_params(s, seg) * s.weight_bytes
        if self.tie(p, seg) is not None:  # the tied copy has its own reduction (tie)
            g -= self.tied_params() * s.grad_bytes
            w -= self.tied_params() * s.weight_bytes
        phases: list = []
        if n > 1:
            key, weight, bw, lat = self.pl.dp_link(p)
            add_cost = (n - 1) / n * g * 3 / self.c.mem_bw  # summing the received halves
            steps = 2 * (n - 1) * lat * self.collectives(seg, g)  # every bucket's collective pays its steps
            if s.strategy in ("allreduce-3d", "allreduce", "ddp"):
                phases = [("delay", steps + add_cost), ("flow", key, weight, 2 * (n - 1) / n * g * s.wire_factor)]
            elif s.strategy == "sharded-ps":  # per bucket a reduce-scatter and an all-gather, (n-1) steps each
                phases = [("delay", steps + add_cost), ("flow", key, weight, (n - 1) / n * (g + w))]
            elif s.strategy == "ps":
                bw_s, lat_s = self.server_link()
                k = max(s.servers, 1)
                senders = n if s.servers else n - 1
                if s.staleness > 0:  # a worker waits for its own push and pull only
                    phases = [("delay", 2 * lat_s), ("flow", ("worker", p), 1.0, g), ("flow", ("worker", p), 1.0, w)]
                else:
                    phases = [("delay", lat_s), ("flow", ("srv-in",), 1.0, senders * g / k),
                              ("delay", senders * g / k / self.c.mem_bw + self.cm.optim(seg, 1.0 / k)),
                              ("flow", ("srv-out",), 1.0, senders * w / k), ("delay", lat_s)]
        self._red[seg] = phases
        return phases

    def collectives(self, seg: int, g: float) -> int:
        """How many collectives a data-parallel engine issues for ``g`` gradient bytes per step: its
        buckets (the pipeline engine reduces a chunk as one flat buffer: 1). DDP: a first bucket of 1 MB,
        then ``--dp.bucket_mb``; ``sharded-ps``: ``--dp.first_bucket_mb``, then ``--dp.shard_bucket_mb``;
        ``allreduce``: ``--dp.first_bucket_mb``, then ``--dp.fusion_mb``, and the cycle time closes a bucket
        between two blocks' gradients at most once per block (a block's gradients arrive together)."""
        s = self.s
        if s.mode != "dp":
            return 1
        first, rest = {"ddp": (2**20, s.bucket_bytes), "sharded-ps": (s.first_bytes, s.shard_bytes),
                       "allreduce": (s.first_bytes, s.fusion_bytes)}.get(s.strategy, (g, g))
        k = 1 + math.ceil(max(0.0, g - first) / max(rest, 1.0))
        if s.strategy == "allreduce" and s.cycle_s > 0:
            k = max(k, min(math.ceil(self.cm.backward(seg) / s.cycle_s), s.n_layer + 2))
        return k

    def reduce_lead(self, p: int, seg: int) -> float:
        s = self.s
        if s.mode != "dp" or s.dp <= 1 or s.strategy not in ("ddp", "allreduce"):
            return 0.0
        first = s.bucket_bytes if s.strategy == "ddp" else s.fusion_bytes
        frac = min(1.0, first / max(self.cm.grad_bytes(seg), 1.0))
        return self.cm.backward(seg) * (1.0 - frac)

    def tied_params(self) -> float:
        return self.s.vocab * self.s.d_model / self.s.tp

    def tie(self, p: int, seg: int):
        """The tied embedding's reduction (``foldtrain/parallel/pipeline/tie.py``) at the end that holds
        segment ``seg``: ``{"dp": phases, "pair": phases}`` or ``None``.

        ``dp`` runs on the rank's reduction stream before the chunk's own reduction: the head's dense
        copy all-reduced over dp; the embedding's per-row "touched" bytes (MAX all-reduce of ``V``
        bytes), then the rows of that union only (dense when more than half the rows). The union's
        size is that of ``T`` uniformly drawn tokens (``T`` = tokens of the global batch),
        ``V (1 - (1 - 1/V)^T)``: an upper bound for text, whose tokens repeat more. ``pair`` is the
        2-rank all-reduce of the dp-summed copies between pipeline ranks 0 and P-1 of a replica,
        on their link, once both ends' ``dp`` phases are done."""
        s = self.s
        if s.mode != "3d" or s.segments < 2 or seg not in (0, self.last):
            return None
        if (p, seg) in self._tie:
            return self._tie[(p, seg)]
        n = s.dp
        rows, cols = s.vocab / s.tp, s.d_model
        phases: list = []
        if n > 1:
            key, weight, _bw, lat = self.pl.dp_link(p)
            ring = 2 * (n - 1) / n
            sent = rows
            if seg == 0:
                phases += [("delay", 2 * (n - 1) * lat), ("flow", key, weight, ring * rows)]  # the touched-row bytes
                union = rows * (1.0 - (1.0 - 1.0 / s.vocab) ** (s.dp * s.microbatches * s.micro_batch * s.seq))
                sent = union if 2 * union <= rows else rows
            nbytes = sent * cols * s.grad_bytes
            phases += [("delay", 2 * (n - 1) * lat + (n - 1) / n * nbytes * 3 / self.c.mem_bw),
                       ("flow", key, weight, ring * nbytes)]
        other = s.pp - 1 if seg == 0 else 0
        key, weight, lat = self.pl.p2p_link(p, other)
        if key[0] == "p2p":
            key = ("tie", p)  # the pair's own stream of the link, beside the pipeline's transfers
        hop = self.c.intra.coll if key[0] == "tie" else self.c.inter.coll  # a 2-rank all-reduce: two steps
        pair = [("delay", 2 * hop), ("flow", key, weight, self.tied_params() * s.grad_bytes)]
        self._tie[(p, seg)] = out = {"dp": phases, "pair": pair}
        return out

    def optim(self, p: int, seg: int) -> float:
        s = self.s
        if s.strategy == "ps" and s.dp > 1:
            return 0.0  # the server steps (inside the reduction)
        shard = 1.0 / s.dp if s.strategy == "sharded-ps" and s.dp > 1 else 1.0
        return self.cm.optim(seg, shard)

    # -- barriers the action list does not show
    def before_steps(self):
        s = self.s
        if s.mode != "3d" or (s.pp * s.tp == 1 and not s.fp16_scaler):
            return None
        cost = self.pl.pipeline_latency() if s.pp * s.tp > 1 else 0.0
        return cost + (self.pl.world_latency() if s.fp16_scaler else 0.0)

    def end_of_iteration(self):
        return self.pl.world_latency() if self.s.mode == "3d" else None

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
            "layout": {"dp": s.dp, "pp": s.pp, "tp": s.tp, "virtual": s.virtual, "microbatches": s.microbatches,
                       "micro_batch": s.micro_batch, "schedule": s.schedule if s.mode == "3d" else None,
                       "dp_sync": s.dp_sync if s.mode == "3d" else None, "defer_reduce": s.defer,
                       "strategy": s.strategy, "ps_servers": s.servers, "precision": s.dtype, "ac": s.ac,
                       "world": s.world},
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


def simulate_setup(s: Setup, c: Cluster, *, check_memory: bool = True, keep_events: bool = False) -> Result:
    sched = build_schedule("1f1b" if s.mode == "dp" else s.schedule, s.pp, s.virtual, s.microbatches, s.dp_sync, s.defer)
    costs = RunCosts(s, c)
    mems = [rank_memory(s, costs.cm, sched, p, c.runtime, server=(s.strategy == "ps" and s.servers == 0 and p == 0))
            for p in range(s.pp)]
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
            f"does not fit: pipeline rank {p} needs {peak / GB:.2f} GB but a {c.name} device has {c.memory / GB:.2f} GB "
            f"({format_breakdown(mems[p])}); use {'' if s.ac else '--ac full, '}a smaller micro-batch, more --parallel.pp/tp, "
            f"{'' if s.mode == '3d' else 'a sharded strategy, '}or a larger device (foldtrain plan finds one that fits)"
        )
    # Every iteration ends in the loss all-reduce (a barrier) with no reduction in flight, so one
    # iteration is the steady state; deferred reductions cross into the next one: simulate two.
    iters = 2 if s.defer else 1
    if keep_events:
        iters += 1
    sim: Sim = run_schedule(sched, costs, iterations=iters, record_from=0 if keep_events else iters - 1)
    step = sim.iter_end[-1] - (sim.iter_end[-2] if iters > 1 else 0.0)
    if s.strategy == "ps" and s.staleness > 0 and s.dp > 1:
        bw_s, _ = costs.server_link()
        k = max(s.servers, 1)
        tot_g = sum(costs.cm.grad_bytes(g) for g in range(s.segments))
        tot_w = sum(segment_params(s, g) for g in range(s.segments)) * s.weight_bytes
        server = max(s.dp * tot_g, s.dp * tot_w) / k / bw_s + s.dp / k * sum(costs.cm.optim(g) for g in range(s.segments))
        if server > step:
            notes.append(f"async parameter server bound: the server needs {server:.4g} s per round of {s.dp} gradients")
            step = server
    evs = [r.events for r in sim.ranks]
    last = [[e for e in r if e["step"] == iters - 1] for r in evs]
    summ = summarize(last, skip_first=False)[-1] if any(last) else {}
    tokens = s.tokens_per_step
    flops = 6 * model_params(s) * tokens + 12 * s.n_layer * s.seq * s.d_model * tokens
    devices = s.dp * s.pp * s.tp
    mfu = flops / (step * devices * c.peak(s.dtype)) if step > 0 else 0.0
    return Result(setup=s, cluster=c, step_time=step, tokens_per_s=tokens / step if step > 0 else 0.0, mfu=mfu,
                  bubble=summ.get("bubble_mean", 0.0), all_rank_idle=summ.get("all_idle", 0.0),
                  exposed_dp=summ.get("reduce_wait_max", 0.0), memory=mems, events=evs if keep_events else [],
                  notes=notes)


def simulate(cfg, cluster: Cluster, *, check_memory: bool = True, keep_events: bool = False) -> Result:
    """Predict ``cfg`` (a resolved, validated Config) on ``cluster``."""
    return simulate_setup(resolve_setup(cfg), cluster, check_memory=check_memory, keep_events=keep_events)
