"""A full disk during a save, on a small tmpfs used as the run directory (needs root to mount; skipped
otherwise): one line naming the directory and the space needed, exit 2, the previous checkpoint intact
and loadable, and no partial step directory left behind."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.checkpoint.conftest import copy_run
from tests.conftest import tiny_run_args


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@pytest.fixture
def small_disk(tmp_path, run4):
    """A tmpfs holding a copy of ``run4`` (checkpoints at steps 2 and 4) plus room for about half a checkpoint."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    src = copy_run(run4, tmp_path)
    ckpt = _dir_bytes(src / "checkpoints" / "step_00000004")
    size = _dir_bytes(src) + ckpt // 2 + (256 << 10)  # the run, half a checkpoint, page rounding of small files
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip() or 'not root'}); the test needs root")
    try:
        shutil.copytree(src, mnt / "run")
        yield mnt / "run"
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _resume(run: Path, data: Path, capsys) -> tuple[int, list[str]]:
    from foldtrain.cli import main

    args = tiny_run_args(data, run, "--train.steps", "6", "--checkpoint.every", "2", "--resume")
    code = main(["train", *args])
    return code, [line for line in capsys.readouterr().err.splitlines() if line.startswith("foldtrain: error:")]


def _assert_previous_intact(run: Path) -> None:
    from foldtrain.checkpoint import CheckpointManager
    from foldtrain.checkpoint.manager import load_model_weights
    from foldtrain.config import build_config
    from foldtrain.train.trainer import build_model

    ckpt = CheckpointManager(run / "checkpoints")
    assert [p.name for p in ckpt.checkpoints()] == ["step_00000002", "step_00000004"]
    assert not list((run / "checkpoints").glob("*.tmp"))  # nothing partial for --resume to pick up
    path, skipped = ckpt.newest_intact()
    assert path.name == "step_00000004" and not skipped
    load_model_weights(build_model(build_config(tiny_run_args(Path("unused"), run))), path)


def test_a_save_that_cannot_fit_is_refused_before_writing(small_disk, small_data, capsys):
    code, errors = _resume(small_disk, small_data, capsys)
    assert code == 2
    assert len(errors) == 1 and f"not enough space in {small_disk / 'checkpoints'} to save step 6" in errors[0]
    assert "MiB" in errors[0]
    _assert_previous_intact(small_disk)


def test_a_disk_that_fills_during_the_write_is_one_line(small_disk, small_data, capsys, monkeypatch):
    """The space check passes (it is disabled here, as when another writer fills the disk meanwhile)."""
    from foldtrain.checkpoint.manager import CheckpointManager

    monkeypatch.setattr(CheckpointManager, "_check_space", lambda *a: None)
    code, errors = _resume(small_disk, small_data, capsys)
    assert code == 2
    assert len(errors) == 1 and f"no space left in {small_disk / 'checkpoints'} while saving step 6" in errors[0]
    _assert_previous_intact(small_disk)
