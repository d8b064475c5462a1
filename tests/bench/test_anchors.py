"""The baselines the benchmarks compare with, each in ONE small torchrun launch on loopback."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TINY_ARGS
from tests.support import torchrun

HOROVODRUN = Path(sys.executable).with_name("horovodrun")


def run_anchor(n: int, module: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return torchrun(n, "-m", module, *args, timeout=timeout)


def common(data: Path, out: Path, steps: int = 2) -> list[str]:
    return [
        *TINY_ARGS,
        "--train.global_batch",
        "4",
        "--train.seq_len",
        "16",
        "--train.steps",
        str(steps),
        "--optim.warmup_steps",
        "1",
        "--data.path",
        str(data),
        "--out",
        str(out),
        "--train.device",
        "cpu",
    ]


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def torch_pipelining(data: Path, out: Path, schedule: str) -> list[dict]:
    r = run_anchor(
        2,
        "foldtrain.bench.anchors.torch_pipelining",
        "--schedule",
        schedule,
        *common(data, out),
        "--model.n_layer",
        "4",
        "--parallel.pp",
        "2",
        "--parallel.virtual",
        "2",
        "--parallel.microbatches",
        "4",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return records(out)


@pytest.fixture(scope="module")
def bfs(small_data, tmp_path_factory) -> list[dict]:
    """LoopedBFS with 2 chunks per rank (4 stages, the tied head split across ranks), 2 steps."""
    return torch_pipelining(small_data, tmp_path_factory.mktemp("bfs"), "looped-bfs")


def test_torch_pipelining_anchor_world2(bfs):
    rec = bfs
    assert [x["step"] for x in rec] == [1, 2]
    for x in rec:
        assert x["step_time_s"] > 0 and x["tokens_per_s"] > 0 and x["peak_mem_mb"] > 0
        assert 5.0 < x["loss"] < 8.0  # ~ln(512): the global mean loss reached rank 0
        assert x["grad_norm"] > 0


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_torch_zero_bubble_anchors_train_the_same_model(small_data, tmp_path, bfs, schedule):
    """torch's V-shaped zero-bubble schedules (both copies of the tie on rank 0, summed there) take the same
    two steps as LoopedBFS (the tie split over two ranks): the second step's loss and the gradient norms
    agree, so the placement and the tie are right."""
    rec = torch_pipelining(small_data, tmp_path / schedule, schedule)
    for a, b in zip(rec, bfs):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * b["loss"], (rec, bfs)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * b["grad_norm"], (rec, bfs)


def test_ddp_plain_anchor_world2(small_data, tmp_path):
    out = tmp_path / "ddp"
    r = run_anchor(
        2, "foldtrain.bench.anchors.ddp_plain", *common(small_data, out, steps=3), "--train.micro_batch", "1"
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rec = records(out)
    assert [x["step"] for x in rec] == [1, 2, 3]
    assert all(x["tokens_per_s"] > 0 and 5.0 < x["loss"] < 8.0 for x in rec)


@pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed (pip install -e '.[bench]')"
)
def test_deepspeed_pipe_anchor_world2(small_data, tmp_path):
    """DeepSpeed's PipelineModule over 2 pipeline stages, 2 micro-batches, 2 steps (starts without compiling any op)."""
    out = tmp_path / "ds"
    r = run_anchor(
        2,
        "foldtrain.bench.anchors.deepspeed_pipe",
        *common(small_data, out),
        "--model.n_layer",
        "2",
        "--parallel.pp",
        "2",
        "--parallel.microbatches",
        "2",
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "built successfully" not in r.stdout + r.stderr  # no JIT-compiled DeepSpeed op
    rec = records(out)
    assert [x["step"] for x in rec] == [1, 2]
    assert all(x["tokens_per_s"] > 0 and 5.0 < x["loss"] < 8.0 for x in rec)


@pytest.mark.skipif(not HOROVODRUN.is_file(), reason="Horovod is not installed (bash scripts/install-horovod.sh)")
def test_horovod_plain_anchor_world2(small_data, tmp_path):
    out = tmp_path / "hvd"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HOROVOD_CYCLE_TIME": "5"}
    cmd = [
        str(HOROVODRUN),
        "-np",
        "2",
        "-H",
        "localhost:2",
        sys.executable,
        "-m",
        "foldtrain.bench.anchors.horovod_plain",
        *common(small_data, out, steps=3),
        "--train.micro_batch",
        "1",
    ]
    r = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env=env, cwd=Path(__file__).resolve().parents[2]
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    rec = records(out)
    assert [x["step"] for x in rec] == [1, 2, 3]
    assert all(x["tokens_per_s"] > 0 and 5.0 < x["loss"] < 8.0 for x in rec)


def test_fsdp_plain_anchor_world2_matches_foldtrains_fsdp(small_data, tmp_path):
    """The plain FSDP2 script and `foldtrain train --dp.strategy fsdp` train the same model on the same rows:
    their losses agree (fp32; the anchor clips with torch's clip_grad_norm_, foldtrain with its own norm)."""
    plain, ours = tmp_path / "plain", tmp_path / "ours"
    args = [*common(small_data, plain, steps=3), "--train.micro_batch", "1"]
    r = run_anchor(2, "foldtrain.bench.anchors.fsdp_plain", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    mine = [*common(small_data, ours, steps=3), "--train.micro_batch", "1", "--dp.strategy", "fsdp"]
    r = run_anchor(2, "foldtrain", "train", *mine, "--train.progress", "false", "--train.sample_tokens", "0")
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = records(plain), records(ours)
    assert [x["step"] for x in a] == [1, 2, 3]
    assert all(abs(x["loss"] - y["loss"]) < 1e-5 * abs(y["loss"]) for x, y in zip(a, b)), (a, b)
