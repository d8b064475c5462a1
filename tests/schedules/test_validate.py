"""The validator must reject broken schedules; the timing model must reproduce the textbook makespans."""

import dataclasses
import itertools

import pytest

from foldtrain.schedules import (
    Action,
    Op,
    Schedule,
    ScheduleError,
    build_schedule,
    validate_schedule,
)
from foldtrain.sim import simulate_order


def edited(sched: Schedule, rank: int, fn) -> Schedule:
    ranks = [list(r) for r in sched.ranks]
    ranks[rank] = fn(list(ranks[rank]))
    return dataclasses.replace(sched, ranks=ranks)


def index(acts, text):
    return [str(a) for a in acts].index(text)


def swap(acts, x, y):
    i, j = index(acts, x), index(acts, y)
    acts[i], acts[j] = acts[j], acts[i]
    return acts


def move_before(acts, x, y):
    a = acts.pop(index(acts, x))
    acts.insert(index(acts, y), a)
    return acts


def rejects(sched, needle, **kw):
    with pytest.raises(ScheduleError) as e:
        validate_schedule(sched, **kw)
    assert needle in str(e.value), str(e.value)
    return str(e.value)


BASE = build_schedule("1f1b", 2, 1, 2)  # rank 1: RA(c1,m0<-0) F(c1,m0) B(c1,m0) SG(c1,m0->0) RA(c1,m1<-0) ...


def test_base_is_valid():
    validate_schedule(BASE)


def test_swapped_recvs_rejected():
    bad = edited(BASE, 1, lambda a: swap(a, "RA(c1,m0<-0)", "RA(c1,m1<-0)"))
    rejects(bad, "order mismatch")


def test_swapped_sends_rejected():
    bad = edited(BASE, 1, lambda a: swap(a, "SG(c1,m0->0)", "SG(c1,m1->0)"))
    rejects(bad, "order mismatch")


def test_send_order_across_kinds_checked_per_pair():
    # P=2: rank 0 sends activations AND gradients to rank 1; with one channel per direction
    # their relative order matters, with one channel per kind it does not.
    s = build_schedule("interleaved-1f1b", 2, 2, 2)
    acts1 = s.ranks[1]
    # find a RA and a RG on rank 1 that are adjacent in rank 1's receive order and swap them
    recvs = [i for i, a in enumerate(acts1) if a.op in (Op.RECV_ACT, Op.RECV_GRAD)]
    i, j = next((i, j) for i, j in zip(recvs, recvs[1:]) if acts1[i].op is not acts1[j].op)
    ranks = [list(r) for r in s.ranks]
    # move the later recv just before the earlier one: kind order unchanged, cross-kind order broken
    ranks[1].insert(i, ranks[1].pop(j))
    bad = dataclasses.replace(s, ranks=ranks)
    rejects(bad, "order mismatch")  # strict default
    validate_schedule(bad, channels="per-kind")  # separate channels per kind: still fine


def test_dropped_backward_rejected():
    bad = edited(BASE, 0, lambda a: [x for x in a if str(x) != "B(c0,m1)"])
    rejects(bad, "B(c0,m1) is missing on rank 0")


def test_duplicate_forward_rejected():
    bad = edited(BASE, 0, lambda a: a + [Action(Op.FORWARD, 0, 1)])
    rejects(bad, "appears 2 times")


def test_backward_before_forward_rejected():
    bad = edited(BASE, 1, lambda a: move_before(a, "B(c1,m1)", "RA(c1,m1<-0)"))
    rejects(bad, "backward before its forward")


def test_compute_before_its_recv_rejected():
    bad = edited(BASE, 1, lambda a: swap(a, "RA(c1,m1<-0)", "F(c1,m1)"))
    rejects(bad, "needs RA(c1,m1)")


def test_send_before_compute_rejected():
    bad = edited(BASE, 0, lambda a: swap(a, "F(c0,m0)", "SA(c0,m0->1)"))
    rejects(bad, "needs F(c0,m0)")


def test_wrong_rank_and_peer_rejected():
    rejects(edited(BASE, 0, lambda a: a + [Action(Op.FORWARD, 1, 0)]), "lives on rank 1")
    bad = edited(BASE, 0, lambda a: [dataclasses.replace(x, peer=0) if x.op is Op.SEND_ACT else x for x in a])
    rejects(bad, "peer must be rank 1")


