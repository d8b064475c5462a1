"""``--checkpoint.async``: DCP's async_save stages the state to host memory and a background thread writes,
hashes and renames it. The state saved is the state at the call, not what training does to it afterwards; at
most one save is in flight; a background failure surfaces as one line at the next wait; and a 2-rank run
resumed from a checkpoint written in the background ends bit for bit where the uninterrupted run ended."""

from __future__ import annotations

import shutil
from concurrent.futures import Future

import pytest
import torch
from safetensors.torch import load_file

from foldtrain.checkpoint import CheckpointManager
from foldtrain.errors import CheckpointError
from tests.conftest import tiny_run_args
from tests.support import failed, torchrun


def _state(value: float) -> dict:
    return {"w": torch.full((256, 64), value), "b": torch.arange(10.0) * value}


def test_background_save_holds_the_state_at_the_call(tmp_path):
    ckpt = CheckpointManager(tmp_path / "ckpts", keep=5)
    live = _state(1.0)
    path = ckpt.save(2, live, {"data_step": 2}, background=True)
    live["w"].add_(100.0)  # training goes on while the write is in flight
    live["b"].mul_(-1.0)
    ckpt.wait()
    assert not ckpt.in_flight and ckpt.damage(path) is None
    loaded = _state(0.0)
    meta, _ = ckpt.load(path, loaded)
    assert meta["step"] == 2
    assert torch.equal(loaded["w"], torch.full((256, 64), 1.0)) and torch.equal(loaded["b"], torch.arange(10.0))


def test_the_next_save_completes_the_pending_one(tmp_path):
    ckpt = CheckpointManager(tmp_path / "ckpts", keep=5)
    ckpt.save(2, _state(2.0), {}, background=True)
    ckpt.save(4, _state(4.0), {}, background=True)  # waits for step 2 first
    assert [p.name for p in ckpt.checkpoints()] == ["step_00000002"]
    ckpt.save(6, _state(6.0), {})  # a synchronous save also completes the pending one
    assert [p.name for p in ckpt.checkpoints()] == ["step_00000002", "step_00000004", "step_00000006"]
    assert all(ckpt.damage(p) is None for p in ckpt.checkpoints())
    assert not list((tmp_path / "ckpts").glob("*.tmp"))


def test_a_failed_background_write_is_one_line_at_the_wait(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    def failing(*args, **kwargs):
        future: Future = Future()
        future.set_exception(OSError(5, "Input/output error"))
        return future

    ckpt = CheckpointManager(tmp_path / "ckpts")
    ckpt.save(2, _state(2.0), {})
    monkeypatch.setattr(dcp, "async_save", failing)
    ckpt.save(4, _state(4.0), {}, background=True)
    with pytest.raises(CheckpointError) as err:
        ckpt.wait()
    msg = str(err.value)
    assert "\n" not in msg and "step_00000004" in msg and "Input/output error" in msg
    assert [p.name for p in ckpt.checkpoints()] == ["step_00000002"]  # the previous one stays
    assert ckpt.damage(ckpt.latest()) is None and not list((tmp_path / "ckpts").glob("*.tmp"))
    ckpt.wait()  # the error was reported once


@pytest.mark.timeout(600)
def test_two_ranks_resume_from_a_background_checkpoint_bit_for_bit(small_data, tmp_path):
    out = tmp_path / "run"
    args = tiny_run_args(small_data, out, "--train.steps", "6", "--checkpoint.every", "2", "--checkpoint.keep", "5")
    args += ["--dp.strategy", "ddp", "--train.device", "cpu", "--checkpoint.async"]
    r = torchrun(2, "-m", "foldtrain", "train", *args, timeout=300)
    assert r.returncode == 0, failed(r)
    ckpt = CheckpointManager(out / "checkpoints")
    assert [p.name for p in ckpt.checkpoints()] == ["step_00000002", "step_00000004", "step_00000006"]
    assert all(ckpt.damage(p) is None for p in ckpt.checkpoints())
    uninterrupted = load_file(str(out / "model.safetensors"))

    shutil.rmtree(out / "checkpoints" / "step_00000006")  # resume from step 4, written in the background
    r = torchrun(2, "-m", "foldtrain", "train", *args, "--resume", timeout=300)
    assert r.returncode == 0, failed(r)
    resumed = load_file(str(out / "model.safetensors"))
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed)


def test_bench_checkpoint_prints_the_stall_of_each_mode(capsys):
    from foldtrain.bench.checkpoint import main

    assert main(["--n_layer", "1", "--d_model", "64", "--steps", "2", "--every", "1", "--repeat", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "mode" not in line]
    assert [r.split("|")[1].strip() for r in rows] == ["none", "sync", "async"]
    blocked = {r.split("|")[1].strip(): float(r.split("|")[4]) for r in rows}
    assert blocked["none"] == 0 and blocked["sync"] > 0  # a synchronous save blocks for its whole write
