"""What both benchmarks share: options, the common training arguments, data, anchors' availability,
running a list of jobs (loopback and emulated networks) and printing the results."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from foldtrain.errors import FoldtrainError

LOOPBACK = "loopback"


def logger():
    """Progress lines to stderr (the tables go to stdout)."""

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    return log


@contextlib.contextmanager
def signals_as_exceptions():
    """SIGTERM / SIGHUP raise SystemExit while the benchmark runs, so every ``finally`` (stopping the
    runs' process trees, tearing the emulated network down, removing the workspace) still runs.
    A context manager, or a decorator of the benchmark's ``main``."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    old = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        try:
            old[sig] = signal.signal(sig, handler)
        except (ValueError, OSError):
            pass
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h if h is not None else signal.SIG_DFL)


def csv(s: str) -> list[str]:
    return [x.strip() for x in str(s).split(",") if x.strip()]


def csv_ints(s: str) -> list[int]:
    try:
        out = [int(x) for x in csv(s)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got '{s}'") from None
    if not out or any(x < 1 for x in out):
        raise argparse.ArgumentTypeError(f"expected positive integers, got '{s}'")
    return out


def add_common(p: argparse.ArgumentParser, defaults: dict) -> None:
    g = p.add_argument_group("model, batch and run length (the same for every run)")
    g.add_argument("--preset", default=defaults["preset"], help="model preset (default %(default)s)")
    g.add_argument(
        "--n_layer", type=int, default=defaults.get("n_layer", 0), help="override the preset's layers (0: preset)"
    )
    g.add_argument(
        "--d_model", type=int, default=defaults.get("d_model", 0), help="override the preset's width (0: preset)"
    )
    g.add_argument(
        "--n_head", type=int, default=defaults.get("n_head", 0), help="override the preset's heads (0: preset)"
    )
    g.add_argument(
        "--global_batch",
        type=int,
        default=defaults["global_batch"],
        help="sequences per step over all workers (default %(default)s)",
    )
    g.add_argument("--seq_len", type=int, default=defaults["seq_len"], help="tokens per sequence (default %(default)s)")
    g.add_argument("--steps", type=int, default=defaults["steps"], help="steps per run (default %(default)s)")
    g.add_argument(
        "--warmup",
        type=int,
        default=defaults["warmup"],
        help="first steps left out of the medians (default %(default)s)",
    )
    g.add_argument("--data", default="", help="prepared data directory or raw text (default: the built-in corpus)")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="--train.device of every run")
    g.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra `foldtrain train` option for every run (and anchor), e.g. --set optim.lr=1e-3; repeatable",
    )
    g = p.add_argument_group("execution")
    g.add_argument(
        "--networks",
        "--network",
        default=defaults["networks"],
        help=f"comma list: {LOOPBACK} and/or tc rates of the emulated network, e.g. 1gbit,100mbit "
        "(default %(default)s)",
    )
    g.add_argument(
        "--delay_ms", type=float, default=0.0, help="one-way latency added between emulated nodes (needs sch_netem)"
    )
    g.add_argument(
        "--netns_prefix",
        default="ftb",
        help="name prefix of the emulated network's namespaces/links (default %(default)s)",
    )
    g.add_argument(
        "--threads",
        type=int,
        default=0,
        help="OMP_NUM_THREADS per process (default: CPU cores / processes, at least 1)",
    )
    g.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run everything this many times, in rounds; report the median "
        "over repetitions of each run's medians (default %(default)s)",
    )
    g.add_argument(
        "--timeout",
        type=float,
        default=defaults.get("timeout", 900.0),
        help="seconds before a run is stopped (default %(default)s)",
    )
    g.add_argument(
        "--out",
        default="",
        help="keep every run (metrics, logs) and results.json here (default: a temporary directory)",
    )
    g.add_argument("--report", default="", help="also write the table and ratios as Markdown to this file")
    g.add_argument("--quick", action="store_true", help="a tiny smoke configuration (overrides sizes, steps, ranks)")
    g.add_argument("--dry_run", action="store_true", help="print the runs and their command lines; run nothing")


def apply_defaults(a, parser: argparse.ArgumentParser, values: dict) -> None:
    """Set ``values`` on the parsed options that still hold the parser's default."""
    for k, v in values.items():
        if getattr(a, k) == parser.get_default(k):
            setattr(a, k, v)


