"""Checkpoint on a signal (``--checkpoint.on_signal``): SIGTERM to torchrun mid-run (it forwards the signal
to its ranks), every rank finishes its step, saves together and exits; ``--resume`` ends with an
uninterrupted run's weights bit for bit, every step in metrics.jsonl once. Three torchrun launches and one
plain process (the exit code, and an unknown signal name refused as one line)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import tiny_run_args
from tests.launch import launch_env

pytestmark = [pytest.mark.faults, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 40  # enough steps that the signal, sent after step 2 is logged, arrives well before the end


def _cmd(world: int | None, args: list[str]) -> list[str]:
    if world is None:
        return [sys.executable, "-m", "foldtrain", "train", *args]
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)]
    return [*run, "-m", "foldtrain", "train", *args]


def _args(data: Path, out: Path, *extra: str) -> list[str]:
    layout = ["--dp.strategy", "ddp", "--train.device", "cpu", "--checkpoint.every", "100"]
    return tiny_run_args(data, out, "--train.steps", str(STEPS), *layout, *extra)


def _steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.is_file() else []


def _signal_after_step(cmd: list[str], out: Path, step: int, sig: signal.Signals) -> subprocess.CompletedProcess:
    """Start ``cmd``, send ``sig`` to it once metrics.jsonl holds ``step``, wait for it to end."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=launch_env(), cwd=ROOT)
    deadline = time.monotonic() + 300
    while (not _steps(out) or _steps(out)[-1] < step) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def _preempted_at(out: Path, sig: str) -> int:
    lines = re.findall(r"\] (preempted: .*)", (out / "train.log").read_text())
    assert len(lines) == 1, lines
    m = re.fullmatch(rf"preempted: {sig} received; saved (\S+) after step (\d+) of {STEPS}; .*--resume", lines[0])
    assert m, lines[0]
    return int(m.group(2))


def test_sigterm_under_torchrun_saves_and_resume_is_exact(small_data, tmp_path):
    ref, out = tmp_path / "ref", tmp_path / "run"
    r = subprocess.run(_cmd(2, _args(small_data, ref)), capture_output=True, text=True, env=launch_env(), cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]

    r = _signal_after_step(_cmd(2, _args(small_data, out)), out, 2, signal.SIGTERM)
    assert r.returncode != 0  # torchrun re-raises the signal after its ranks have exited
    stopped = _preempted_at(out, "SIGTERM")
    assert 2 <= stopped < STEPS
    from foldtrain.checkpoint import CheckpointManager

    ckpt = CheckpointManager(out / "checkpoints")
    assert [p.name for p in ckpt.checkpoints()] == [f"step_{stopped:08d}"]
    assert ckpt.damage(ckpt.latest()) is None and not list((out / "checkpoints").glob("*.tmp"))
    assert _steps(out) == list(range(1, stopped + 1))

    r = subprocess.run(
        _cmd(2, _args(small_data, out, "--resume")), capture_output=True, text=True, env=launch_env(), cwd=ROOT
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert _steps(out) == list(range(1, STEPS + 1))
    a, b = load_file(str(out / "model.safetensors")), load_file(str(ref / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_one_process_exits_with_the_preempted_code_and_bad_names_are_one_line(small_data, tmp_path):
    from foldtrain.errors import EXIT_PREEMPTED

    out = tmp_path / "single"
    r = _signal_after_step(_cmd(None, _args(small_data, out, "--dp.strategy", "none")), out, 2, signal.SIGUSR1)
    assert r.returncode == EXIT_PREEMPTED, r.stderr[-3000:]
    stopped = _preempted_at(out, "SIGUSR1")
    assert (out / "checkpoints" / f"step_{stopped:08d}" / "meta.json").is_file()

    from foldtrain.cli import main

    assert main(["train", *_args(small_data, tmp_path / "bad", "--checkpoint.signals", "TERM,NOPE")]) == 2
