"""Unit-cost runs of a schedule through the event engine.

Every forward costs ``t_f``, every backward ``t_b`` (a split one: ``I`` and ``W`` half of it each), a
cross-rank transfer ``t_comm`` of latency and nothing else, each chunk's data-parallel reduction
``t_reduce`` on the rank's reduction stream and each optimizer step ``t_optim``; no barriers. Useful to
look at a schedule's shape and for the analytic checks (bubble ``(P-1)/(M+P-1)``, fold's
``(V M + P - 1)(t_F + t_B)``).
"""

from __future__ import annotations

from typing import Any

from foldtrain.schedules import Op, Schedule, StepPolicy

from .events import run_schedule


class UnitCosts:
    """A :class:`~foldtrain.sim.events.Costs` of fixed durations and free links (see the module docstring)."""

    def __init__(
        self, t_f: float = 1.0, t_b: float = 2.0, t_comm: float = 0.0, t_reduce: float = 0.0, t_optim: float = 0.0
    ):
        self.t_f, self.t_b, self.t_comm, self.t_reduce, self.t_optim = t_f, t_b, t_comm, t_reduce, t_optim

    def compute(self, p: int, a) -> float:
        if a.op is Op.FORWARD:
            return self.t_f
        return self.t_b if a.op is Op.BACKWARD else self.t_b / 2

    def send(self, p: int, a):
        return ("free",), 1.0, self.t_comm, 0.0

    def reduce_buckets(self, p: int, c: int) -> list:
        return [(None, [("delay", self.t_reduce)])]

    def deferred_buckets(self, p: int, c: int):
        return None

    def tie(self, p: int, c: int):
        return None

    def optim(self, p: int, c: int) -> float:
        return self.t_optim

    def unshard(self, p: int, a):
        return None

    def blocking_reduce(self, p: int, c: int):
        return None

    def gather(self, p: int, c: int, without_tied: bool = False):
        return None

    def pair_gather(self, p: int, c: int):
        return None

    def tied_gather(self, p: int, c: int):
        return None

    def before_steps(self):
        return None

    def end_of_iteration(self):
        return None

    def queue_cap(self, meeting: str) -> float:
        return 0.0

    def link_bw(self, key) -> float:
        return float("inf")

    def cpu_share(self):
        return None

    def comm_cpu(self, nbytes: float) -> float:
        return 0.0

    def action_overhead(self) -> float:
        return 0.0

    def overlap_slowdown(self) -> float:
        return 0.0

    def policy(self) -> StepPolicy:
        return StepPolicy()


def simulate_order(sched: Schedule, t_f: float = 1.0, t_b: float = 2.0, t_comm: float = 0.0) -> dict:
    """One iteration of ``sched`` at unit costs (communication free but ``t_comm`` latency per edge).

    Returns ``{"ranks": [[(Action, start, end), ...] compute per rank], "makespan", "busy": [per-rank
    compute time], "bubble": [per-rank idle fraction of the makespan]}``.
    """
    sim = run_schedule(sched, UnitCosts(t_f, t_b, t_comm), iterations=1)
    comp = [sched.compute_only(p) for p in range(sched.pp)]
    out = []
    for p, r in enumerate(sim.ranks):
        evs = [e for e in r.events if e["kind"] == "compute"]
        out.append([(a, e["start"], e["end"]) for a, e in zip(comp[p], evs)])
    makespan = max((e for acts in out for _, _, e in acts), default=0.0)
    busy = [sum(e - s for _, s, e in acts) for acts in out]
    bubble = [1.0 - b / makespan if makespan else 0.0 for b in busy]
    return {
        "ranks": out,
        "makespan": makespan,
        "busy": busy,
        "bubble": bubble,
        "_sched": sched,
        "_costs": (t_f, t_b, t_comm),
    }


def events_from_simulation(
    sim_result: dict[str, Any],
    schedule: Schedule | None = None,
    *,
    t_reduce: float = 0.0,
    t_optim: float = 0.0,
    unit_s: float = 1e-3,
    step: int = 0,
    recv_waits: bool = True,
) -> list[list[dict[str, Any]]]:
    """Per-rank profile events (:mod:`foldtrain.profile.timeline` format) of a unit-cost run.

    One unit becomes ``unit_s`` seconds. With ``t_reduce`` / ``t_optim`` > 0 the reductions and
    optimizer steps are simulated too (``reduce_launch``, ``reduce``, ``reduce_wait``, ``optim``
    events); reductions deferred to the next iteration are launched but not waited for.
    """
    sched = schedule if schedule is not None else sim_result["_sched"]
    t_f, t_b, t_comm = sim_result["_costs"]
    with_red = t_reduce > 0 or t_optim > 0
    sim = run_schedule(sched, UnitCosts(t_f, t_b, t_comm, t_reduce, t_optim), iterations=1)
    keep = {"compute", "step"} | ({"recv_wait"} if recv_waits else set())
    if with_red:
        keep |= {"reduce_launch", "reduce", "reduce_wait", "optim"}
    out = []
    for r in sim.ranks:
        evs = []
        for e in r.events:
            if e["kind"] not in keep:
                continue
            e = dict(e, start=e["start"] * unit_s, end=e["end"] * unit_s, step=step)
            if e["kind"] == "step":
                e["name"], e["start"] = f"step {step}", 0.0
            evs.append(e)
        out.append(evs)
    return out
