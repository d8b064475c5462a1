"""Torch-free metrics over the events of all ranks (real runs and the simulator alike).

``events_by_rank`` is any of: a list of per-rank event lists (index = rank, as
:func:`~foldtrain.profile.timeline.gather_timelines` returns), a ``{rank: events}``
mapping, a list of :class:`~foldtrain.profile.timeline.Timeline`, or one flat
list of events (grouped by their ``"rank"`` field).

Per step window ``[t0, t1]`` (``D = t1 - t0``), with ``U_r`` the union of rank
``r``'s ``compute`` intervals clipped to the window:

* ``bubble[r]   = 1 - |U_r| / D``                      (per-rank pipeline bubble)
* ``all_idle    = 1 - |U_0 ∪ U_1 ∪ ... | / D``          (share of the step in which
  NO rank computes: Fold3D's "all-GPU idle time", 44% for Megatron in the paper)
* ``reduce_wait[r]`` = total ``reduce_wait`` time of rank ``r`` (data-parallel
  communication it could not hide); ``reduce_wait_max`` = its max over ranks.

Step windows: for a step ``s``, ``t0`` is the earliest start and ``t1`` the latest
end of the ranks' ``"step"`` events of ``s`` (written by ``Timeline.end_step``);
without them, of all events carrying ``step == s``; with no step information at
all, the whole recording is one window (``step: None``). An event counts for
step ``s`` when its ``step`` field is ``s`` (or, with no step information, always).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

Interval = tuple[float, float]

# --------------------------------------------------------------------------- input shapes


def as_rank_lists(events_by_rank: Any) -> list[list[dict[str, Any]]]:
    """Normalise the accepted input shapes to ``[events of rank 0, events of rank 1, ...]``."""
    if events_by_rank is None:
        return []
    if isinstance(events_by_rank, Mapping):
        if not events_by_rank:
            return []
        out: list[list[dict]] = [[] for _ in range(max(events_by_rank) + 1)]
        for r, evs in events_by_rank.items():
            out[r] = list(evs)
        return out
    seq = list(events_by_rank)
    if not seq:
        return []
    if all(isinstance(x, dict) for x in seq):  # one flat list of events
        n = max(int(ev["rank"]) for ev in seq) + 1
        out = [[] for _ in range(n)]
        for ev in seq:
            out[int(ev["rank"])].append(ev)
        return out
    return [list(getattr(x, "events", x) or []) for x in seq]


# --------------------------------------------------------------------------- interval arithmetic


def merge_intervals(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint union of ``intervals`` (empty ones dropped)."""
    ivs = sorted((float(s), float(e)) for s, e in intervals if e > s)
    out: list[Interval] = []
    for s, e in ivs:
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def clip_intervals(intervals: Iterable[Interval], lo: float, hi: float) -> list[Interval]:
    return [(max(s, lo), min(e, hi)) for s, e in intervals if min(e, hi) > max(s, lo)]


def total_length(intervals: Iterable[Interval]) -> float:
    return sum(e - s for s, e in merge_intervals(intervals))


def complement(merged: list[Interval], lo: float, hi: float) -> list[Interval]:
    """``[lo, hi]`` minus the disjoint sorted intervals ``merged``."""
    out: list[Interval] = []
    t = lo
    for s, e in merged:
        if s > t:
            out.append((t, min(s, hi)))
        t = max(t, e)
        if t >= hi:
            break
    if t < hi:
        out.append((t, hi))
    return [(s, e) for s, e in out if e > s]


# --------------------------------------------------------------------------- step windows


def step_windows(events_by_rank: Any) -> list[tuple[Any, float, float]]:
    """``[(step, t0, t1), ...]`` ordered by ``t0`` (see the module docstring)."""
    ranks = as_rank_lists(events_by_rank)
    markers: dict[Any, list[float]] = {}
    tagged: dict[Any, list[float]] = {}
    lo, hi = float("inf"), float("-inf")
    for evs in ranks:
        for ev in evs:
            s, e = ev["start"], ev["end"]
            lo, hi = min(lo, s), max(hi, e)
            step = ev.get("step")
            if step is None:
                continue
            table = markers if ev["kind"] == "step" else tagged
            w = table.setdefault(step, [s, e])
            w[0], w[1] = min(w[0], s), max(w[1], e)
    if not markers and not tagged:
        return [] if lo > hi else [(None, lo, hi)]
    wins = {**tagged, **markers}  # a step's markers win over its tagged events
    return sorted(((st, w[0], w[1]) for st, w in wins.items()), key=lambda x: (x[1], x[2]))


