"""Profiling of a multi-rank run: every rank keeps its steps' events; every ``flush_every`` steps and at the
run's end one gather (a collective) brings them to rank 0, which appends each step's idle figures to
``profile.jsonl`` and writes ``timeline.json`` and ``gantt.png`` of the last few steps.

Why not gather after every step: a gather holds every rank until the slowest arrives and its messages
queue behind the gradients on the link, so each step would end in a pause in which deferred reductions
run for free and the ranks line up again. The profiled steps then looked faster than the run's own (at
1 Gbit/s fold-zb with deferral paused 80-100 ms between its 340 ms steps). Now only the step after each
gather pays for it.

Collective: every rank calls :meth:`StepProfiler.after_step` and :meth:`StepProfiler.flush` alike.
"""

from __future__ import annotations

import json
from pathlib import Path

from foldtrain.profile.analysis import format_summary, summarize
from foldtrain.profile.export import plot_gantt, write_chrome_trace
from foldtrain.profile.timeline import Timeline, gather_steps

KEEP_STEPS = 3  # steps kept for timeline.json / gantt.png
FLUSH_EVERY = 50  # steps between gathers: a gather disturbs the step after it (see above)
PROFILE_FILE = "profile.jsonl"  # one line of figures per profiled step


def step_figures(gathered: list[list[dict]]) -> dict:
    """The figures of one step from its events on every rank (``profile.jsonl``'s line, without ``step``)."""
    s = [x for x in summarize(gathered, skip_first=False) if x.get("step") != "mean"]
    if not s:
        return {}
    s = s[-1]
    return {
        "bubble_fraction": s["bubble_mean"],
        "bubble_fraction_max": s["bubble_max"],
        "all_rank_idle_fraction": s["all_idle"],
        "exposed_dp_comm_s": s["reduce_wait_max"],
        "profiled_step_s": s["duration"],  # the step window over all ranks
        # compute + optimizer, busiest rank
        "busy_max_s": max((c + o for c, o in zip(s["compute"], s["optim"])), default=0.0),
        # the computes' CPU seconds over their wall seconds, every rank: on shared cores the share of a core
        # a computing rank had
        "compute_cpu_share": s["compute_cpu_share"],
        # CPU seconds of a rank's process in the step (every thread) and of its computes, means over the ranks:
        # their difference is what the collectives, the executor and the optimizer took
        "process_cpu_s": s["process_cpu"],
        "compute_cpu_s": s["compute_cpu"],
    }


class StepProfiler:
    def __init__(self, timeline: Timeline, keep_steps: int = KEEP_STEPS, flush_every: int = FLUSH_EVERY):
        self.timeline = timeline
        self.keep_steps, self.flush_every = keep_steps, flush_every
        self.pending: list[list[dict]] = []  # this rank's events of each step since the last gather
        self.steps: list[list[list[dict]]] = []  # rank 0: the last gathered steps, per step, per rank

    def after_step(self) -> bool:
        """Keep this step's events (no communication). True when :meth:`flush` is due."""
        self.pending.append(list(self.timeline.events))
        self.timeline.clear()
        return len(self.pending) >= self.flush_every

    def flush(self, out: Path | None = None) -> list[dict]:
        """Gather every rank's pending steps (a collective) and, on rank 0, append their figures to
        ``out/profile.jsonl``. Returns those figures, one dict per step with its ``step`` (rank 0; [] elsewhere)."""
        gathered = gather_steps(self.timeline, self.pending)
        self.pending = []
        if gathered is None:
            return []
        self.steps = (self.steps + gathered)[-self.keep_steps :]
        rows = []
        for g in gathered:
            steps = {ev["step"] for evs in g for ev in evs if ev["kind"] == "step"}
            figures = step_figures(g)
            if figures:
                rows.append({"step": max(steps) if steps else None, **figures})
        if out is not None and rows:
            out.mkdir(parents=True, exist_ok=True)
            with open(out / PROFILE_FILE, "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
        return rows

    def events(self) -> list[list[dict]]:
        """The kept steps' events per global rank (rank 0 only; empty elsewhere)."""
        if not self.steps:
            return []
        return [[ev for g in self.steps for ev in g[r]] for r in range(len(self.steps[0]))]

    def write(self, out: Path, title: str) -> dict:
        """Rank 0: write ``timeline.json`` and ``gantt.png`` of the kept steps and print the per-step table."""
        events = self.events()
        if not events:
            return {}
        out.mkdir(parents=True, exist_ok=True)
        write_chrome_trace(out / "timeline.json", events)
        plot_gantt(out / "gantt.png", events, title)
        summaries = summarize(events)
        print(
            f"pipeline profile ({title}); timeline.json and gantt.png in {out}\n{format_summary(summaries)}", flush=True
        )
        return summaries[-1] if summaries else {}
