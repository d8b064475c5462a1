"""Run logging: ``metrics.jsonl``, progress on stderr, a log file and TensorBoard when installed.

Progress goes to a terminal as a live tqdm bar; anywhere else (a Slurm ``.out`` file, nohup, CI, a
pipe) as one plain line per logged step, so the file holds no carriage-return updates. Both show
the same figures: step, loss, validation loss when evaluated, tokens/s.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import torch


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process: max allocated on CUDA, max RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def progress_figures(record: dict[str, Any]) -> dict[str, str]:
    """The figures a progress display shows for one metrics record, formatted."""
    post = {k: f"{record[k]:.4f}" for k in ("loss", "val_loss") if isinstance(record.get(k), float)}
    if "tokens_per_s" in record:
        post["tok/s"] = f"{record['tokens_per_s']:.0f}"
    return post


def truncate_metrics(path: Path, step: int) -> None:
    """Keep only the records of steps up to ``step`` in ``path`` (and no torn last line); atomic."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line + "\n")
        except (ValueError, KeyError, TypeError):
            continue  # a line torn by a kill mid-write
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(kept))
    tmp.replace(path)


class RunLogger:
    """Writes only on the main rank; other ranks get a silent logger.

    ``stream``: where progress and info lines go (default: ``sys.stderr`` at the time of writing).
    ``resumed``: the run continues from step ``start_step`` (a resume or a restart): records of later
    steps, logged by an attempt that died before its next checkpoint, are dropped from ``metrics.jsonl``
    so that it holds every step once.
    """

    def __init__(
        self,
        out: Path,
        enabled: bool,
        total_steps: int,
        start_step: int,
        progress: bool,
        stream: TextIO | None = None,
        resumed: bool = False,
    ):
        self.enabled = enabled
        if enabled and resumed:
            truncate_metrics(out / "metrics.jsonl", start_step)
        self.metrics = open(out / "metrics.jsonl", "a") if enabled else None
        self.log_file = open(out / "train.log", "a") if enabled else None
        self._stream = stream
        self.total_steps = total_steps
        self.progress = enabled and progress
        self.bar = None  # created at the first logged step, so start-up lines print above it
        self._bar_args = dict(total=total_steps, initial=start_step)
        self.tb = None
        if enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(out / "tb"))
            except ImportError:  # tensorboard not installed: optional
                self.tb = None

    def info(self, msg: str) -> None:
        if not self.enabled:
            return
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        self.log_file.write(line + "\n")
        self.log_file.flush()
        if self.bar is not None:
            self.bar.write(msg, file=self.stream)
        else:
            print(msg, file=self.stream, flush=True)

    @property
    def stream(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stderr

    def _is_terminal(self) -> bool:
        isatty = getattr(self.stream, "isatty", None)
        return bool(isatty and isatty())

    def log(self, record: dict[str, Any], advance: int = 0) -> None:
        if not self.enabled:
            return
        self.metrics.write(json.dumps(record) + "\n")
        self.metrics.flush()
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, record["step"])
        if not self.progress:
            return
        if not self._is_terminal():
            figures = "  ".join(f"{k} {v}" for k, v in progress_figures(record).items())
            print(f"step {record['step']}/{self.total_steps}  {figures}", file=self.stream, flush=True)
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(unit="step", dynamic_ncols=True, file=self.stream, **self._bar_args)
        self.bar.set_postfix(progress_figures(record), refresh=False)
        self.bar.update(advance)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        for f in (self.metrics, self.log_file):
            if f is not None:
                f.close()
        if self.tb is not None:
            self.tb.close()