def _step_events(evs: list[dict], step: Any, has_steps: bool) -> list[dict]:
    return [ev for ev in evs if not has_steps or ev.get("step") == step]


def _kind_intervals(evs: list[dict], kind: str, lo: float, hi: float) -> list[Interval]:
    return clip_intervals(((ev["start"], ev["end"]) for ev in evs if ev["kind"] == kind), lo, hi)


def idle_intervals(events_by_rank: Any) -> list[Interval]:
    """Intervals, inside the step windows, during which no rank computes (for the Gantt shading)."""
    ranks = as_rank_lists(events_by_rank)
    wins = step_windows(ranks)
    has_steps = bool(wins) and wins[0][0] is not None
    out: list[Interval] = []
    for step, lo, hi in wins:
        busy = merge_intervals(
            iv for evs in ranks for iv in _kind_intervals(_step_events(evs, step, has_steps), "compute", lo, hi)
        )
        out += complement(busy, lo, hi)
    return out


# --------------------------------------------------------------------------- metrics


def step_summary(ranks: list[list[dict]], step: Any, lo: float, hi: float, has_steps: bool = True) -> dict[str, Any]:
    """Metrics of one step window ``[lo, hi]`` (see the module docstring); times in seconds."""
    dur = hi - lo
    compute, bubble, recv_wait, reduce_wait, optim = [], [], [], [], []
    all_busy: list[Interval] = []
    cpu_timed: list[dict] = []
    process_cpu: list[float] = []
    for evs in ranks:
        mine = _step_events(evs, step, has_steps)
        cpu_timed += [e for e in mine if e["kind"] == "compute" and "cpu_s" in e.get("args", {})]
        process_cpu += [e["args"]["cpu_s"] for e in mine if e["kind"] == "step" and "cpu_s" in e.get("args", {})]
        busy = merge_intervals(_kind_intervals(mine, "compute", lo, hi))
        all_busy += busy
        c = sum(e - s for s, e in busy)
        compute.append(c)
        bubble.append(1.0 - c / dur if dur > 0 else 0.0)
        recv_wait.append(sum(e - s for s, e in _kind_intervals(mine, "recv_wait", lo, hi)))
        reduce_wait.append(sum(e - s for s, e in _kind_intervals(mine, "reduce_wait", lo, hi)))
        optim.append(sum(e - s for s, e in _kind_intervals(mine, "optim", lo, hi)))
    union = total_length(all_busy)
    n = len(ranks)
    timed = [(e["end"] - e["start"], e["args"]["cpu_s"]) for e in cpu_timed if e["end"] > e["start"]]
    return {
        # CPU seconds over wall seconds of the compute spans that kept them (a measured run's, not a simulation's)
        "compute_cpu_share": sum(c for _, c in timed) / sum(w for w, _ in timed) if timed else None,
        # the CPU seconds a rank's whole process ran in the step (every thread), mean over the ranks
        "process_cpu": sum(process_cpu) / len(process_cpu) if process_cpu else None,
        "compute_cpu": sum(c for _, c in timed) / n if timed else None,
        "step": step,
        "start": lo,
        "end": hi,
        "duration": dur,
        "ranks": n,
        "compute": compute,
        "bubble": bubble,
        "bubble_mean": sum(bubble) / n if n else 0.0,
        "bubble_max": max(bubble, default=0.0),
        "all_idle": 1.0 - union / dur if dur > 0 else 0.0,
        "all_idle_time": max(dur - union, 0.0),
        "recv_wait": recv_wait,
        "reduce_wait": reduce_wait,
        "reduce_wait_max": max(reduce_wait, default=0.0),
        "optim": optim,
    }


_PER_RANK = ("compute", "bubble", "recv_wait", "reduce_wait", "optim")
_SCALARS = ("duration", "bubble_mean", "bubble_max", "all_idle", "all_idle_time", "reduce_wait_max")
_MEASURED = ("compute_cpu_share", "process_cpu", "compute_cpu")  # None where no event kept its CPU seconds


def mean_summary(steps: list[dict[str, Any]], skip_first: bool = True) -> dict[str, Any]:
    """Average of per-step summaries, without the first (warm-up) when ``skip_first`` and there are >= 2."""
    use = steps[1:] if skip_first and len(steps) >= 2 else list(steps)
    if not use:
        return {"step": "mean", "steps": []}
    k = len(use)
    n = max(s["ranks"] for s in use)
    out: dict[str, Any] = {"step": "mean", "steps": [s["step"] for s in use], "ranks": n}
    for key in _SCALARS:
        out[key] = sum(s[key] for s in use) / k
    for key in _MEASURED:
        known = [s[key] for s in use if s.get(key) is not None]
        out[key] = sum(known) / len(known) if known else None
    for key in _PER_RANK:
        out[key] = [sum(s[key][r] for s in use if r < len(s[key])) / k for r in range(n)]
    return out


