"""Metrics on synthetic events of known geometry and on simulated schedules."""

from __future__ import annotations

import pytest

from foldtrain.profile import (
    Timeline,
    as_rank_lists,
    format_summary,
    idle_intervals,
    last_chunk_forwards,
    link_windows,
    merge_intervals,
    step_windows,
    summarize,
)
from foldtrain.schedules import build_schedule
from foldtrain.sim import events_from_simulation, simulate_order

approx = pytest.approx


def ev(rank, kind, start, end, step=0, name=None, **args):
    return {"name": name or kind, "kind": kind, "rank": rank, "start": start, "end": end, "step": step, "args": args}


def two_ranks(r1_compute, r1_end):
    """Rank 0 computes [0,1] and [2,3]; rank 1 computes ``r1_compute``; step markers [0,3] and [0,r1_end]."""
    r0 = [
        ev(0, "compute", 0, 1),
        ev(0, "compute", 2, 3),
        ev(0, "reduce_wait", 3.0, 3.0),
        ev(0, "step", 0, 3, name="step 0"),
    ]
    r1 = [ev(1, "compute", *r1_compute), ev(1, "step", 0, r1_end, name="step 0")]
    return [r0, r1]


def test_union_covers_step_no_idle():
    s = summarize(two_ranks((1, 2), 3))[0]
    assert (s["start"], s["end"], s["duration"]) == (0, 3, 3)
    assert s["all_idle"] == approx(0.0) and s["all_idle_time"] == approx(0.0)
    assert s["compute"] == approx([2.0, 1.0])
    assert s["bubble"] == approx([1 / 3, 2 / 3])
    assert s["bubble_mean"] == approx(0.5) and s["bubble_max"] == approx(2 / 3)
    assert idle_intervals(two_ranks((1, 2), 3)) == []


def test_shifted_rank_gives_exact_idle_fraction():
    ranks = two_ranks((3.5, 4), 4)
    ranks[0].insert(0, ev(0, "reduce_wait", 3.0, 3.25, chunk=0))
    ranks[0].insert(0, ev(0, "reduce_wait", 3.25, 3.5, chunk=1))
    ranks[1].insert(0, ev(1, "reduce_wait", 1.0, 1.5, chunk=1))
    ranks[1].insert(0, ev(1, "recv_wait", 0.0, 3.5))
    ranks[1].insert(0, ev(1, "optim", 3.9, 4.0))
    s = summarize(ranks)[0]
    # window [0, 4]; union of compute [0,1] + [2,3] + [3.5,4] = 2.5
    assert s["duration"] == 4
    assert s["all_idle"] == approx(1 - 2.5 / 4)
    assert s["all_idle_time"] == approx(1.5)
    assert s["bubble"] == approx([1 - 2 / 4, 1 - 0.5 / 4])
    assert s["reduce_wait"] == approx([0.5, 0.5]) and s["reduce_wait_max"] == approx(0.5)
    assert s["recv_wait"] == approx([0.0, 3.5])
    assert s["optim"] == approx([0.0, 0.1])
    assert idle_intervals(ranks) == [(1, 2), (3, 3.5)]


def test_overlapping_compute_counted_once():
    ranks = [[ev(0, "compute", 0, 2), ev(0, "compute", 1, 3, name="fused"), ev(0, "step", 0, 4)]]
    s = summarize(ranks)[0]
    assert s["compute"] == approx([3.0]) and s["bubble"] == approx([0.25]) and s["all_idle"] == approx(0.25)


def test_the_computes_cpu_share_is_their_cpu_seconds_over_their_wall_seconds():
    """Over every rank's computes that kept their thread's CPU seconds (a measured run's); none: no figure."""
    timed = [
        [ev(0, "compute", 0, 2, cpu_s=1.0), ev(0, "compute", 2, 3, cpu_s=1.0), ev(0, "step", 0, 4, cpu_s=3.0)],
        [ev(1, "compute", 1, 4, cpu_s=2.0), ev(1, "step", 0, 4, cpu_s=2.5)],
    ]
    (s,) = [x for x in summarize(timed, skip_first=False) if x["step"] != "mean"]
    assert s["compute_cpu_share"] == approx(4.0 / 6.0)
    assert s["compute_cpu"] == approx(2.0) and s["process_cpu"] == approx(2.75)  # means over the ranks
    untimed = summarize(two_ranks((0, 3), 3), skip_first=False)
    assert all(x[k] is None for x in untimed for k in ("compute_cpu_share", "compute_cpu", "process_cpu"))


