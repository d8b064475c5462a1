"""``python -m foldtrain.profile report FILES``: Gantt chart, Chrome trace and idle metrics of recorded events.

``FILES`` are ``save_events`` / ``Timeline.to_json`` files or a ``--profile`` run's ``timeline.json``. A simulated
run writes the same ``timeline.json`` / ``gantt.png`` as a real ``--profile`` run with ``foldtrain simulate ...
--profile DIR``.
"""

from __future__ import annotations

import argparse
import sys

from .analysis import format_summary, summarize
from .export import load_events, plot_gantt, write_chrome_trace


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m foldtrain.profile", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    rep = sub.add_parser("report", help="metrics / plots of recorded events")
    rep.add_argument("files", nargs="+")
    rep.add_argument("--steps", type=int, nargs="*", help="plot only these steps")
    rep.add_argument("--png", help="write a Gantt chart here")
    rep.add_argument("--trace", help="write a Chrome trace JSON here")
    rep.add_argument("--title", default=None)
    args = ap.parse_args(argv)
    events = load_events(*args.files)
    steps = args.steps or None
    print(format_summary(summarize(events), unit="ms"))
    if args.png:
        print("wrote", plot_gantt(args.png, events, args.title or "", steps=steps))
    if args.trace:
        print("wrote", write_chrome_trace(args.trace, events, steps=steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
