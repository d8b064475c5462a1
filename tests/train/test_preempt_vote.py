"""The stop vote a 3D step carries with its loss (``share``): every rank stops after the same step, and no
collective of the loop's own is needed (the process-level signal tests: tests/faults/test_preempt_signal.py)."""

from __future__ import annotations

import signal

import torch

from foldtrain.train.preempt import Preemption
from foldtrain.train.trainer import column, memory_record


def test_the_vote_carried_by_the_step_decides_without_a_collective():
    p = Preemption(True, "TERM", 30.0, torch.device("cpu"))  # no process group: a collective would fail here
    assert p.flag() == 0.0
    p.received = signal.SIGTERM
    assert p.flag() == 1.0
    assert p.stop_agreed([0.0, 1.0]) is True  # another rank received it
    assert p.stop_agreed([0.0, 0.0]) is False  # the vote is what was carried, not this rank's now
    off = Preemption(False, "TERM", 30.0, torch.device("cpu"))
    assert off.flag() == 0.0 and off.stop_agreed([1.0]) is False


def test_memory_figures_come_from_the_carried_share():
    from foldtrain.distributed import DistEnv

    env = DistEnv(1, 3, 1, torch.device("cpu"))
    rec = memory_record(env, column([[0.0, 100.0], [0.0, 250.0], [0.0, 180.0]], 1))
    assert rec == {"peak_mem_mb": 250.0, "peak_mem_mb_max": 250.0, "peak_mem_mb_ranks": [100.0, 250.0, 180.0]}
