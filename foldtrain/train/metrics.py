"""Run logging: ``metrics.jsonl``, a live progress bar, a log file and TensorBoard when installed."""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process: max allocated on CUDA, max RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


class RunLogger:
    """Writes only on the main rank; other ranks get a silent logger."""

    def __init__(self, out: Path, enabled: bool, total_steps: int, start_step: int, progress: bool):
        self.enabled = enabled
        self.metrics = open(out / "metrics.jsonl", "a") if enabled else None
        self.log_file = open(out / "train.log", "a") if enabled else None
        self.bar = None  # created at the first logged step, so start-up lines print above it
        self._bar_args = dict(total=total_steps, initial=start_step) if enabled and progress else None
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
            self.bar.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr, flush=True)

    def log(self, record: dict[str, Any], advance: int = 0) -> None:
        if not self.enabled:
            return
        self.metrics.write(json.dumps(record) + "\n")
        self.metrics.flush()
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, record["step"])
        if self.bar is None and self._bar_args is not None:
            from tqdm import tqdm

            self.bar = tqdm(unit="step", dynamic_ncols=True, file=sys.stderr, **self._bar_args)
        if self.bar is not None:
            post = {k: record[k] for k in ("loss", "val_loss") if k in record}
            if "tokens_per_s" in record:
                post["tok/s"] = f"{record['tokens_per_s']:.0f}"
            self.bar.set_postfix(
                {k: (f"{v:.4f}" if isinstance(v, float) else v) for k, v in post.items()}, refresh=False
            )
            self.bar.update(advance)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        for f in (self.metrics, self.log_file):
            if f is not None:
                f.close()
        if self.tb is not None:
            self.tb.close()
