"""``--dp.strategy horovod`` under ``horovodrun`` against one process; runs only where Horovod is installed.

Three launches of 2 processes:

* ``horovodrun -np 2`` running ``dp_worker.py``: fp32 with a checkpoint round trip, gradient
  accumulation (3 backward passes per step) with active clipping, and bf16-master (Horovod's
  ``grouped_allreduce_`` path), each against the single-process engine (``--dp.strategy none``);
* ``horovodrun -np 2 python -m foldtrain train --dp.strategy horovod``: the command a user types,
  against ``foldtrain train`` in one process: rank and world come from Horovod (only rank 0 writes
  metrics, config and the exported model; the checkpoint is saved by both through one
  process group);
* ``torchrun --nproc-per-node 2 ... --dp.strategy horovod``: each process would be a Horovod world
  of one that exchanges nothing; refused with one line.

Build Horovod with ``bash scripts/install-horovod.sh`` (a few minutes); without it every test here
is skipped and says so.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import tiny_run_args
from tests.parallel.dp.test_dp_strategies import (
    HALF_TOL,
    TOL,
    assert_matches_single_process,
    param_rel,
    reference_of,
    rel,
    s,
)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
HOROVODRUN = Path(sys.executable).with_name("horovodrun")


def _missing() -> str:
    if importlib.util.find_spec("horovod") is None:
        return "Horovod is not installed (bash scripts/install-horovod.sh builds it)"
    try:
        import horovod.torch  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any failure to load the extension means: cannot test here
        return f"horovod.torch does not import: {e}"
    if not HOROVODRUN.is_file():
        return f"no horovodrun next to {sys.executable}"
    return ""


MISSING = _missing()
pytestmark = pytest.mark.skipif(bool(MISSING), reason=MISSING)

HVD = ["--dp.strategy", "horovod"]
CASES = [
    s("fp32/horovod", HVD, 10, ckpt_at=5),
    s(
        "clip/horovod", [*HVD, "--train.micro_batch", "2", "--optim.grad_clip", "0.05"], 6
    ),  # 6 rows per rank: 3 micro-batches
    s("bf16-master/horovod", [*HVD, "--precision", "bf16-master"], 3, ckpt_at=2),
    s("wire/horovod-fp16", [*HVD, "--dp.compression", "fp16"], 4),  # hvd.Compression.fp16
]


def env() -> dict[str, str]:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }


def horovodrun(n: int, argv: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [str(HOROVODRUN), "-np", str(n), "-H", f"localhost:{n}", sys.executable, *argv]
    return subprocess.run(cmd, env=env(), cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("hvd")
    (out / "spec.json").write_text(json.dumps(CASES))
    proc = horovodrun(2, [str(HERE / "dp_worker.py"), str(out / "spec.json"), str(out)])
    assert proc.returncode == 0, f"horovodrun failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    res = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for r, got in enumerate(res):
        errors = {k: v["error"] for k, v in got.items() if "error" in v}
        assert not errors, f"rank {r}: {errors}"
    return res


def test_ranks_come_from_horovod(results):
    for r, res in enumerate(results):
        for case in CASES:
            got = res[case["name"]]
            assert (got["engine"], got["dp_rank"], got["dp_world"], got["batch_rows"]) == ("HorovodStrategy", r, 2, 6)


@pytest.mark.parametrize("name", ["fp32/horovod", "clip/horovod"])
def test_fp32_equals_single_process(results, name):
    """Every step's loss, the gradient norm and every parameter equal the single-process run (1e-5)."""
    case = next(c for c in CASES if c["name"] == name)
    ref = reference_of(case)
    rank0 = assert_matches_single_process(results, name, case)
    assert all(torch.equal(results[1][name]["params"][k], v) for k, v in rank0["params"].items())  # one replica
    if name.startswith("clip/"):
        assert min(ref["grad_norms"]) > 0.05  # the clip really scaled the gradients


def test_bf16_master_matches_single_process(results):
    case = CASES[2]
    ref = reference_of(case)
    for res in results:
        got = res[case["name"]]
        assert max(rel(a, b) for a, b in zip(got["losses"], ref["losses"])) < HALF_TOL


def test_fp16_compression_stays_close(results):
    """``--dp.compression fp16``: Horovod's fp16 compressor rounds each gradient once per step; the losses stay
    within fp16's precision of the single process's, and differ from the uncompressed run's."""
    case = next(c for c in CASES if c["name"] == "wire/horovod-fp16")
    ref = reference_of(case)
    got, plain = results[0][case["name"]], results[0]["fp32/horovod"]
    assert max(rel(a, b) for a, b in zip(got["losses"], ref["losses"])) < 1e-4
    assert got["losses"] != plain["losses"][: len(got["losses"])]


def test_checkpoint_round_trip_continues_identically(results):
    """Saved (DCP) through the torch.distributed group formed beside Horovod's, loaded into fresh
    engines (whose learning-rate schedule must drive Horovod's optimizer, not the one it wraps):
    the continued steps repeat the uninterrupted run bit for bit (two ranks: one addition per element)."""
    for case in (c for c in CASES if c.get("ckpt_at")):
        for res in results:
            got = res[case["name"]]
            assert got["resumed_losses"] == got["losses"][case["ckpt_at"] :], case["name"]
        rank0 = results[0][case["name"]]
        worst, tensor = param_rel(rank0["resumed_params"], rank0["params"])
        assert all(torch.equal(rank0["resumed_params"][k], v) for k, v in rank0["params"].items()), (
            f"{case['name']}: {tensor} off by {worst:.1e}"
        )


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]


def test_foldtrain_train_under_horovodrun(small_data, tmp_path):
    """The user's command, against ``foldtrain train`` in one process: same losses and weights (1e-5)."""
    from safetensors.torch import load_file

    from foldtrain.config import build_config
    from foldtrain.train.trainer import train

    steps = ["--train.steps", "8", "--checkpoint.every", "4"]
    one, two = tmp_path / "one", tmp_path / "two"
    train(build_config(tiny_run_args(small_data, one, *steps)))
    proc = horovodrun(2, ["-m", "foldtrain", "train", *tiny_run_args(small_data, two, *steps, *HVD)])
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    log = (two / "train.log").read_text()
    assert "2 process(es), strategy horovod" in log and log.count("parameters (analytic") == 1  # rank 0 alone writes
    assert [p.name for p in sorted((two / "checkpoints").iterdir())] == ["step_00000004", "step_00000008"]
    a, b = _losses(two), _losses(one)
    assert len(a) == len(b) == 8 and max(rel(x, y) for x, y in zip(a, b)) < TOL
    wa, wb = load_file(str(two / "model.safetensors")), load_file(str(one / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wb:
        if k.endswith("qkv.bias"):  # the key biases get only rounding noise (see test_dp_strategies.exact_zero_grad)
            continue
        err = float((wa[k].double() - wb[k].double()).norm() / wb[k].double().norm().clamp_min(1e-12))
        assert err < TOL, f"{k} off by {err:.2e}"


def test_torchrun_world_is_refused(small_data, tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "foldtrain",
        "train",
        *tiny_run_args(small_data, tmp_path / "run", "--train.steps", "2", *HVD),
    ]
    proc = subprocess.run(cmd, env=env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    line = re.search(r"foldtrain: error: (.*)", proc.stderr)
    assert line, proc.stderr[-3000:]
    assert line.group(1).startswith("--dp.strategy horovod: Horovod's world has 1 process(es) but 2 were launched"), (
        line.group(1)
    )
    assert "horovodrun -np 2" in line.group(1)
