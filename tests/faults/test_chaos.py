"""Chaos at small size: under ``torchrun --max-restarts K``, K kills (SIGKILL) of a seeded random rank at a
seeded random step and point (forward, backward, a collective, a checkpoint save; this seed: a backward and a
forward), for the layout pp 2 x tp 2; with root and iproute2 also a whole emulated node (all its ranks at once)
lost on a 2 nodes x 2 ranks cluster.
The bench's other layouts restart through the same path, which tests/faults/test_kill_and_restart.py covers
with kills it places by hand: the data-parallel engines (allreduce, sharded-ps) and dp 2 x pp 2 with fold,
per-chunk dp_sync and deferred reductions (a kill before the first checkpoint and one in a reduction, as
this seed plans for it, are among its four); ``foldtrain bench chaos`` runs them all.

Each chaos run's final parameters equal an uninterrupted run's of the same config bit for bit, every
kill struck where it was planned (each attempt resumed from the checkpoint the plan predicts), and
``metrics.jsonl`` holds every step exactly once. The code is ``foldtrain bench chaos``'s, which runs
longer with more kills. Two launches per layout (reference and chaos).
"""

from __future__ import annotations

import sys

import pytest

from foldtrain.bench import chaos
from foldtrain.errors import FoldtrainError
from foldtrain.netem import cluster

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(900)]

KILLS, STEPS, EVERY, SEED = 2, 6, 2, 0  # as `foldtrain bench chaos --kills 2 --steps 6 --every 2`


def can_emulate() -> bool:
    try:
        cluster.check_prerequisites()
        return True
    except FoldtrainError:
        return False


def plans() -> dict[str, list[chaos.Kill]]:
    """The kills of each layout, seeded as the bench seeds them (layout i: SEED + i)."""
    return {
        layout: chaos.plan_kills(SEED + i, KILLS, world, STEPS, EVERY)
        for i, (layout, (world, _)) in enumerate(chaos.LAYOUTS.items())
    }


def test_the_plans_strike_at_every_point_and_at_reachable_steps():
    kills = [k for plan in plans().values() for k in plan]
    assert {k.point for k in kills} == set(chaos.POINTS)
    for plan in plans().values():
        start = 0
        for k in plan:
            assert start < k.step <= STEPS  # the attempt gets there before it ends
            start = chaos.resume_step(k, STEPS, EVERY)


def assert_nothing_lost(row: dict, kills: int = KILLS) -> None:
    assert row["rc"] == 0, row
    assert row["killed_workers"] == kills and row["survived"] == kills, row
    assert row["starts"] == row["planned_starts"], row  # every kill struck where planned
    assert row["params_equal"], row
    assert row["steps_once"], row
    assert row["ok"]


# tensor parallelism inside a pipeline (fold with deferred reductions: tests/faults/test_kill_and_restart.py)
TESTED = ("pp2xtp2",)


@pytest.mark.parametrize("layout", TESTED)
def test_random_kills_lose_nothing(small_data, tmp_path, layout, monkeypatch):
    monkeypatch.setattr(chaos, "TORCHRUN", [sys.executable, "-m", "tests.launch"])  # its ranks forked: tests/launch.py
    seed = SEED + list(chaos.LAYOUTS).index(layout)
    row = chaos.chaos_layout(layout, str(small_data), tmp_path, KILLS, STEPS, EVERY, seed)
    assert row["faults"] == chaos.fault_env(plans()[layout])
    assert_nothing_lost(row)


@pytest.mark.skipif(not can_emulate(), reason="the emulated cluster needs root and iproute2 (ip, tc)")
def test_a_whole_node_lost_loses_nothing(small_data, tmp_path):
    """One node loss (both ranks of node 1 at once); torchrun reports the node's first killed worker."""
    row = chaos.chaos_node_loss(str(small_data), tmp_path, 1, STEPS, EVERY, SEED + len(chaos.LAYOUTS))
    assert_nothing_lost(row, kills=1)
