"""Output of ``foldtrain simulate``: a table, one JSON object, or the profile files of a real run."""

from __future__ import annotations

import json
from pathlib import Path

from .memory import GB
from .simulate import Result


def layout_text(r: Result) -> str:
    s = r.setup
    if s.mode == "3d":
        sched = (
            f"{s.schedule} dp_sync={s.dp_sync}"
            + (" defer_reduce" if s.defer else "")
            + (" distributed_optimizer" if s.dist_optim else "")
        )
        return (
            f"dp={s.dp} pp={s.pp} tp={s.tp} V={s.virtual} M={s.microbatches} x {s.micro_batch} seq={s.seq} "
            f"{sched} {s.dtype}" + (" ac=full" if s.ac else "")
        )
    srv = f" servers={s.servers}" if s.servers else ""
    stale = f" staleness={s.staleness}" if s.staleness else ""
    return f"{s.strategy} workers={s.dp}{srv}{stale} M={s.microbatches} x {s.micro_batch} seq={s.seq} {s.dtype}" + (
        " ac=full" if s.ac else ""
    )


def format_table(r: Result) -> str:
    lines = [
        f"cluster      {r.cluster.name} ({r.cluster.gpus_per_node} per node, {r.cluster.memory / GB:.0f} GB devices)",
        f"layout       {layout_text(r)}  ({r.setup.world} ranks)",
        f"step time    {r.step_time:.4g} s",
        f"throughput   {r.tokens_per_s:,.0f} tokens/s",
        f"MFU          {r.mfu:.1%}",
        f"bubble       {r.bubble:.1%} (mean over pipeline ranks)",
        f"all-rank idle {r.all_rank_idle:.1%}",
        f"exposed DP   {r.exposed_dp:.4g} s",
        f"peak memory  {r.peak_mem / GB:.2f} GB of {r.cluster.memory / GB:.0f} GB"
        + ("" if r.fits else "  (DOES NOT FIT)"),
        "",
        f"{'rank':>4} {'params':>8} {'grads':>8} {'optim':>8} {'masters':>8} {'buffers':>8} {'activ.':>8} "
        f"{'runtime':>8} {'total GB':>9}",
    ]
    for p, m in enumerate(r.memory):
        lines.append(
            f"{p:>4} "
            + " ".join(
                f"{m[k] / GB:>8.2f}"
                for k in ("params", "grads", "optimizer", "masters", "comm_buffers", "activations", "runtime")
            )
            + f" {m['total'] / GB:>9.2f}"
        )
    lines += [f"note: {n}" for n in r.notes]
    return "\n".join(lines)


def to_json_text(r: Result) -> str:
    return json.dumps(r.to_json(), indent=None)


def write_profile(r: Result, out: str | Path) -> list[str]:
    """``timeline.json`` (Chrome trace) and ``gantt.png`` of the simulated iterations, as a real ``--profile`` run."""
    from foldtrain.profile.analysis import format_summary, summarize
    from foldtrain.profile.export import plot_gantt, write_chrome_trace

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    events = r.events
    title = f"simulated on {r.cluster.name}: {layout_text(r)}"
    paths = [write_chrome_trace(out / "timeline.json", events)]
    try:
        paths.append(str(plot_gantt(out / "gantt.png", events, title)))
    except ImportError:
        pass  # matplotlib missing: the trace is still written
    (out / "summary.txt").write_text(format_summary(summarize(events)) + "\n")
    return paths
