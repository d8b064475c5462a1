"""Timeline: recording, disabled no-ops, step windows, alignment, JSON, gather (fake and real torch.distributed)."""

from __future__ import annotations

import json
import sys
import threading
import time
import types

import pytest

from foldtrain.profile import KINDS, NULL_SPAN, Timeline, gather_timelines


class FakeClock:
    """Returns start, start + 1, ... on successive calls."""

    def __init__(self, start: float = 0.0) -> None:
        self.reset(start)

    def reset(self, start: float = 0.0) -> None:
        self.t = start - 1.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def fake_timeline(rank: int, start: float = 0.0) -> Timeline:
    """A timeline whose clock reads ``start``, ``start + 1``, ... from now on (after its calibration reads)."""
    clock = FakeClock()
    tl = Timeline(rank, clock=clock)
    clock.reset(start)
    return tl


def test_spans_recorded_in_order_with_kinds():
    tl = fake_timeline(3, start=1.0)
    tl.begin_step(7)  # clock 1
    with tl.span("F c0 m0", "compute", op="F", chunk=0, mb=0):  # 2..3
        pass
    with tl.span("RG c0 m0", "recv_wait", chunk=0, mb=0, peer=1):  # 4..5
        pass
    tl.record("LR c0", "reduce_launch", 5.5, 5.75, chunk=0)
    with tl.span("OS c0", "optim"):  # 6..7
        pass
    tl.instant("mark", "other", note="x")  # 8
    tl.end_step(7)  # 9
    with tl.span("eval", "other"):  # outside any step
        pass
    evs = tl.events
    assert [e["name"] for e in evs] == ["F c0 m0", "RG c0 m0", "LR c0", "OS c0", "mark", "step 7", "eval"]
    assert [e["kind"] for e in evs] == ["compute", "recv_wait", "reduce_launch", "optim", "other", "step", "other"]
    assert [(e["start"], e["end"]) for e in evs[:6]] == [(2, 3), (4, 5), (5.5, 5.75), (6, 7), (8, 8), (1, 9)]
    assert all(e["rank"] == 3 for e in evs)
    assert [e["step"] for e in evs] == [7] * 6 + [None]
    assert evs[0]["args"] == {"op": "F", "chunk": 0, "mb": 0, "cpu_s": evs[0]["args"]["cpu_s"]}
    # the CPU seconds: a compute's thread's, and the whole process's in the step; nothing else keeps them
    assert evs[0]["args"]["cpu_s"] >= 0.0 and evs[5]["args"]["cpu_s"] >= evs[0]["args"]["cpu_s"]
    assert [i for i, e in enumerate(evs) if "cpu_s" in e["args"]] == [0, 5]
    assert evs[1]["args"]["peer"] == 1
    assert evs[4]["args"] == {"note": "x", "instant": True}
    assert set(e["kind"] for e in evs) <= set(KINDS)


def test_a_compute_span_keeps_the_cpu_seconds_its_thread_ran():
    """A compute that waits (here: sleeps) keeps its wall time but hardly any CPU time; one that works keeps
    some of both: on shared cores, their ratio is the share of a core the rank had."""
    tl = Timeline(0)
    with tl.span("F c0 m0", "compute"):
        time.sleep(0.05)
    with tl.span("B c0 m0", "compute"):
        end = time.thread_time() + 0.02
        while time.thread_time() < end:
            pass
    slept, worked = tl.events
    assert slept["end"] - slept["start"] >= 0.05 and slept["args"]["cpu_s"] < 0.01
    assert 0.02 <= worked["args"]["cpu_s"] <= worked["end"] - worked["start"] + 1e-3


def test_span_records_when_body_raises_and_propagates():
    tl = fake_timeline(0)
    with pytest.raises(KeyError):
        with tl.span("B c1 m0", "compute"):
            raise KeyError("boom")
    assert len(tl.events) == 1 and tl.events[0]["end"] > tl.events[0]["start"]


def test_unknown_kind_and_reversed_times_rejected():
    tl = Timeline(0)
    with pytest.raises(ValueError, match="kind"):
        tl.span("x", "computee")
    with pytest.raises(ValueError, match="kind"):
        tl.record("x", "bogus", 0.0, 1.0)
    with pytest.raises(ValueError, match="before"):
        tl.record("x", "compute", 2.0, 1.0)


def test_disabled_timeline_records_nothing():
    tl = Timeline(0, enabled=False)
    assert tl.span("F", "compute", chunk=1) is NULL_SPAN
    assert tl.span("F", "not-a-kind") is NULL_SPAN  # no validation cost either
    with tl.span("F", "compute"):
        pass
    with pytest.raises(RuntimeError):  # the null span does not swallow exceptions
        with tl.span("F", "compute"):
            raise RuntimeError
    tl.record("x", "compute", 0, 1)
    tl.instant("x", "other")
    tl.begin_step(0)
    tl.end_step(0)
    assert tl.events == [] and len(tl) == 0 and tl.step is None


