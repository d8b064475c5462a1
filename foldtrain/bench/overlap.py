"""Overlap efficiency: how much of the communication that could be hidden was hidden.

    efficiency = (T_after_flush - T_run) / (T_after_flush - T_bound)
    T_bound    = max(T_compute, T_link)

* ``T_run``: the run's step time, from a run WITHOUT ``--profile`` (the profiler's per-step
  gather slows foldtrain's runs);
* ``T_compute``: the step with its data-parallel communication free, from the run's profiled
  twin: the step window minus the longest blocking data-parallel wait of any rank (for a pipeline
  this keeps its bubbles, which no overlap removes); for ``bench dp`` (no timeline): the step time
  minus the blocked communication time (``compute_s``);
* ``T_link``: the busiest node's bytes on the wire per step (the larger of sent / received, from
  the NIC counters of the emulated cluster) at the link's rate;
* ``T_after_flush``: ``bench pipeline``: the after-flush baseline of the same invocation and
  network (measured); ``bench dp``: ``T_compute + T_link``, nothing overlapped (a bound, not a run).

1.0 means the step is as short as the slower of computation and link allows; 0 means nothing was
gained over reducing after the flush. Undefined when ``T_after_flush <= T_bound`` (nothing to hide).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from foldtrain.bench.results import RunResult
from foldtrain.bench.tables import Ratio, _ratio


def rate_bytes(network: str) -> float | None:
    from foldtrain.errors import FoldtrainError
    from foldtrain.netem.cluster import parse_rate

    try:
        return parse_rate(network) / 8.0
    except FoldtrainError:
        return None  # loopback


def link_s(run: RunResult) -> float | None:
    rate = rate_bytes(run.network)
    if not rate or not run.wire:
        return None
    return max(max(s, r) for s, r in run.wire) / rate


def efficiency(t_af: float, t_run: float, t_compute: float, t_link: float) -> tuple[float | None, str]:
    bound = max(t_compute, t_link)
    detail = (
        f"T_after-flush {1e3 * t_af:.0f} ms, T_run {1e3 * t_run:.0f} ms, T_bound {1e3 * bound:.0f} ms = "
        f"max(compute {1e3 * t_compute:.0f}, link {1e3 * t_link:.0f})"
    )
    if t_af - bound <= 1e-9:
        return None, detail + "; nothing to hide"
    return (t_af - t_run) / (t_af - bound), detail


def pipeline_overlap(runs: list[RunResult], baseline: str = "interleaved-1f1b") -> list[Ratio]:
    """One line per foldtrain run that reduces per chunk, against the after-flush baseline."""
    out = []
    for r in runs:
        if r.bench != "pipeline" or r.impl != "foldtrain" or r.info.get("dp_sync") == "after-flush" or not r.ok:
            continue
        if r.info.get("bound_of"):  # a --bound run: its ratio to the throttled run is bound_ratios'
            continue
        base = next(
            (
                b
                for b in runs
                if b.bench == "pipeline"
                and b.impl == "foldtrain"
                and b.variant == baseline
                and b.network == r.network
                and b.info.get("dp_sync") == "after-flush"
                and b.ok
            ),
            None,
        )
        name = (
            f"overlap efficiency {r.variant} V={r.info.get('virtual')} {r.info.get('dp_sync')}"
            + (" defer" if r.info.get("defer") else "")
            + (" zero" if r.info.get("zero") else "")
            + f" [{r.network}]"
        )
        m = r.metrics
        t_link = link_s(r)
        needed = (base, m.get("step_time_s"), m.get("profiled_step_s"), t_link)
        if any(x is None for x in needed):
            out.append(Ratio(name, None, "needs the after-flush baseline, a profiled twin and an emulated network"))
            continue
        t_compute = m["profiled_step_s"] - m.get("exposed_dp_comm_s", 0.0)
        v, detail = efficiency(base.metrics["step_time_s"], m["step_time_s"], t_compute, t_link)
        out.append(Ratio(name, v, detail))
    return out


def dp_overlap(runs: list[RunResult]) -> list[Ratio]:
    out = []
    for r in runs:
        if r.bench != "dp" or not r.ok or r.workers < 2:
            continue
        m = r.metrics
        t_link = link_s(r)
        if t_link is None or m.get("step_time_s") is None or m.get("compute_s") is None:
            continue
        t_compute = m["compute_s"]
        v, detail = efficiency(t_compute + t_link, m["step_time_s"], t_compute, t_link)
        out.append(
            Ratio(
                f"overlap efficiency {r.label} [{r.network}, {r.precision}, {r.ranks} ranks]",
                v,
                detail + " (T_after-flush = compute + link)",
            )
        )
    return out


PROFILED_KEYS = (
    "all_rank_idle_fraction",
    "bubble_fraction",
    "bubble_fraction_max",
    "exposed_dp_comm_s",
    "profiled_step_s",
    "busy_max_s",
)


CONFIG_KEYS = ("virtual", "dp_sync", "defer", "zero", "tied", "fsdp")  # what tells two runs of a schedule apart


def _same_config(a: RunResult, b: RunResult, keys: tuple[str, ...] = CONFIG_KEYS) -> bool:
    return (a.impl, a.variant, a.network, a.precision) == (b.impl, b.variant, b.network, b.precision) and all(
        a.info.get(k) == b.info.get(k) for k in keys
    )


def merge_profiled(runs: list[RunResult]) -> list[RunResult]:
    """Fold each profiled twin's timeline figures into its plain run (whose speed is the one reported)."""
    twins = [r for r in runs if r.info.get("profiled_twin")]
    plain = [r for r in runs if not r.info.get("profiled_twin")]
    for t in twins:
        r = next((p for p in plain if _same_config(p, t)), None)
        if r is None:
            continue
        r.info["profiled_out"] = t.out_dir
        if t.ok:
            r.metrics.update({k: t.metrics[k] for k in PROFILED_KEYS if k in t.metrics})
        else:
            r.info["note"] = (
                r.info.get("note", "") + "; " if r.info.get("note") else ""
            ) + f"profiled run failed: {t.error}"
    return plain