def test_steps_windows_and_mean_skips_warmup():
    ranks = [[], []]
    # step 0: [0, 10], both ranks compute 5 (rank 1 overlapping rank 0 by 2): union 8 -> idle 0.2
    # step 1: [10, 14], rank 0 computes 2, rank 1 computes 2 disjoint: union 4 -> idle 0
    # step 2: [14, 18], rank 0 computes 1, rank 1 nothing -> idle 0.75
    # an event between steps (step None) is ignored; events of step 1 past other windows count for step 1
    for r, segs in ((0, [(0, 0, 5), (1, 10, 12), (2, 14, 15)]), (1, [(0, 3, 8), (1, 12, 14)])):
        for st, a, b in segs:
            ranks[r].append(ev(r, "compute", a, b, step=st))
    for st, a, b in ((0, 0, 10), (1, 10, 14), (2, 14, 18)):
        for r in range(2):
            ranks[r].append(ev(r, "step", a, b - (0.5 if r else 0), step=st))
    ranks[0].append(ev(0, "compute", 100, 200, step=None))
    out = summarize(ranks)
    assert [s["step"] for s in out] == [0, 1, 2, "mean"]
    assert [s["all_idle"] for s in out[:3]] == approx([0.2, 0.0, 0.75])
    mean = out[-1]
    assert mean["steps"] == [1, 2]
    assert mean["all_idle"] == approx(0.375)
    assert mean["duration"] == approx(4.0)
    assert mean["bubble"] == approx([(0.5 + 0.75) / 2, (0.5 + 1.0) / 2])
    no_skip = summarize(ranks, skip_first=False)[-1]
    assert no_skip["steps"] == [0, 1, 2] and no_skip["all_idle"] == approx(0.95 / 3)
    # a single step is its own mean
    one = summarize([ranks[0][:1] + [ranks[0][3]]])
    assert one[-1]["steps"] == [0] and one[-1]["all_idle"] == one[0]["all_idle"]
    assert "all-idle" in format_summary(out)


def test_no_step_information_is_one_window():
    ranks = [[ev(0, "compute", 1, 2, step=None)], [ev(1, "compute", 3, 5, step=None)]]
    assert step_windows(ranks) == [(None, 1, 5)]
    s = summarize(ranks)[0]
    assert s["step"] is None and s["all_idle"] == approx(0.25)


def test_input_shapes_agree():
    ranks = two_ranks((3.5, 4), 4)
    flat = [e for evs in ranks for e in evs]
    as_map = {0: ranks[0], 1: ranks[1]}
    tls = [Timeline.from_dict({"rank": r, "events": evs}) for r, evs in enumerate(ranks)]
    ref = summarize(ranks)
    for shape in (flat, as_map, tls):
        assert as_rank_lists(shape) == ranks
        assert summarize(shape) == ref
    assert summarize([]) == [] and summarize(None) == []


def test_merge_intervals():
    assert merge_intervals([(3, 4), (0, 1), (0.5, 2), (2, 2.5), (5, 5)]) == [(0, 2.5), (3, 4)]


def test_timeline_events_feed_the_analysis():
    ticks = iter(range(1000))
    tls = [Timeline(r, clock=lambda: next(ticks)) for r in range(2)]  # a shared fake clock: one time base
    ticks = iter(range(2, 1000))
    tls[0].begin_step(0)
    tls[1].begin_step(0)  # noqa: E702
    with tls[0].span("F c0 m0", "compute"):
        pass
    with tls[1].span("RA c1 m0", "recv_wait"):
        pass
    with tls[1].span("F c1 m0", "compute"):
        pass
    tls[0].end_step(0)
    tls[1].end_step(0)  # noqa: E702
    s = summarize(tls)[0]
    # clock: 0, 1 wall bases; begin 2, 3; spans 4-5, 6-7, 8-9; end 10, 11 -> window [2, 11]
    assert s["duration"] == 9 and s["compute"] == [1, 1] and s["recv_wait"] == [0, 1]


# --------------------------------------------------------------------------- simulator bridge


def _summary(name, pp, v, m, **kw):
    sched = build_schedule(name, pp, v, m, kw.pop("dp_sync", "after-flush"))
    sim = simulate_order(sched, **{k: kw.pop(k) for k in ("t_f", "t_b", "t_comm") if k in kw})
    evs = events_from_simulation(sim, sched, **kw)
    return sched, sim, evs, summarize(evs)[0]


