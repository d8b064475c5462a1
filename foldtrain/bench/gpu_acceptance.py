"""The GPU acceptance run: ``bash scripts/gpu-acceptance.sh [OUT]`` (``python -m foldtrain.bench.gpu_acceptance``).

One prepared run for the few minutes a GPU is at hand. It prints one table and writes it, row by row as the
checks finish, to ``OUT/gpu-acceptance.md`` (and ``OUT/gpu-acceptance.json``); each check's rows say what was
measured, the target and PASS or FAIL. docs/testing.md lists the checks and their targets.

The checks run in a worker process (``--worker``), one after another, each under its own time limit and all
under one budget (``--budget_s``, 450 s by default: the run ends within 8 minutes). A check that raises or
runs out of time is a FAIL row and the next one runs; one that takes the worker down (or hangs it past its
limit) is a FAIL row too, and a fresh worker goes on with the rest.

Without a GPU it says so in one line and runs the dry check: the same checks at CPU scale (``tiny`` shapes, a
few steps, the CPU twin of ``calibrate``'s GPU probes, gloo instead of NCCL, ``--dry_run`` for the
benchmarks), so that every code path runs; it then exits 0. With a GPU it exits 1 if any row failed.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from foldtrain.bench import gpu_checks as single
from foldtrain.bench import gpu_multi as multi

FAULT_ENV = "FOLDTRAIN_ACCEPTANCE_FAULT"  # tests only: "CHECK:exit" or "CHECK:hang", comma-separated

# name -> (check, time limit in seconds); the order is the run's
CHECKS = {
    "data": (single.check_data, 90.0),
    "cuda-vs-cpu": (single.check_cuda_vs_cpu, 60.0),
    "dataparallel": (single.check_dataparallel, 45.0),
    "bf16": (lambda ctx: single.check_half(ctx, "bf16"), 60.0),
    "fp16": (lambda ctx: single.check_half(ctx, "fp16"), 60.0),
    "speed-gpt2-small": (lambda ctx: single.check_speed(ctx, "gpt2-small"), 100.0),
    "speed-gpt2-medium": (lambda ctx: single.check_speed(ctx, "gpt2-medium"), 150.0),
    "speed-gpt2-large": (lambda ctx: single.check_speed(ctx, "gpt2-large"), 150.0),
    "memory-model": (single.check_memory, 30.0),
    "calibrate": (single.check_calibrate, 120.0),
    "simulate": (single.check_simulate, 30.0),
    "padding": (single.check_padding, 60.0),
    "equivalence": (multi.check_equivalence, 120.0),
    "calibrate-nccl": (multi.check_calibrate_links, 120.0),
    "bench-dp": (lambda ctx: multi.check_bench(ctx, "dp"), 120.0),
    "bench-pipeline": (lambda ctx: multi.check_bench(ctx, "pipeline"), 120.0),
}
MULTI = ("equivalence", "calibrate-nccl", "bench-dp", "bench-pipeline")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="scripts/gpu-acceptance.sh", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("out", nargs="?", default="", help="directory for the report (default: a new one under /tmp)")
    ap.add_argument("--dry", action="store_true", help="run the dry check even where a GPU is visible")
    ap.add_argument("--budget_s", type=float, default=450.0, help="the whole run's time (default %(default)s)")
    ap.add_argument("--checks", default="", help="comma list of checks to run (default: all that apply)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory (prepared data, runs)")
    ap.add_argument("--limit_s", type=float, default=0.0, help="cap every check's time limit (default: its own)")
    ap.add_argument(
        "--grace_s", type=float, default=20.0, help="wait this long past a check's limit before killing its worker"
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--work", default="", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    unknown = [c for c in a.checks.split(",") if c and c not in CHECKS]
    if unknown:
        ap.error(f"unknown check(s) {', '.join(unknown)}; choose from {', '.join(CHECKS)}")
    return a


# ---------------------------------------------------------------------- the worker


def worker(a: argparse.Namespace) -> int:
    """Run the checks named in ``--checks`` in order; every start and every check's rows go to
    ``WORK/events.jsonl``, what later checks need to ``WORK/state.json``."""
    import torch

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the driver's kill: run_cmd's finally ends children
    work = Path(a.work)
    state_file = work / "state.json"
    state = json.loads(state_file.read_text()) if state_file.is_file() else {}
    device = torch.device("cpu") if a.dry else torch.device("cuda", 0)
    ctx = single.Ctx(work, Path(a.out), a.dry, device, a.deadline, state)
    names = [c for c in a.checks.split(",") if c]
    for i, name in enumerate(names, 1):
        emit(work, {"start": name, "t": time.time()})
        print(f"[{i}/{len(names)}] {name} ...", flush=True)
        t0 = time.perf_counter()
        inject_fault(name)
        rows = run_one(ctx, name, limit_of(a, name))
        seconds = time.perf_counter() - t0
        state_file.write_text(json.dumps(ctx.state))
        emit(work, {"done": name, "rows": rows, "seconds": seconds})
        for r in rows:
            print(f"    {verdict(r):<4}  {r['check']}: {r['measured']}", flush=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 0


def limit_of(a: argparse.Namespace, name: str) -> float:
    return min(CHECKS[name][1], a.limit_s) if a.limit_s > 0 else CHECKS[name][1]


def inject_fault(name: str) -> None:
    """Tests only: with ``FOLDTRAIN_ACCEPTANCE_FAULT=NAME:exit`` the worker dies as check NAME starts; with
    ``NAME:hang`` it hangs where its own time limit cannot reach (the driver's recovery paths)."""
    for spec in os.environ.get(FAULT_ENV, "").split(","):
        check, _, what = spec.partition(":")
        if check == name and what == "exit":
            os._exit(3)
        if check == name and what == "hang":
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
            time.sleep(3600)


def run_one(ctx: single.Ctx, name: str, limit: float) -> list[dict]:
    """The rows of check ``name``: its own, or one FAIL row saying why it has none."""
    fn = CHECKS[name][0]
    left = ctx.deadline - time.time()
    if left < 3:
        return [single.row(name, "not run: the run's time budget was spent", "", False, ran=False)]
    if name != "data" and "data" not in ctx.state:
        return [single.row(name, "not run: no prepared data (the data check failed)", "", False, ran=False)]
    ctx.check_end = time.time() + min(limit, left)
    try:
        with single.time_limit(min(limit, left)):
            return fn(ctx)
    except single.CheckTimeout as e:
        return [single.row(name, str(e), f"done within {min(limit, left):.0f} s", False, ran=False)]
    except Exception as e:  # noqa: BLE001 - a failing check is a row; the next check runs
        traceback.print_exc()
        return [single.row(name, f"{type(e).__name__}: {single.tail(str(e))}", "", False, ran=False)]


def emit(work: Path, record: dict) -> None:
    with open(work / "events.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


# ---------------------------------------------------------------------- the report


def verdict(r: dict) -> str:
    return {True: "PASS", False: "FAIL"}.get(r["ok"], "—")


class Report:
    """``OUT/gpu-acceptance.md`` and ``.json``, rewritten whole after every check."""

    def __init__(self, out: Path, info: dict):
        self.out, self.info, self.rows, self.appendix = out, info, [], {}
        self.running = ""

    def add(self, rows: list[dict], check: str) -> None:
        """``rows`` of the check named ``check`` (a key of CHECKS)."""
        self.rows += [{**r, "id": check} for r in rows]
        self.write()

    def markdown(self) -> str:
        i = self.info
        lines = [
            "# GPU acceptance run",
            "",
            f"{i['date']}: {i['mode']}; {i['device']}; torch {i['torch']}, Python {i['python']}; "
            f"`{i['command']}`, {i['elapsed_s']:.0f} s of a {i['budget_s']:.0f} s budget.",
            "",
        ]
        if i["dry"]:
            lines += ["Dry check: CPU scale; a verdict here says that the code ran, not that a target is met.", ""]
        lines += ["| check | measured | target | result |", "|---|---|---|---|"]
        lines += [f"| {r['check']} | {r['measured']} | {r['target']} | {verdict(r)} |" for r in self.rows]
        if self.running:
            lines += ["", f"(running: {self.running})"]
        for title, text in self.appendix.items():
            lines += ["", f"## {title}", "", text.strip()]
        return "\n".join(lines).replace("\x00", "") + "\n"

    def write(self) -> None:
        self.info["elapsed_s"] = time.time() - self.info["t0"]
        (self.out / "gpu-acceptance.md").write_text(self.markdown())
        data = {**self.info, "rows": self.rows}
        (self.out / "gpu-acceptance.json").write_text(json.dumps(data, indent=1, default=str))


# ---------------------------------------------------------------------- the driver


def read_events(path: Path, offset: int) -> tuple[list[dict], int]:
    if not path.is_file():
        return [], offset
    with open(path) as f:
        f.seek(offset)
        text = f.read()
    complete = text[: text.rfind("\n") + 1]
    return [json.loads(line) for line in complete.splitlines() if line], offset + len(complete)


def run_worker(a, work: Path, out: Path, pending: list[str], report: Report, log) -> list[str]:
    """One worker over ``pending``; the checks still to run after it ends (the one it died in is a FAIL row)."""
    cmd = [sys.executable, "-m", "foldtrain.bench.gpu_acceptance", "--worker", "--work", str(work), str(out)]
    cmd += ["--checks", ",".join(pending), "--deadline", str(a.deadline), "--limit_s", str(a.limit_s)]
    cmd += ["--dry"] if a.dry else []
    events, offset = work / "events.jsonl", 0
    if events.is_file():
        offset = events.stat().st_size
    proc = subprocess.Popen(cmd, stderr=log, start_new_session=True, env=single.child_env())
    current, killed = None, ""
    while True:
        exited = proc.poll() is not None
        new, offset = read_events(events, offset)
        for ev in new:
            if "start" in ev:
                current = (ev["start"], ev["t"])
                report.running = ev["start"]
                report.write()
            else:
                current = None
                pending.remove(ev["done"])
                report.add([{**r, "seconds": round(ev["seconds"], 1)} for r in ev["rows"]], ev["done"])
        if exited:
            break
        if current and time.time() > min(current[1] + limit_of(a, current[0]), a.deadline) + a.grace_s:
            killed = f"the worker was still in this check {a.grace_s:.0f} s past its time limit; killed it"
            single.kill_group(proc)
        time.sleep(0.3)
    if current is not None:
        why = killed or f"the worker died in this check (exit {proc.returncode}); see gpu-acceptance.log"
        report.add([single.row(current[0], why, "", False, ran=False)], current[0])
        pending.remove(current[0])
    elif pending and proc.returncode != 0:
        for name in pending:
            why = f"not run: the worker failed to start (exit {proc.returncode})"
            report.add([single.row(name, why, "", False, ran=False)], name)
        return []
    return pending


def count_gpus() -> tuple[int, str]:
    import torch

    if not torch.cuda.is_available():
        return 0, "no CUDA device"
    n = torch.cuda.device_count()
    return n, f"{n} x {torch.cuda.get_device_name(0)}"


def plan(a, gpus: int, report: Report) -> list[str]:
    """The checks this machine runs; rows for those it cannot (one GPU: the multi-GPU ones)."""
    names = [c for c in (a.checks.split(",") if a.checks else CHECKS) if c]
    if a.checks and "data" not in names:
        names.insert(0, "data")  # every check trains on it
    if not a.dry and gpus < 2:
        for name in (n for n in names if n in MULTI):
            why = f"not run: needs 2 GPUs or more, this machine has {gpus}"
            report.add([single.row(name, why, "", None, ran=False)], name)
        names = [n for n in names if n not in MULTI]
    return names


def drive(a: argparse.Namespace) -> int:
    import torch

    gpus, device = count_gpus()
    if gpus == 0:
        print("gpu-acceptance: no NVIDIA GPU visible (torch.cuda.is_available() is False); running the dry check")
    a.dry = a.dry or gpus == 0
    out = Path(a.out or tempfile.mkdtemp(prefix="gpu-acceptance-", dir="/tmp"))
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-acceptance-work-"))
    a.deadline = time.time() + a.budget_s
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "mode": "dry check (no GPU)" if a.dry else f"{gpus} GPU(s)",
        "dry": a.dry,
        "gpus": gpus,
        "device": device,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "command": "bash scripts/gpu-acceptance.sh " + " ".join(sys.argv[1:]),
        "budget_s": a.budget_s,
        "t0": time.time(),
    }
    report = Report(out, info)
    pending = plan(a, gpus, report)
    print(f"gpu-acceptance: {len(pending)} checks, report in {out / 'gpu-acceptance.md'}", flush=True)
    with open(out / "gpu-acceptance.log", "a") as log:
        while pending:
            pending = run_worker(a, work, out, pending, report, log)
    state_file = work / "state.json"
    report.appendix = json.loads(state_file.read_text()).get("appendix", {}) if state_file.is_file() else {}
    report.running = ""
    report.write()
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    print("\n" + report.markdown())
    failed = [r for r in report.rows if r["ok"] is False]
    return 0 if a.dry or not failed else 1


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    return worker(a) if a.worker else drive(a)


if __name__ == "__main__":
    sys.exit(main())