def defer_ratios(runs: list[RunResult], baseline: str = "interleaved-1f1b") -> list[Ratio]:
    """fold + deferral against the after-flush baseline and against the best torch anchor."""
    out = []
    runs = [r for r in runs if not r.info.get("bound_of")]
    for net in dict.fromkeys(r.network for r in runs if r.bench == "pipeline"):
        d = next(
            (
                r
                for r in runs
                if r.impl == "foldtrain"
                and r.variant == "fold"
                and r.info.get("defer")
                and not r.info.get("zero")
                and r.network == net
            ),
            None,
        )
        if d is None:
            continue
        base = next(
            (
                r
                for r in runs
                if r.impl == "foldtrain"
                and r.variant == baseline
                and r.network == net
                and r.info.get("dp_sync") == "after-flush"
            ),
            None,
        )
        best = _fastest(
            [r for r in runs if r.impl == "torch" and r.network == net and r.ok and r.metrics.get("tokens_per_s")]
        )
        for other, label in (
            (base, f"{baseline} (after-flush)"),
            (best, f"best torch anchor ({best.variant})" if best else "best torch anchor"),
        ):
            if d.ok and other is not None and other.ok and other.metrics.get("tokens_per_s"):
                out.append(
                    Ratio(
                        f"fold+defer / {label} tokens/s [{net}]",
                        d.metrics["tokens_per_s"] / other.metrics["tokens_per_s"],
                    )
                )
            else:
                out.append(Ratio(f"fold+defer / {label} tokens/s [{net}]", None, "not run or failed"))
    return out


def zero_ratios(runs: list[RunResult]) -> list[Ratio]:
    """Each schedule with the distributed optimizer (``+zero``, ``+zero+tied``) against the same schedule without it."""
    out = []
    for r in runs:
        if r.impl != "foldtrain" or not r.info.get("zero"):
            continue
        same = ("virtual", "dp_sync", "defer")  # everything but the optimizer
        base = next((b for b in runs if not b.info.get("zero") and _same_config(r, b, same)), None)
        label = r.variant + ("+defer" if r.info.get("defer") else "")
        zero = "+zero" + ("+tied" if r.info.get("tied") else "")
        v, why = _ratio(r, base, names=(f"{label}{zero}", label))
        out.append(Ratio(f"{label}{zero} / {label} tokens/s [{r.network}]", v, why))
    return out


TORCH_ZERO_BUBBLE = ("interleaved-zb", "zbv", "dualpipev")


