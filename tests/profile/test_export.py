"""Chrome trace JSON, Gantt PNG, saving / loading events, and the command line."""

from __future__ import annotations

import json

import pytest

from foldtrain.profile import (
    Timeline,
    chrome_trace,
    load_events,
    plot_gantt,
    read_chrome_trace,
    save_events,
    summarize,
    write_chrome_trace,
)
from foldtrain.profile.__main__ import main
from foldtrain.schedules import build_schedule
from foldtrain.sim import events_from_simulation, simulate_order


@pytest.fixture(scope="module")
def fold_events():
    sched = build_schedule("fold", 2, 2, 4, "per-chunk")
    return events_from_simulation(simulate_order(sched, t_comm=0.1), sched, t_reduce=3.0, t_optim=0.5)


def recorded_events():
    """Events as a trainer records them: two steps, p2p waits, launch / wait of DP reductions, instants."""
    clock = iter(x * 1e-3 for x in range(1000)).__next__
    tls = [Timeline(r, clock=clock) for r in range(2)]
    for step in range(2):
        for tl in tls:
            tl.begin_step(step)
        for mb in range(2):
            with tls[0].span(f"F c0 m{mb}", "compute", op="F", chunk=0, mb=mb):
                pass
            with tls[0].span(f"SA c0 m{mb}", "send", chunk=0, mb=mb, peer=1):
                pass
            with tls[1].span(f"RA c1 m{mb}", "recv_wait", chunk=1, mb=mb, peer=0):
                pass
            with tls[1].span(f"F+B c1 m{mb}", "compute", op="FB", chunk=1, mb=mb):
                pass
        for mb in range(2):
            with tls[0].span(f"B c0 m{mb}", "compute", op="B", chunk=0, mb=mb):
                pass
        for r, tl in enumerate(tls):
            with tl.span(f"LR c{r}", "reduce_launch", chunk=r):
                pass
            tl.instant("launched", "other")
            with tl.span("data", "other"):
                pass
            with tl.span(f"WR c{r}", "reduce_wait", chunk=r):
                pass
            with tl.span(f"OS c{r}", "optim", chunk=r):
                pass
            tl.end_step(step)
    return [tl.events for tl in tls]


def test_chrome_trace_structure(tmp_path, fold_events):
    path = write_chrome_trace(tmp_path / "sub" / "trace.json", fold_events)
    with open(path) as f:
        trace = json.load(f)
    evs = trace["traceEvents"]
    xs = [e for e in evs if e["ph"] == "X"]
    instants = [e for e in evs if e["ph"] == "i"]
    n_all = sum(len(r) for r in fold_events)
    n_instant = sum(1 for r in fold_events for e in r if e["args"].get("instant"))
    assert len(xs) == n_all - n_instant and len(instants) == n_instant > 0
    names = {(e["pid"], e["args"]["name"]) for e in evs if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {(0, "rank 0"), (1, "rank 1")}
    assert min(e["ts"] for e in xs) == 0.0
    assert all(e["dur"] >= 0 and e["pid"] in (0, 1) for e in xs)
    f0 = next(e for e in xs if e["name"] == "F c0 m0")
    assert f0["tid"] == 0 and f0["cat"] == "compute" and f0["dur"] == pytest.approx(1000.0)  # 1 unit = 1 ms = 1000 us
    b = next(e for e in xs if e["name"] == "B c2 m3")
    assert b["dur"] == pytest.approx(2000.0)
    tids = {e["cat"]: e["tid"] for e in xs}
    assert len({tids["compute"], tids["recv_wait"], tids["reduce_wait"], tids["optim"]}) == 4


def test_chrome_trace_of_recorded_events_and_step_filter():
    ranks = recorded_events()
    full = chrome_trace(ranks)["traceEvents"]
    one = chrome_trace(ranks, steps=[1])["traceEvents"]
    n_x = sum(1 for r in ranks for e in r if not e["args"].get("instant"))
    assert sum(e["ph"] == "X" for e in full) == n_x
    assert sum(e["ph"] == "X" for e in one) == n_x // 2
    assert all(e["args"]["step"] == 1 for e in one if e["ph"] in ("X", "i"))
    json.dumps(full)


def test_a_written_trace_reads_back_as_the_events(tmp_path):
    """timeline.json back into events: every event with its rank, kind, name, step, args and duration, the times
    from the trace's first event (what the analysis reads of a run, e.g. bench pipeline's order bound)."""
    ranks = recorded_events()
    back = read_chrome_trace(write_chrome_trace(tmp_path / "timeline.json", ranks))
    t0 = min(e["start"] for r in ranks for e in r)
    assert len(back) == len(ranks)
    for mine, read in zip(ranks, back):
        assert len(read) == len(mine)
        key = lambda e: (e["start"], e["name"])  # noqa: E731
        for a, b in zip(sorted(mine, key=key), sorted(read, key=lambda e: (e["start"] + t0, e["name"]))):
            assert (b["name"], b["kind"], b["rank"], b["step"], b["args"]) == (
                a["name"],
                a["kind"],
                a["rank"],
                a["step"],
                a["args"],
            )
            assert b["start"] == pytest.approx(a["start"] - t0, abs=1e-9)
            assert b["end"] - b["start"] == pytest.approx(a["end"] - a["start"], abs=1e-9)
    assert summarize(back)[-1]["duration"] == pytest.approx(summarize(ranks)[-1]["duration"])


def _png_ok(path, min_bytes=5000):
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > min_bytes, len(data)


def test_gantt_png_from_simulation(tmp_path, fold_events):
    path = plot_gantt(tmp_path / "gantt.png", fold_events, title="fold P=2 V=2 M=4")
    _png_ok(path, 20000)


def test_gantt_png_from_recorded_events(tmp_path):
    _png_ok(plot_gantt(tmp_path / "rec.png", recorded_events(), steps=[1], stats=False, dpi=80), 3000)


def test_save_load_round_trip(tmp_path):
    ranks = recorded_events()
    back = load_events(save_events(tmp_path / "ev.json", ranks))
    assert back == ranks
    # per-rank Timeline.to_json files
    paths = []
    for r, evs in enumerate(ranks):
        p = tmp_path / f"tl{r}.json"
        p.write_text(Timeline.from_dict({"rank": r, "events": evs}).to_json())
        paths.append(p)
    assert summarize(load_events(*paths)) == summarize(ranks)
    # a --profile run's timeline.json (a Chrome trace) reads back as read_chrome_trace reads it
    trace = write_chrome_trace(tmp_path / "t.json", ranks)
    assert load_events(trace) == read_chrome_trace(trace)
    for got, want in zip(summarize(load_events(trace)), summarize(ranks), strict=True):  # to the trace's 1 us
        for key in ("duration", "all_idle", "bubble", "compute", "reduce_wait"):
            assert got[key] == pytest.approx(want[key], abs=1e-5), key
    other = tmp_path / "other.json"
    other.write_text('{"format": 3}')
    with pytest.raises(ValueError, match="not an events file"):
        load_events(other)


def test_cli_report(tmp_path, capsys):
    trace2, ev = tmp_path / "r.json", tmp_path / "ev.json"
    save_events(ev, recorded_events())
    assert main(["report", str(ev), "--trace", str(trace2), "--steps", "1"]) == 0
    assert len(json.loads(trace2.read_text())["traceEvents"]) > 10
    capsys.readouterr()
    assert main(["report", str(trace2)]) == 0  # a --profile run's timeline.json: the same table for step 1
    table = capsys.readouterr().out
    assert "bubble" in table and len(table.splitlines()) >= 3, table