def test_events_from_simulation_shape():
    sched, sim, evs, _ = _summary("fold", 2, 2, 4, t_comm=0.5)
    for p in range(2):
        comp = [e for e in evs[p] if e["kind"] == "compute"]
        assert len(comp) == 2 * 2 * 4
        assert [(e["args"]["op"], e["args"]["chunk"], e["args"]["mb"]) for e in comp] == [
            (a.op.value, a.chunk, a.mb) for a in sched.compute_only(p)
        ]
        a, s, e = sim["ranks"][p][0]
        assert comp[0]["name"] == f"F c{a.chunk} m{a.mb}" and comp[0]["start"] == s * 1e-3
        assert [e["kind"] for e in evs[p] if e["kind"] not in ("compute", "recv_wait")] == ["step"]
    assert evs[1][0]["kind"] == "recv_wait" and evs[1][0]["name"] == "RA c1 m0"  # rank 1 waits for c0 m0 + t_comm


@pytest.mark.parametrize("p,m", [(4, 8), (2, 4), (4, 4), (3, 7)])
def test_1f1b_bubble_matches_analytic(p, m):
    _, sim, _, s = _summary("1f1b", p, 1, m)
    expected = (p - 1) / (m + p - 1)
    assert s["bubble"] == approx([expected] * p)
    assert s["bubble"] == approx(sim["bubble"])
    assert s["duration"] == approx(sim["makespan"] * 1e-3)
    assert s["all_idle"] == approx(0.0)  # some rank always computes in a flushed pipeline without DP
    assert s["reduce_wait_max"] == 0.0


def test_schedules_compare_sensibly():
    p, m = 4, 8
    _, _, _, gpipe = _summary("gpipe", p, 1, m)
    _, _, _, one_f = _summary("1f1b", p, 1, m)
    _, _, _, fold = _summary("fold", p, 2, m)
    _, _, _, inter = _summary("interleaved-1f1b", p, 2, m)
    assert gpipe["bubble"] == approx(one_f["bubble"])  # same bubble, 1F1B only saves memory
    assert fold["bubble"] == approx([(p - 1) / (2 * m + p - 1)] * p)  # (P-1)/(V*M+P-1)
    assert fold["bubble_mean"] < one_f["bubble_mean"]
    assert inter["bubble_mean"] == approx(fold["bubble_mean"])


def test_per_chunk_reduction_hides_dp_communication():
    """Fold3D's point: after-flush reductions leave every rank idle; per-chunk ones overlap the backward."""
    kw = dict(t_reduce=3.0, t_optim=0.5)
    _, _, flush_ev, flush = _summary("fold", 2, 2, 4, dp_sync="after-flush", **kw)
    _, _, chunk_ev, chunk = _summary("fold", 2, 2, 4, dp_sync="per-chunk", **kw)
    # after-flush: both chunks' reductions (2 x 3) serialised after the last backward of the rank
    assert flush["reduce_wait"] == approx([6e-3, 6e-3])
    # per-chunk: only chunk 0's reduction (the last to finish) is exposed
    assert chunk["reduce_wait"] == approx([3e-3, 3e-3])
    assert chunk["all_idle"] < flush["all_idle"]
    assert chunk["duration"] < flush["duration"]
    # all-rank idle = exposed tail: rank 0 ends last; its wait + 2 optimizer steps, nobody computes meanwhile
    assert flush["all_idle_time"] == approx((6 + 1) * 1e-3)
    assert chunk["all_idle_time"] == approx((3 + 1) * 1e-3)
    kinds = {e["kind"] for e in chunk_ev[0]}
    assert {"reduce", "reduce_launch", "reduce_wait", "optim"} <= kinds
    # deferred reductions are launched but waited for in the next iteration
    sched = build_schedule("fold", 2, 2, 4, "per-chunk", defer_reduce=True)
    evs = events_from_simulation(simulate_order(sched), sched, **kw)
    s = summarize(evs)[0]
    assert s["reduce_wait"] == approx([3e-3, 3e-3])
    assert len([e for e in evs[0] if e["kind"] == "optim"]) == 1


