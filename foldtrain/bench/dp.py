"""``foldtrain bench dp``: the data-parallel study (Bai 2022) on this machine.

Every strategy x precision at 1, 2 and 4 ranks, same model and global batch, on loopback
(``torchrun --standalone``) and on the emulated network (one rank per node, throttled links),
plus the plain-PyTorch DDP anchor (and Horovod when installed); one table, then the target
ratios computed from the same invocation.
"""

from __future__ import annotations

import argparse
import os
import sys

from foldtrain.bench import common
from foldtrain.errors import FoldtrainError
from foldtrain.bench.overlap import dp_overlap
from foldtrain.bench.results import DP_HEADERS, RunResult, dp_ratios, dp_rows

STRATEGIES = ("none", "ps", "sharded-ps", "allreduce", "ddp", "horovod")
ANCHORS = ("ddp_plain", "horovod")
DEFAULTS = dict(preset="tiny", global_batch=16, seq_len=128, steps=15, warmup=3, networks="loopback,1gbit", timeout=900.0)
QUICK = dict(preset="tiny", n_layer=2, d_model=64, n_head=2, global_batch=8, seq_len=64, steps=6, warmup=2, ranks=[1, 2],
             precisions="fp32")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="foldtrain bench dp",
        description="Data-parallel strategies x precisions x ranks on loopback and an emulated slow network, "
                    "against a plain-PyTorch DDP loop (and Horovod when installed).",
        epilog="Example: foldtrain bench dp --strategies none,allreduce,ddp --precisions fp32 --ranks 1,2 --networks loopback,100mbit",
    )
    g = p.add_argument_group("what to compare")
    g.add_argument("--strategies", default=",".join(STRATEGIES), help="comma list of --dp.strategy values (default: all)")
    g.add_argument("--precisions", default="fp32,bf16", help="comma list of --precision values (default %(default)s)")
    g.add_argument("--ranks", type=common.csv_ints, default=[1, 2, 4], help="comma list of world sizes (default 1,2,4)")
    g.add_argument("--anchors", default=",".join(ANCHORS), help="baselines: ddp_plain, horovod; 'none' for no anchors")
    g.add_argument("--ps_servers", type=int, default=0, help="--dp.ps_servers for ps runs (default 0: colocated on rank 0)")
    g.add_argument("--micro_batch", type=int, default=0, help="--train.micro_batch (0: the whole per-rank batch)")
    common.add_common(p, DEFAULTS)
    return p


