"""Validate ``foldtrain simulate`` against runs on this machine; writes ``docs/simulator.md``.

    foldtrain bench simulator [--out DIR] [--steps N] [--repeat K]

One invocation: (1) calibrates this machine in the conditions of the runs (compute with 1, 2 and
4 concurrent processes, and how much of the cores' work is lost when 4 ranks share 2 cores; gloo
on loopback, gloo across two emulated nodes at 1 Gbit/s);
(2) runs ``foldtrain bench dp`` (ps, sharded-ps, allreduce, ddp at 2 and 4 ranks, loopback and
1 Gbit/s) and ``foldtrain bench pipeline`` (every schedule x dp_sync, the zero-bubble ones, fold and
fold-zb with and without deferral, 1f1b and fold with fsdp, two emulated nodes at 1 Gbit/s); (3) simulates
every run with the calibrated cluster;
(4) writes the comparison, and the measured and simulated Gantt charts of one fold run. Needs
root and iproute2 for the emulated network.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from foldtrain.calibrate import (
    FSDP_FIELDS,
    fit_head,
    links,
    measure_action_overhead,
    measure_compute,
    measure_fsdp_host,
    measure_loopback,
    measure_loss_buffers,
    measure_network,
    measure_oversubscription,
)
from foldtrain.config import build_config
from foldtrain.sim.cluster import Cluster
from foldtrain.sim.report import write_profile
from foldtrain.sim.simulate import simulate
from foldtrain.sim.validation import spearman

ROOT = Path(__file__).resolve().parents[2]  # the repository (docs/ lives there)
CMD = "foldtrain bench simulator"
PIPE_MODEL = [
    "--model.preset",
    "tiny",
    "--model.n_layer",
    "8",
    "--model.d_model",
    "256",
    "--train.global_batch",
    "8",
    "--train.seq_len",
    "32",
]
DP_MODEL = ["--model.preset", "tiny", "--train.global_batch", "16", "--train.seq_len", "128"]


def fsdp_fields(comp: dict) -> dict[str, float]:
    """The Cluster's FSDP2 host-work fields of a calibration: ``measure_fsdp_host``'s dict, or the
    ``(per unit, per gather)`` pair a calibration saved before the root's figure had its own."""
    host = comp.get("fsdp_host", {})
    return dict(zip(("fsdp_unit", "fsdp_gather"), host, strict=True)) if isinstance(host, list) else host


def cluster_of(
    comps: dict,
    ranks: int,
    cores: int,
    loop: dict,
    net: dict | None,
    per_node: int,
    name: str,
    busy: dict | None = None,
) -> Cluster:
    """This machine as a cluster for a run of ``ranks`` processes: compute as calibrated with as many
    concurrent processes as run at once with a core each (``min(ranks, cores)``), and the ``cores``
    shared by every rank (the simulator slows ranks down when more of them compute than there are cores).
    ``busy``: the loopback probe with the run's number of processes, when ``loop`` has fewer: its
    collective step (latency and CPU)."""
    # that concurrency, or the nearest calibrated
    comp = comps[min(comps, key=lambda k: abs(k - min(ranks, cores)))]
    busy = busy or loop
    # a collective's step with the run's processes
    intra, inter = links(loop, net, busy.get("collective_latency_s", 0.0))
    return Cluster(
        name=name,
        gpus_per_node=per_node,
        memory=1e12,
        tflops={d: comp[d][0] for d in ("fp32", "bf16", "fp16")},
        mem_bw=comp["mem_bw"],
        efficiency=1.0,
        half_size=comp["fp32"][1],
        layer_overhead=comp["block_overhead"],
        intra=intra,
        inter=inter,
        runtime=comp["runtime"],
        backward_ratio=comp.get("backward_ratio", 2.0),
        split_ratio=comp.get("split_ratio", 0.0),
        split_weight_share=comp.get("split_weight_share", 0.0),
        elem_bw=comp.get("elem_bw", 0.0),
        softmax_rate=comp.get("softmax_rate", 0.0),
        loss_buffers=comp.get("loss_buffers", 3.0),
        rows_half_size=comp.get("rows_half_size", 0.0),
        head_weight_rate=comp.get("head_weight_rate", 0.0),
        optim_rate=comp.get("optim_rate", 0.0),
        comm_cpu=(net or loop).get("cpu_per_byte", 0.0),
        action_overhead=overhead_at(comp.get("action_overhead", 0.0), ranks),
        **fsdp_fields(comp),
        shared_cores=float(cores),
        oversubscribed=comp.get("oversubscribed", 1.0),
        collective_cpu=busy.get("collective_cpu_s", 0.0),
    )