def parse_args(parser: argparse.ArgumentParser, argv: list[str], quick: dict) -> argparse.Namespace:
    """``argv``'s options; with --quick, ``quick``'s value for every option the command line left at its default."""
    a = parser.parse_args(argv)
    if a.quick:
        apply_defaults(a, parser, quick)
    return a


def model_args(a) -> list[str]:
    out = ["--model.preset", a.preset]
    for k in ("n_layer", "d_model", "n_head"):
        if getattr(a, k):
            out += [f"--model.{k}", str(getattr(a, k))]
    return out


def train_args(a, data_path: str) -> list[str]:
    """The options every run gets: model, batch, length, no checkpoints / samples / progress bar."""
    args = [
        *model_args(a),
        "--train.global_batch",
        str(a.global_batch),
        "--train.seq_len",
        str(a.seq_len),
        "--train.steps",
        str(a.steps),
        "--train.log_every",
        "1",
        "--train.eval_every",
        "0",
        "--train.eval_batches",
        "1",
        "--train.sample_tokens",
        "0",
        "--train.progress",
        "false",
        "--train.device",
        a.device,
        "--checkpoint.every",
        "0",
        "--checkpoint.keep",
        "1",
        "--checkpoint.safetensors",
        "false",
    ]
    if data_path:
        args += ["--data.path", data_path]
    for kv in a.set:
        if "=" not in kv:
            raise FoldtrainError(f"--set expects KEY=VALUE, got '{kv}'; write e.g. --set optim.lr=1e-3")
        k, v = kv.split("=", 1)
        args += [f"--{k.lstrip('-')}", v]
    return args


def prepare_data(a) -> str:
    """Prepare (or find in the cache) the data once, before any run, and return its directory."""
    from foldtrain.config import build_config
    from foldtrain.data import resolve_data

    cfg = build_config(
        [
            *model_args(a),
            *(["--data.path", a.data] if a.data else []),
            *[x for kv in a.set if kv.startswith("data.") for x in (f"--{kv.split('=', 1)[0]}", kv.split("=", 1)[1])],
        ]
    )
    return str(resolve_data(cfg.data))


