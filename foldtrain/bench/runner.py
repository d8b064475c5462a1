"""Launching one benchmark run: torchrun on loopback, or one torchrun per node on the emulated network.

A run is described by a :class:`Job` (what to run and where); :func:`run_job` launches it, waits
(with a timeout), and returns a :class:`~foldtrain.bench.results.RunResult` with the medians of its
``metrics.jsonl`` after warm-up, or the error line of its output when it failed. On the emulated
network the per-node link counters are sampled while the run is in its measured steps (between
the warm-up and the last step), giving wire bytes per step.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from foldtrain.bench.results import RunResult, error_line, read_metrics, summarize_records
from foldtrain.netem.cluster import EmulatedCluster
from foldtrain.netem.procs import kill_tree, wait_all

ANCHORS = Path(__file__).with_name("anchors")


@dataclass
class Job:
    result: RunResult  # the identity of the run (bench, impl, variant, precision, ranks, network, workers, info)
    script: list[str]  # after torchrun's options: ["-m", "foldtrain", "train"] or [path to a script]
    args: list[str]  # the run's arguments (foldtrain config overrides); --out is added
    nnodes: int = 1  # >1 (or network != loopback): one torchrun per node of the cluster
    nproc_per_node: int = 1
    threads: int = 1  # OMP_NUM_THREADS per process
    env: dict[str, str] = field(default_factory=dict)
    launcher: list[str] | None = None  # instead of torchrun (e.g. horovodrun), loopback only
    horovod: bool = False  # a Horovod job: horovodrun on loopback (launcher), horovod_launch on the emulated network

    def command(self, out_dir: Path) -> list[str]:
        """The loopback command line (for --dry_run and for running)."""
        if self.launcher is not None:
            return [*self.launcher, *self.script, *self.args, "--out", str(out_dir)]
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(self.nproc_per_node),
            *self.script,
            *self.args,
            "--out",
            str(out_dir),
        ]

    def describe(self) -> str:
        r = self.result
        extra = " ".join(f"{k}={v}" for k, v in r.info.items() if k in ("virtual", "dp_sync", "cycle_ms"))
        return f"{r.label} {r.precision} {r.ranks} rank(s) {r.network}" + (f" {extra}" if extra else "")


class WireSampler:
    """Samples the cluster's link counters when the run has logged ``warmup`` steps and again at
    its last-but-one step (the last step may include end-of-run work), to get bytes per step."""

    def __init__(self, cluster: EmulatedCluster, nnodes: int, metrics: Path, warmup: int, steps: int):
        self.cluster, self.nnodes, self.metrics = cluster, nnodes, metrics
        self.start_at = min(warmup, max(steps - 2, 0))
        self.end_at = max(steps - 1, self.start_at + 1)
        self.start: tuple[int, list] | None = None
        self.end: tuple[int, list] | None = None
        self._size = -1
        self._lines = 0

    def _count(self) -> int:
        try:
            size = self.metrics.stat().st_size
        except OSError:
            return 0
        if size != self._size:
            self._size = size
            self._lines = sum(
                1 for line in self.metrics.read_text(errors="replace").splitlines() if '"step_time_s"' in line
            )
        return self._lines

    def _snap(self) -> list:
        return [self.cluster.link_bytes(k) for k in range(self.nnodes)]

    def poll(self) -> None:
        if self.end is not None:
            return
        n = self._count()
        if self.start is None and n >= self.start_at:
            self.start = (n, self._snap())
        elif self.start is not None and n >= self.end_at and n > self.start[0]:
            self.end = (n, self._snap())

    def per_step(self) -> list[tuple[float, float]] | None:
        if self.start is None or self.end is None:
            return None
        steps = self.end[0] - self.start[0]
        return [((s1 - s0) / steps, (r1 - r0) / steps) for (s0, r0), (s1, r1) in zip(self.start[1], self.end[1])]


def run_job(
    job: Job,
    out_dir: Path,
    warmup: int,
    steps: int,
    timeout_s: float,
    cluster: EmulatedCluster | None = None,
    log=print,
    gpus: int = 0,
) -> RunResult:
    """Launch ``job`` (on ``cluster`` when given), wait, and summarize it into a RunResult."""
    res = job.result
    out_dir.mkdir(parents=True, exist_ok=True)
    res.out_dir = str(out_dir)
    t0 = time.monotonic()
    timed_out = False
    try:
        if cluster is None:
            log_path = out_dir / "launch.log"
            env = {**os.environ, "OMP_NUM_THREADS": str(job.threads), "PYTHONUNBUFFERED": "1", **job.env}
            with open(log_path, "w") as f:
                p = subprocess.Popen(
                    job.command(out_dir), stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
                )
                try:
                    timed_out = wait_all([p], timeout_s)
                finally:
                    if p.poll() is None:
                        kill_tree(p)
            codes, text = [p.returncode], log_path.read_text(errors="replace")
        else:
            sampler = WireSampler(cluster, job.nnodes, out_dir / "metrics.jsonl", warmup, steps)
            port = random.randint(20000, 39999)
            if job.horovod:
                from foldtrain.bench.horovod_launch import run_horovod

                jr = run_horovod(
                    cluster,
                    [*job.script, *job.args, "--out", str(out_dir)],
                    nproc_per_node=job.nproc_per_node,
                    nnodes=job.nnodes,
                    env=job.env,
                    threads=job.threads,
                    timeout_s=timeout_s,
                    log_dir=out_dir / "launch",
                    on_poll=sampler.poll,
                )
            else:
                jr = cluster.run_torchrun(
                    [*job.script, *job.args, "--out", str(out_dir)],
                    nproc_per_node=job.nproc_per_node,
                    nnodes=job.nnodes,
                    port=port,
                    env=job.env,
                    threads=job.threads,
                    timeout_s=timeout_s,
                    log_dir=out_dir / "launch",
                    on_poll=sampler.poll,
                    gpus=gpus,
                )
            codes, text, timed_out = jr.returncodes, jr.text(), jr.timed_out
            res.wire = sampler.per_step()
    except KeyboardInterrupt:
        raise
    except Exception as e:  # the harness itself failed for this run: report, go on
        codes, text = [None], f"{type(e).__name__}: {e}"
    res.info["wall_s"] = round(time.monotonic() - t0, 1)
    records = read_metrics(out_dir / "metrics.jsonl")
    if timed_out:
        res.error = f"timed out after {timeout_s:.0f} s" + (
            f" (last output: {error_line(text)})" if text.strip() else ""
        )
    elif any(c != 0 for c in codes):
        res.error = error_line(text)
    elif not records:
        res.error = "finished but logged no step metrics (metrics.jsonl empty)"
    if records:
        res.metrics = summarize_records(records, warmup)
    return res