def _name(r: RunResult) -> str:
    """A run's schedule with its options, e.g. ``fold-zb+defer`` or ``torch:zbv``."""
    opts = ("+defer" if r.info.get("defer") else "") + ("+zero" if r.info.get("zero") else "")
    return r.label + opts + ("+tied" if r.info.get("tied") else "")


def zero_bubble_ratios(runs: list[RunResult]) -> list[Ratio]:
    """The zero-bubble schedules against the ones they improve on, per network: zb-h1 / 1f1b (tokens/s,
    all-rank idle, peak memory), interleaved-zb / interleaved-1f1b, fold-zb(+defer) / fold(+defer) and /
    interleaved-1f1b after the flush, each foldtrain zero-bubble schedule / each of torch's, and the best
    foldtrain configuration / the best torch one."""
    runs = [r for r in runs if r.bench == "pipeline" and not r.info.get("bound_of")]
    out: list[Ratio] = []
    for net in dict.fromkeys(r.network for r in runs):
        here = {_name(r): r for r in runs if r.network == net and not r.info.get("zero")}
        ours_by_name = {k: r for k, r in here.items() if r.impl == "foldtrain"}
        pairs = [("zb-h1", "1f1b"), ("interleaved-zb", "interleaved-1f1b"), ("fold-zb", "fold")]
        pairs += [
            ("fold-zb+defer", "fold+defer"),
            ("fold-zb", "interleaved-1f1b"),
            ("fold-zb+defer", "interleaved-1f1b"),
        ]
        for a, b in pairs:
            if a not in ours_by_name:
                continue
            v, why = _ratio(ours_by_name[a], ours_by_name.get(b), names=(a, b))
            out.append(Ratio(f"{a} / {b} tokens/s [{net}]", v, why))
            if (a, b) == ("zb-h1", "1f1b"):
                for key in ("all_rank_idle_fraction", "peak_mem_mb"):
                    v, why = _ratio(ours_by_name[a], ours_by_name.get(b), key, names=(a, b))
                    out.append(Ratio(f"{a} / {b} {key.replace('_', ' ')} [{net}]", v, why))
        ours = [r for r in ours_by_name.values() if r.variant in ("zb-h1", "interleaved-zb", "fold-zb")]
        for t in TORCH_ZERO_BUBBLE:
            theirs = here.get(f"torch:{t}")
            for r in ours if theirs is not None else []:
                v, why = _ratio(r, theirs, names=(_name(r), f"torch {t}"))
                out.append(Ratio(f"{_name(r)} / torch {t} tokens/s [{net}]", v, why))
        done = [r for r in here.values() if r.ok and r.metrics.get("tokens_per_s")]
        best = {impl: _fastest([r for r in done if r.impl == impl]) for impl in ("foldtrain", "torch")}
        if best["foldtrain"] is not None and best["torch"] is not None:
            f, t = best["foldtrain"], best["torch"]
            v, _ = _ratio(f, t)
            out.append(Ratio(f"best foldtrain ({_name(f)}) / best torch ({_name(t)}) tokens/s [{net}]", v))
    return out


def _fastest(runs: list[RunResult]) -> RunResult | None:
    return max(runs, key=lambda r: r.metrics["tokens_per_s"], default=None)


def _is_limit_of(b: RunResult, run: RunResult) -> bool:
    """Whether ``b`` is ``run``'s ``--bound`` twin: the same configuration with its links at the bound's rate."""
    return (
        b.info.get("bound_of") == run.network
        and not run.info.get("bound_of")
        and _same_config(run, replace(b, network=run.network))
    )


def bound_ratios(runs: list[RunResult]) -> list[Ratio]:
    """Each foldtrain run on a throttled network against the same run with the links changed in place to the
    ``--bound`` rate (its compute-bound limit)."""
    out: list[Ratio] = []
    for b in runs:
        net = b.info.get("bound_of")
        if not net:
            continue
        run = next((r for r in runs if _is_limit_of(b, r)), None)
        v, why = _ratio(run, b, names=(_name(b), f"{_name(b)} at {b.network}"))
        out.append(Ratio(f"{_name(b)} [{net}] / the same at {b.network} (its limit) tokens/s", v, why))
    return out


def _deferring(r: RunResult) -> bool:
    return r.bench == "pipeline" and r.impl == "foldtrain" and bool(r.info.get("defer")) and not r.info.get("bound_of")