def least_disturbed(calibrations) -> dict:
    """Of several compute calibrations in the same conditions, the one whose blocks and heads ran fastest:
    on a shared machine a disturbance only ever slows a probe down, so a single probe per concurrency
    can be far off (one disturbed probe put the 1-rank run at 6,698 tokens/s against 8,309-8,527
    measured; an undisturbed one at 8,685)."""
    return min(calibrations, key=lambda c: sum(f + b for f, b in c["blocks"]) + sum(c["heads"]))


def overhead_at(measured: float | dict, ranks: int) -> float:
    """The executor's host work per action measured with the number of processes nearest ``ranks``
    (a number: a single measurement that holds for every process count)."""
    if not isinstance(measured, dict):
        return float(measured)
    return float(measured[min(measured, key=lambda k: abs(int(k) - ranks))])


def load_calibration(path: Path) -> tuple[dict, dict, dict, int, tuple]:
    """``calibration.json`` of an earlier invocation: compute and loopback by process count, the
    network, the cores and the load averages at the start and end of its runs."""
    saved = json.loads(path.read_text())
    comps = {int(k): v for k, v in saved["compute"].items()}
    for v in comps.values():  # the head's fit from its probe times, as the current code fits them
        if "heads" in v:
            v["softmax_rate"], v["head_weight_rate"] = fit_head(
                v["fp32"][0], v["fp32"][1], v["rows_half_size"], v["heads"]
            )
    loop = {int(k): v for k, v in saved["loopback"].items()}
    load = tuple(saved.get("load", (float("nan"), float("nan"))))
    return comps, loop, saved["net"], int(saved.get("cores", os.cpu_count() or 1)), load


