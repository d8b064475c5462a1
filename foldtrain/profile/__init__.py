"""Timeline profiling: per-rank event recording, cross-rank metrics, Chrome trace and Gantt export.

Torch-free except :func:`gather_timelines` (imports ``torch.distributed`` when called)
and matplotlib-free except :func:`plot_gantt` (imports matplotlib when called).

>>> from foldtrain.profile import summarize
>>> ev = lambda r, s, e: {"name": "F", "kind": "compute", "rank": r, "start": s, "end": e, "step": 0}
>>> s = summarize([[ev(0, 0.0, 1.0)], [ev(1, 1.0, 2.0)]])[-1]
>>> s["bubble"], s["all_idle"]
([0.5, 0.5], 0.0)

Simulated events come from :mod:`foldtrain.sim` (``foldtrain simulate --profile DIR``).
"""

from .analysis import (
    as_rank_lists,
    format_summary,
    idle_intervals,
    last_chunk_forwards,
    link_windows,
    mean_summary,
    merge_intervals,
    step_summary,
    step_windows,
    summarize,
)
from .export import (
    TRACE_ROWS,
    chrome_trace,
    load_events,
    plot_gantt,
    read_chrome_trace,
    save_events,
    write_chrome_trace,
)
from .recorder import StepProfiler
from .timeline import KINDS, NULL_SPAN, Timeline, gather_steps, gather_timelines, shifted_events

__all__ = [
    "KINDS",
    "NULL_SPAN",
    "StepProfiler",
    "TRACE_ROWS",
    "Timeline",
    "as_rank_lists",
    "chrome_trace",
    "format_summary",
    "gather_steps",
    "gather_timelines",
    "idle_intervals",
    "last_chunk_forwards",
    "link_windows",
    "load_events",
    "mean_summary",
    "merge_intervals",
    "plot_gantt",
    "read_chrome_trace",
    "save_events",
    "shifted_events",
    "step_summary",
    "step_windows",
    "summarize",
    "write_chrome_trace",
]
