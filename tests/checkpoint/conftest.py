"""A finished tiny run with checkpoints, shared by the checkpoint tests (copied before being damaged)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.conftest import tiny_run_args


@pytest.fixture(scope="session")
def run4(small_data, tmp_path_factory) -> Path:
    """A finished 4-step run with checkpoints at steps 2 and 4."""
    from foldtrain.cli import main

    out = tmp_path_factory.mktemp("ckpt") / "run"
    assert main(["train", *tiny_run_args(small_data, out, "--train.steps", "4", "--checkpoint.every", "2")]) == 0
    return out


def copy_run(run: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(run, dst)
    return dst
