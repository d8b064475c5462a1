"""End-to-end single-process training: resume exactness, atomic checkpoints, run-dir safety."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from foldtrain.checkpoint import manager as ckpt_manager
from foldtrain.config import build_config
from foldtrain.errors import CheckpointError, ConfigError
from foldtrain.train.trainer import train
from tests.conftest import tiny_run_args


def losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "model.safetensors"))


def run(data, out, *extra):
    return train(build_config(tiny_run_args(data, out, *extra)))


def test_metrics_and_outputs(small_data, tmp_path):
    out = tmp_path / "run"
    run(small_data, out, "--checkpoint.every", "10", "--checkpoint.keep", "1", "--train.eval_every", "10")
    rec = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rec] == list(range(1, 21))
    assert all({"step", "loss", "lr", "tokens_per_s"} <= r.keys() for r in rec)
    assert "val_loss" in rec[9] and "val_ppl" in rec[19]
    assert rec[-1]["loss"] < rec[0]["loss"] - 0.5  # it learns
    assert (out / "config.toml").is_file() and (out / "train.log").is_file()
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_00000020"]  # keep=1 pruned step 10
    assert "parts.0.wte.weight" in weights(out)


def test_resume_is_exact(small_data, tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    run(small_data, full, "--checkpoint.every", "10")
    run(small_data, part, "--checkpoint.every", "10", "--train.stop_at", "10")
    assert max(losses(part)) == 10 and not (part / "model.safetensors").exists()
    run(small_data, part, "--checkpoint.every", "10", "--resume")
    assert losses(part) == losses(full)  # bit-for-bit on CPU
    a, b = weights(full), weights(part)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_reproducible_bit_for_bit(small_data, tmp_path):
    run(small_data, tmp_path / "a", "--train.steps", "5")
    run(small_data, tmp_path / "b", "--train.steps", "5")
    assert losses(tmp_path / "a") == losses(tmp_path / "b")


def test_crash_during_save_keeps_previous_checkpoint(small_data, tmp_path, monkeypatch):
    out = tmp_path / "run"
    real_save = ckpt_manager.dcp.save

    def crashing_save(state, checkpoint_id, **kw):
        if checkpoint_id.endswith("step_00000020.tmp"):
            real_save(state, checkpoint_id=checkpoint_id, **kw)  # files written, then the "machine dies"
            (Path(checkpoint_id) / ".metadata").write_bytes(b"half-written")
            raise KeyboardInterrupt("simulated crash mid-save")
        return real_save(state, checkpoint_id=checkpoint_id, **kw)

    monkeypatch.setattr(ckpt_manager.dcp, "save", crashing_save)
    with pytest.raises(KeyboardInterrupt):
        run(small_data, out, "--checkpoint.every", "10")
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == ["step_00000010", "step_00000020.tmp"]
    monkeypatch.setattr(ckpt_manager.dcp, "save", real_save)
    run(small_data, out, "--checkpoint.every", "10", "--resume")  # resumes from step 10
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000010", "step_00000020"]
    full = tmp_path / "full"
    run(small_data, full, "--checkpoint.every", "10")
    assert losses(out)[20] == losses(full)[20]


def test_existing_run_is_not_overwritten(small_data, tmp_path):
    out = tmp_path / "run"
    run(small_data, out, "--train.steps", "3")
    before = {p: p.stat().st_mtime_ns for p in (out / "checkpoints").rglob("*")}
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        run(small_data, out, "--train.steps", "3")
    assert before == {p: p.stat().st_mtime_ns for p in (out / "checkpoints").rglob("*")}


def test_resume_without_checkpoint(small_data, tmp_path):
    with pytest.raises(CheckpointError, match="holds no checkpoint"):
        run(small_data, tmp_path / "none", "--resume")


def test_resume_from_corrupt_checkpoint(small_data, tmp_path):
    out = tmp_path / "run"
    run(small_data, out, "--train.steps", "4", "--train.stop_at", "2")
    ck = out / "checkpoints" / "step_00000002"
    shard = next(ck.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 3])  # truncated
    with pytest.raises(CheckpointError, match="corrupt"):
        run(small_data, out, "--train.steps", "4", "--resume")
    assert shard.exists()  # nothing deleted


def test_gradient_accumulation_matches_full_batch(small_data, tmp_path):
    run(small_data, tmp_path / "a", "--train.steps", "4")
    run(small_data, tmp_path / "b", "--train.steps", "4", "--train.micro_batch", "2")
    la, lb = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert all(abs(la[s] - lb[s]) <= 1e-5 * abs(la[s]) for s in la)
