"""Chrome-trace (Perfetto) export and a matplotlib Gantt chart of per-rank events.

Both take ``events_by_rank`` in any shape :func:`~foldtrain.profile.analysis.as_rank_lists`
accepts, from real runs (:func:`~foldtrain.profile.timeline.gather_timelines`) or the
simulator (:mod:`foldtrain.sim`, ``foldtrain simulate --profile DIR``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

from .analysis import as_rank_lists, idle_intervals, step_windows, summarize

# Chrome trace rows (tid) per event kind
TRACE_ROWS: dict[str, tuple[int, str]] = {
    "compute": (0, "compute"),
    "recv_wait": (1, "p2p comm"),
    "send": (1, "p2p comm"),
    "reduce_launch": (2, "dp reduce (blocking)"),
    "reduce_wait": (2, "dp reduce (blocking)"),
    "reduce": (3, "dp reduce (in flight)"),
    "optim": (4, "optimizer"),
    "other": (5, "other"),
    "step": (6, "step"),
}


def _is_instant(ev: dict[str, Any]) -> bool:
    return bool((ev.get("args") or {}).get("instant")) or ev["end"] <= ev["start"]


def _select_steps(ranks: list[list[dict]], steps: Iterable[Any] | None) -> list[list[dict]]:
    if steps is None:
        return ranks
    keep = set(steps)
    return [[ev for ev in evs if ev.get("step") in keep] for evs in ranks]


def chrome_trace(events_by_rank: Any, steps: Iterable[Any] | None = None) -> dict[str, Any]:
    """The Chrome trace-event dict (``{"traceEvents": [...]}``) of the events.

    Complete events (``ph: "X"``) for every event with a duration, instant events
    (``ph: "i"``) for ``Timeline.instant``; ``pid`` = rank, ``tid`` = row of the
    event's kind (:data:`TRACE_ROWS`); timestamps in µs from the first event;
    ``process_name`` ("rank N") and ``thread_name`` metadata.
    """
    ranks = _select_steps(as_rank_lists(events_by_rank), steps)
    t0 = min((ev["start"] for evs in ranks for ev in evs), default=0.0)
    out: list[dict[str, Any]] = []
    for r, evs in enumerate(ranks):
        out.append({"name": "process_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": r, "tid": 0, "args": {"sort_index": r}})
        used = sorted({TRACE_ROWS.get(ev["kind"], TRACE_ROWS["other"]) for ev in evs})
        for tid, label in used:
            out.append({"name": "thread_name", "ph": "M", "pid": r, "tid": tid, "args": {"name": label}})
            out.append({"name": "thread_sort_index", "ph": "M", "pid": r, "tid": tid, "args": {"sort_index": tid}})
        for ev in evs:
            tid = TRACE_ROWS.get(ev["kind"], TRACE_ROWS["other"])[0]
            args = dict(ev.get("args") or {})
            if ev.get("step") is not None:
                args.setdefault("step", ev["step"])
            rec = {
                "name": ev["name"],
                "cat": ev["kind"],
                "pid": r,
                "tid": tid,
                "ts": (ev["start"] - t0) * 1e6,
                "args": args,
            }
            if _is_instant(ev):
                rec.update(ph="i", s="t")
            else:
                rec.update(ph="X", dur=max(ev["end"] - ev["start"], 0.0) * 1e6)
            out.append(rec)
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str | os.PathLike, events_by_rank: Any, steps: Iterable[Any] | None = None) -> str:
    """Write :func:`chrome_trace` as JSON to ``path`` (open it in https://ui.perfetto.dev or chrome://tracing)."""
    path = _ensure_parent(path)
    with open(path, "w") as f:
        json.dump(chrome_trace(events_by_rank, steps), f, default=str)
    return path


def read_chrome_trace(path: str | os.PathLike) -> list[list[dict[str, Any]]]:
    """Per-rank events back from a file :func:`write_chrome_trace` wrote (``timeline.json``), in seconds from the
    trace's first event: what :mod:`.analysis` reads."""
    with open(path) as f:
        return _trace_events(json.load(f))


def _trace_events(trace: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """:func:`read_chrome_trace` of a trace already parsed."""
    flat = []
    for rec in trace["traceEvents"]:
        if rec.get("ph") not in ("X", "i"):
            continue
        args = dict(rec.get("args") or {})
        start = rec["ts"] / 1e6
        end = start + rec.get("dur", 0.0) / 1e6
        flat.append(
            {
                "name": rec["name"],
                "kind": rec["cat"],
                "rank": rec["pid"],
                "start": start,
                "end": end,
                "step": args.pop("step", None),
                "args": args,
            }
        )
    return as_rank_lists(flat)


# --------------------------------------------------------------------------- Gantt chart

_COLORS = {
    "F": "#4C72B0",  # forward
    "B": "#DD8452",  # backward
    "I": "#E8A87C",  # a split backward's input gradient
    "W": "#937860",  # a split backward's weight gradients
    "fused": "#8172B3",  # other compute, e.g. fused head + loss
    "recv_wait": "#D9D9D9",
    "send": "#A0A0A0",
    "reduce_wait": "#F4C7C3",
    "reduce": ("#55A868", "#9CD3A8"),
    "optim": "#C44E52",
    "other": "#CCB974",
    "idle": "#FFD54F",
}


def _compute_class(ev: dict[str, Any]) -> str:
    op = (ev.get("args") or {}).get("op")
    if op is None:
        op = ev["name"].split(" ", 1)[0]
    return op if op in ("F", "B", "I", "W") else "fused"


def _reduce_bars(evs: list[dict]) -> list[tuple[float, float, Any]]:
    """(start, end, chunk) of the data-parallel reductions in flight on one rank.

    ``reduce`` events when recorded; otherwise each ``reduce_launch`` paired with
    the next ``reduce_wait`` of the same chunk (launch -> end of the wait, an upper
    bound of the completion); launches never waited for are dropped.
    """
    bars = [(ev["start"], ev["end"], (ev.get("args") or {}).get("chunk")) for ev in evs if ev["kind"] == "reduce"]
    if bars:
        return bars
    pending: dict[Any, list[float]] = {}
    for ev in sorted(
        (e for e in evs if e["kind"] in ("reduce_launch", "reduce_wait")), key=lambda e: (e["start"], e["end"])
    ):
        c = (ev.get("args") or {}).get("chunk")
        if ev["kind"] == "reduce_launch":
            pending.setdefault(c, []).append(ev["start"])
        elif pending.get(c):
            bars.append((pending[c].pop(0), ev["end"], c))
    return bars


_MAIN_H, _MAIN_Y = 0.58, -0.40  # rank r's main band: [r + _MAIN_Y, r + _MAIN_Y + _MAIN_H]
_THIN_H, _THIN_Y = 0.16, 0.23  # its DP reductions: [r + _THIN_Y, r + _THIN_Y + _THIN_H]
_MAX_LABELS = 3000  # chunk / micro-batch labels written at most, over the whole chart

# legend entry per kind drawn: (label, Patch properties)
_LEGEND: dict[str, tuple[str, dict[str, Any]]] = {
    "F": ("forward", dict(facecolor=_COLORS["F"])),
    "B": ("backward", dict(facecolor=_COLORS["B"])),
    "I": ("backward, input gradient (I)", dict(facecolor=_COLORS["I"])),
    "W": ("backward, weight gradients (W)", dict(facecolor=_COLORS["W"])),
    "fused": ("other compute (fused head)", dict(facecolor=_COLORS["fused"])),
    "recv_wait": ("recv wait", dict(facecolor=_COLORS["recv_wait"], hatch="////", edgecolor="#8C8C8C")),
    "send": ("send", dict(facecolor=_COLORS["send"])),
    "reduce_wait": (
        "DP reduce wait (blocked)",
        dict(facecolor=_COLORS["reduce_wait"], hatch="xxx", edgecolor="#C44E52"),
    ),
    "reduce": ("DP reduction in flight", dict(facecolor=_COLORS["reduce"][0], edgecolor="#2F6B3C")),
    "optim": ("optimizer step", dict(facecolor=_COLORS["optim"])),
    "other": ("other", dict(facecolor=_COLORS["other"])),
    "idle": ("all ranks idle", dict(facecolor=_COLORS["idle"], alpha=0.5)),
}


def _ensure_parent(path: str | os.PathLike) -> str:
    """``path`` as a string, its directory created."""
    path = os.fspath(path)
    d = os.path.dirname(path)
    if d:
        os.makedirs(d, exist_ok=True)
    return path


class _GanttAxes:
    """The chart's axes with what drawing on them needs: the time origin (x in ms from it), the scale
    in pixels (to label only bars wide enough), and the kinds drawn so far (for the legend)."""

    def __init__(self, ax: Any, t0: float, px_per_ms: float, char_px: float):
        self.ax, self.t0, self.px_per_ms, self.char_px = ax, t0, px_per_ms, char_px
        self.present: set[str] = set()
        self.n_labels = 0

    def x(self, t: float) -> float:
        return (t - self.t0) * 1e3

    def draw_rank(self, r: int, evs: list[dict]) -> None:
        """Rank ``r``'s row: its events in the main band, the reductions in flight in the thin bar below."""
        self._draw_main_band(r, evs)
        self._draw_reductions(r, evs)
        self._draw_reduce_launches(r, evs)

    def _draw_main_band(self, r: int, evs: list[dict]) -> None:
        x = self.x
        groups: dict[str, list[tuple[float, float]]] = {}
        for ev in evs:
            kind = ev["kind"]
            if kind in ("step", "reduce", "reduce_launch") or _is_instant(ev):
                continue
            key = _compute_class(ev) if kind == "compute" else kind
            if key not in _COLORS:
                key = "other"
            groups.setdefault(key, []).append((x(ev["start"]), max(x(ev["end"]) - x(ev["start"]), 1e-9)))
            if kind == "compute" and self.n_labels < _MAX_LABELS:
                self._label_compute(r, ev)
        for key, bars in groups.items():
            self.present.add(key)
            style: dict[str, Any] = {"facecolors": _COLORS[key], "edgecolor": "white", "linewidth": 0.6, "zorder": 3}
            if key == "recv_wait":
                style.update(hatch="////", edgecolor="#8C8C8C", linewidth=0.4)
            elif key == "reduce_wait":
                style.update(hatch="xxx", edgecolor="#C44E52", linewidth=0.4)
            elif key == "send":
                style.update(edgecolor="none")
            self.ax.broken_barh(bars, (r + _MAIN_Y, _MAIN_H), **style)

    def _label_compute(self, r: int, ev: dict) -> None:
        """``c<chunk> m<mb>`` (or the tighter ``c<chunk>m<mb>``) inside a compute bar wide enough for it."""
        a = ev.get("args") or {}
        if "chunk" not in a or "mb" not in a:
            return
        w_px = (ev["end"] - ev["start"]) * 1e3 * self.px_per_ms
        for label in (f"c{a['chunk']} m{a['mb']}", f"c{a['chunk']}m{a['mb']}"):
            if w_px >= len(label) * self.char_px + 3:
                self.ax.text(
                    (self.x(ev["start"]) + self.x(ev["end"])) / 2,
                    r + _MAIN_Y + _MAIN_H / 2,
                    label,
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white",
                    clip_on=True,
                    zorder=4,
                )
                self.n_labels += 1
                return

    def _draw_reductions(self, r: int, evs: list[dict]) -> None:
        """The data-parallel reductions in flight, alternating two greens, labelled with their chunk."""
        x = self.x
        red = _reduce_bars(evs)
        if not red:
            return
        self.present.add("reduce")
        cols = _COLORS["reduce"]
        self.ax.broken_barh(
            [(x(s), max(x(e) - x(s), 1e-9)) for s, e, _ in red],
            (r + _THIN_Y, _THIN_H),
            facecolors=[cols[i % 2] for i in range(len(red))],
            edgecolor="#2F6B3C",
            linewidth=0.4,
            zorder=3,
        )
        for s, e, c in red:
            label = f"c{c}"
            if c is not None and (e - s) * 1e3 * self.px_per_ms >= len(label) * self.char_px * 0.85 + 2:
                self.ax.text(
                    (x(s) + x(e)) / 2,
                    r + _THIN_Y + _THIN_H / 2,
                    label,
                    ha="center",
                    va="center",
                    fontsize=6,
                    color="#143D1E",
                    clip_on=True,
                    zorder=4,
                )

    def _draw_reduce_launches(self, r: int, evs: list[dict]) -> None:
        launches = [self.x(ev["start"]) for ev in evs if ev["kind"] == "reduce_launch"]
        if launches:
            self.present.add("reduce_launch")
            self.ax.vlines(
                launches, r + _THIN_Y - 0.03, r + _THIN_Y + _THIN_H + 0.03, colors="#2F6B3C", linewidth=0.9, zorder=4
            )

    def draw_idle_and_steps(self, ranks: list[list[dict]]) -> None:
        """The intervals in which no rank computes, shaded across all rows; the steps' bounds dashed."""
        x = self.x
        for s, e in idle_intervals(ranks):
            self.present.add("idle")
            self.ax.axvspan(x(s), x(e), color=_COLORS["idle"], alpha=0.35, zorder=1, linewidth=0)
        wins = step_windows(ranks)
        if len(wins) > 1 or (wins and wins[0][0] is not None):
            for st, lo, hi in wins:
                self.ax.axvline(x(lo), color="#666666", linestyle="--", linewidth=0.7, zorder=2)
                self.ax.axvline(x(hi), color="#666666", linestyle="--", linewidth=0.7, zorder=2)
                if st is not None and len(wins) > 1:
                    self.ax.text(x(lo), -0.62, f" step {st}", fontsize=7, color="#444444", va="bottom", ha="left")


def _style_axes(ax: Any, n: int, span_ms: float) -> None:
    """One labelled row per rank, rank 0 on top; x in ms with a light grid."""
    ax.set_ylim(n - 0.5, -0.72)
    ax.set_yticks(range(n))
    ax.set_yticklabels([f"rank {r}" for r in range(n)])
    ax.set_xlim(-0.01 * span_ms, span_ms * 1.01)
    ax.set_xlabel("time (ms)")
    ax.grid(axis="x", color="#E5E5E5", linewidth=0.6, zorder=0)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def _stats_heading(title: str, ranks: list[list[dict]]) -> str:
    """``title`` with the all-rank idle / bubble / exposed-DP numbers of the last summary line under it."""
    summ = summarize(ranks)
    if not summ:
        return title
    m = summ[-1]
    note = "" if len(summ) <= 2 else f" (mean of steps {', '.join(map(str, m['steps']))})"
    line = (
        f"step {m['duration'] * 1e3:.3g} ms · all-rank idle {m['all_idle']:.1%} · "
        f"bubble mean {m['bubble_mean']:.1%} · exposed DP wait (max over ranks) "
        f"{m['reduce_wait_max'] * 1e3:.3g} ms{note}"
    )
    return f"{title}\n{line}" if title else line


def _add_legend(fig: Any, present: set[str]) -> None:
    from matplotlib.patches import Patch

    handles = [Patch(label=lab, **kw) for key, (lab, kw) in _LEGEND.items() if key in present]
    if handles:
        fig.legend(
            handles=handles,
            loc="lower center",
            bbox_to_anchor=(0.5, 0.02),
            ncol=min(len(handles), 7),
            fontsize=8,
            frameon=False,
        )


def plot_gantt(
    path: str | os.PathLike,
    events_by_rank: Any,
    title: str = "",
    *,
    steps: Iterable[Any] | None = None,
    stats: bool = True,
    width: float = 14.0,
    dpi: int = 130,
) -> str:
    """Write a Gantt chart PNG of the events (matplotlib, Agg; no pyplot state).

    One row per rank (rank 0 on top): forwards and backwards in two colours
    (labelled ``c<chunk> m<mb>`` where wide enough), other compute (fused head)
    in a third, receive waits grey and hatched, blocking DP-reduction waits
    hatched red, optimizer steps red; under each row a thin bar of the
    data-parallel reductions in flight (launch -> completion); the intervals in
    which no rank computes shaded across all rows. x axis: ms from the first
    event. ``steps`` restricts the chart to those steps; ``stats`` adds the
    all-rank idle / bubble / exposed-DP numbers under the title.
    """
    from matplotlib.figure import Figure

    ranks = _select_steps(as_rank_lists(events_by_rank), steps)
    n = max(len(ranks), 1)
    all_ev = [ev for evs in ranks for ev in evs]
    t0 = min((ev["start"] for ev in all_ev), default=0.0)
    t1 = max((ev["end"] for ev in all_ev), default=t0 + 1e-3)
    span_ms = max((t1 - t0) * 1e3, 1e-9)

    head_in = 0.75 if (stats or title) else 0.25
    foot_in = 1.05  # x label + legend
    height = head_in + 0.62 * n + 0.3 + foot_in
    fig = Figure(figsize=(width, height), dpi=dpi)
    left, right = 0.06, 0.985
    fig.subplots_adjust(left=left, right=right, bottom=foot_in / height, top=1.0 - head_in / height)
    ax = fig.add_subplot(1, 1, 1)
    axes_px = (right - left) * width * dpi
    char_px = 7 * dpi / 72 * 0.6  # ~ width of one 7 pt character
    chart = _GanttAxes(ax, t0, px_per_ms=axes_px / (span_ms * 1.02), char_px=char_px)

    for r, evs in enumerate(ranks):
        chart.draw_rank(r, evs)
    chart.draw_idle_and_steps(ranks)
    _style_axes(ax, n, span_ms)
    heading = _stats_heading(title, ranks) if stats and all_ev else title
    if heading:
        ax.set_title(heading, fontsize=10, loc="left")
    _add_legend(fig, chart.present)
    path = _ensure_parent(path)
    fig.savefig(path, dpi=dpi)
    return path


# --------------------------------------------------------------------------- saving gathered events


def save_events(path: str | os.PathLike, events_by_rank: Any) -> str:
    """Write per-rank events as JSON ``{"ranks": [[event, ...], ...]}`` (read back by :func:`load_events`)."""
    path = _ensure_parent(path)
    with open(path, "w") as f:
        json.dump({"ranks": as_rank_lists(events_by_rank)}, f, default=str)
    return path


def load_events(*paths: str | os.PathLike) -> list[list[dict[str, Any]]]:
    """Per-rank events from files written by :func:`save_events`, ``Timeline.to_json`` (one per rank) or
    :func:`write_chrome_trace` (a ``--profile`` run's ``timeline.json``, read by :func:`read_chrome_trace`).

    Events of a ``Timeline.to_json`` file go to that timeline's rank; the files
    must already share a time base (e.g. events gathered and saved by rank 0).
    """
    flat: list[dict[str, Any]] = []
    for p in paths:
        with open(p) as f:
            d = json.load(f)
        if isinstance(d, dict) and "ranks" in d:
            for r, evs in enumerate(d["ranks"]):
                flat += [dict(ev, rank=r) for ev in evs]
        elif isinstance(d, dict) and "events" in d:
            flat += [dict(ev, rank=d["rank"]) for ev in d["events"]]
        elif isinstance(d, dict) and "traceEvents" in d:
            flat += [ev for evs in _trace_events(d) for ev in evs]
        elif isinstance(d, dict):
            raise ValueError(
                f"{p}: not an events file (want the output of save_events, Timeline.to_json or a --profile run's "
                "timeline.json)"
            )
        else:  # a bare list of per-rank lists, or of events
            flat += [dict(ev, rank=r) for r, evs in enumerate(as_rank_lists(d)) for ev in evs]
    return as_rank_lists(flat)