def plan(a, data_path: str, horovod_ok: bool = False, notes: list[str] | None = None) -> dict[str, list]:
    """The jobs of this invocation, grouped by network (loopback first). Pure: no processes.
    Combinations that cannot run are left out with a line in ``notes``."""
    notes = notes if notes is not None else []
    from foldtrain.bench.runner import Job
    from foldtrain.config import PRECISIONS

    strategies = common.csv(a.strategies)
    bad = [s for s in strategies if s not in STRATEGIES]
    precisions = common.csv(a.precisions)
    bad += [p for p in precisions if p not in PRECISIONS]
    anchors = [x for x in common.csv(a.anchors) if x != "none"]
    bad += [x for x in anchors if x not in ANCHORS]
    if bad:
        raise FoldtrainError(f"bench dp: unknown value(s) {', '.join(bad)}; strategies: {', '.join(STRATEGIES)}; "
                         f"precisions: {', '.join(PRECISIONS)}; anchors: {', '.join(ANCHORS)}")
    networks = common.csv(a.networks)
    base = common.train_args(a, data_path)
    if a.micro_batch:
        base += ["--train.micro_batch", str(a.micro_batch)]
    jobs: dict[str, list] = {common.LOOPBACK: []}
    for net in networks:
        jobs.setdefault(net, [])
    def add(net: str, impl: str, variant: str, prec: str, n: int, script: list[str], extra: list[str], workers: int,
            launcher: list[str] | None = None, note: str = ""):
        res = RunResult("dp", impl, variant, prec, n, net, workers, info={"note": note} if note else {})
        threads = common.threads_for(a, n)
        jobs[net].append(Job(res, script, [*base, "--precision", prec, *extra], nnodes=1 if net == common.LOOPBACK else n,
                             nproc_per_node=n if net == common.LOOPBACK else 1, threads=threads, launcher=launcher))

    for prec in precisions:
        # the single-process reference (speed-up 1.0): always on loopback, network does not matter
        if "none" in strategies:
            add(common.LOOPBACK, "foldtrain", "none", prec, 1, ["-m", "foldtrain", "train"], ["--dp.strategy", "none"], 1)
        if "ddp_plain" in anchors and 1 in a.ranks:
            add(common.LOOPBACK, "ddp_plain", "", prec, 1, ["-m", "foldtrain.bench.anchors.ddp_plain"], [], 1)
    for net in networks:
        for prec in precisions:
            for n in a.ranks:
                if n == 1:
                    continue  # one process: no network; its runs are the loopback references above
                for s in strategies:
                    if s == "none":
                        continue
                    extra, workers = ["--dp.strategy", s], n
                    if s == "ps" and a.ps_servers:
                        if a.ps_servers >= n:
                            notes.append(f"ps at {n} ranks skipped: --ps_servers {a.ps_servers} leaves no worker")
                            continue
                        extra += ["--dp.ps_servers", str(a.ps_servers)]
                        workers = n - a.ps_servers
                    if a.global_batch % workers:
                        msg = f"{s} at {n} ranks skipped: global batch {a.global_batch} does not split over {workers} workers"
                        if msg not in notes:
                            notes.append(msg)
                        continue
                    add(net, "foldtrain", s, prec, n, ["-m", "foldtrain", "train"], extra, workers)
                    if s == "ps" and a.ps_servers:
                        jobs[net][-1].result.info["ps_servers"] = a.ps_servers
                if "ddp_plain" in anchors and a.global_batch % n == 0:  # (the strategies' note covers n)
                    add(net, "ddp_plain", "", prec, n, ["-m", "foldtrain.bench.anchors.ddp_plain"], [], n)
                if "horovod" in anchors and horovod_ok and net == common.LOOPBACK and a.global_batch % n == 0:
                    add(net, "horovod", "", prec, n, ["-m", "foldtrain.bench.anchors.horovod_plain"], [], n,
                        launcher=["horovodrun", "-np", str(n), "-H", f"localhost:{n}", sys.executable])
    return jobs


@common.signals_as_exceptions()
def main(argv: list[str]) -> int:
    a = common.parse_args(parser(), argv, QUICK)
    log = common.logger()
    notes: list[str] = []
    horovod_ok = False
    anchors = common.csv(a.anchors)
    if "horovod" in anchors:
        horovod_ok = common.optional_anchor("horovod", "horovod.torch", log, notes)
        if horovod_ok and any(n != common.LOOPBACK for n in common.csv(a.networks)):
            notes.append("horovod anchor runs on loopback only (horovodrun across namespaces would need ssh)")
    ws = common.Workspace(a.out, "dp")
    try:
        data_path = "" if a.dry_run else common.prepare_data(a)
        jobs = plan(a, data_path, horovod_ok, notes)
        if a.dry_run:
            common.print_dry_run(jobs, ws, print)
            return 0
        cores = os.cpu_count() or 1
        if max(a.ranks) > cores:
            notes.append(f"{max(a.ranks)} ranks share {cores} CPU cores here: runs above {cores} ranks are oversubscribed, so "
                         "scaling efficiency is bounded by the cores, not the strategy; compare strategies at equal ranks")
        max_nodes = {net: max([j.nnodes for j in js] or [1]) for net, js in jobs.items()}
        load_before = os.getloadavg()
        results = common.execute(jobs, a, ws, max_nodes, log)
        rows = dp_rows(results)
        ratios = dp_ratios(results) + dp_overlap(results)
        notes += common.run_notes(a, load_before)
        notes += [
            "medians over the steps after warm-up; tokens/s = global batch x seq_len / step time",
            "speed-up: over foldtrain `none` (1 process) at the same precision; efficiency = speed-up / data-parallel workers",
            "MB/step/worker and server: the strategy's own byte counters logged by rank 0 (for ps rank 0 is the server), "
            "else (starred *) the emulated links' counters; wire MB/step: link bytes (sent + received, with TCP/IP overhead) of node 0 / "
            "mean of the other nodes, sampled over the measured steps",
        ]
        common.print_results("foldtrain bench dp", DP_HEADERS, rows, ratios, notes, results, a, ws)
        return 0
    finally:
        ws.close()
