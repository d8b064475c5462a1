"""scripts/gpu-acceptance.sh: its dry check on a machine without a GPU, its recovery from a check that takes
its worker down or hangs, and the pieces of the throughput check that need no GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from foldtrain.bench.gpu_acceptance import CHECKS, FAULT_ENV, MULTI, Report, parse_args, plan
from foldtrain.bench.gpu_checks import key_bias_free, longest_run
from foldtrain.bench.gpu_plain import device_peak_tflops, probe_micro_batches

ROOT = Path(__file__).resolve().parents[2]


def acceptance(out: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The script as a user runs it, with no GPU visible, on the Python running the tests."""
    full = {k: v for k, v in os.environ.items() if k != FAULT_ENV}
    full.update({"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHON": sys.executable, **(env or {})})
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu-acceptance.sh"), str(out), *args],
        capture_output=True,
        text=True,
        env=full,
        timeout=300,
    )


def by_check(report: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in report["rows"]:
        out.setdefault(r["id"], []).append(r)
    return out


# a dry verdict that depends on no timing and no device: it must hold on the CPU too
DETERMINISTIC = (
    "data",
    "cuda-vs-cpu",
    "dataparallel",
    "bf16",
    "fp16",
    "calibrate",
    "equivalence",
    "calibrate-nccl",
    "bench-dp",
    "bench-pipeline",
)


def test_dry_check_runs_every_check_on_the_cpu_and_exits_0(tmp_path):
    p = acceptance(tmp_path / "out")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert p.stdout.count("no NVIDIA GPU visible") == 1
    report = json.loads((tmp_path / "out" / "gpu-acceptance.json").read_text())
    assert report["dry"] and report["gpus"] == 0
    checks = by_check(report)
    assert list(checks) == list(CHECKS), "every check, in order"
    broken = [r for r in report["rows"] if not r["ran"]]
    assert not broken, broken
    for name in DETERMINISTIC:
        assert all(r["ok"] for r in checks[name]), checks[name]
    # the multi-device checks: one equivalence row per strategy and layout, each at fp32 tolerance
    assert {r["check"] for r in checks["equivalence"]} == {
        f"gloo {c}"
        for c in (
            *("dp2 ddp", "dp2 allreduce", "dp2 ps", "dp2 sharded-ps", "dp2 fsdp", "dp2 distributed optimizer"),
            *("pp2 fold", "tp2 1f1b"),
        )
    }
    md = (tmp_path / "out" / "gpu-acceptance.md").read_text()
    table = [line for line in md.splitlines() if line.startswith("| ") and not line.startswith("| check ")]
    assert len(table) == len(report["rows"])
    assert "## foldtrain bench dp (dry run)" in md and "## foldtrain bench pipeline (dry run)" in md
    assert "| check | measured | target | result |" in p.stdout, "the table is printed too"


def test_a_check_that_kills_or_hangs_its_worker_is_a_fail_row_and_the_rest_still_run(tmp_path):
    faults = {FAULT_ENV: "calibrate:hang,cuda-vs-cpu:exit"}
    args = ("--checks", "calibrate,cuda-vs-cpu,simulate", "--limit_s", "3", "--grace_s", "1")
    p = acceptance(tmp_path / "out", *args, env=faults)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    checks = by_check(json.loads((tmp_path / "out" / "gpu-acceptance.json").read_text()))
    assert list(checks) == ["data", "calibrate", "cuda-vs-cpu", "simulate"]  # data first: every check needs it
    (hung,), (died,) = checks["calibrate"], checks["cuda-vs-cpu"]
    assert not hung["ran"] and hung["ok"] is False and "killed" in hung["measured"]
    assert not died["ran"] and died["ok"] is False and "exit 3" in died["measured"]
    # a third worker ran the last check: it completed (and fails, having no measured run to compare with)
    assert all(r["ran"] and r["ok"] is False for r in checks["simulate"])


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H200", 989.4),
        ("NVIDIA H100 80GB HBM3", 989.4),
        ("NVIDIA H100 PCIe", 756.5),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A10", 125.0),
        ("NVIDIA L4", 121.0),
        ("NVIDIA L40S", 362.05),
        ("NVIDIA H100 NVL", None),  # calibrate measures an NVL board's peak (lower clocks): no datasheet MFU
        ("Tesla V100-SXM2-32GB", None),
    ],
)
def test_device_peaks_by_name(name, peak):
    assert device_peak_tflops(name) == peak


class FakeLoop:
    """A plain loop whose step takes 1 s per micro-batch row up to ``saturate`` rows, and runs out of memory
    above ``fits`` rows."""

    def __init__(self, fits: int, saturate: int):
        import torch

        self.fits, self.saturate, self.device = fits, saturate, torch.device("cpu")
        self.opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)

    def timed(self, _sampler, rows: int, _start: int, steps: int) -> list[float]:
        import torch

        if rows > self.fits:
            raise torch.cuda.OutOfMemoryError("fake")
        return [max(1.0, rows / self.saturate)] * steps


def test_micro_batch_probe_stops_at_out_of_memory_and_keeps_the_fastest():
    best, probes = probe_micro_batches(FakeLoop(fits=16, saturate=64), None, (4, 8, 16, 32, 64), seq_len=10)
    assert best == 16
    assert probes == [(4, 40.0), (8, 80.0), (16, 160.0), (32, None)]


def test_micro_batch_probe_stops_when_a_larger_batch_gains_nothing():
    best, probes = probe_micro_batches(FakeLoop(fits=64, saturate=8), None, (4, 8, 16, 32), seq_len=10)
    assert best == 8 and [b for b, _ in probes] == [4, 8, 16]


def test_overflow_runs_and_key_biases():
    import torch

    assert longest_run([False, True, True, False, True]) == 2 and longest_run([]) == 0
    # qkv.bias is head-major [head][q|k|v][head_dim]: the key biases (k) are left out
    bias = torch.arange(2 * 3 * 2.0)
    assert key_bias_free("parts.1.attn.qkv.bias", bias, 2).tolist() == [0, 1, 4, 5, 6, 7, 10, 11]
    assert key_bias_free("parts.1.attn.proj.bias", bias, 2) is bias


def test_one_gpu_runs_the_single_device_checks_and_reports_the_others_as_not_run(tmp_path):
    info = {"date": "", "mode": "", "dry": False, "device": "", "torch": "", "python": "", "command": ""}
    report = Report(tmp_path, {**info, "budget_s": 450.0, "t0": 0.0})
    names = plan(parse_args([str(tmp_path)]), 1, report)
    assert names == [c for c in CHECKS if c not in MULTI]
    assert [r["id"] for r in report.rows] == list(MULTI)
    assert all(r["ok"] is None and not r["ran"] and "needs 2 GPUs" in r["measured"] for r in report.rows)
    assert plan(parse_args([str(tmp_path)]), 2, report) == list(CHECKS)
    assert plan(parse_args([str(tmp_path), "--checks", "simulate"]), 1, report) == ["data", "simulate"]
