"""``--dp.strategy dataparallel`` (``torch.nn.DataParallel``) without a GPU: its refusals, its routing, the
thread-local autocast it works around, and its step on a CPU against ``--dp.strategy none``.

What a CPU run can show: the strategy is built and reached the way the trainer builds it, the run's
autocast reaches the model through the replica wrapper, and the step (loss, clipping, optimizer, fp16 loss
scaling, fp32 masters) is the single-process one. What it cannot: ``nn.DataParallel`` without CUDA devices
calls the module directly, so the replication from GPU 0, the scatter of the rows, the replicas' threads,
the gather of the logits and the sum of the gradients onto GPU 0 (``reduce_add``) do not run here, nor does
the rounding of a gradient summed over GPUs.
"""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch

from foldtrain.config import build_config, dp_workers, validate
from foldtrain.distributed import DistEnv
from foldtrain.engine import build_engine
from foldtrain.errors import ConfigError
from foldtrain.model import GPT, GPTShape
from foldtrain.optim.precision import Precision
from foldtrain.parallel.dp import strategy_for
from foldtrain.parallel.dp.dataparallel import AutocastReplica, TorchDataParallelStrategy, device_ids
from foldtrain.schedules.layout import uses_3d_engine
from tests.equivalence import scalar_rel, worst_param
from tests.parallel.dp.dp_worker import D_MODEL, HEADS, MODEL, params_of, train
from tests.support import SyntheticSampler

BASE = [*MODEL, "--train.seq_len", "16", "--train.global_batch", "8", "--optim.warmup_steps", "2"]
DP = ["--dp.strategy", "dataparallel"]
TOL = 1e-5


@pytest.fixture
def gpus(monkeypatch):
    """Pretend ``n`` CUDA devices are visible, for the checks that read the count (nothing runs on them)."""

    def see(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return see


def refusal(args: list[str], world: int = 1) -> str:
    with pytest.raises(ConfigError) as e:
        validate(build_config([*BASE, *DP, *args]), world)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_refused_under_torchrun_whatever_the_devices(gpus):
    gpus(4)
    msg = refusal([], world=2)
    assert "2 processes were launched" in msg and "--dp.strategy ddp under torchrun" in msg


def test_refused_without_a_cuda_device(gpus):
    gpus(0)
    msg = refusal([])
    assert "needs CUDA devices" in msg and "none is visible" in msg and "--dp.strategy none" in msg


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--parallel.pp", "2"], ["--parallel.pp 2", "set them to 1"]),
        (["--parallel.tp", "2"], ["tp 2", "set them to 1"]),
        (["--train.device", "cpu"], ["--train.device is cpu", "--train.device auto or cuda"]),
        (["--parallel.dp", "8"], ["--parallel.dp 8", "4 are visible", "--parallel.dp 4 or less"]),
        (["--parallel.dp", "3"], ["8 rows", "over 3 GPUs", "multiple of 3"]),
        (["--train.micro_batch", "2"], ["2 rows", "over 4 GPUs", "multiple of 4"]),
    ],
)
def test_combinations_that_cannot_run_are_one_line_each(gpus, args, words):
    gpus(4)
    msg = refusal(args)
    assert all(w in msg for w in words), msg


def test_accepted_with_visible_gpus_and_routed_to_the_replicated_engine(gpus):
    gpus(4)
    for args in ([], ["--parallel.dp", "2"], ["--precision", "bf16-master", "--train.micro_batch", "4"]):
        cfg = validate(build_config([*BASE, *DP, *args]), 1)
        assert not uses_3d_engine(cfg) and dp_workers(cfg, 1) == 1
        assert strategy_for(cfg, 1) is TorchDataParallelStrategy
    assert device_ids(build_config([*BASE, *DP]), 4) == [0, 1, 2, 3]
    assert device_ids(build_config([*BASE, *DP, "--parallel.dp", "2"]), 4) == [0, 1]


def test_the_train_command_refuses_before_any_process_group(tmp_path):
    """On this machine (no CUDA device) the trainer stops at validation with one line and exit 2."""
    proc = subprocess.run(
        [sys.executable, "-m", "foldtrain", "train", "--out", str(tmp_path / "run"), *BASE, *DP],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "needs CUDA devices" in lines[0], proc.stderr
    assert not (tmp_path / "run").exists()


def test_replica_threads_compute_in_the_runs_half_precision():
    """DataParallel's worker threads re-enter autocast with the enabled flag only, and the dtype is
    thread-local: a thread that does so gets the device type's default (bf16 on a CPU, fp16 on CUDA). The
    wrapper enters the run's own autocast inside the thread, so an fp16 run computes in fp16 there."""
    torch.manual_seed(0)
    cfg = build_config(BASE)
    model = GPT(GPTShape.from_config(cfg.model), 0)
    replica = AutocastReplica(model, Precision("fp16", torch.device("cpu")))
    x = torch.randint(0, cfg.model.vocab_size, (2, 16))
    seen = {}

    def worker():  # what parallel_apply does in each replica's thread, once per module
        for key, module in (("bare", model), ("wrapped", replica)):
            with torch.no_grad(), torch.autocast("cpu", enabled=True):
                seen[key] = module(x).dtype

    with replica.precision.forward_context():  # the engine's context, in the main thread
        t = threading.Thread(target=worker)
        t.start()
        t.join()
    assert seen == {"bare": torch.bfloat16, "wrapped": torch.float16}


def run(args: list[str], steps: int = 4) -> dict:
    cfg = build_config([*BASE, *args])
    torch.manual_seed(cfg.train.seed)
    model = GPT(GPTShape.from_config(cfg.model), cfg.train.seed)
    engine = build_engine(cfg, model, DistEnv(0, 1, 0, torch.device("cpu")), cfg.train.micro_batch or 8)
    sampler = SyntheticSampler(cfg.model.vocab_size, cfg.train.seq_len)
    out = train(engine, cfg, sampler, 0, steps, 0, {"name": "dataparallel"})
    out["params"], out["strategy"] = params_of(engine.eval_model()), type(engine.strategy)
    return out


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["--train.micro_batch", "2", "--optim.grad_clip", "0.05"],
        ["--precision", "bf16"],
        ["--precision", "fp16"],
        ["--precision", "bf16-master"],
    ],
    ids=["fp32", "accumulate+clip", "bf16", "fp16", "bf16-master"],
)
def test_the_step_on_a_cpu_matches_the_single_process_one(args):
    """The same global batch through dataparallel (DataParallel calling the replica directly here) and through
    --dp.strategy none: losses, gradient norms and every parameter within 1e-5 after 4 steps."""
    got, ref = run([*args, *DP]), run(args)
    assert got["strategy"] is TorchDataParallelStrategy and ref["strategy"] is not TorchDataParallelStrategy
    assert max(scalar_rel(a, b) for a, b in zip(got["losses"], ref["losses"])) <= TOL
    assert max(scalar_rel(a, b) for a, b in zip(got["grad_norms"], ref["grad_norms"])) <= TOL
    err, name = worst_param(got["params"], ref["params"], HEADS, D_MODEL)
    assert err <= TOL, (name, err)
