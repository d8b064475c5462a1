"""Checkpoint on a signal (``--checkpoint.on_signal``): finish the step, save together, exit.

A handled signal (``--checkpoint.signals``, default TERM and USR1) only sets a flag. At every step
boundary the ranks all-reduce that flag (one int, MAX), so a signal that reached only some ranks, or
reached them during different steps, still makes every rank stop after the same step. They save a
checkpoint of that step, log one line and exit with :data:`foldtrain.errors.EXIT_PREEMPTED`.

A second signal more than :data:`REPEAT_GRACE_S` after the first, or ``--checkpoint.signal_timeout_s``
passing before the save is complete, ends the process at once with
:data:`foldtrain.errors.EXIT_PREEMPT_ABORTED` (``os._exit``: no cleanup); saves are atomic, so the
previous checkpoint stays the latest intact one. A signal repeated within the grace counts once: a
scheduler that signals every process and a torchrun that forwards the same signal deliver it twice.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from foldtrain import collectives
from foldtrain.config.validate import parse_signals
from foldtrain.errors import EXIT_PREEMPT_ABORTED

REPEAT_GRACE_S = 2.0


class Preemption:
    """Signal handlers while training runs; ``stop_agreed()`` at each step boundary."""

    def __init__(self, enabled: bool, signals: str, timeout_s: float, device: torch.device):
        self.enabled = enabled
        self.signals = parse_signals(signals) if enabled else []
        self.timeout_s = timeout_s
        self.device = device if dist.is_initialized() and dist.get_backend() == "nccl" else torch.device("cpu")
        self.received: signal.Signals | None = None
        self._first_at = 0.0
        self._old: dict = {}
        self._timer: threading.Timer | None = None

    def __enter__(self) -> Preemption:
        if self.enabled and threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)
        self._old.clear()
        if self._timer is not None:
            self._timer.cancel()

    def _handle(self, signum, _frame) -> None:
        now = time.monotonic()
        if self.received is None:
            self.received, self._first_at = signal.Signals(signum), now
            if self.timeout_s > 0:
                self._timer = threading.Timer(
                    self.timeout_s,
                    _abort,
                    (
                        f"the save after {self.received.name} "
                        f"took longer than --checkpoint.signal_timeout_s {self.timeout_s:g}",
                    ),
                )
                self._timer.daemon = True
                self._timer.start()
        elif now - self._first_at > REPEAT_GRACE_S:
            _abort(f"a second signal ({signal.Signals(signum).name}) arrived before the save was complete")

    def flag(self) -> float:
        """This rank's vote for :meth:`stop_agreed`: 1.0 once it has received a signal."""
        return 1.0 if self.enabled and self.received is not None else 0.0

    def stop_agreed(self, votes: list[float] | None = None) -> bool:
        """Whether any rank has received a signal (collective: call on every rank at the same boundary).
        ``votes``: every rank's :meth:`flag` as the step's own collective carried it (then no collective)."""
        if not self.enabled:
            return False
        if votes is not None:
            return any(v > 0 for v in votes)
        flag = 1 if self.received is not None else 0
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return bool(flag)
        t = torch.tensor([flag], dtype=torch.int32, device=self.device)
        collectives.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def describe(self) -> str:
        return self.received.name if self.received is not None else "a signal on another rank"


def _abort(why: str) -> None:
    os.write(
        sys.stderr.fileno(),
        f"foldtrain: error: {why}; aborted without saving, the previous checkpoint is intact "
        f"(exit {EXIT_PREEMPT_ABORTED})\n".encode(),
    )
    os._exit(EXIT_PREEMPT_ABORTED)