def test_link_windows_from_the_last_deferred_wait_to_the_first_launch():
    """Per step and node: from the end of the node's last wait for a deferred chunk to the node's first launch;
    0 when a launch comes first; other nodes' events, undeferred waits and steps without both left out."""

    def node(base, wait_end, launch, step, other_wait=None):
        r0 = [
            ev(base, "reduce_wait", wait_end - 0.5, wait_end, step, chunk=2, deferred=True),
            ev(base, "reduce_wait", 9.0, 9.5, step, chunk=0, deferred=False),  # the step's own WR: no deadline
            ev(base, "reduce_launch", launch + 1.0, launch + 1.0, step),
            ev(base, "step", 0, 10, step),
        ]
        r1 = [ev(base + 1, "reduce_launch", launch, launch, step), ev(base + 1, "step", 0, 10, step)]
        if other_wait is not None:
            r1.append(ev(base + 1, "reduce_wait", other_wait - 0.1, other_wait, step, chunk=3, deferred=True))
        return [r0, r1]

    step1 = node(0, 2.0, 5.0, 1, other_wait=3.0) + node(2, 1.0, 2.5, 1)  # node 0: 5 - 3; node 1: 2.5 - 1
    step2 = node(0, 6.0, 5.0, 2) + node(2, 1.0, 1.25, 2)  # node 0 launched before its last wait ended: 0
    ranks = [a + b for a, b in zip(step1, step2)]
    assert link_windows(ranks, [[0, 1], [2, 3]]) == approx([2.0, 1.5, 0.0, 0.25])
    # each rank its own node: rank 0 launches 1 s after rank 1; rank 1 has no deferred wait in step 2
    assert link_windows(ranks, [[0], [1]]) == approx([4.0, 2.0, 0.0])
    nothing = [[e for e in evs if e["kind"] != "reduce_launch"] for evs in ranks]
    assert link_windows(nothing, [[0, 1], [2, 3]]) == []


def test_last_chunk_forwards_after_the_first_least_over_the_ranks_holding_it():
    """Per step: the durations of the highest chunk's forwards after the first to start, summed per rank, the least
    over the ranks holding that chunk; other chunks, other ops and steps with one such forward left out."""

    def fwd(rank, chunk, start, dur, step, op="F"):
        return ev(rank, "compute", start, start + dur, step, op=op, chunk=chunk, mb=0)

    r1 = [fwd(1, 3, 0.5, 1.0, 1), fwd(1, 3, 0.0, 4.0, 1), fwd(1, 3, 6.0, 2.0, 1), fwd(1, 1, 9.0, 9.0, 1)]
    r1 += [fwd(1, 3, 20.0, 1.0, 1, op="W"), fwd(1, 3, 30.0, 1.0, 2)]  # a W; step 2: one forward only
    r3 = [fwd(3, 3, 0.0, 1.0, 1), fwd(3, 3, 1.0, 5.0, 1), fwd(3, 3, 6.0, 5.0, 1)]  # another replica's: 10 s
    r0 = [fwd(0, 2, 0.0, 50.0, 1), fwd(0, 2, 50.0, 50.0, 1), fwd(0, 2, 30.0, 1.0, 2), fwd(0, 2, 31.0, 1.0, 2)]
    ranks = [r0, r1, [], r3]
    # rank 1 started with the 4 s forward: 1 + 2 = 3 s after it (less than rank 3's 10); step 2's last chunk is
    # chunk 3 (one forward): no value, though chunk 2 has two there
    assert last_chunk_forwards(ranks) == approx([3.0])
    # the last chunk is the trace's: a step whose last-chunk forwards are missing gives nothing, not chunk 2's
    assert last_chunk_forwards([r0, [e for e in r1 if e["step"] != 1], [], [e for e in r3 if e["step"] != 1]]) == []
    untagged = [[dict(e, step=None) for e in evs] for evs in ranks]  # no steps: no window (not one over all)
    assert last_chunk_forwards(untagged) == []
    odd = [[ev(0, "compute", 0.0, 1.0, 1, op="F", chunk=None), ev(0, "compute", 1.0, 2.0, 1)], r1]  # no chunk, no args
    assert last_chunk_forwards(odd) == approx([3.0])
    nameless = [ev(0, "compute", t, t + 1.0, 1, op="F", chunk=None) for t in (0.0, 1.0, 2.0)]
    assert last_chunk_forwards([nameless]) == []  # no forward names its chunk


@pytest.mark.parametrize("name,v", [("fold-zb", 2), ("zbv", 2), ("1f1b", 1)])
def test_last_chunk_forwards_of_a_simulated_step(name, v):
    """On the simulator's events (the same format as a run's): M - 1 forwards of the last chunk, wherever it sits
    (zbv: rank 0)."""
    _, _, evs, _ = _summary(name, 2, v, 4, t_f=1.5, dp_sync="per-chunk")
    assert last_chunk_forwards(evs) == approx([3 * 1.5e-3])
