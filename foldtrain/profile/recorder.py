"""Per-step profiling of a multi-rank run: gather every rank's timeline after each step, keep the
last few steps, report the step's idle figures, and write ``timeline.json`` and ``gantt.png``.

Collective: every rank calls :meth:`StepProfiler.after_step`; the events land on global rank 0.
"""

from __future__ import annotations

from pathlib import Path

from foldtrain.profile.analysis import format_summary, summarize
from foldtrain.profile.export import plot_gantt, write_chrome_trace
from foldtrain.profile.timeline import Timeline, gather_timelines

KEEP_STEPS = 3  # steps kept for timeline.json / gantt.png


class StepProfiler:
    def __init__(self, timeline: Timeline, keep_steps: int = KEEP_STEPS):
        self.timeline = timeline
        self.keep_steps = keep_steps
        self.steps: list[list[list[dict]]] = []  # gathered per step (rank 0)
        self.last: dict[str, float] = {}

    def after_step(self) -> None:
        """Gather this step's events of every rank (a collective) and summarise them on rank 0."""
        gathered = gather_timelines(self.timeline)
        self.timeline.clear()
        if gathered is None:
            return
        self.steps = (self.steps + [gathered])[-self.keep_steps :]
        s = [x for x in summarize(gathered, skip_first=False) if x.get("step") != "mean"]
        if s:
            s = s[-1]
            self.last = {
                "bubble_fraction": s["bubble_mean"],
                "bubble_fraction_max": s["bubble_max"],
                "all_rank_idle_fraction": s["all_idle"],
                "exposed_dp_comm_s": s["reduce_wait_max"],
                "profiled_step_s": s["duration"],  # the step window over all ranks
                # compute + optimizer, busiest rank
                "busy_max_s": max((c + o for c, o in zip(s["compute"], s["optim"])), default=0.0),
            }

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