def test_unmatched_send_rejected():
    bad = edited(BASE, 1, lambda a: [x for x in a if str(x) != "RA(c1,m1<-0)"])
    rejects(bad, "SA(c0,m1->1) has no matching recv on rank 1")


def test_deadlock_reports_each_rank():
    # rank 0 waits for a gradient before sending the activation that produces it
    bad = edited(BASE, 0, lambda a: move_before(a, "RG(c0,m0<-1)", "SA(c0,m0->1)"))
    msg = rejects(bad, "deadlock")
    assert "rank 0 blocked at #1 RG(c0,m0<-1)" in msg and "rank 1 blocked at #0 RA(c1,m0<-0)" in msg


def test_reduction_errors_rejected():
    rejects(edited(BASE, 0, lambda a: [x for x in a if x.op is not Op.OPTIM_STEP]), "0 OS actions")
    rejects(edited(BASE, 0, lambda a: swap(a, "WR(c0)", "OS(c0)")), "LR < WR < OS")
    rejects(edited(BASE, 0, lambda a: move_before(a, "LR(c0)", "B(c0,m1)")), "before the chunk's last backward")
    # a wait before the forward is only legal with defer_reduce
    moved = edited(BASE, 0, lambda a: move_before(move_before(a, "WR(c0)", "F(c0,m0)"), "OS(c0)", "F(c0,m0)"))
    rejects(moved, "defer_reduce is off")
    deferred = build_schedule("fold", 2, 2, 2, "per-chunk", True)
    rejects(edited(deferred, 0, lambda a: move_before(a, "F(c2,m0)", "WR(c2)")), "before the chunk's first forward")
    rejects(edited(deferred, 0, lambda a: move_before(a, "F(c2,m0)", "OS(c2)")), "must both precede the first forward")


def test_after_flush_launch_must_follow_compute():
    s = build_schedule("fold", 2, 2, 2)
    rejects(edited(s, 0, lambda a: move_before(a, "LR(c2)", "B(c0,m1)")), "after-flush")


def test_rendezvous_model():
    for name, v in (("gpipe", 2), ("1f1b", 1)):
        validate_schedule(build_schedule(name, 4, v, 8), sends="rendezvous")
    # breadth-first sends far ahead of their consumer: needs asynchronous sends
    rejects(build_schedule("fold", 2, 2, 4), "deadlock (rendezvous sends)", sends="rendezvous")
    validate_schedule(build_schedule("fold", 2, 2, 4), sends="async")


# ------------------------------------------------------------------ timing


@pytest.mark.parametrize("pp,m", list(itertools.product((1, 2, 4), (1, 2, 4, 8))))
def test_gpipe_and_1f1b_makespan(pp, m):
    t_f, t_b = 1.0, 2.0
    expect = (m + pp - 1) * (t_f + t_b)
    for name in ("gpipe", "1f1b"):
        r = simulate_order(build_schedule(name, pp, 1, m), t_f, t_b)
        assert r["makespan"] == pytest.approx(expect)
        assert r["bubble"][0] == pytest.approx((pp - 1) / (m + pp - 1))


@pytest.mark.parametrize("pp,m", [(2, 2), (2, 4), (4, 4), (4, 8)])
def test_interleaved_and_fold_shrink_the_bubble(pp, m):
    one = simulate_order(build_schedule("1f1b", pp, 1, m))
    for v in (2, 3):
        for name in ("interleaved-1f1b", "fold"):
            r = simulate_order(build_schedule(name, pp, v, m))
            assert max(r["bubble"]) < min(one["bubble"]), (name, v, r["bubble"], one["bubble"])
        # fold (M >= P): (V*M + P - 1) chunk-units of F+B, the Fold3D paper's cost model
        assert simulate_order(build_schedule("fold", pp, v, m))["makespan"] == pytest.approx((v * m + pp - 1) * 3.0)


def test_simulate_records_and_comm_latency():
    s = build_schedule("1f1b", 2, 1, 1)
    r = simulate_order(s, 1.0, 2.0, t_comm=0.5)
    assert [(str(a), st, en) for a, st, en in r["ranks"][1]] == [("F(c1,m0)", 1.5, 2.5), ("B(c1,m0)", 2.5, 4.5)]
    assert r["makespan"] == pytest.approx(7.0) and r["busy"] == [3.0, 3.0]
