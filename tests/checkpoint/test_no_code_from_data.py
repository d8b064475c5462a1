"""No code from data: a pickle planted in a checkpoint never runs, whether or not its checksum was forged.

Each planted pickle would create a marker file when unpickled (``os.system("touch ...")``); every
``--resume`` below must end with one line, exit 2, and leave the marker absent.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from foldtrain.checkpoint.integrity import describe
from foldtrain.checkpoint.safe_load import UnsafePickle, load_metadata
from foldtrain.cli import main
from tests.checkpoint.conftest import copy_run
from tests.conftest import tiny_run_args


class Evil:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def forge_checksums(ck: Path) -> None:
    """What an attacker who controls the whole directory does: make meta.json match the planted files."""
    meta = json.loads((ck / "meta.json").read_text())
    meta["files"] = describe(ck, [p.name for p in ck.iterdir() if p.name != "meta.json"])
    (ck / "meta.json").write_text(json.dumps(meta))


def engine_state(data: Path, out: Path) -> dict:
    """A complete, well-formed DCP state of the run's model (what a crafted checkpoint would mimic)."""
    from foldtrain.config import build_config
    from foldtrain.engine import ReplicatedEngine as Engine
    from foldtrain.train.trainer import build_model

    cfg = build_config(tiny_run_args(data, out))
    return Engine(build_model(cfg), cfg, torch.device("cpu"), 8).state_dict()


def resume_fails(small_data, out: Path, capsys) -> str:
    capsys.readouterr()
    assert main(["train", *tiny_run_args(small_data, out, "--train.steps", "6", "--resume")]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("foldtrain: error:")]
    assert len(lines) == 1
    return lines[0]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("forged", [False, True], ids=["checksum-mismatch", "forged-checksums"])
@pytest.mark.parametrize("target", ["rank0.pt", ".metadata", "byte-value"])
def test_planted_pickle_runs_nothing(run4, tmp_path, small_data, capsys, target, forged):
    out = copy_run(run4, tmp_path)
    ck = out / "checkpoints" / "step_00000004"
    marker = tmp_path / "pwned"
    if target == "rank0.pt":
        torch.save({"rng": Evil(marker), "extra": {}}, ck / "rank0.pt")
    elif target == ".metadata":
        (ck / ".metadata").write_bytes(pickle.dumps(Evil(marker)))
    else:  # a non-tensor value of the DCP state (stored with torch.save inside a .distcp file)
        for p in [*ck.glob("*.distcp"), ck / ".metadata"]:
            p.unlink()
        state = engine_state(small_data, out)
        state["lr_scheduler"]["last_epoch"] = Evil(marker)
        dcp.save(state, checkpoint_id=str(ck), no_dist=True)
    assert not marker.exists()
    if forged:
        forge_checksums(ck)
    line = resume_fails(small_data, out, capsys)
    assert not marker.exists(), "the planted pickle ran"
    if not forged:
        assert "is corrupt:" in line and "does not match its checksum" in line or "bytes," in line, line
    elif target == "rank0.pt":
        assert "rank0.pt holds more than tensors and plain values" in line and "refusing to load it" in line, line
    elif target == ".metadata":
        assert ".metadata refers to posix.system, which is not checkpoint metadata" in line, line
    else:
        assert "a stored value is not plain data (refused by the restricted unpickler); refusing to load it" in line, (
            line
        )


def test_metadata_unpickler_allows_only_metadata(run4):
    md = load_metadata((run4 / "checkpoints" / "step_00000004" / ".metadata").read_bytes())
    assert "model.parts.0.wte.weight" in md.state_dict_metadata
    with pytest.raises(UnsafePickle, match="builtins.eval"):
        load_metadata(pickle.dumps(eval))
