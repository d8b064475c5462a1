"""The command line: subcommands, and every bad input as one clear line with a non-zero exit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from foldtrain.cli import main
from tests.conftest import tiny_run_args


def err_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    lines = [line for line in err if line.startswith("foldtrain: error:")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture(scope="module")
def trained_run(small_data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "run"
    assert main(["train", *tiny_run_args(small_data, out, "--train.steps", "6")]) == 0
    return out


def test_python_m_entry_point_and_config(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "foldtrain", "config", "--train.steps", "7"], capture_output=True, text=True, check=True
    )
    assert "steps = 7" in r.stdout and "[parallel]" in r.stdout
    r = subprocess.run(
        [sys.executable, "-m", "foldtrain", "train", "--train.stesp", "7"], capture_output=True, text=True
    )
    assert (
        r.returncode == 2
        and r.stderr.strip() == "foldtrain: error: unknown config key 'train.stesp'; did you mean --train.steps?"
    )


def test_generate_and_eval(trained_run, capsys):
    assert main(["eval", "--out", str(trained_run)]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["val_loss"] > 0 and res["val_ppl"] > 1 and res["checkpoint"].endswith("step_00000006")
    assert (
        main(["generate", "--out", str(trained_run), "--prompt", "def ", "--max_tokens", "20", "--temperature", "0.5"])
        == 0
    )
    text = capsys.readouterr().out
    assert text.startswith("def ") and len(text) > 10


def test_prepare_subcommand(small_corpus, tmp_path, capsys):
    out = tmp_path / "prep"
    assert main(["prepare", "--data.path", str(small_corpus), "--data.out", str(out), "--data.vocab_size", "400"]) == 0
    assert "prepared" in capsys.readouterr().out
    assert json.loads((out / "meta.json").read_text())["vocab_size"] <= 400


def test_bad_data_inputs(small_data, tmp_path, capsys):
    assert main(["train", *tiny_run_args(tmp_path / "missing", tmp_path / "r1")]) == 2
    assert "does not exist" in err_line(capsys)
    (tmp_path / "empty").mkdir()
    assert main(["train", *tiny_run_args(tmp_path / "empty", tmp_path / "r2")]) == 2
    assert "empty" in err_line(capsys) or "no " in err_line(capsys)
    blank = tmp_path / "blank"
    blank.mkdir()
    (blank / "a.txt").write_text("")
    (blank / "b.txt").write_text("")
    assert main(["prepare", "--data.path", str(blank), "--data.out", str(tmp_path / "p")]) == 2
    assert "no tokens" in err_line(capsys)
    assert not (tmp_path / "p").exists()


def test_token_file_truncated(small_data, tmp_path, capsys):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(small_data, bad)
    f = bad / "train-00000.bin"  # the first shard (a one-file dataset of the v1 format names it train.bin)
    f.write_bytes(f.read_bytes()[:-7])
    assert main(["train", *tiny_run_args(bad, tmp_path / "r")]) == 2
    assert "truncated" in err_line(capsys)
    f.write_bytes(np.zeros(len(f.read_bytes()) + 7, dtype=np.uint8).tobytes())  # right size, wrong bytes
    assert main(["train", *tiny_run_args(bad, tmp_path / "r")]) == 2
    assert "corrupt" in err_line(capsys)
    assert not (tmp_path / "r" / "checkpoints").exists()


def test_model_data_mismatches(small_data, tmp_path, capsys):
    args = tiny_run_args(small_data, tmp_path / "r")
    assert main(["train", *args, "--model.vocab_size", "100"]) == 2
    assert "larger than the model's embedding" in err_line(capsys)
    assert main(["train", *args, "--train.seq_len", "65"]) == 2
    assert "larger than the model's context" in err_line(capsys)
    assert main(["train", *args, "--train.global_batch", "0"]) == 2
    assert "must be > 0" in err_line(capsys)
    assert main(["train", *args, "--train.global_batch", "eight"]) == 2
    assert "expected int" in err_line(capsys)


def test_resume_errors(trained_run, tmp_path, small_data, capsys):
    assert main(["train", *tiny_run_args(small_data, tmp_path / "fresh", "--resume")]) == 2
    assert "holds no checkpoint" in err_line(capsys)
    assert main(["train", *tiny_run_args(small_data, trained_run, "--train.steps", "6")]) == 2
    assert "already holds checkpoints" in err_line(capsys)
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(trained_run, broken)
    (broken / "checkpoints" / "step_00000006" / ".metadata").write_bytes(b"\x00garbage")
    assert main(["train", *tiny_run_args(small_data, broken, "--train.steps", "8", "--resume")]) == 2
    assert "corrupt" in err_line(capsys)
    assert (broken / "checkpoints" / "step_00000006" / ".metadata").read_bytes() == b"\x00garbage"
