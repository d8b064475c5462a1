"""``foldtrain plot RUN [RUN ...] [--out PNG]``: training curves of one or more runs, overlaid.

Reads each run's ``metrics.jsonl`` and draws loss, validation loss and tokens/s against the
step (top row) and against wall time (bottom row), one line per run labelled with its name,
so comparing strategies or settings is a glance. Wall time is the record's ``time_s`` (seconds
since the training loop started; a resumed session continues from where the last one ended);
older runs without it fall back to the running sum of ``step_time_s``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from foldtrain.errors import ConfigError

PANELS = (("loss", "training loss"), ("val_loss", "validation loss"), ("tokens_per_s", "tokens/s"))


def read_metrics(run: str | Path) -> list[dict[str, Any]]:
    """The records of ``RUN/metrics.jsonl`` (or of a metrics file given directly), in order."""
    p = Path(run).expanduser()
    f = p / "metrics.jsonl" if p.is_dir() else p
    if not p.exists():
        raise ConfigError(f"run {p} does not exist; pass the --out directory of a `foldtrain train` run")
    if not f.is_file() or f.name != "metrics.jsonl":
        raise ConfigError(
            f"{p} holds no metrics.jsonl, so it is not a training run; "
            "pass the --out directory of a `foldtrain train` run"
        )
    records = []
    lines = f.read_text(encoding="utf-8").splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            if n == len(lines):
                break  # a run killed mid-write leaves a partial last line
            raise ConfigError(f"{f} line {n} is not JSON; the file is damaged") from None
        if isinstance(r, dict) and "step" in r:
            records.append(r)
    if not records:
        raise ConfigError(f"{f} holds no logged steps yet; plot after the run has logged a step")
    return records


def wall_times(records: list[dict[str, Any]]) -> list[float]:
    """Seconds of training at each record; resumed sessions (``time_s`` restarting) are laid end to end."""
    out, offset, last, acc = [], 0.0, 0.0, 0.0
    for r in records:
        if "time_s" in r:
            t = float(r["time_s"])
            if t < last:  # a new session (resume) restarted the clock
                offset += last
            last = t
            out.append(offset + t)
        else:
            acc += float(r.get("step_time_s", 0.0))
            out.append(acc)
    return out


def run_names(runs: list[str]) -> list[str]:
    """Short distinct labels: the directory names, or the paths when names repeat."""
    names = [Path(r).expanduser().resolve().name or str(r) for r in runs]
    return names if len(set(names)) == len(names) else [str(r) for r in runs]


def plot_runs(runs: list[str], out: str | Path | None = None) -> Path:
    """Draw the curves of ``runs`` into a PNG; returns its path."""
    if not runs:
        raise ConfigError("plot needs at least one run; pass RUN directories written by `foldtrain train`")
    data = [read_metrics(r) for r in runs]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("foldtrain plot needs matplotlib; install it with pip install 'foldtrain[plots]'") from None
    if out is None:
        out = Path(runs[0]) / "plot.png" if len(runs) == 1 else Path("foldtrain-plot.png")
    out = Path(out).expanduser()
    fig, axes = plt.subplots(2, len(PANELS), figsize=(5 * len(PANELS), 7.5), squeeze=False)
    for name, records in zip(run_names(runs), data):
        steps = [r["step"] for r in records]
        times = wall_times(records)
        for col, (key, _) in enumerate(PANELS):
            idx = [i for i, r in enumerate(records) if isinstance(r.get(key), (int, float))]
            style = {"marker": "o", "markersize": 3} if key == "val_loss" else {"linewidth": 1}
            for row, xs in enumerate((steps, times)):
                axes[row][col].plot([xs[i] for i in idx], [records[i][key] for i in idx], label=name, **style)
    for col, (_, title) in enumerate(PANELS):
        for row, xlabel in enumerate(("step", "wall time (s)")):
            ax = axes[row][col]
            ax.set_title(f"{title} vs {xlabel.split(' (')[0]}")
            ax.set_xlabel(xlabel)
            ax.grid(True, alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=8)
            else:
                ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
