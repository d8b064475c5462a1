"""Timeline profiling: per-rank event recording, cross-rank metrics, Chrome trace and Gantt export.

Torch-free except :func:`gather_timelines` (imports ``torch.distributed`` when called)
and matplotlib-free except :func:`plot_gantt` (imports matplotlib when called).

>>> from foldtrain.schedules import build_schedule, simulate_order
>>> from foldtrain.profile import events_from_simulation, summarize
>>> sim = simulate_order(build_schedule("1f1b", 4, 1, 8))
>>> s = summarize(events_from_simulation(sim))[-1]
>>> round(s["bubble"][0], 4) == round(3 / 11, 4)   # (P-1)/(M+P-1)
True
"""

from .analysis import (
    as_rank_lists,
    events_from_simulation,
    format_summary,
    idle_intervals,
    mean_summary,
    merge_intervals,
    step_summary,
    step_windows,
    summarize,
)
from .export import TRACE_ROWS, chrome_trace, load_events, plot_gantt, save_events, write_chrome_trace
from .timeline import KINDS, NULL_SPAN, Timeline, gather_timelines, shifted_events
from .recorder import StepProfiler

__all__ = [
    "KINDS",
    "NULL_SPAN",
    "StepProfiler",
    "TRACE_ROWS",
    "Timeline",
    "as_rank_lists",
    "chrome_trace",
    "events_from_simulation",
    "format_summary",
    "gather_timelines",
    "idle_intervals",
    "load_events",
    "mean_summary",
    "merge_intervals",
    "plot_gantt",
    "save_events",
    "shifted_events",
    "step_summary",
    "step_windows",
    "summarize",
    "write_chrome_trace",
]