def order_bounds(runs: list[RunResult]) -> list[Ratio]:
    """Each foldtrain run with ``--fold.defer_reduce`` on a throttled network against the shortest step its order
    of actions allows there. A node's link cannot carry the previous step's deferred bytes after the waits for them
    nor this step's before its first reduction is launched (:func:`foldtrain.profile.analysis.link_windows`, from
    the run's profiled twin), so on average a step lasts at least that node's bytes at the link's rate plus its mean
    window; the bound is the largest over the nodes. The value is the bound over the run's step; with a ``--bound``
    twin the detail gives the twin's step (the compute-bound limit) over the bound: at most that share of the limit is
    reachable. Not with the distributed optimizer or FSDP, whose all-gathers use the link inside that window."""
    from foldtrain.profile import link_windows

    def node_windows(events, node):
        return link_windows(events, [node])

    what = "its mean idle window"
    return [_link_bound(r, runs, "its order's bound", what, node_windows) for r in runs if _deferring(r)]


def layout_bounds(runs: list[RunResult]) -> list[Ratio]:
    """As :func:`order_bounds`, with the window ANY order of the run's layout and micro-batches leaves every link
    (:func:`foldtrain.profile.analysis.last_chunk_forwards`, the same for all nodes): with a ``--bound`` twin, the
    share of the compute-bound limit that no such order passes on this link."""
    from foldtrain.profile import last_chunk_forwards

    def run_windows(events, node):
        return last_chunk_forwards(events)

    what = "the last chunk's forwards after its first"
    return [_link_bound(r, runs, "any order's bound", what, run_windows) for r in runs if _deferring(r)]


def _link_bound(r: RunResult, runs: list[RunResult], bound_name: str, window_name: str, windows_of) -> Ratio:
    """``r``'s line for a bound of the form: per node, its bytes at the link's rate + the mean of
    ``windows_of(events, node's ranks)`` (seconds per step during which the link idles), the largest over nodes."""
    from foldtrain.profile import read_chrome_trace

    name = f"{_name(r)} V={r.info.get('virtual')} [{r.network}]: {bound_name} / its step"
    if r.info.get("zero") or r.info.get("fsdp"):
        return Ratio(name, None, "not with all-gathers of weights on the link (distributed optimizer, FSDP)")
    trace = Path(r.info.get("profiled_out", "")) / "timeline.json"
    rate, t_run = rate_bytes(r.network), r.metrics.get("step_time_s")
    if not (rate and r.wire and t_run and trace.is_file()):
        return Ratio(name, None, "needs the run's step time, a profiled twin (timeline.json), an emulated network")
    bounds = _node_bounds(read_chrome_trace(trace), r.wire, r.ranks // len(r.wire), rate, windows_of)
    if not bounds:
        return Ratio(name, None, f"its timeline gives no step a window on any node ({window_name})")
    bound, t_link, mean, windows = max(bounds, key=lambda b: b[0])
    detail = (
        f"step >= the busiest node's link {1e3 * t_link:.0f} ms + {window_name} {1e3 * mean:.0f} ms "
        f"(of {len(windows)} steps: {1e3 * min(windows):.0f}-{1e3 * max(windows):.0f}) = {1e3 * bound:.0f} ms; "
        f"measured {1e3 * t_run:.0f} ms"
    )
    limit = next((b for b in runs if _is_limit_of(b, r)), None)
    if limit is not None and limit.metrics.get("step_time_s"):
        t_lim = limit.metrics["step_time_s"]
        detail += f"; its limit at {limit.network} {1e3 * t_lim:.0f} ms = {t_lim / bound:.3f} of this bound"
    return Ratio(name, bound / t_run, detail)


def _node_bounds(events, wire, per_node: int, rate: float, windows_of) -> list[tuple[float, float, float, list]]:
    """Per node with windows: (its bytes at ``rate`` + its mean window, those bytes' seconds, the mean, the windows)."""
    out = []
    for n, (sent, received) in enumerate(wire):
        windows = windows_of(events, list(range(n * per_node, (n + 1) * per_node)))
        if windows:
            t_link, mean = max(sent, received) / rate, sum(windows) / len(windows)
            out.append((t_link + mean, t_link, mean, windows))
    return out