def summarize(events_by_rank: Any, skip_first: bool = True) -> list[dict[str, Any]]:
    """One summary per step window (ordered by time), then their average.

    The last element has ``"step": "mean"`` and ``"steps"``: the steps it
    averages (all but the first, as warm-up, when there are >= 2 and
    ``skip_first``). Empty input gives ``[]``.
    """
    ranks = as_rank_lists(events_by_rank)
    wins = step_windows(ranks)
    if not wins:
        return []
    has_steps = wins[0][0] is not None
    per_step = [step_summary(ranks, st, lo, hi, has_steps) for st, lo, hi in wins]
    return per_step + [mean_summary(per_step, skip_first)]


def link_windows(events_by_rank: Any, nodes: list[list[int]]) -> list[float]:
    """Seconds per step and node during which a schedule that defers reductions into the next step (fold with
    ``--fold.defer_reduce``) leaves the node's data-parallel link nothing to carry, in whatever order it reduced:
    from the node's last wait for a deferred chunk (``reduce_wait`` with ``deferred``: that chunk's bytes of the
    previous step must have crossed when it starts) to the step's first reduction launched on the node
    (``reduce_launch``: until then no gradient of this step is complete), 0 when that launch comes first. Counted
    from the wait's end: a wait the link made longer delays what follows it, not the computation in between.
    ``nodes``: the ranks sharing each link. Steps of a node without both events are left out."""
    ranks = as_rank_lists(events_by_rank)
    out = []
    for step, _, _ in step_windows(ranks):
        for node in nodes:
            evs = [ev for r in node if r < len(ranks) for ev in ranks[r] if ev.get("step") == step]
            needed = [e["end"] for e in evs if e["kind"] == "reduce_wait" and (e.get("args") or {}).get("deferred")]
            launched = [e["start"] for e in evs if e["kind"] == "reduce_launch"]
            if needed and launched:
                out.append(max(0.0, min(launched) - max(needed)))
    return out


def last_chunk_forwards(events_by_rank: Any) -> list[float]:
    """Seconds per step during which no schedule of the same layout and micro-batches can use a data-parallel link,
    if it reduces every gradient once, complete (partial sums would add bytes) and updates synchronously. Every
    parameter takes part in every micro-batch's forward, so the previous step's reductions must have landed when
    the last chunk's first forward ends (``F`` of the highest ``chunk`` in the trace); every gradient depends on
    every micro-batch's loss, so none of this step's is complete before that chunk's last forward ends (the
    head's gradient comes first, with the loss, inside that forward). In between, the chunk's rank runs its other
    forwards: the sum of their measured durations, the least over the ranks holding the chunk (the conservative
    choice). Steps without two such forwards, and traces without steps, give nothing."""
    ranks = as_rank_lists(events_by_rank)
    forwards = [[e for e in evs if e["kind"] == "compute" and (e.get("args") or {}).get("op") == "F"] for evs in ranks]
    chunks = [e["args"].get("chunk") for evs in forwards for e in evs]
    last = max((c for c in chunks if c is not None), default=None)
    if last is None:
        return []
    out = []
    for step, _, _ in step_windows(ranks):
        if step is None:  # no steps in the trace: no window (not one over the whole recording)
            continue
        sums = []
        for evs in forwards:
            mine = sorted(
                (e for e in evs if e.get("step") == step and e["args"].get("chunk") == last), key=lambda e: e["start"]
            )
            if len(mine) >= 2:
                sums.append(sum(e["end"] - e["start"] for e in mine[1:]))
        if sums:
            out.append(min(sums))
    return out


def format_summary(summaries: list[dict[str, Any]], unit: str = "ms") -> str:
    """A small text table of :func:`summarize`'s output."""
    scale = {"s": 1.0, "ms": 1e3, "us": 1e6}[unit]
    lines = [
        f"{'step':>6} {'time/' + unit:>10} {'all-idle':>9} {'bubble(mean)':>13} {'bubble(max)':>12} "
        f"{'dp-wait(max)/' + unit:>16}"
    ]
    for s in summaries:
        if "duration" not in s:
            continue
        lines.append(
            f"{str(s['step']):>6} {s['duration'] * scale:>10.3f} {s['all_idle']:>9.1%} {s['bubble_mean']:>13.1%} "
            f"{s['bubble_max']:>12.1%} {s['reduce_wait_max'] * scale:>16.3f}"
        )
    return "\n".join(lines)
