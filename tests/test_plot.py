"""`foldtrain plot`: a PNG of several runs' curves; clear errors for directories without metrics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from foldtrain.cli import main
from foldtrain.errors import ConfigError
from foldtrain.plot import plot_runs, read_metrics, run_names, wall_times

PNG = b"\x89PNG\r\n\x1a\n"


def fake_run(d: Path, steps: int, speed: float, resume_at: int = 0) -> Path:
    d.mkdir(parents=True)
    lines = []
    for s in range(1, steps + 1):
        t = (s - resume_at if resume_at and s > resume_at else s) * 0.5  # a resumed session restarts its clock
        rec = {"step": s, "loss": 9.0 / s**0.3, "tokens_per_s": speed + s, "step_time_s": 0.5, "time_s": t}
        if s % 5 == 0:
            rec["val_loss"] = 8.0 / s**0.3
        lines.append(json.dumps(rec))
    (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return d


def test_plot_several_runs(tmp_path):
    a, b = fake_run(tmp_path / "ddp", 20, 4000.0), fake_run(tmp_path / "allreduce", 12, 3000.0, resume_at=6)
    out = tmp_path / "cmp.png"
    assert main(["plot", str(a), str(b), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG and out.stat().st_size > 10_000
    assert plot_runs([str(a)]) == a / "plot.png" and (a / "plot.png").read_bytes()[:8] == PNG  # default: beside the run
    assert wall_times(read_metrics(b))[-1] == pytest.approx(12 * 0.5)  # the resumed session continues the clock
    old = [{"step": 1, "loss": 1.0, "step_time_s": 0.25}, {"step": 2, "loss": 1.0, "step_time_s": 0.5}]
    assert wall_times(old) == [0.25, 0.75]  # records without time_s: summed step times
    assert run_names([str(a), str(tmp_path / "x" / "ddp")]) == [str(a), str(tmp_path / "x" / "ddp")]


def test_plot_of_a_real_run(small_data, tmp_path):
    from foldtrain.config import build_config
    from foldtrain.train.trainer import train
    from tests.conftest import tiny_run_args

    train(build_config(tiny_run_args(small_data, tmp_path / "run", "--train.steps", "4", "--train.eval_every", "2")))
    rec = read_metrics(tmp_path / "run")
    assert all(r["time_s"] > 0 for r in rec) and [r["time_s"] for r in rec] == sorted(r["time_s"] for r in rec)
    assert plot_runs([str(tmp_path / "run")]).read_bytes()[:8] == PNG


def test_plot_errors(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds no metrics.jsonl, so it is not a training run"):
        read_metrics(tmp_path / "empty")
    with pytest.raises(ConfigError, match="does not exist"):
        read_metrics(tmp_path / "nowhere")
    (tmp_path / "started").mkdir()
    (tmp_path / "started" / "metrics.jsonl").write_text("")
    with pytest.raises(ConfigError, match="holds no logged steps yet"):
        read_metrics(tmp_path / "started")
    assert main(["plot", str(tmp_path / "empty")]) == 2
    assert "foldtrain: error:" in capsys.readouterr().err
