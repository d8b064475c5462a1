"""``foldtrain bench dp``: the data-parallel study (Bai 2022) on this machine.

Every strategy x precision at 1, 2 and 4 ranks, same model and global batch, on loopback
(``torchrun --standalone``) and on the emulated network (one rank per node, throttled links),
plus the plain-PyTorch DDP anchor (and Horovod when installed); one table, then the target
ratios computed from the same invocation.

Horovod (where ``import horovod.torch`` works): foldtrain's ``--dp.strategy horovod`` (row
``horovod``) and the minimal Horovod loop (row ``horovod_plain``, beside ``ddp_plain``) run under
``horovodrun`` on loopback and under the same launch made by hand on the emulated network
(:mod:`foldtrain.bench.horovod_launch`), both with ``HOROVOD_CYCLE_TIME`` = ``--horovod_cycle_ms``
and ``HOROVOD_FUSION_THRESHOLD`` = foldtrain's ``--dp.fusion_mb`` default.
"""

from __future__ import annotations

import argparse
import os

from foldtrain.bench import common
from foldtrain.bench.horovod_launch import horovodrun_command
from foldtrain.bench.overlap import dp_overlap
from foldtrain.bench.results import RunResult
from foldtrain.bench.tables import DP_HEADERS, dp_ratios, dp_rows
from foldtrain.config import DPConfig
from foldtrain.errors import FoldtrainError

STRATEGIES = ("none", "ps", "sharded-ps", "allreduce", "ddp", "horovod", "fsdp", "fsdp-root")
# a row that is a --dp.strategy with options, not a strategy of its own
VARIANTS = {"fsdp-root": ["--dp.strategy", "fsdp", "--dp.shard_vocab", "false"]}
ANCHORS = ("ddp_plain", "horovod_plain", "fsdp_plain")
ANCHOR_ALIASES = {"horovod": "horovod_plain"}
# Horovod's background thread gathers ready gradients every HOROVOD_CYCLE_TIME ms (default 1 ms, tuned for
# GPUs); on 2 shared CPU cores that polling competes with the compute. Measured by sweeping it (docs/benchmarks.md).
HOROVOD_CYCLE_MS = 20.0
DEFAULTS = dict(
    preset="tiny", global_batch=16, seq_len=128, steps=15, warmup=3, networks="loopback,1gbit", timeout=900.0
)
QUICK = dict(
    preset="tiny",
    n_layer=2,
    d_model=64,
    n_head=2,
    global_batch=8,
    seq_len=64,
    steps=6,
    warmup=2,
    ranks=[1, 2],
    precisions="fp32",
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="foldtrain bench dp",
        description="Data-parallel strategies x precisions x ranks on loopback and an emulated slow network, "
        "against a plain-PyTorch DDP loop (and Horovod when installed).",
        epilog="Example: foldtrain bench dp --strategies none,allreduce,ddp --precisions fp32 --ranks 1,2 "
        "--networks loopback,100mbit",
    )
    g = p.add_argument_group("what to compare")
    g.add_argument(
        "--strategies",
        default=",".join(STRATEGIES),
        help="comma list of --dp.strategy values, and fsdp-root: fsdp with --dp.shard_vocab false (default: all)",
    )
    g.add_argument("--precisions", default="fp32,bf16", help="comma list of --precision values (default %(default)s)")
    g.add_argument("--ranks", type=common.csv_ints, default=[1, 2, 4], help="comma list of world sizes (default 1,2,4)")
    g.add_argument(
        "--anchors",
        default=",".join(ANCHORS),
        help="baselines: ddp_plain, horovod_plain, fsdp_plain; 'none' for no anchors",
    )
    g.add_argument(
        "--horovod_cycle_ms",
        type=csv_floats,
        default=[HOROVOD_CYCLE_MS],
        help="HOROVOD_CYCLE_TIME of the Horovod runs, ms (default 20; Horovod's own default is 1); "
        "a comma list runs every Horovod row once per value (a tuning sweep)",
    )
    g.add_argument(
        "--ps_servers", type=int, default=0, help="--dp.ps_servers for ps runs (default 0: colocated on rank 0)"
    )
    g.add_argument("--micro_batch", type=int, default=0, help="--train.micro_batch (0: the whole per-rank batch)")
    common.add_common(p, DEFAULTS)
    return p


