"""``foldtrain bench pipeline``: Fold3D's question on this machine.

Two emulated nodes on throttled links (1gbit and 100mbit by default); pipeline ranks inside a
node, data parallelism across nodes (dp=2 x pp=2: world 4, 2 processes per node; the mesh puts
TP innermost, then PP, then DP, so global rank = d*P + p and node = d). foldtrain's ``gpipe``,
``1f1b`` (V=1) and ``interleaved-1f1b`` (V=2) with the gradient all-reduce after the flush, and
``fold`` (V=2) reducing each chunk as soon as its last backward is done, each with ``--profile``
(all-rank idle fraction, exposed DP communication, gantt.png); against PyTorch's
``torch.distributed.pipelining`` schedules with a DDP-style all-reduce after the flush, and
DeepSpeed's PipelineModule when installed. The zero-bubble schedules (``zb-h1``, ``zbv``, ``interleaved-zb``,
``fold-zb``) against torch's (``interleaved-zb``, ``zbv``, ``dualpipev``).

``--bound RATE`` measures each foldtrain configuration's compute-bound limit in the same invocation: right
after each run on a throttled network the same run again with the links' rate changed in place to RATE
(e.g. 40gbit), then back; the ratio of the two says how much of the limit the slow link leaves. Each run with
``--fold.defer_reduce`` and a profiled twin also gets the shortest step its order allows on the throttled link
(:func:`~foldtrain.bench.overlap.order_bounds`), which may lie above that limit, and the shortest any order of
its layout allows (:func:`~foldtrain.bench.overlap.layout_bounds`).
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

from foldtrain.bench import common
from foldtrain.bench.overlap import (
    bound_ratios,
    defer_ratios,
    layout_bounds,
    merge_profiled,
    order_bounds,
    pipeline_overlap,
    zero_bubble_ratios,
    zero_ratios,
)
from foldtrain.bench.results import RunResult
from foldtrain.bench.tables import PIPE_HEADERS, pipeline_ratios, pipeline_rows
from foldtrain.errors import FoldtrainError
from foldtrain.schedules import SCHEDULE_NAMES

SCHEDULES = SCHEDULE_NAMES
TORCH_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "interleaved-zb", "zbv", "dualpipev")
DEFAULT_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "fold")
DEFAULT_TORCH = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs")
VIRTUAL = ("interleaved-1f1b", "fold", "interleaved-zb", "fold-zb", "looped-bfs")  # V chunks per rank
PER_CHUNK = ("fold", "fold-zb")  # reduce each chunk when its backward ends, by default
# 8.5M parameters (34 MB of fp32 gradients, ~17 MB per pipeline rank) against 256 tokens per step: on two CPU
# cores the gradient all-reduce over 1gbit is a sizeable part of a step (~0.3 s of ~1.2 s), over 100mbit most of it
DEFAULTS = dict(
    preset="tiny",
    n_layer=8,
    d_model=256,
    global_batch=8,
    seq_len=32,
    steps=10,
    warmup=3,
    networks="1gbit,100mbit",
    timeout=900.0,
)
QUICK = dict(
    preset="tiny", n_layer=4, d_model=64, n_head=2, global_batch=8, seq_len=64, steps=5, warmup=2, networks="1gbit"
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="foldtrain bench pipeline",
        description="Pipeline schedules with data parallelism across two emulated nodes: foldtrain's gpipe, 1f1b, "
        "interleaved-1f1b (after-flush all-reduce) and fold (per-chunk all-reduce) against "
        "torch.distributed.pipelining (+ DDP-style all-reduce) and DeepSpeed when installed.",
        epilog="Schedules take an optional ':DP_SYNC', "
        "e.g. --schedules fold,fold:after-flush,interleaved-1f1b:per-chunk.",
    )
    g = p.add_argument_group("what to compare")
    g.add_argument(
        "--schedules",
        default=",".join(DEFAULT_SCHEDULES),
        help=f"foldtrain schedules of {', '.join(SCHEDULES)}; fold+defer for --fold.defer_reduce "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--torch_schedules",
        default=",".join(DEFAULT_TORCH),
        help=f"torch.distributed.pipelining schedules of {', '.join(TORCH_SCHEDULES)}; zbv and dualpipev always "
        "run 2 stages per rank in a V (default: %(default)s)",
    )
    g.add_argument("--anchors", default="torch,deepspeed", help="baselines: torch, deepspeed; 'none' for none")
    g.add_argument("--dp", type=int, default=2, help="data-parallel degree = emulated nodes (default %(default)s)")
    g.add_argument("--pp", type=int, default=2, help="pipeline ranks per node (default %(default)s)")
    g.add_argument(
        "--virtual",
        type=int,
        default=2,
        help="chunks per pipeline rank for interleaved-1f1b, fold, looped-bfs (default %(default)s)",
    )
    g.add_argument(
        "--microbatches",
        type=int,
        default=0,
        help="micro-batches per data-parallel rank (0: global_batch / dp, micro-batch 1)",
    )
    g.add_argument("--precision", default="fp32", help="--precision of every run (default %(default)s)")
    g.add_argument(
        "--bound",
        default="",
        metavar="RATE",
        help="after each foldtrain run on a throttled network, the same run with the links changed in place to "
        "RATE (e.g. 40gbit): its compute-bound limit (default: none)",
    )
    g.add_argument(
        "--no_profile", action="store_true", help="leave --profile off the foldtrain runs (no idle metrics, no gantt)"
    )
    common.add_common(p, DEFAULTS)
    return p


OPTIONS = {
    "defer": ["--fold.defer_reduce", "true"],
    "zero": ["--optim.distributed", "true"],
    "tied": ["--optim.shard_tied", "true"],
    "whole": ["--optim.split_tied", "false"],
    "fsdp": ["--dp.strategy", "fsdp"],
}


def parse_schedule(spec: str, virtual: int) -> tuple[str, int, str, tuple[str, ...]]:
    """``fold`` / ``fold-zb`` -> (name, V, "per-chunk", ()); ``interleaved-1f1b`` / ``interleaved-zb`` ->
    (..., V, "after-flush", ()); ``gpipe`` / ``1f1b`` / ``zb-h1`` -> (..., 1, "after-flush", ()); ``zbv`` -> (..., 2,
    "after-flush", ()) whatever ``--virtual`` says;
    ``NAME:DP_SYNC`` overrides the sync; ``+defer`` adds ``--fold.defer_reduce`` (fold, fold-zb), ``+zero``
    ``--optim.distributed`` (e.g. ``fold+defer+zero``), ``+tied`` with it ``--optim.shard_tied``, ``+whole`` with it
    ``--optim.split_tied false``, ``+fsdp``
    ``--dp.strategy fsdp``."""
    spec, *options = spec.split("+")
    for what in options:
        if what not in OPTIONS:
            raise FoldtrainError(
                f"bench pipeline: unknown schedule option '+{what}'; choose from +defer (fold+defer), +zero "
                "(the distributed optimizer), +tied (with +zero: its tied copies sliced too), +whole (with +zero: "
                "each end steps its whole tied copy) and +fsdp (every chunk fully sharded over dp)"
            )
    name, _, sync = spec.partition(":")
    if name not in SCHEDULES:
        raise FoldtrainError(f"bench pipeline: unknown schedule '{name}'; choose from {', '.join(SCHEDULES)}")
    v = 2 if name == "zbv" else virtual if name in VIRTUAL else 1  # zbv: always two chunks in a V
    sync = sync or ("per-chunk" if name in PER_CHUNK else "after-flush")
    if sync not in ("after-flush", "per-chunk"):
        raise FoldtrainError(f"bench pipeline: unknown dp_sync '{sync}' in '{spec}'; use after-flush or per-chunk")
    return name, v, sync, tuple(sorted(set(options)))


def plan(a, data_path: str, deepspeed_ok: bool = False) -> dict[str, list]:
    """The jobs of this invocation grouped by network. Pure: no processes."""
    from foldtrain.bench.runner import Job

    if a.global_batch % a.dp:
        raise FoldtrainError(f"bench pipeline: --global_batch {a.global_batch} is not divisible by --dp {a.dp}")
    rows = a.global_batch // a.dp
    M = a.microbatches or rows
    if rows % M:
        raise FoldtrainError(f"bench pipeline: {rows} rows per data-parallel rank do not split into {M} micro-batches")
    world = a.dp * a.pp
    base = [
        *common.train_args(a, data_path),
        "--precision",
        a.precision,
        "--parallel.dp",
        str(a.dp),
        "--parallel.pp",
        str(a.pp),
        "--parallel.microbatches",
        str(M),
    ]
    anchors = [x for x in common.csv(a.anchors) if x != "none"]
    unknown = [x for x in anchors if x not in ("torch", "deepspeed")]
    unknown += [s for s in common.csv(a.torch_schedules) if s not in TORCH_SCHEDULES]
    if unknown:
        raise FoldtrainError(f"bench pipeline: unknown anchor or torch schedule {', '.join(unknown)}")
    specs = [parse_schedule(s, a.virtual) for s in common.csv(a.schedules)]
    jobs: dict[str, list] = {}
    for net in common.csv(a.networks):
        loop = net == common.LOOPBACK
        threads = common.threads_for(a, world)
        js = jobs.setdefault(net, [])

        # add is called only inside this iteration, so the loop variables it reads are the current ones
        def add(impl, variant, v, sync, script, extra, note="", **more):
            info = {"virtual": v, "dp_sync": sync, **more}
            if note:
                info["note"] = note
            args = [*base, "--parallel.virtual", str(v), *extra]
            res = RunResult("pipeline", impl, variant, a.precision, world, net, a.dp, info=info)  # noqa: B023
            js.append(common_job(Job, res, script, args, loop, a, threads))  # noqa: B023
            if a.bound and not loop and impl == "foldtrain" and not more.get("profiled_twin"):  # noqa: B023
                twin = {**info, "link_rate": a.bound, "bound_of": net, "tag": (info.get("tag", "") + "bound")}  # noqa: B023
                res = RunResult("pipeline", impl, variant, a.precision, world, a.bound, a.dp, info=twin)
                js.append(common_job(Job, res, script, args, loop, a, threads))  # noqa: B023

        for name, v, sync, options in specs:
            extra = ["--parallel.schedule", name, "--parallel.dp_sync", sync]
            more = {}
            for what in options:
                extra += OPTIONS[what]
                more[what] = True
            if options:
                more["tag"] = "-".join(options)
            # tokens/s from a run without --profile; the idle figures from a profiled twin (merged after)
            note = " ".join(OPTIONS[w][0] for w in options)
            add("foldtrain", name, v, sync, ["-m", "foldtrain", "train"], extra, note, **more)
            if not a.no_profile:
                add(
                    "foldtrain",
                    name,
                    v,
                    sync,
                    ["-m", "foldtrain", "train"],
                    [*extra, "--profile"],
                    note,
                    **{**more, "profiled_twin": True, "tag": more.get("tag", "") + "profiled"},
                )
        if "torch" in anchors:
            for s in common.csv(a.torch_schedules):
                v = 2 if s in ("zbv", "dualpipev") else a.virtual if s in VIRTUAL else 1
                add("torch", s, v, "after-flush", ["-m", "foldtrain.bench.anchors.torch_pipelining"], ["--schedule", s])
        if "deepspeed" in anchors and deepspeed_ok:
            add("deepspeed", "1f1b", 1, "after-flush", ["-m", "foldtrain.bench.anchors.deepspeed_pipe"], [])
    return jobs


def common_job(Job, res, script, args, loopback: bool, a, threads: int):
    if loopback:
        return Job(res, script, args, nnodes=1, nproc_per_node=a.dp * a.pp, threads=threads)
    return Job(res, script, args, nnodes=a.dp, nproc_per_node=a.pp, threads=threads)


@common.signals_as_exceptions()
def main(argv: list[str]) -> int:
    a = common.parse_args(parser(), argv, QUICK)
    log = common.logger()
    notes: list[str] = []
    anchors = common.csv(a.anchors)
    deepspeed_ok = False
    if "deepspeed" in anchors:
        deepspeed_ok = common.optional_anchor("deepspeed", "deepspeed", log, notes)
    ws = common.Workspace(a.out, "pipeline")
    try:
        data_path = "" if a.dry_run else common.prepare_data(a)
        jobs = plan(a, data_path, deepspeed_ok)
        if a.dry_run:
            common.print_dry_run(jobs, ws, print)
            return 0
        max_nodes = {net: a.dp for net in jobs}
        load_before = os.getloadavg()
        results = merge_profiled(common.execute(jobs, a, ws, max_nodes, log))
        if a.out:
            for r in results:
                g = Path(r.info.get("profiled_out", r.out_dir)) / "gantt.png"
                if r.impl == "foldtrain" and g.is_file():
                    defer = "defer" if r.info.get("defer") else ""
                    dst = ws.root / f"gantt_{common.slug(r.variant, r.info.get('dp_sync', ''), defer, r.network)}.png"
                    shutil.copy(g, dst)
                    r.info["gantt"] = str(dst)
        rows = pipeline_rows(results)
        ratios = pipeline_ratios(results) + defer_ratios(results) + zero_ratios(results) + pipeline_overlap(results)
        ratios += zero_bubble_ratios(results) + bound_ratios(results) + order_bounds(results)
        ratios += layout_bounds(results)
        notes += common.run_notes(a, load_before)
        notes += [
            f"world {a.dp * a.pp}: dp={a.dp} across emulated nodes x pp={a.pp} inside each; micro-batches per dp rank: "
            f"{a.microbatches or a.global_batch // a.dp}",
            "medians over the steps after warm-up; time/step: the wall period from a step's start to the next's "
            "(what runs between steps included); "
            "tokens/s and time/step of foldtrain rows come from runs without --profile; "
            "all-rank idle / bubble / exposed DP comm from a separate --profile run of the same configuration "
            "(the anchors do not log them)",
            "torch anchors: torch.distributed.pipelining schedules + a flat all-reduce of each stage's gradients "
            "over the dp group after the schedule (DDP-style, after the flush)",
        ]
        if deepspeed_ok:
            notes.append(
                "deepspeed: DeepSpeed's PipelineModule and its 1F1B TrainSchedule, gradients all-reduced over the dp "
                "group after the flush, torch's AdamW (DeepSpeed compiles no op here); embeddings untied"
            )
        common.print_results(
            "foldtrain bench pipeline",
            PIPE_HEADERS,
            rows,
            ratios,
            notes,
            results,
            a,
            ws,
            kept="runs, gantt_*.png and results.json",
            without_out="pass --out DIR to keep the runs and each foldtrain run's gantt.png",
        )
        return 0
    finally:
        ws.close()
