"""``foldtrain plan``: search the layouts of a model on a cluster, rank them by predicted throughput.

Search space: ``dp x pp x tp = gpus`` (tp within a node, dividing heads and width; the vocabulary is
padded to a multiple of tp),
``V`` in 1, 2, 4, 8, the micro-batch size (powers of two dividing a data-parallel rank's rows),
the schedule (gpipe, 1f1b, zb-h1 for V = 1; interleaved-1f1b, interleaved-zb, fold, fold-zb for V > 1; zbv at
V = 2), ``dp_sync``, fold's
deferral (when the base config allows it: no clipping, no fp16), recomputation, the 3D engine's
distributed optimizer where dp > 1 (always, when the base config sets ``--optim.distributed``; with a pipeline
with and without ``--optim.shard_tied``, only with it when the base config sets it), FSDP over dp
with pp or tp (``--dp.strategy fsdp``; not with deferral), and, where there
is neither pipeline nor tensor parallelism, the data-parallel strategies (allreduce, ddp,
sharded-ps). Every candidate is first estimated in closed form (per-rank compute, the
``(V M + P - 1)`` pipeline, exposed reduction) with its activation memory; those that fit are
ranked by the estimate, and the best ``SIMULATE`` go through the full event simulation, which
decides the order.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from foldtrain.config import build_config, to_toml, validate
from foldtrain.errors import ConfigError, FoldtrainError
from foldtrain.schedules.generators import DEFERRABLE, SPLIT_BACKWARD

from .cluster import Cluster
from .costs import CostModel, Placement, lookup_rows, rank_segments, segment_params, stepped_share, tied_params
from .memory import GB
from .setup import Setup, resolve_setup
from .simulate import Result, simulate_setup

SIMULATE = 24


@dataclass
class Candidate:
    cfg: Any
    setup: Setup
    estimate: float  # s per step, closed form
    mem: float  # bytes, closed-form peak
    result: Result | None = None
    reasons: list[str] = field(default_factory=list)

    def label(self) -> str:
        s = self.setup
        if s.mode == "dp":
            return f"{s.strategy} x{s.dp} mb={s.micro_batch}" + (" ac" if s.ac else "")
        sync = "" if s.dp == 1 else f" {s.dp_sync}"
        return (
            f"dp{s.dp} pp{s.pp} tp{s.tp} V{s.virtual} mb={s.micro_batch} {s.schedule}{sync}"
            + (" defer" if s.defer else "")
            + (" dist-optim" if s.dist_optim else "")
            + (" shard-tied" if s.shard_tied else "")
            + (" fsdp" if s.strategy == "fsdp-3d" else "")
            + (" ac" if s.ac else "")
        )

    def to_json(self) -> dict:
        d = self.result.to_json() if self.result else {}
        d["label"] = self.label()
        d["reasons"] = self.reasons
        return d


@dataclass
class PlanResult:
    cluster: Cluster
    gpus: int
    considered: int
    fitting: int
    simulated: int
    top: list[Candidate]


def _divisors(n: int) -> list[int]:
    return [i for i in range(1, n + 1) if n % i == 0]


def _variants(base, gpus: int, cluster: Cluster):
    m, t = base.model, base.train
    allow_defer = base.optim.grad_clip == 0 and not base.precision.startswith("fp16")
    for tp in _divisors(gpus):
        if tp > cluster.gpus_per_node or m.n_head % tp or m.d_model % tp:
            continue
        for pp in _divisors(gpus // tp):
            if pp > m.n_layer:
                continue
            dp = gpus // (tp * pp)
            if t.global_batch % dp:
                continue
            rows = t.global_batch // dp
            mbs = [b for b in (1, 2, 4, 8, 16, 32) if rows % b == 0]
            for mb in mbs:
                M = rows // mb
                for ac in ("none", "full"):
                    if pp == 1 and tp == 1 and dp > 1:
                        for strat in ("allreduce", "ddp", "sharded-ps"):
                            yield dict(
                                strategy=strat,
                                dp=dp,
                                pp=1,
                                tp=1,
                                virtual=1,
                                schedule="1f1b",
                                dp_sync="after-flush",
                                defer=False,
                                mb=mb,
                                M=M,
                                ac=ac,
                            )
                    for v in (1, 2, 4, 8):
                        if v > 1 and (pp == 1 or pp * v > m.n_layer):
                            continue
                        for sc in _schedules(pp, v, M):
                            for sync in (
                                ("after-flush", "per-chunk") if dp > 1 and pp > 1 and v > 1 else ("after-flush",)
                            ):
                                for defer in (
                                    (False, True)
                                    if sc in DEFERRABLE and sync == "per-chunk" and v > 1 and allow_defer
                                    else (False,)
                                ):
                                    layout = dict(
                                        dp=dp, pp=pp, tp=tp, virtual=v, schedule=sc, dp_sync=sync, mb=mb, M=M, ac=ac
                                    )
                                    yield from _reductions(base, layout, defer)


def _reductions(base, layout: dict, defer: bool):
    """The 3D engine's data-parallel reductions for one layout: its all-reduce, the distributed optimizer
    (where dp > 1; only it when the base config sets ``--optim.distributed``) and FSDP (dp > 1 with a pipeline
    or tensor parallelism, without deferral: ``check_fsdp``)."""
    dp = layout["dp"]
    for dist in (True,) if base.optim.distributed else (False, True)[: 1 + (dp > 1)]:
        # the tied copies' state sliced too: only where the pipeline splits the tie (else the same run)
        ties = ((True,) if base.optim.shard_tied else (False, True)) if dist and layout["pp"] > 1 else (False,)
        for tied in ties:
            yield dict(layout, strategy="none", defer=defer, dist=dist, tied=tied)
    fsdp_ok = dp > 1 and layout["pp"] * layout["tp"] > 1
    if fsdp_ok and not defer and not base.optim.distributed:
        yield dict(layout, strategy="fsdp", defer=False, dist=False)


def _make_cfg(base, c: dict):
    cfg = copy.deepcopy(base)
    p = cfg.parallel
    p.dp, p.pp, p.tp, p.virtual, p.schedule, p.dp_sync = (
        c["dp"],
        c["pp"],
        c["tp"],
        c["virtual"],
        c["schedule"],
        c["dp_sync"],
    )
    p.microbatches = c["M"]
    p.layers_per_chunk = []
    cfg.train.micro_batch = c["mb"]
    cfg.ac = c["ac"]
    cfg.fold.defer_reduce = c["defer"]
    cfg.dp.strategy = c["strategy"]
    cfg.dp.ps_servers = 0
    cfg.optim.distributed = c.get("dist", False)
    cfg.optim.shard_tied = c.get("tied", False)
    return cfg


def _schedules(pp: int, v: int, M: int) -> list[str]:
    """The schedules a layout of ``pp`` ranks x ``v`` chunks x ``M`` micro-batches can run."""
    if pp == 1:
        return ["1f1b"]
    if v == 1:
        return ["gpipe", "1f1b", "zb-h1"]
    out = ["fold", "fold-zb"] + (["interleaved-1f1b", "interleaved-zb"] if M % pp == 0 else [])
    return out + (["zbv"] if v == 2 else [])


def _live_chunks(s: Setup) -> int:
    """Micro-batch x chunk activations alive at once on the busiest rank (rank 0)."""
    M, P, V = s.microbatches, s.pp, s.virtual
    if s.schedule in ("gpipe", "fold", "fold-zb"):
        return M * V
    if s.schedule in ("1f1b", "zb-h1"):
        return min(P, M) if s.mode == "3d" else 1
    if s.schedule == "zbv":
        return min(M * V, 2 * P)
    return min(M * V, 2 * (P - 1) + (V - 1) * P + 1)


def estimate(s: Setup, c: Cluster) -> tuple[float, float]:
    """Closed-form (step time, peak memory of rank 0)."""
    cm, pl = CostModel(s, c), Placement(s, c)
    segs = range(s.segments)
    u = sum(cm.forward(g) + cm.backward(g) for g in segs) / s.segments  # one chunk x micro-batch, F + B
    M, P, V = s.microbatches, s.pp, s.virtual
    # the pipeline's fill: F + B per hop, or F + I where the split backward fills the rest with W (zero bubble)
    split = s.schedule in SPLIT_BACKWARD
    fill = sum(cm.forward(g) + cm.backward_input(g) for g in segs) / s.segments if split else u
    t = V * M * u + (P - 1) * fill if s.mode == "3d" else M * u
    if P > 1:
        key, w, lat = pl.p2p_link(0, 1)
        bw = c.inter.bw / w if key[0] == "nic" else c.intra.bw
        t += 2 * (P - 1) * (lat + cm.activation_bytes() / bw) * (V if V > 1 else 1)
    if s.dp > 1:
        key, w, bw, lat = pl.dp_link(0)
        if key[0] == "nic":  # the node's interface, shared by the stages (x tp ranks) the node holds
            bw = bw / (w * max(1, min(P, c.gpus_per_node // s.tp)))
        g = sum(cm.grad_bytes(x) for x in rank_segments(s, 0))
        factor = 2 if s.strategy != "sharded-ps" and not s.dist_optim else 1 + s.weight_bytes / s.grad_bytes
        ring = factor * (s.dp - 1) / s.dp * g / bw + 2 * (s.dp - 1) * lat
        if s.shard_tied and P > 1:  # the tied copy's landing after its step (rank 0's embedding copy: the
            # looked-up rows only, costs.lookup_rows)
            rows = lookup_rows(s, 0)
            tied = 2 * rows * s.d_model * 4 if rows else tied_params(s) * s.weight_bytes
            ring += (s.dp - 1) / s.dp * tied / bw
        if s.strategy == "fsdp-3d":  # exposed: an all-gather per pass that finds its blocks sharded, the LR's
            # fp32 reduce-scatter (pipeline_fsdp)
            n = g / s.grad_bytes
            passes = 2 * M * V if s.reshard_after_forward else V
            ring = (s.dp - 1) / s.dp * n * (passes * s.weight_bytes / V + 4) / bw + 2 * (s.dp - 1) * lat
        elif s.mode == "dp" and s.strategy in ("ddp", "allreduce"):
            ring = max(ring - u, ring / 10)  # buckets start during the last backward
        elif s.dp_sync == "per-chunk":
            hidden = u * M * (V - 1) if V > 1 else 0.0
            ring = max(ring / V, ring - hidden) if not s.defer else ring / V / 2
        t += ring
    t += sum(cm.optim(x, stepped_share(s, x)) for x in rank_segments(s, 0))
    per_block = cm.act_bytes_block(recompute=s.ac)
    n_par = sum(segment_params(s, x) for x in rank_segments(s, 0))
    stepped = sum(segment_params(s, x) * stepped_share(s, x) for x in rank_segments(s, 0))
    opt = (8 + (4 if s.master else 0)) * stepped / n_par
    buf = s.grad_bytes if s.dp > 1 else 0
    state = n_par * (s.weight_bytes + s.grad_bytes + opt + buf)
    if s.strategy == "fsdp-3d":  # fp32 shards; the chunks unsharded with their fp32 gradients at the turn
        state = n_par * (16 / s.dp + s.weight_bytes + 4)
    mem = state + _live_chunks(s) * s.layers[0] * per_block + c.runtime
    if s.ac:
        mem += cm.act_bytes_block(recompute=False)
    if s.segments == 1:
        mem += 2 * s.micro_batch * s.seq * s.vocab / s.tp * 4
    return t, mem


def plan(
    argv: list[str], config_file: str | None, cluster: Cluster, gpus: int, simulate_top: int | None = None
) -> PlanResult:
    base = build_config(argv, config_file)
    if simulate_top is None:
        simulate_top = SIMULATE if gpus <= 128 else 8
    cands: list[Candidate] = []
    considered = 0
    for c in _variants(base, gpus, cluster):
        considered += 1
        cfg = _make_cfg(base, c)
        try:
            s = resolve_setup(cfg, full_check=False)
        except FoldtrainError:
            continue
        t, mem = estimate(s, cluster)
        if mem <= cluster.memory:
            cands.append(Candidate(cfg, s, t, mem))
    if considered == 0:
        raise ConfigError(
            f"no layout of --model.preset {base.model.preset} uses --gpus {gpus} with --train.global_batch "
            f"{base.train.global_batch}: dp x pp x tp must equal the GPU count, tp must divide the heads and width "
            f"and stay within a node of {cluster.gpus_per_node}, "
            f"pp at most the {base.model.n_layer} layers, "
            f"and dp must divide the global batch; pick another --gpus or --train.global_batch"
        )
    if not cands:
        raise ConfigError(
            f"none of the {considered} layouts of {base.model.preset} on {gpus} x {cluster.name} fits in "
            f"{cluster.memory / GB:.0f} GB per device, even with recomputation; use more GPUs or a smaller model"
        )
    cands.sort(key=lambda x: x.estimate)
    sims: list[Candidate] = []
    for cand in cands[:simulate_top]:
        validate(cand.cfg)
        resolve_setup(cand.cfg)  # the full layout check (builds and validates the schedule)
        r = simulate_setup(cand.setup, cluster, check_memory=False)
        if r.fits:
            cand.result = r
            sims.append(cand)
    sims.sort(key=lambda x: -x.result.tokens_per_s)
    _explain(sims)
    return PlanResult(cluster, gpus, considered, len(cands), len(sims), sims)


def _explain(sims: list[Candidate]) -> None:
    if not sims:
        return
    best = sims[0].result
    for i, c in enumerate(sims):
        r, s = c.result, c.setup
        why = []
        if i == 0 and len(sims) > 1:
            why.append(f"{r.tokens_per_s / sims[1].result.tokens_per_s - 1:+.1%} over the next")
        elif i > 0:
            why.append(f"{r.tokens_per_s / best.tokens_per_s - 1:+.1%} vs the best")
        if s.pp > 1:
            why.append(f"bubble {r.bubble:.0%}")
        if s.dp > 1:
            why.append(
                f"exposed DP {r.exposed_dp:.3g} s"
                + (" (per-chunk overlap)" if s.dp_sync == "per-chunk" and s.mode == "3d" else "")
            )
        why.append(
            "no recomputation"
            if not s.ac
            else "recomputation needed to fit"
            if c.mem > 0.8 * r.cluster.memory
            else "recomputation"
        )
        if s.tp > 1:
            why.append(f"tp {s.tp} inside a node")
        why.append(f"{r.peak_mem / GB:.1f} GB peak")
        c.reasons = why


def format_plan(res: PlanResult, top: int = 5) -> str:
    lines = [
        f"plan for {res.gpus} x {res.cluster.name}: {res.considered} layouts, {res.fitting} fit by estimate, "
        f"{res.simulated} simulated in full",
        f"{'#':>2} {'layout':<58} {'step s':>9} {'tokens/s':>12} {'MFU':>6} {'mem GB':>7}  why",
    ]
    for i, c in enumerate(res.top[:top]):
        r = c.result
        lines.append(
            f"{i + 1:>2} {c.label():<58} {r.step_time:>9.4g} {r.tokens_per_s:>12,.0f} {r.mfu:>6.1%} "
            f"{r.peak_mem / GB:>7.2f}  {'; '.join(c.reasons)}"
        )
    if not res.top:
        lines.append("no simulated layout fits in memory")
    return "\n".join(lines)


def _launch_line(world: int, per_node: int) -> str:
    """The torchrun command that starts ``world`` ranks, ``per_node`` on each machine."""
    if world <= per_node:
        return f"torchrun --nproc_per_node {world} -m foldtrain train --config FILE"
    nodes = -(-world // per_node)
    return (
        f"on each of {nodes} nodes, torchrun --nnodes {nodes} --nproc_per_node {per_node} "
        "--rdzv_backend c10d --rdzv_endpoint HOST0:29500 -m foldtrain train --config FILE"
    )


def plan_toml(res: PlanResult) -> str:
    if not res.top:
        raise ConfigError("no layout fits; nothing to write")
    c = res.top[0]
    cfg = copy.deepcopy(c.cfg)
    head = [
        f"# foldtrain plan: best of {res.simulated} simulated layouts on {res.gpus} x {res.cluster.name}: {c.label()}",
        f"# predicted {c.result.tokens_per_s:,.0f} tokens/s, {c.result.peak_mem / GB:.2f} GB peak per device",
    ]
    world = c.setup.dp if c.setup.mode == "dp" else c.setup.world
    head.append(f"# launch {world} processes: {_launch_line(world, res.cluster.gpus_per_node)}")
    if c.setup.mode == "dp":
        head.append(f"# a data-parallel strategy: parallel.dp stays 1 for train (simulate takes --parallel.dp {world})")
        cfg.parallel.dp = 1
        cfg.parallel.microbatches = 0
    return "\n".join(head) + "\n" + to_toml(cfg)