def threads_for(a, processes_on_machine: int) -> int:
    return a.threads or max(1, (os.cpu_count() or 1) // max(1, processes_on_machine))


def module_available(name: str, timeout_s: float = 120.0) -> tuple[bool, str]:
    """Whether ``import name`` works in a fresh interpreter (some import hard-crash or hang)."""
    try:
        p = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False, "import timed out"
    if p.returncode == 0:
        return True, ""
    lines = [line for line in (p.stderr or "").splitlines() if line.strip()]
    return False, lines[-1] if lines else f"exit {p.returncode}"


def load_note(before: tuple[float, float, float]) -> str:
    """The machine's load while the benchmark ran: other work on the same cores makes step times noisy."""
    after = os.getloadavg()
    return (
        f"load average (1 min) {before[0]:.1f} at start, {after[0]:.1f} at the end, on {os.cpu_count()} CPU cores; "
        "other work on the cores skews step times (use --repeat on a busy machine)"
    )


def optional_anchor(name: str, module: str, log, notes: list[str]) -> bool:
    """Whether the ``name`` anchor can run (``import module`` works); if not, say it is skipped."""
    ok, why = module_available(module)
    if not ok:
        log(f"{name}: not installed, skipped" + (f" ({why})" if why and "No module named" not in why else ""))
        notes.append(f"{name}: not installed, skipped")
    return ok


def run_notes(a, load_before: tuple[float, float, float]) -> list[str]:
    """The notes every benchmark's results get: the machine's load, --quick, --repeat."""
    notes = [load_note(load_before)]
    if a.quick:
        notes.append("--quick is a smoke test (tiny model, a few measured steps): its numbers are not a measurement")
    if a.repeat > 1:
        notes.append(f"every run was repeated {a.repeat} times in rounds; each row is the median over the repetitions")
    return notes


def cuda_devices(device: str) -> int:
    """GPUs the runs may use (0 with --device cpu or without CUDA), to spread emulated nodes over them."""
    if device == "cpu":
        return 0
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


class Workspace:
    """Where runs go: ``--out`` (kept), else a temporary directory removed at the end."""

    def __init__(self, out: str, name: str):
        self.keep = bool(out)
        self.root = Path(out) if out else Path(tempfile.mkdtemp(prefix=f"foldtrain-bench-{name}-"))
        self.root.mkdir(parents=True, exist_ok=True)
        self.runs = self.root / "runs"
        if self.runs.exists() and any(self.runs.iterdir()):
            stamp = time.strftime("%Y%m%d-%H%M%S")
            self.runs = self.root / f"runs-{stamp}"
        self.runs.mkdir(parents=True, exist_ok=True)

    def run_dir(self, name: str) -> Path:
        return self.runs / name

    def close(self) -> None:
        if not self.keep:
            shutil.rmtree(self.root, ignore_errors=True)


def slug(*parts) -> str:
    return "_".join(str(p).replace("/", "-").replace(":", "-").replace(" ", "") for p in parts if str(p) != "")


def run_name(r) -> str:
    cycle = f"cycle{r.info['cycle_ms']}ms" if r.info.get("cycle_ms") else ""  # a Horovod cycle-time sweep
    return slug(
        r.bench,
        r.impl,
        r.variant,
        r.info.get("virtual", ""),
        r.info.get("dp_sync", ""),
        r.info.get("tag", ""),
        r.precision,
        f"{r.ranks}r",
        r.network,
        cycle,
    )


def _at_rate(one, job, rep: int, cluster, net: str):
    """``one(job, rep, cluster)`` on links changed in place to the job's ``link_rate`` (a ``--bound`` run), and
    back to ``net``'s rate after it."""
    rate = job.result.info.get("link_rate")
    if not rate:
        return one(job, rep, cluster)
    cluster.set_rate(rate)
    try:
        return one(job, rep, cluster)
    finally:
        cluster.set_rate(net)


def execute(jobs_by_network: dict[str, list], a, ws: Workspace, max_nodes: dict[str, int], log) -> list:
    """Run every job (``--repeat`` times, in rounds so slow phases of a shared machine hit every
    run alike): loopback ones directly, the others inside one emulated cluster per network.
    Repetitions of a run are merged (:func:`~foldtrain.bench.results.merge_repeats`).

    A network that cannot be emulated (no root / iproute2) is reported once and its jobs are
    skipped; the runs of other networks go on."""
    from foldtrain.bench.results import merge_repeats
    from foldtrain.bench.runner import run_job
    from foldtrain.netem.cluster import EmulatedCluster, check_prerequisites

    if any(net != LOOPBACK and jobs for net, jobs in jobs_by_network.items()):
        try:
            check_prerequisites()
        except FoldtrainError as e:  # no emulated network here: say so once, run the loopback part
            log(f"foldtrain bench: {e}")
            jobs_by_network = {net: jobs for net, jobs in jobs_by_network.items() if net == LOOPBACK}
    repeat = max(1, getattr(a, "repeat", 1))
    results: dict[int, list] = {}
    gpus = cuda_devices(a.device)
    total = sum(len(v) for v in jobs_by_network.values()) * repeat
    done = 0

    def one(job, rep: int, cluster=None):
        nonlocal done
        done += 1
        job = dataclasses.replace(job, result=dataclasses.replace(job.result, info=dict(job.result.info)))
        name = run_name(job.result) + (f"_rep{rep + 1}" if repeat > 1 else "")
        log(f"[{done}/{total}] {job.describe()}" + (f" (repetition {rep + 1}/{repeat})" if repeat > 1 else "") + " ...")
        res = run_job(job, ws.run_dir(name), a.warmup, a.steps, a.timeout, cluster=cluster, log=log, gpus=gpus)
        if res.ok:
            tok = res.metrics.get("tokens_per_s")
            step_ms = 1e3 * res.metrics.get("step_time_s", 0)
            log(
                f"        {tok:,.0f} tokens/s, {step_ms:.1f} ms/step ({res.info['wall_s']} s)"
                if tok
                else f"        done ({res.info['wall_s']} s)"
            )
        else:
            log(f"        FAILED: {res.error}")
        return res

    for net, jobs in jobs_by_network.items():
        if not jobs:
            continue
        if net == LOOPBACK:
            for rep in range(repeat):
                for job in jobs:
                    results.setdefault(id(job), []).append(one(job, rep))
            continue
        try:
            with EmulatedCluster(max_nodes[net], net, a.delay_ms, a.netns_prefix) as cluster:
                bps = cluster.measure_throughput(0, 1) if cluster.n_nodes > 1 else None
                if bps is not None:
                    log(
                        f"emulated network {net}: {cluster.n_nodes} nodes, measured {bps / 1e6:.1f} MB/s node0->node1 "
                        f"(shaped to {cluster.rate_bits / 8e6:.1f} MB/s)"
                    )
                    if bps < 0.5 * cluster.rate_bits / 8:
                        log(
                            f"warning: the {net} links deliver under half their rate to one Python stream; "
                            "the machine may be too busy for this rate to be the bottleneck"
                        )
                for rep in range(repeat):
                    for job in jobs:
                        results.setdefault(id(job), []).append(_at_rate(one, job, rep, cluster, net))
        except FoldtrainError as e:  # this network could not be built or checked: say so, keep the other results
            log(f"foldtrain bench: {e}; skipping the {net} runs")
    order = [job for jobs in jobs_by_network.values() for job in jobs]
    return [merge_repeats(results[id(j)]) for j in order if id(j) in results]


def print_dry_run(jobs_by_network: dict[str, list], ws: Workspace, log=print) -> None:
    for net, jobs in jobs_by_network.items():
        for job in jobs:
            r = job.result
            out = ws.run_dir(run_name(r))
            env = " ".join(f"{k}={v}" for k, v in {"OMP_NUM_THREADS": job.threads, **job.env}.items())
            if net == LOOPBACK:
                cmd = job.command(out)
                log(f"{job.describe()}:\n  {env} {' '.join(cmd)}")
            elif getattr(job, "horovod", False):
                log(
                    f"{job.describe()}: {job.nnodes} node(s) x {job.nproc_per_node} process(es) "
                    f"on the emulated {net} network, "
                    f"Horovod's rendezvous server in node 0:\n  per process: ip netns exec <prefix>-n<k> env "
                    f"GLOO_SOCKET_IFNAME=<prefix>-v<k> HOROVOD_RANK=r HOROVOD_SIZE={job.nnodes * job.nproc_per_node} "
                    f"... {env} {sys.executable} {' '.join([*job.script, *job.args])} --out {out}"
                )
            else:
                rate = job.result.info.get("link_rate")
                log(
                    f"{job.describe()}: {job.nnodes} node(s) x {job.nproc_per_node} process(es) "
                    f"on the emulated {net} network"
                    + (f", its links changed in place to {rate}" if rate else "")
                    + ":\n"
                    f"  per node k: ip netns exec <prefix>-n<k> env GLOO_SOCKET_IFNAME=<prefix>-v<k> {env} "
                    f"{sys.executable} -m torch.distributed.run --nnodes {job.nnodes} --node_rank k "
                    f"--nproc_per_node {job.nproc_per_node} "
                    f"--master_addr 198.18.0.1 --master_port PORT {' '.join([*job.script, *job.args])} --out {out}"
                )


def print_results(
    title: str,
    headers,
    rows,
    ratios,
    notes: list[str],
    results: list,
    a,
    ws: Workspace,
    kept: str = "runs and results.json",
    without_out: str = "",
) -> None:
    """The table, the ratios and the notes on stdout; results.json in ``--out`` (saying that ``kept``
    is there, or printing ``without_out`` when there is no ``--out``); the Markdown ``--report``."""
    from foldtrain.bench.results import save_results
    from foldtrain.bench.tables import report_markdown, text_table

    print()
    print(text_table(headers, rows))
    print()
    print("Ratios (same invocation):")
    for r in ratios:
        print("  " + r.line())
    if not ratios:
        print("  (none computable from these runs)")
    for n in notes:
        print("note: " + n)
    if a.out:
        save_results(results, ws.root / "results.json")
        print(f"{kept} in {ws.root}")
    elif without_out:
        print(without_out)
    if a.report:
        Path(a.report).write_text(report_markdown(title, headers, rows, ratios, notes))
        print(f"wrote {a.report}")


def gather_from_workers(bench: str, ranks: int, args: list[str]):
    """Launch ``foldtrain bench BENCH --worker OUT ARGS`` under torchrun on ``ranks`` CPU processes (one thread
    each) and return what its rank 0 wrote to ``OUT/bytes.json``; a failed launch exits with its output's
    tail."""
    import json

    out = Path(tempfile.mkdtemp(prefix=f"ft-{bench}-"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    cmd += ["-m", "foldtrain", "bench", bench, "--worker", str(out), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    written = (out / "bytes.json").is_file()  # rank 0 writes it once every rank's figures are gathered
    if r.returncode != 0 and not written:
        raise SystemExit(f"foldtrain bench {bench}: the run failed:\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
    if r.returncode != 0:  # gloo's threads sometimes abort at process exit, after the figures are complete
        print(f"note: the run exited with {r.returncode} after its figures were gathered; they are used")
    return json.loads((out / "bytes.json").read_text())
