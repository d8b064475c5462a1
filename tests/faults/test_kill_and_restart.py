"""Fault injection: ranks killed with SIGKILL under torchrun (``foldtrain/faults.py`` picks the moment).

Every case either resumes under ``--max-restarts`` to exactly the final loss and weights of an
uninterrupted run of the same layout (fp32, CPU), or ends with one line within ``--dp.timeout_s``;
none hangs (each launch has a hard timeout), no partial ``step_X.tmp`` survives, and the newest
intact checkpoint always loads. Nine torchrun launches in all: four references, five faulted.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests import support
from tests.conftest import tiny_run_args

pytestmark = [pytest.mark.faults, pytest.mark.timeout(1000)]  # a reference and a faulted launch per test

STEPS, EVERY, TIMEOUT_S = 8, 3, 10
LAUNCH_TIMEOUT = 450  # a hang fails the test instead of the suite (generous: CI machines may be shared)


def torchrun(
    world: int, args: list[str], fault: str = "", restarts: int = 0, monitor_s: float | None = None, fork=True
) -> subprocess.CompletedProcess:
    """``torchrun --max-restarts RESTARTS`` of ``foldtrain train ARGS`` with ``FOLDTRAIN_FAULT=FAULT``; with
    ``fork`` its agent and ranks forked from a warm interpreter (:mod:`tests.launch`), else torchrun itself."""
    env = {"FOLDTRAIN_FAULT": fault} if fault else None
    argv = ["--max-restarts", str(restarts), "-m", "foldtrain", "train", *args]
    return support.torchrun(world, *argv, timeout=LAUNCH_TIMEOUT, monitor_s=monitor_s, env=env, fork=fork)


def run_args(data: Path, out: Path, layout: list[str]) -> list[str]:
    return tiny_run_args(
        data,
        out,
        "--train.steps",
        str(STEPS),
        "--checkpoint.every",
        str(EVERY),
        "--checkpoint.keep",
        "5",
        "--dp.timeout_s",
        str(TIMEOUT_S),
        "--train.device",
        "cpu",
        *layout,
    )


LAYOUTS = {
    "allreduce": (2, ["--dp.strategy", "allreduce"]),
    "sharded-ps": (2, ["--dp.strategy", "sharded-ps"]),
    "dp2xpp2": (4, ["--parallel.dp", "2", "--parallel.pp", "2", "--train.micro_batch", "2"]),
    "dp2xpp2-fold-defer": (
        4,
        ["--model.n_layer", "4", "--parallel.dp", "2", "--parallel.pp", "2", "--parallel.virtual", "2"]
        + ["--train.micro_batch", "2", "--parallel.schedule", "fold", "--parallel.dp_sync", "per-chunk"]
        + ["--fold.defer_reduce", "true", "--optim.grad_clip", "0"],
    ),
}


@pytest.fixture(scope="module")
def reference(small_data, tmp_path_factory):
    """``reference(layout)``: the run dir of an uninterrupted run of that layout (one launch each, cached)."""
    done: dict[str, Path] = {}

    def get(layout: str) -> Path:
        if layout not in done:
            world, extra = LAYOUTS[layout]
            out = tmp_path_factory.mktemp(f"ref_{layout}") / "run"
            r = torchrun(world, run_args(small_data, out, extra))
            assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
            done[layout] = out
        return done[layout]

    return get


def final_loss(out: Path) -> float:
    rec = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rec if r["step"] == STEPS][-1]  # a restarted attempt may repeat steps; the last is final


def assert_same_result(out: Path, ref: Path) -> None:
    assert final_loss(out) == final_loss(ref)
    a, b = load_file(str(out / "model.safetensors")), load_file(str(ref / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def assert_newest_intact_loads(out: Path, step: int, extra: tuple[str, ...] = ()) -> None:
    """No partial save survives; the newest intact checkpoint is ``step`` and loads into the model
    (``extra``: the layout's arguments, for its model shape)."""
    from foldtrain.checkpoint import CheckpointManager
    from foldtrain.checkpoint.manager import load_model_weights
    from foldtrain.config import build_config
    from foldtrain.train.trainer import build_model

    ckpt = CheckpointManager(out / "checkpoints")
    path, skipped = ckpt.newest_intact()
    assert path is not None and path.name == f"step_{step:08d}" and not skipped
    model = build_model(build_config(tiny_run_args(Path("unused"), out, *extra)))
    load_model_weights(model, path)
    if (out / "model.safetensors").is_file():
        exported = load_file(str(out / "model.safetensors"))
        assert all(torch.equal(model.state_dict()[k], v) for k, v in exported.items())


def notices(out: Path) -> list[str]:
    return re.findall(r"\] (restart \d+: .*)", (out / "train.log").read_text())


def test_allreduce_survives_kills_in_forward_reduction_save_and_export(small_data, tmp_path, reference):
    """One launch, four kills: before the first checkpoint (forward of step 2), in a DP all-reduce
    (step 5), in the save of step 6 (leaves step_00000006.tmp) and in the final export."""
    out = tmp_path / "run"
    fault = "0:1:2:forward;1:0:5:reduce;2:1:6:save;3:0:8:export"
    # torchrun itself (the other tests fork their ranks from a warm interpreter, tests/launch.py)
    r = torchrun(2, run_args(small_data, out, LAYOUTS["allreduce"][1]), fault=fault, restarts=4, fork=False)
    assert r.returncode == 0, (r.stdout + r.stderr)[-5000:]
    assert r.stderr.count("exitcode: -9") == 4  # torchrun saw four SIGKILLed workers
    ck = out / "checkpoints"
    assert notices(out) == [
        "restart 1: no intact checkpoint yet, starting over from step 0",
        f"restart 2: resuming from {ck / 'step_00000003'}",
        f"restart 3: resuming from {ck / 'step_00000003'}",  # the killed save of step 6 was never renamed
        f"restart 4: resuming from {ck / 'step_00000008'}",  # killed in the export: only the export is redone
    ]
    assert not list(ck.glob("*.tmp")) and not (out / "model.tmp").exists()
    assert_same_result(out, reference("allreduce"))
    assert_newest_intact_loads(out, STEPS)


@pytest.mark.parametrize("layout,fault", [("sharded-ps", "0:1:5:reduce"), ("dp2xpp2", "0:2:5:p2p")])
def test_kill_in_communication_resumes_exactly(small_data, tmp_path, reference, layout, fault):
    """sharded-ps: rank 1 dies entering the reduce-scatter of step 5; dp 2 x pp 2: global rank 2
    (replica 1, first stage) dies at its first pipeline transfer of step 5."""
    world, extra = LAYOUTS[layout]
    out = tmp_path / "run"
    r = torchrun(world, run_args(small_data, out, extra), fault=fault, restarts=1)
    assert r.returncode == 0, (r.stdout + r.stderr)[-5000:]
    assert r.stderr.count("exitcode: -9") == 1
    assert notices(out) == [f"restart 1: resuming from {out / 'checkpoints' / 'step_00000003'}"]
    assert_same_result(out, reference(layout))
    assert_newest_intact_loads(out, STEPS)


def test_dp_x_pp_fold_survives_kills_in_reduction_forward_save_and_export(small_data, tmp_path, reference):
    """dp 2 x pp 2, fold with per-chunk dp_sync and deferred reductions; one launch, four kills: global
    rank 2 (replica 1, first stage) in a gradient reduction of step 2, before the first checkpoint; rank 1
    (replica 0, second stage) in a forward of step 5; rank 3 in the save of step 6 (armed at step 4: the
    next save); rank 0 in the final export. Every step is logged once."""
    world, extra = LAYOUTS["dp2xpp2-fold-defer"]
    out = tmp_path / "run"
    fault = "0:2:2:reduce;1:1:5:forward;2:3:4:save;3:0:8:export"
    r = torchrun(world, run_args(small_data, out, extra), fault=fault, restarts=4)
    assert r.returncode == 0, (r.stdout + r.stderr)[-5000:]
    assert r.stderr.count("exitcode: -9") == 4
    ck = out / "checkpoints"
    assert notices(out) == [
        "restart 1: no intact checkpoint yet, starting over from step 0",
        f"restart 2: resuming from {ck / 'step_00000003'}",
        f"restart 3: resuming from {ck / 'step_00000003'}",  # the killed save of step 6 was never renamed
        f"restart 4: resuming from {ck / 'step_00000008'}",  # killed in the export: only the export is redone
    ]
    assert not list(ck.glob("*.tmp")) and not (out / "model.tmp").exists()
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1))
    assert_same_result(out, reference("dp2xpp2-fold-defer"))
    assert_newest_intact_loads(out, STEPS, tuple(extra))


def test_without_restarts_a_kill_is_one_line_within_the_timeout(small_data, tmp_path):
    """No --max-restarts: rank 1 dies in the all-reduce of step 5; rank 0 names it in one line (gloo
    reports the closed connection at once; a stalled peer would be named after --dp.timeout_s, which
    tests/parallel/dp times), the launch ends, and the run's newest intact checkpoint (step 3) loads.
    torchrun polls every 0.1 s and then signals rank 0 (SIGTERM): the line must come before the process
    group's teardown, which may outlast that."""
    out = tmp_path / "run"
    r = torchrun(2, run_args(small_data, out, LAYOUTS["allreduce"][1]), fault="0:1:5:reduce", monitor_s=0.1)
    assert r.returncode != 0
    lines = re.findall(r"foldtrain: error: (.*)", r.stderr)
    assert lines == [
        f"rank 1 stopped responding during all-reduce at step 5 (timeout {TIMEOUT_S} s); check that rank's log"
    ], r.stderr[-3000:]
    assert_newest_intact_loads(out, 3)
