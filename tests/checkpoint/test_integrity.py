"""Verified checkpoints, in one process: checksums in meta.json, one-line errors, automatic fallback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from foldtrain.checkpoint import CheckpointManager
from foldtrain.checkpoint.integrity import HASH, damage, file_digest
from foldtrain.checkpoint.manager import load_model_weights
from foldtrain.checkpoint.safe_load import load_rank_state, rng_state, save_rank_state, set_rng_state
from foldtrain.cli import main
from foldtrain.config import build_config
from foldtrain.errors import CheckpointError
from foldtrain.train.trainer import build_model
from tests.checkpoint.conftest import copy_run
from tests.conftest import tiny_run_args


def err_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    lines = [line for line in err if line.startswith("foldtrain: error:")]
    assert len(lines) == 1, err
    return lines[0]


def snapshot(root: Path) -> dict:
    return {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in root.rglob("*") if p.is_file()}


def test_meta_json_lists_every_file_with_its_checksum(run4):
    ck = run4 / "checkpoints" / "step_00000004"
    meta = json.loads((ck / "meta.json").read_text())
    names = {p.name for p in ck.iterdir()} - {"meta.json"}
    assert (
        set(meta["files"]) == names and {".metadata", "rank0.pt"} <= names and any(n.endswith(".distcp") for n in names)
    )
    assert meta["hash"] == HASH and meta["step"] == 4
    for name, rec in meta["files"].items():
        assert rec == {"bytes": (ck / name).stat().st_size, HASH: file_digest(ck / name)}
    assert damage(ck) is None


def test_every_kind_of_damage_is_named(run4, tmp_path):
    out = copy_run(run4, tmp_path)
    ck = out / "checkpoints" / "step_00000004"
    shard = next(ck.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte, same size
    shard.write_bytes(bytes(data))
    assert damage(ck) == f"{shard.name} does not match its checksum"
    shard.write_bytes(bytes(data[:100]))
    assert damage(ck) == f"{shard.name} has 100 bytes, {len(data)} were saved"
    shard.unlink()
    assert damage(ck) == f"{shard.name} is missing"
    (ck / "evil.pt").write_bytes(b"x")
    assert damage(ck) == "evil.pt is not part of the checkpoint as saved"
    (ck / "meta.json").write_text("{not json")
    assert "meta.json is unreadable" in damage(ck)
    (ck / "meta.json").unlink()
    assert "no meta.json" in damage(ck)


def test_resume_from_a_corrupt_checkpoint_is_one_line_and_touches_nothing(run4, tmp_path, capsys, small_data):
    out = copy_run(run4, tmp_path)
    ck = out / "checkpoints" / "step_00000004"
    shard = next(ck.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 4096] = bytes(4096)  # the 4 KiB in the middle
    shard.write_bytes(bytes(data[: len(data)]))
    before = snapshot(out)
    assert main(["train", *tiny_run_args(small_data, out, "--train.steps", "6", "--resume")]) == 2
    line = err_line(capsys)
    assert f"checkpoint {ck} is corrupt: {shard.name} does not match its checksum" in line
    assert f"the newest intact checkpoint is {out / 'checkpoints' / 'step_00000002'}" in line
    assert snapshot(out) == before  # nothing written, nothing deleted


def test_eval_of_a_corrupt_checkpoint_is_one_line(run4, tmp_path, capsys):
    out = copy_run(run4, tmp_path)
    (out / "checkpoints" / "step_00000004" / "rank0.pt").write_bytes(b"junk")
    assert main(["eval", "--out", str(out)]) == 2
    assert "rank0.pt has 4 bytes" in err_line(capsys)
    assert main(["eval", "--out", str(out), "--checkpoint", str(out / "checkpoints" / "step_00000002")]) == 0


def test_automatic_resume_after_a_restart_falls_back_to_the_newest_intact(
    run4, tmp_path, small_data, monkeypatch, capsys
):
    """What a torchrun restart sees: its job owns --out, the newest checkpoint is damaged -> resume from
    the one before, say so in one line, and end exactly where an uninterrupted run ends."""
    ident = {"TORCHELASTIC_RUN_ID": "job-1", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "RANK": "0"}
    for k, v in {**ident, "TORCHELASTIC_RESTART_COUNT": "0"}.items():
        monkeypatch.setenv(k, v)
    out = tmp_path / "run"
    args = tiny_run_args(small_data, out, "--train.steps", "6", "--checkpoint.every", "2")
    assert main(["train", *args, "--train.stop_at", "4"]) == 0  # the first attempt, "killed" after step 4
    assert (out / ".job.json").is_file()
    rank0 = out / "checkpoints" / "step_00000004" / "rank0.pt"
    data = bytearray(rank0.read_bytes())
    data[len(data) // 2] ^= 0xFF
    rank0.write_bytes(bytes(data))
    capsys.readouterr()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert main(["train", *args]) == 0  # no --resume: automatic
    err = capsys.readouterr().err
    notice = [line for line in err.splitlines() if line.startswith("restart 1:")]
    assert notice == [
        "restart 1: skipped 1 damaged checkpoint(s) (step_00000004: rank0.pt does not match its checksum); "
        f"resuming from {out / 'checkpoints' / 'step_00000002'}"
    ]
    full = tmp_path / "full"
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert main(["train", *tiny_run_args(small_data, full, "--train.steps", "6", "--checkpoint.every", "2")]) == 0
    a, b = load_file(str(out / "model.safetensors")), load_file(str(full / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_rank_state_round_trip_restores_every_rng_stream(tmp_path):
    import random

    import numpy as np

    random.seed(3), np.random.seed(4), torch.manual_seed(5)
    random.random(), np.random.randn(3), torch.randn(3)
    save_rank_state(tmp_path / "rank0.pt", {"counter": torch.arange(3), "note": "x", "n": 2})
    want = (random.random(), np.random.randn(3), torch.randn(3), random.gauss(0, 1))
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    rng, extra = load_rank_state(tmp_path / "rank0.pt")
    set_rng_state(rng)
    got = (random.random(), np.random.randn(3), torch.randn(3), random.gauss(0, 1))
    assert got[0] == want[0] and np.array_equal(got[1], want[1]) and torch.equal(got[2], want[2]) and got[3] == want[3]
    assert torch.equal(extra["counter"], torch.arange(3)) and extra["note"] == "x" and extra["n"] == 2
    assert set(rng) >= {"torch", "numpy", "python"} and isinstance(rng_state()["torch"], torch.Tensor)


def test_layout_and_shape_mismatch_are_one_line_before_any_process_group(run4, tmp_path, capsys, small_data):
    from foldtrain.checkpoint.rundir import plan_run

    with pytest.raises(
        CheckpointError, match=r"was saved by 1 processes, this launch has 2; resume with --nproc_per_node 1"
    ):
        plan_run(run4, True, 3, world_size=2)
    out = copy_run(run4, tmp_path)
    assert (
        main(["train", *tiny_run_args(small_data, out, "--train.steps", "6", "--resume"), "--model.d_model", "64"]) == 2
    )
    assert "holds another model shape: d_model 32 (now 64)" in err_line(capsys)


def test_load_model_weights_verifies(run4, tmp_path):
    out = copy_run(run4, tmp_path)
    cfg = build_config(tiny_run_args(Path("unused"), out))
    model = build_model(cfg)
    load_model_weights(model, out / "checkpoints" / "step_00000004")
    exported = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in exported.items())
    meta = out / "checkpoints" / "step_00000004" / ".metadata"
    meta.write_bytes(meta.read_bytes() + b"\x00")
    with pytest.raises(CheckpointError, match=r"\.metadata has \d+ bytes"):
        load_model_weights(model, out / "checkpoints" / "step_00000004")


def test_manager_prefers_newest_intact(run4, tmp_path):
    out = copy_run(run4, tmp_path)
    m = CheckpointManager(out / "checkpoints")
    assert m.newest_intact() == (out / "checkpoints" / "step_00000004", [])
    (out / "checkpoints" / "step_00000004" / "meta.json").unlink()
    path, skipped = m.newest_intact()
    assert path == out / "checkpoints" / "step_00000002" and skipped[0][0].name == "step_00000004"
