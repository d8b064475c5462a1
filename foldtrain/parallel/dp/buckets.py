"""Gradient buckets that are identical on every rank, and their launch in one fixed order.

A collective must be called by every rank with the same tensor shape, in the same order. A
bucket plan is a list of buckets, each a list of parameter indices; two ways to make one:

* :func:`fixed_plan`: cut a fixed parameter order at byte boundaries (a small first bucket,
  then buckets up to a cap, big parameters alone). Every rank computes the same plan from the same model.
* :func:`timed_plan`: replay the gradient-ready times one rank observed during a backward and
  cut where Horovod's background loop would have launched: when the fusion buffer is full, or
  when a cycle time has passed since the last launch (``HOROVOD_CYCLE_TIME``). The times are one
  rank's (rank 0's), so the plan is computed once there and broadcast: a time-based flush decided
  independently on each rank would cut different buckets and deadlock or mis-sum.

:class:`OrderedLauncher` then launches bucket ``k`` once all its gradients are ready *and* buckets
``0..k-1`` have been launched: the launch order is the plan's order on every rank, whatever
order the hooks fire in. ``finish()`` launches whatever is left (parameters that got no gradient).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def fixed_plan(
    sizes: Sequence[int], order: Sequence[int], first_bytes: float, cap_bytes: float, alone_bytes: float | None = None
) -> list[list[int]]:
    """Buckets over ``order`` (parameter indices) with byte ``sizes``: the first closes at
    ``first_bytes``; the others never pass ``cap_bytes`` (a bucket closes before a parameter that
    would take it past the cap); a parameter of at least ``alone_bytes`` (default: the cap) is a
    bucket alone. So every bucket but the first holds at most ``max(cap, largest parameter)``."""
    alone = cap_bytes if alone_bytes is None else alone_bytes
    plan: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i in order:
        if cur and (sizes[i] >= alone or (plan and used + sizes[i] > cap_bytes)):
            plan.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += sizes[i]
        if used >= (first_bytes if not plan else cap_bytes) or sizes[i] >= alone:
            plan.append(cur)
            cur, used = [], 0
    if cur:
        plan.append(cur)
    return plan


def timed_plan(
    events: Sequence[tuple[int, float]],
    sizes: Sequence[int],
    n_params: int,
    first_bytes: float,
    cap_bytes: float,
    cycle_s: float,
) -> list[list[int]]:
    """Buckets from observed ``(parameter index, ready time)`` events, in their order.

    A bucket closes when it holds ``first_bytes`` (the first) or ``cap_bytes`` (the others), or
    before a gradient that arrives ``cycle_s`` or more after the last launch (``cycle_s <= 0``:
    no time flush). Parameters that never became ready form a last bucket, in index order."""
    plan: list[list[int]] = []
    cur: list[int] = []
    used = 0
    last = events[0][1] if events else 0.0
    seen = set()
    for i, t in events:
        if i in seen:
            continue
        seen.add(i)
        if cur and cycle_s > 0 and t - last >= cycle_s:
            plan.append(cur)
            cur, used, last = [], 0, t
        cur.append(i)
        used += sizes[i]
        if used >= (first_bytes if not plan else cap_bytes):
            plan.append(cur)
            cur, used, last = [], 0, t
    if cur:
        plan.append(cur)
    missing = [i for i in range(n_params) if i not in seen]
    if missing:
        plan.append(missing)
    return plan


class OrderedLauncher:
    """Counts ready gradients per bucket and calls ``launch(k)`` strictly in plan order."""

    def __init__(self, plan: list[list[int]], launch: Callable[[int], None]):
        self.plan = plan
        self.launch = launch
        self.bucket_of = {i: k for k, b in enumerate(plan) for i in b}
        self.reset()

    def reset(self) -> None:
        self.missing = [len(b) for b in self.plan]  # per bucket: gradients not ready yet
        self.next_bucket = 0  # the first bucket not launched yet
        self.log: list[int] = []  # bucket indices in launch order, this backward

    def ready(self, i: int) -> None:
        k = self.bucket_of[i]
        self.missing[k] -= 1
        while self.next_bucket < len(self.plan) and self.missing[self.next_bucket] <= 0:
            self._launch_next()

    def finish(self) -> None:
        while self.next_bucket < len(self.plan):
            self._launch_next()

    def _launch_next(self) -> None:
        k = self.next_bucket
        self.next_bucket += 1
        self.log.append(k)
        self.launch(k)