def csv_floats(text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma list of positive numbers (e.g. 1,5,20)")
    return vals


def _choices(a) -> tuple[list[str], list[str], list[str]]:
    """The strategies, precisions and anchors asked for; an error naming any unknown one."""
    from foldtrain.config import PRECISIONS

    strategies = common.csv(a.strategies)
    bad = [s for s in strategies if s not in STRATEGIES]
    precisions = common.csv(a.precisions)
    bad += [p for p in precisions if p not in PRECISIONS]
    anchors = [ANCHOR_ALIASES.get(x, x) for x in common.csv(a.anchors) if x != "none"]
    bad += [x for x in anchors if x not in ANCHORS]
    if bad:
        raise FoldtrainError(
            f"bench dp: unknown value(s) {', '.join(bad)}; strategies: {', '.join(STRATEGIES)}; "
            f"precisions: {', '.join(PRECISIONS)}; anchors: {', '.join(ANCHORS)}"
        )
    return strategies, precisions, anchors


class _Jobs:
    """The jobs by network (loopback first), and how one run becomes a job there: one node of ``n``
    processes on loopback, ``n`` emulated nodes of one process elsewhere; a Horovod run once per
    ``--horovod_cycle_ms``."""

    def __init__(self, a, base: list[str], networks: list[str]):
        from foldtrain.bench.runner import Job

        self.Job, self.a, self.base = Job, a, base
        self.cycles = getattr(a, "horovod_cycle_ms", [HOROVOD_CYCLE_MS])
        self.by_network: dict[str, list] = {common.LOOPBACK: []}
        for net in networks:
            self.by_network.setdefault(net, [])

    def add(
        self,
        net: str,
        impl: str,
        variant: str,
        prec: str,
        n: int,
        script: list[str],
        extra: list[str],
        workers: int,
        horovod: bool = False,
    ) -> None:
        threads = common.threads_for(self.a, n)
        loop = net == common.LOOPBACK
        for c in self.cycles if horovod else [None]:
            info = {}
            env = {}
            if c is not None:
                env = {
                    "HOROVOD_CYCLE_TIME": f"{c:g}",
                    "HOROVOD_FUSION_THRESHOLD": str(int(DPConfig().fusion_mb * 2**20)),
                }
                if len(self.cycles) > 1:  # a sweep: rows told apart by the note, runs by their directory
                    info.update(note=f"cycle {c:g} ms", cycle_ms=f"{c:g}")
            res = RunResult("dp", impl, variant, prec, n, net, workers, info=info)
            launcher = horovodrun_command(n) if horovod and loop else None
            self.by_network[net].append(
                self.Job(
                    res,
                    script,
                    [*self.base, "--precision", prec, *extra],
                    nnodes=1 if loop else n,
                    nproc_per_node=n if loop else 1,
                    threads=threads,
                    launcher=launcher,
                    horovod=horovod,
                    env=env,
                )
            )


def _strategy_layout(a, s: str, n: int, notes: list[str]) -> tuple[list[str], int] | None:
    """Strategy ``s`` at ``n`` ranks: its extra arguments and data-parallel workers, or None (with a
    line in ``notes``) when it cannot run: no worker left by the servers, or a batch that does not split."""
    extra, workers = list(VARIANTS.get(s, ["--dp.strategy", s])), n
    if s == "ps" and a.ps_servers:
        if a.ps_servers >= n:
            notes.append(f"ps at {n} ranks skipped: --ps_servers {a.ps_servers} leaves no worker")
            return None
        extra += ["--dp.ps_servers", str(a.ps_servers)]
        workers = n - a.ps_servers
    if a.global_batch % workers:
        msg = f"{s} at {n} ranks skipped: global batch {a.global_batch} does not split over {workers} workers"
        if msg not in notes:
            notes.append(msg)
        return None
    return extra, workers


def plan(a, data_path: str, horovod_ok: bool = False, notes: list[str] | None = None) -> dict[str, list]:
    """The jobs of this invocation, grouped by network (loopback first). Pure: no processes.
    Combinations that cannot run are left out with a line in ``notes``."""
    notes = notes if notes is not None else []
    strategies, precisions, anchors = _choices(a)
    networks = common.csv(a.networks)
    base = common.train_args(a, data_path)
    if a.micro_batch:
        base += ["--train.micro_batch", str(a.micro_batch)]
    jobs = _Jobs(a, base, networks)
    if "horovod" in strategies and not horovod_ok:
        notes.append("horovod strategy skipped: Horovod is not installed (bash scripts/install-horovod.sh)")
    train, ddp_plain = ["-m", "foldtrain", "train"], ["-m", "foldtrain.bench.anchors.ddp_plain"]

    for prec in precisions:
        # the single-process reference (speed-up 1.0): always on loopback, network does not matter
        if "none" in strategies:
            jobs.add(common.LOOPBACK, "foldtrain", "none", prec, 1, train, ["--dp.strategy", "none"], 1)
        if "ddp_plain" in anchors and 1 in a.ranks:
            jobs.add(common.LOOPBACK, "ddp_plain", "", prec, 1, ddp_plain, [], 1)
    for net in networks:
        for prec in precisions:
            for n in a.ranks:
                if n == 1:
                    continue  # one process: no network; its runs are the loopback references above
                for s in strategies:
                    if s == "none" or (s == "horovod" and not horovod_ok):
                        continue
                    layout = _strategy_layout(a, s, n, notes)
                    if layout is None:
                        continue
                    jobs.add(net, "foldtrain", s, prec, n, train, *layout, horovod=s == "horovod")
                    if s == "ps" and a.ps_servers:
                        jobs.by_network[net][-1].result.info["ps_servers"] = a.ps_servers
                if "ddp_plain" in anchors and a.global_batch % n == 0:  # (the strategies' note covers n)
                    jobs.add(net, "ddp_plain", "", prec, n, ddp_plain, [], n)
                if "fsdp_plain" in anchors and a.global_batch % n == 0:
                    jobs.add(net, "fsdp_plain", "", prec, n, ["-m", "foldtrain.bench.anchors.fsdp_plain"], [], n)
                if "horovod_plain" in anchors and horovod_ok and a.global_batch % n == 0:
                    script = ["-m", "foldtrain.bench.anchors.horovod_plain"]
                    jobs.add(net, "horovod_plain", "", prec, n, script, [], n, horovod=True)
    return jobs.by_network


@common.signals_as_exceptions()
def main(argv: list[str]) -> int:
    a = common.parse_args(parser(), argv, QUICK)
    log = common.logger()
    notes: list[str] = []
    horovod_ok = False
    anchors = [ANCHOR_ALIASES.get(x, x) for x in common.csv(a.anchors)]
    if "horovod_plain" in anchors or "horovod" in common.csv(a.strategies):
        horovod_ok = common.optional_anchor("horovod", "horovod.torch", log, notes)
    if horovod_ok:
        cycle_ms = ", ".join(f"{c:g}" for c in a.horovod_cycle_ms)
        notes.append(
            f"horovod, horovod_plain: HOROVOD_CYCLE_TIME {cycle_ms} ms (--horovod_cycle_ms), "
            f"HOROVOD_FUSION_THRESHOLD {DPConfig().fusion_mb:g} MB; horovodrun on loopback, "
            "its gloo launch by hand (foldtrain.bench.horovod_launch) on the emulated network"
        )
    ws = common.Workspace(a.out, "dp")
    try:
        data_path = "" if a.dry_run else common.prepare_data(a)
        jobs = plan(a, data_path, horovod_ok, notes)
        if a.dry_run:
            common.print_dry_run(jobs, ws, print)
            return 0
        cores = os.cpu_count() or 1
        if max(a.ranks) > cores:
            notes.append(
                f"{max(a.ranks)} ranks share {cores} CPU cores here: runs above {cores} ranks are oversubscribed, so "
                "scaling efficiency is bounded by the cores, not the strategy; compare strategies at equal ranks"
            )
        max_nodes = {net: max([j.nnodes for j in js] or [1]) for net, js in jobs.items()}
        load_before = os.getloadavg()
        results = common.execute(jobs, a, ws, max_nodes, log)
        rows = dp_rows(results)
        ratios = dp_ratios(results) + dp_overlap(results)
        notes += common.run_notes(a, load_before)
        notes += [
            "medians over the steps after warm-up; tokens/s = global batch x seq_len / step time, the wall period "
            "from a step's start to the next's (what runs between steps included)",
            "speed-up: over foldtrain `none` (1 process) at the same precision; "
            "efficiency = speed-up / data-parallel workers",
            "MB/step/worker and server: the strategy's own byte counters logged by rank 0 "
            "(for ps rank 0 is the server), else (starred *) the emulated links' counters; "
            "wire MB/step: link bytes (sent + received, with TCP/IP overhead) of node 0 / "
            "mean of the other nodes, sampled over the measured steps",
        ]
        common.print_results("foldtrain bench dp", DP_HEADERS, rows, ratios, notes, results, a, ws)
        return 0
    finally:
        ws.close()