def test_disabled_span_does_no_work():
    """A disabled timeline costs one branch per span: the shared do-nothing span (C-level enter/exit,
    no allocation), no clock reads, no events, and exceptions still propagate."""
    reads = []
    tl = Timeline(0, enabled=False, clock=lambda: reads.append(1) or 0.0)
    reads.clear()  # construction may read the clock once to calibrate
    spans = {id(tl.span("F c0 m0", "compute", chunk=0, mb=0)) for _ in range(3)}
    assert spans == {id(NULL_SPAN)}
    with tl.span("B c0 m0", "compute"):
        pass
    with pytest.raises(KeyError):
        with tl.span("x", "send"):
            raise KeyError
    assert reads == [] and tl.events == []
    assert type(NULL_SPAN).__enter__ is tuple and type(NULL_SPAN).__exit__ == "".format  # builtins: no Python frame


def test_align_shifts_past_and_future_events():
    tl = fake_timeline(1, start=11.0)
    base = tl.wall_base
    tl.record("a", "compute", 11.0, 12.0)
    tl.align(-10.0)
    tl.record("b", "compute", 13.0, 14.0)
    with tl.span("c", "send"):
        pass
    assert [(e["start"], e["end"]) for e in tl.events] == [(1.0, 2.0), (3.0, 4.0), (1.0, 2.0)]
    assert tl.offset == -10.0 and tl.wall_base == base + 10.0  # event time + wall_base is still wall time


def test_json_round_trip():
    tl = fake_timeline(2)
    tl.begin_step(0)
    with tl.span("F c2 m1", "compute", op="F", chunk=2, mb=1):
        pass
    tl.instant("i", "other")
    tl.end_step()
    tl.align(0.5)
    s = tl.to_json()
    json.loads(s)
    back = Timeline.from_json(s)
    assert back.rank == 2 and back.events == tl.events
    assert back.offset == tl.offset and back.wall_base == tl.wall_base
    assert back.events is not tl.events


# --------------------------------------------------------------------------- gather_timelines


class _FakeDist(types.ModuleType):
    """Just enough of torch.distributed for gather_timelines, with one thread per rank."""

    def __init__(self, world: int) -> None:
        super().__init__("torch.distributed")
        self.world = world
        self.local = threading.local()
        self._barrier = threading.Barrier(world)
        self._slots: list = [None] * world
        self.calls: list[str] = []

    def is_available(self):
        return True

    def is_initialized(self):
        return True

    def get_world_size(self, group=None):
        return self.world

    def get_rank(self, group=None):
        return self.local.rank

    def get_global_rank(self, group, r):
        return r

    def barrier(self, group=None):
        self._barrier.wait(timeout=10)

    def all_gather_object(self, out, obj, group=None):
        self._slots[self.local.rank] = obj
        self.barrier()
        out[:] = list(self._slots)
        self.barrier()

    def gather_object(self, obj, out, dst=0, group=None):
        self._slots[self.local.rank] = obj
        self.barrier()
        if self.local.rank == dst:
            out[:] = list(self._slots)
        else:
            assert out is None
        self.barrier()


def test_gather_timelines_aligns_clocks_on_rank0(monkeypatch):
    fake = _FakeDist(2)
    fake_torch = types.ModuleType("torch")
    fake_torch.distributed = fake
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    monkeypatch.setitem(sys.modules, "torch.distributed", fake)

    # the same moments, seen by two processes whose perf_counter epochs differ by 1000 s
    tls = [Timeline(0), Timeline(1, clock=lambda: time.perf_counter() + 1000.0)]
    now = time.perf_counter()
    tls[0].record("F c0 m0", "compute", now + 1.0, now + 2.0)
    tls[1].record("F c1 m0", "compute", now + 1002.0, now + 1003.0)
    results: list = [None, None]

    def run(r: int) -> None:
        fake.local.rank = r
        results[r] = gather_timelines(tls[r])

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert results[1] is None
    got = results[0]
    assert [len(x) for x in got] == [1, 1]
    assert (got[0][0]["start"], got[0][0]["end"]) == (now + 1.0, now + 2.0)
    # moved onto rank 0's clock (to within the jitter of reading two clocks)
    assert got[1][0]["start"] == pytest.approx(now + 2.0, abs=1e-3)
    assert got[1][0]["end"] - got[1][0]["start"] == pytest.approx(1.0)
    assert tls[1].events[0]["start"] == now + 1002.0  # recorded events untouched


def test_gather_timelines_real_torch_single_process(tmp_path):
    torch = pytest.importorskip("torch")
    dist = torch.distributed
    tl = Timeline(0)
    with tl.span("F c0 m0", "compute"):
        pass
    assert gather_timelines(tl) == [tl.events]  # not initialised: this rank only
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("torch.distributed unavailable or already initialised")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        got = gather_timelines(tl)
    finally:
        dist.destroy_process_group()
    assert got == [tl.events]