def bench(kind: str, args: list[str], out: Path) -> list[dict]:
    if out.exists():
        shutil.rmtree(out)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    p = subprocess.run(
        [sys.executable, "-m", "foldtrain", "bench", kind, *args, "--out", str(out)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if p.returncode != 0:
        raise SystemExit(f"bench {kind} failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    return json.loads((out / "results.json").read_text()) if (out / "results.json").is_file() else []


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="/tmp/ft-simval")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run every configuration K times, in rounds, and compare the median (a noisy machine: 2 or more)",
    )
    ap.add_argument("--docs", default=str(ROOT / "docs"))
    ap.add_argument(
        "--reuse",
        action="store_true",
        help="do not calibrate or run: simulate again the calibration and runs an earlier invocation left in --out",
    )
    return ap.parse_args(argv)


def calibrate(cores: int) -> tuple[dict, dict, dict]:
    """Compute by concurrency (1, 2, 4 processes), loopback by process count (2, 4) and the 1 Gbit/s
    network between two emulated nodes, measured in the conditions of the runs."""
    comp = {n: least_disturbed(measure_compute(n) for _ in range(2)) for n in (1, 2, 4)}
    loss_buffers = measure_loss_buffers()  # a property of the allocator, not of the concurrency
    over = measure_oversubscription(4, cores)[0]  # the 4-rank runs on this machine's cores
    for v in comp.values():
        v["loss_buffers"], v["oversubscribed"] = loss_buffers, over
    loop = {n: measure_loopback(n) for n in (2, 4)}
    # the executor's host work per action, with as many processes as the runs have: 2, and 4 (the pipeline rows)
    overhead = {
        str(n): measure_action_overhead(
            cluster_of(comp, n, cores, loop[n], None, n, f"this machine, {n} ranks"), dp=n // 2
        )[0]
        for n in (2, 4)
    }
    fsdp_host = measure_fsdp_host(min(cores, 4))  # FSDP2's hooks and copies, core-seconds
    for v in comp.values():
        v["action_overhead"], v["fsdp_host"] = overhead, fsdp_host
    net = measure_network("1gbit", 2)
    return comp, loop, net


def run_benches(a: argparse.Namespace, out: Path) -> tuple[list[dict], list[dict]]:
    """The dp runs and the pipeline runs (those with deferred reduction marked ``defer``)."""
    steps = ["--steps", str(a.steps), "--warmup", "3", "--repeat", str(a.repeat)]
    print("bench dp ...", flush=True)
    dp_args = [
        "--strategies",
        "none,ps,sharded-ps,allreduce,ddp",
        "--precisions",
        "fp32",
        "--ranks",
        "1,2,4",
        "--networks",
        "loopback,1gbit",
        "--anchors",
        "none",
        *steps,
    ]
    dp_runs = bench("dp", dp_args, out / "dp")
    print("bench pipeline ...", flush=True)
    pp_args = [
        "--schedules",
        "gpipe,1f1b,interleaved-1f1b,interleaved-1f1b:per-chunk,fold:after-flush,fold,zb-h1,zbv,interleaved-zb,fold-zb,"
        "1f1b+fsdp,fold+fsdp",
        "--anchors",
        "none",
        "--networks",
        "1gbit",
        *steps,
    ]
    pp_runs = bench("pipeline", pp_args, out / "pp")
    defer_args = [
        "--schedules",
        "fold,fold-zb",
        "--anchors",
        "none",
        "--networks",
        "1gbit",
        "--set",
        "fold.defer_reduce=true",
        "--set",
        "optim.grad_clip=0",
        *steps,
    ]
    pp_runs += [dict(r, defer=True) for r in bench("pipeline", defer_args, out / "ppdefer")]
    return dp_runs, pp_runs


def calibrate_and_run(a: argparse.Namespace, out: Path, load0: tuple) -> tuple:
    """Calibrate, run the benchmarks and save the calibration for ``--reuse``:
    ``(comp, loop, net, cores, load, dp_runs, pp_runs)``, ``load`` the load averages at the start and end."""
    print("calibrating ...", flush=True)
    t0 = time.time()
    cores = os.cpu_count() or 1
    comp, loop, net = calibrate(cores)
    dp_runs, pp_runs = run_benches(a, out)
    saved = {
        "compute": {str(k): v for k, v in comp.items()},
        "loopback": loop,
        "net": net,
        "cores": cores,
        "load": [load0[0], os.getloadavg()[0]],
        # what --reuse writes at the page's head: the invocation that measured the runs, not its own
        "repeat": a.repeat,
        "minutes": max(1, round((time.time() - t0) / 60)),
    }
    (out / "calibration.json").write_text(json.dumps(saved, default=str))
    load = (load0[0], os.getloadavg()[0])
    return comp, loop, net, cores, load, dp_runs, pp_runs


def reuse_runs(out: Path) -> tuple:
    """What :func:`calibrate_and_run` returns, read back from an earlier invocation's ``out``."""
    comp, loop, net, cores, load = load_calibration(out / "calibration.json")

    def read(d: str) -> list[dict]:
        return json.loads((out / d / "results.json").read_text())

    dp_runs, pp_runs = read("dp"), read("pp") + [dict(r, defer=True) for r in read("ppdefer")]
    return comp, loop, net, cores, load, dp_runs, pp_runs


def dp_setup(r: dict, comp: dict, loop: dict, net: dict, cores: int) -> tuple[list[str], Cluster, str]:
    """The configuration arguments, the cluster and the table label of one ``bench dp`` run."""
    n = r["ranks"]
    args = DP_MODEL + (
        ["--dp.strategy", r["variant"], "--parallel.dp", str(r["workers"])] if r["variant"] != "none" else []
    )
    c = cluster_of(
        comp,
        n,
        cores,
        loop[max(n, 2)],
        net if r["network"] != "loopback" else None,
        n if r["network"] == "loopback" else 1,
        f"this machine, {n} ranks, {r['network']}",
    )
    return args, c, f"dp {r['variant']} x{n} {r['network']}"


def pipeline_setup(r: dict, comp: dict, loop: dict, net: dict, cores: int) -> tuple[list[str], Cluster, str]:
    """The configuration arguments, the cluster and the table label of one ``bench pipeline`` run
    (2 nodes x 2 ranks)."""
    v, sync = r["info"]["virtual"], r["info"]["dp_sync"]
    args = PIPE_MODEL + [
        "--parallel.dp",
        "2",
        "--parallel.pp",
        "2",
        "--parallel.microbatches",
        "4",
        "--parallel.virtual",
        str(v),
        "--parallel.schedule",
        r["variant"],
        "--parallel.dp_sync",
        sync,
    ]
    if r.get("defer"):
        args += ["--fold.defer_reduce", "--optim.grad_clip", "0"]
    if r["info"].get("fsdp"):
        args += ["--dp.strategy", "fsdp"]
    # 4 processes on the machine
    c = cluster_of(comp, 4, cores, loop[2], net, 2, "this machine, 2 nodes x 2 ranks, 1gbit", busy=loop[4])
    label = f"pp {r['variant']} V{v} {sync}" + (" defer" if r.get("defer") else "")
    return args, c, label + (" fsdp" if r["info"].get("fsdp") else "")


def simulate_runs(runs: list[dict], comp: dict, loop: dict, net: dict, cores: int) -> tuple[list[tuple], tuple | None]:
    """Every run simulated with the calibrated cluster: ``(run, simulation or None if the run failed, label)``
    rows, and the (run, simulation) of the fold per-chunk run without deferral whose charts the page shows."""
    rows = []
    gantt_pair = None
    for r in runs:
        if r.get("error") or "tokens_per_s" not in r.get("metrics", {}):
            rows.append((r, None, None))
            continue
        setup = dp_setup if r["bench"] == "dp" else pipeline_setup
        args, c, label = setup(r, comp, loop, net, cores)
        sim = simulate(build_config(args), c, keep_events=True)
        rows.append((r, sim, label))
        fold_per_chunk = r["bench"] == "pipeline" and r["variant"] == "fold" and r["info"]["dp_sync"] == "per-chunk"
        if fold_per_chunk and not r.get("defer"):
            gantt_pair = (r, sim)
    return rows, gantt_pair


def copy_gantts(gantt_pair: tuple, img: Path, out: Path) -> None:
    """The measured and the simulated Gantt chart of one run into the docs' images."""
    r, s = gantt_pair
    # tokens/s come from the unprofiled run; the chart from its profiled twin
    g = Path(r.get("info", {}).get("profiled_out", r["out_dir"])) / "gantt.png"
    if g.is_file():
        shutil.copy(g, img / "simval_measured_fold.png")
    tmp = out / "simprof"
    write_profile(s, tmp)
    shutil.copy(tmp / "gantt.png", img / "simval_simulated_fold.png")


def intro_lines(repeats: int, cores: int, load: tuple, minutes: int) -> list[str]:
    """The page's head: the command that measured its runs (``repeats``, ``minutes``) and the conditions."""
    repeat = f" --repeat {repeats}" if repeats > 1 else ""
    return [
        "# Simulator validation: predicted against measured on this machine",
        "",
        f"Regenerate with `{CMD}{repeat}` (needs root and iproute2; about {minutes} minutes). "
        "It calibrates this machine (`foldtrain.calibrate`: compute with 1, 2 and 4 concurrent processes "
        "and the cores' efficiency with 4 ranks on them, gloo on loopback "
        "and across two emulated nodes at 1 Gbit/s), runs `foldtrain bench dp` and `foldtrain bench pipeline`, and "
        "simulates every run with the calibrated numbers.",
        "",
        f"Conditions: {cores} CPU cores (load average {load[0]:.1f} at the start, "
        f"{load[1]:.1f} at the end of the runs); "
        "calibration and runs were made in the same invocation, minutes apart, "
        "so both see similar contention, but contention changes from run to run. The machine's own speed changes "
        "too, by up to twice in minutes on a shared VM ([benchmarks](benchmarks.md#pipeline-schedules-and-fold)): "
        "compare a prediction only with runs of the calibration's minutes.",
        "",
    ]


def comparison_table(rows: list[tuple]) -> list[str]:
    """One row per run: measured and predicted tokens/s and rank 0's peak memory, with the errors."""
    L = [
        "| configuration | measured tokens/s | predicted tokens/s | error "
        "| measured peak MB (rank 0) | predicted (rank 0) | error |",
        "|---|---|---|---|---|---|---|",
    ]
    for r, s, lab in rows:
        if s is None:
            L.append(
                f"| {r['bench']} {r['variant']} x{r['ranks']} {r['network']} "
                f"| failed: {r.get('error', '')[:80]} | | | | | |"
            )
            continue
        m = r["metrics"]
        mm = m.get("peak_mem_mb", float("nan"))
        speed_err = s.tokens_per_s / m["tokens_per_s"] - 1
        mem_err = s.memory[0]["total"] / (mm * 2**20) - 1
        L.append(
            f"| {lab} | {m['tokens_per_s']:,.0f} | {s.tokens_per_s:,.0f} | {speed_err:+.1%} | "
            f"{mm:.0f} | {s.memory[0]['total'] / 2**20:.0f} | {mem_err:+.1%} |"
        )
    return L


def summary_table(rows: list[tuple]) -> list[str]:
    """The errors over every run that simulated, against the targets; nothing when none did."""
    good = [(r, s) for r, s, _ in rows if s is not None]
    meas = [r["metrics"]["tokens_per_s"] for r, _ in good]
    pred = [s.tokens_per_s for _, s in good]
    errs = [p / m - 1 for p, m in zip(pred, meas)]
    if not errs:
        return []
    # the runs log rank 0's peak resident size: compare with rank 0's prediction
    mem_errs = [
        s.memory[0]["total"] / (r["metrics"]["peak_mem_mb"] * 2**20) - 1
        for r, s in good
        if r["metrics"].get("peak_mem_mb")
    ]
    return [
        "",
        "| metric | value | target |",
        "|---|---|---|",
        f"| configurations | {len(errs)} | >= 12 |",
        f"| median absolute error, tokens/s | {statistics.median(abs(e) for e in errs):.1%} | <= 10% |",
        f"| max absolute error | {max(abs(e) for e in errs):.1%} | <= 20% |",
        f"| Spearman rank correlation | {spearman(meas, pred):.2f} | >= 0.9 |",
        f"| peak memory, median / max absolute error | {statistics.median(abs(e) for e in mem_errs):.1%} / "
        f"{max(abs(e) for e in mem_errs):.1%} | within 15% |"
        if mem_errs
        else "| peak memory | not logged | |",
    ]


def _per(values: dict, unit: str, fmt) -> str:
    """``{count: value}`` as "v (count units), ..." in count order; empty when nothing was measured."""
    one = {"processes": "process", "ranks": "rank"}.get(unit, unit)
    items = sorted(values.items(), key=lambda kv: int(kv[0]))
    return ", ".join(f"{fmt(v)} ({k} {one if int(k) == 1 else unit})" for k, v in items)


def _ms(x: float) -> str:
    return f"{x * 1e3:.2f} ms"


def _link_rows(loop: dict, net: dict) -> list[tuple[str, str, str]]:
    """The calibration table's rows of gloo on loopback (by process count) and across the emulated nodes."""

    def loop_of(key: str, fmt) -> str:
        return _per({n: v[key] for n, v in loop.items() if key in v}, "ranks", fmt)

    return [
        (
            "one step of a collective, every rank communicating (loopback)",
            "intra.collective_latency_us",
            loop_of("collective_latency_s", _ms),
        ),
        (
            "the same across two emulated nodes at 1 Gbit/s",
            "inter.collective_latency_us",
            _ms(net["collective_latency_s"]) if "collective_latency_s" in net else "",
        ),
        (
            "CPU a collective's step takes from each rank (loopback)",
            "node.collective_cpu_us",
            loop_of("collective_cpu_s", _ms),
        ),
        *_bandwidth_rows("gloo all-reduce bandwidth (loopback)", "bw_gbs", "allreduce_bw", loop_of, net),
        *_bandwidth_rows(
            "gloo send/recv bandwidth, 16 MB (loopback; the parameter server's transfers)",
            "p2p_gbs",
            "p2p_bw",
            loop_of,
            net,
        ),
    ]


def _bandwidth_rows(what: str, key: str, probe: str, loop_of, net: dict) -> list[tuple[str, str, str]]:
    """A gloo bandwidth on loopback (by process count, through ``loop_of``) and across the two emulated nodes."""
    across = f"{net[probe] / 1e9:.3f} GB/s" if probe in net else ""
    return [
        (what, f"intra.{key}", loop_of(probe, lambda x: f"{x / 1e9:.2f} GB/s")),
        ("the same across two emulated nodes at 1 Gbit/s", f"inter.{key}", across),
    ]


def calibration_table(comp: dict, loop: dict, net: dict) -> list[str]:
    """The calibrated figures the predictions rest on, with the cluster-file key each becomes; a figure
    an older calibration lacks is left out."""
    c = comp[min(comp)]  # the allocator's, the oversubscription's and the executor's figures are in every entry
    over = c.get("action_overhead", {})
    fsdp = fsdp_fields(c)

    rows = [
        (
            "the executor's host work per action",
            "device.action_overhead_us",
            _per(over, "processes", _ms) if isinstance(over, dict) else _ms(over),
        ),
        (
            "FSDP2's host work per block's unit and pass; per pass in the root unit; per unit gathered and resharded",
            "device.fsdp_unit_us, device.fsdp_root_us, device.fsdp_gather_us",
            "; ".join(_ms(fsdp[k]) if k in fsdp else "—" for k in FSDP_FIELDS) if fsdp else "",
        ),
        (
            "fp32 matrix-product peak per process",
            "device.fp32_tflops",
            _per({n: v["fp32"][0] for n, v in comp.items()}, "processes", lambda x: f"{x / 1e9:.0f} GFLOP/s"),
        ),
        (
            "a block's backward / forward time",
            "device.backward_ratio",
            f"{c['backward_ratio']:.2f}" if "backward_ratio" in c else "",
        ),
        (
            "a block's backward split into I and W / the whole one; W's share of it",
            "device.split_ratio, device.split_weight_share",
            f"{c['split_ratio']:.2f}; {c['split_weight_share']:.2f}" if "split_ratio" in c else "",
        ),
        (
            "(b, L, V) fp32 tensors the resident peak holds at the loss",
            "device.loss_buffers",
            f"{c['loss_buffers']:.1f}" if "loss_buffers" in c else "",
        ),
        (
            "the cores' work left with twice as many ranks as cores",
            "node.oversubscribed_efficiency",
            f"{c['oversubscribed']:.2f}" if "oversubscribed" in c else "",
        ),
    ]
    rows += _link_rows(loop, net)
    return [
        "",
        "## The calibration behind these predictions",
        "",
        "| measured by the calibration | cluster-file key | value |",
        "|---|---|---|",
        *(f"| {what} | `{key}` | {value} |" for what, key, value in rows if value),
    ]


GANTT_SECTION = [
    "",
    "## One fold run, measured and simulated (fold, V=2, per-chunk, 2 nodes x 2 ranks, 1 Gbit/s)",
    "",
    "Measured (`gantt.png` of the `--profile` run):",
    "",
    "![measured](img/simval_measured_fold.png)",
    "",
    "Simulated (`foldtrain simulate ... --profile DIR` with the calibrated cluster):",
    "",
    "![simulated](img/simval_simulated_fold.png)",
    "",
]


def write_page(path: Path, lines: list[str]) -> None:
    """``lines`` as the page, keeping what follows the ``<!-- model -->`` marker of the page there."""
    marker = "<!-- model -->"
    body = "\n".join(lines) + "\n"
    if path.is_file() and marker in path.read_text():
        body += "\n" + path.read_text()[path.read_text().index(marker) :]
    path.write_text(body)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    out, docs = Path(a.out), Path(a.docs)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    repeats, minutes = a.repeat, 0
    if a.reuse:
        comp, loop, net, cores, load, dp_runs, pp_runs = reuse_runs(out)
        saved = json.loads((out / "calibration.json").read_text())
        repeats, minutes = saved.get("repeat", a.repeat), saved.get("minutes", 0)
    else:
        comp, loop, net, cores, load, dp_runs, pp_runs = calibrate_and_run(a, out, os.getloadavg())
    rows, gantt_pair = simulate_runs(dp_runs + pp_runs, comp, loop, net, cores)
    img = docs / "img"
    img.mkdir(parents=True, exist_ok=True)
    if gantt_pair:
        copy_gantts(gantt_pair, img, out)
    minutes = minutes or max(1, round((time.time() - t0) / 60))
    lines = intro_lines(repeats, cores, load, minutes) + comparison_table(rows) + summary_table(rows)
    lines += calibration_table(comp, loop, net)
    if gantt_pair:
        lines += GANTT_SECTION
    path = docs / "simulator.md"
    write_page(path, lines)
    print(f"wrote {path} in {time.time() - t0:.0f} s")
    return 0
