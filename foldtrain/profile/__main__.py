"""``python -m foldtrain.profile``: Gantt charts, Chrome traces and idle metrics.

* ``sim``: simulate one iteration of a schedule (``simulate_order``, optionally with
  a data-parallel reduction / optimizer model) and write its Gantt PNG and trace::

    python -m foldtrain.profile sim --schedule fold --pp 2 --virtual 2 --microbatches 4 \\
        --dp-sync per-chunk --t-comm 0.1 --t-reduce 3 --t-optim 0.5 --png docs/img/gantt_fold_sim.png

* ``report``: the same from recorded events (``save_events`` / ``Timeline.to_json`` files).
"""

from __future__ import annotations

import argparse
import sys

from .analysis import events_from_simulation, format_summary, summarize
from .export import load_events, plot_gantt, write_chrome_trace


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m foldtrain.profile", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sim = sub.add_parser("sim", help="simulate a schedule")
    sim.add_argument("--schedule", default="fold")
    sim.add_argument("--pp", type=int, default=2)
    sim.add_argument("--virtual", type=int, default=2)
    sim.add_argument("--microbatches", type=int, default=4)
    sim.add_argument("--dp-sync", default="per-chunk")
    sim.add_argument("--defer-reduce", action="store_true")
    sim.add_argument("--t-f", type=float, default=1.0)
    sim.add_argument("--t-b", type=float, default=2.0)
    sim.add_argument("--t-comm", type=float, default=0.0)
    sim.add_argument("--t-reduce", type=float, default=0.0, help="DP reduction time per chunk (units of the simulator)")
    sim.add_argument("--t-optim", type=float, default=0.0, help="optimizer step time per chunk")
    rep = sub.add_parser("report", help="metrics / plots of recorded events")
    rep.add_argument("files", nargs="+")
    rep.add_argument("--steps", type=int, nargs="*", help="plot only these steps")
    for p in (sim, rep):
        p.add_argument("--png", help="write a Gantt chart here")
        p.add_argument("--trace", help="write a Chrome trace JSON here")
        p.add_argument("--title", default=None)
    args = ap.parse_args(argv)

    steps = None
    if args.cmd == "sim":
        from foldtrain.schedules import build_schedule, simulate_order

        v = 1 if args.schedule == "1f1b" else args.virtual
        sched = build_schedule(args.schedule, args.pp, v, args.microbatches, args.dp_sync, args.defer_reduce)
        result = simulate_order(sched, args.t_f, args.t_b, args.t_comm)
        events = events_from_simulation(result, sched, t_reduce=args.t_reduce, t_optim=args.t_optim)
        title = args.title if args.title is not None else (
            f"{args.schedule} P={args.pp} V={v} M={args.microbatches} dp_sync={args.dp_sync}"
            + (" defer_reduce" if args.defer_reduce else "")
            + f" (simulated: t_F={args.t_f:g} t_B={args.t_b:g} t_comm={args.t_comm:g}"
            + (f" reduce={args.t_reduce:g}/chunk" if args.t_reduce else "")
            + (f" optim={args.t_optim:g}/chunk" if args.t_optim else "") + "; 1 unit = 1 ms)")
        unit = "ms"
    else:
        events = load_events(*args.files)
        title = args.title or ""
        steps = args.steps or None
        unit = "ms"
    print(format_summary(summarize(events), unit=unit))
    if args.png:
        print("wrote", plot_gantt(args.png, events, title, steps=steps))
    if args.trace:
        print("wrote", write_chrome_trace(args.trace, events, steps=steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
