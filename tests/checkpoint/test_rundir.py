"""The run directory before any process group: unwritable --out, and who may resume what after a restart."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from foldtrain.checkpoint.rundir import JOB_FILE, plan_run
from foldtrain.cli import main
from foldtrain.errors import CheckpointError, ConfigError
from tests.checkpoint.conftest import copy_run
from tests.conftest import tiny_run_args


def one_error_line(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("foldtrain: error:")]
    assert len(lines) == 1
    return lines[0]


def test_unwritable_out_is_one_line_before_anything(small_data, tmp_path, capsys):
    import torch.distributed as dist

    afile = tmp_path / "afile"
    afile.write_text("x")
    (tmp_path / "run_ckfile").mkdir()
    (tmp_path / "run_ckfile" / "checkpoints").write_text("x")
    cases = {
        "/proc/x": r"--out /proc/x cannot be written \(creating a directory in /proc fails: .+\); "
        r"choose a writable --out",
        str(afile / "sub" / "run"): rf"--out {afile}/sub/run: {afile} is a file, not a directory; choose another --out",
        str(afile): rf"--out {afile}: {afile} is a file, not a directory",
        str(tmp_path / "run_ckfile"): r"run_ckfile/checkpoints is a file, not a directory",
        " ": r"--out is empty",
    }
    for out, want in cases.items():
        args = tiny_run_args(small_data, Path("x"), "--train.steps", "2")
        args[args.index("--out") + 1] = out
        assert main(["train", *args]) == 2, out
        line = one_error_line(capsys)
        assert re.search(want, line), line
    assert not dist.is_initialized()
    assert afile.read_text() == "x" and sorted(p.name for p in tmp_path.iterdir()) == ["afile", "run_ckfile"]


def env_of(restart: int, run_id: str = "job-1", rank: int = 0) -> dict:
    return {
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_RESTART_COUNT": str(restart),
        "RANK": str(rank),
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
    }


def test_a_restart_resumes_only_a_run_its_own_job_started(run4, tmp_path):
    other = copy_run(run4, tmp_path)  # an unrelated run: its first attempt was refused, so no claim of ours
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        plan_run(other, False, 3, env=env_of(0))
    assert not (other / JOB_FILE).exists()  # the refused first attempt touched nothing
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        plan_run(other, False, 3, env=env_of(1))  # ...and its restart is refused the same way

    fresh = tmp_path / "fresh"
    plan = plan_run(fresh, False, 3, env=env_of(0))  # first attempt of job-1 claims the directory
    assert plan.resume_from is None and (fresh / JOB_FILE).is_file()
    plan = plan_run(fresh, False, 3, env=env_of(1))  # killed before the first checkpoint: starts over
    assert plan.resume_from is None and plan.notice == "restart 1: no intact checkpoint yet, starting over from step 0"
    shutil.copytree(run4 / "checkpoints", fresh / "checkpoints")  # the job's checkpoints, as if it had saved them
    plan = plan_run(fresh, False, 3, env=env_of(2))
    assert plan.resume_from == fresh / "checkpoints" / "step_00000004" and plan.notice.startswith(
        "restart 2: resuming from"
    )
    for ck in (fresh / "checkpoints").iterdir():
        (ck / "meta.json").write_text("{}")
    with pytest.raises(
        CheckpointError,
        match=r"restart 3: every checkpoint in .* is damaged \(step_00000004: its meta.json records no file checksums",
    ):
        plan_run(fresh, False, 3, env=env_of(3))
    with pytest.raises(ConfigError, match="already holds checkpoints"):  # another job (run id) reusing --out
        plan_run(fresh, False, 3, env=env_of(1, run_id="job-2"))
    with pytest.raises(ConfigError, match="already holds checkpoints"):  # a new first attempt of the same id
        plan_run(fresh, False, 3, env=env_of(0))


def test_resume_flag_on_a_first_attempt(run4, tmp_path):
    with pytest.raises(CheckpointError, match="holds no checkpoint; drop --resume"):
        plan_run(tmp_path / "none", True, 3)
    assert plan_run(run4, True, 3).resume_from == run4 / "checkpoints" / "step_00000004"
