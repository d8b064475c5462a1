"""The split-backward (zero-bubble) schedules: their orders, foldtrain's validator and torch pipelining's.

torch's ``_validate_schedule`` (every F, I, W of every stage, W after its I) and
``_simulate_comms_compute`` (a step-by-step dry run that fails on a receive whose send never comes) read
the same action lists, converted to torch's ``_Action``; every schedule foldtrain generates goes through
both, the split-backward ones and today's.
"""

import itertools

import pytest
from torch.distributed.pipelining import schedules as tps

from foldtrain.errors import ConfigError
from foldtrain.schedules import (
    BACKWARD_OPS,
    SCHEDULE_NAMES,
    Action,
    Op,
    Schedule,
    ScheduleError,
    activations_peak,
    build_schedule,
    validate_schedule,
)
from foldtrain.sim import simulate_order

TORCH_OP = {
    Op.FORWARD: tps.F,
    Op.BACKWARD: tps.B,
    Op.BACKWARD_INPUT: tps.I,
    Op.BACKWARD_WEIGHT: tps.W,
    Op.SEND_ACT: tps.SEND_F,
    Op.RECV_ACT: tps.RECV_F,
    Op.SEND_GRAD: tps.SEND_B,
    Op.RECV_GRAD: tps.RECV_B,
}


def torch_order(sched: Schedule) -> dict[int, list]:
    """foldtrain's lists as torch pipelining's ``pipeline_order`` (reductions and steps have no counterpart)."""
    return {
        p: [tps._Action(a.chunk, TORCH_OP[a.op], a.mb) for a in acts if a.op in TORCH_OP]
        for p, acts in enumerate(sched.ranks)
    }


def shapes(name):
    for pp, v, m in itertools.product((1, 2, 4), (1, 2, 4), (1, 2, 4, 8)):
        if name in ("1f1b", "zb-h1") and v != 1 or name == "zbv" and v != 2:
            continue
        if name in ("interleaved-1f1b", "interleaved-zb") and (v < 2 or m % pp):
            continue
        yield pp, v, m


GRID = [(n, *shape) for n in SCHEDULE_NAMES for shape in shapes(n)]


@pytest.mark.parametrize("name,pp,v,m", GRID)
def test_torch_pipelining_validates_every_schedule(name, pp, v, m):
    for sync, defer in (("after-flush", False), ("per-chunk", False), ("per-chunk", True)):
        if defer and name not in ("fold", "fold-zb"):
            continue
        s = build_schedule(name, pp, v, m, sync, defer)
        validate_schedule(s)
        order = torch_order(s)
        tps._validate_schedule(order, pp, s.segments, m)
        tps._simulate_comms_compute(order, s.rank_of, s.segments)


def ops_of(s, p):
    return [(a.op.value, a.chunk, a.mb) for a in s.compute_only(p)]


def test_zb_h1_order():
    """1F1B's F and I positions; rank p holds its W back by p micro-batches, at most P alive everywhere."""
    s = build_schedule("zb-h1", 4, 1, 6)
    assert " ".join(str(a) for a in s.compute_only(3)) == " ".join(
        ["F(c3,m0) I(c3,m0)", "F(c3,m1) I(c3,m1)", "F(c3,m2) I(c3,m2)", "F(c3,m3) I(c3,m3) W(c3,m0)"]
        + ["F(c3,m4) I(c3,m4) W(c3,m1)", "F(c3,m5) I(c3,m5) W(c3,m2)", "W(c3,m3) W(c3,m4) W(c3,m5)"]
    )
    one = build_schedule("1f1b", 4, 1, 6)
    for p in range(4):
        as_1f1b = [(op.replace("I", "B"), c, mb) for op, c, mb in ops_of(s, p) if op != "W"]
        assert as_1f1b == ops_of(one, p)
        assert activations_peak(s, p) == 4 >= activations_peak(one, p)


def test_interleaved_zb_keeps_interleaved_positions_and_peak():
    s, base = build_schedule("interleaved-zb", 4, 2, 8), build_schedule("interleaved-1f1b", 4, 2, 8)
    for p in range(4):
        assert [(op.replace("I", "B"), c, mb) for op, c, mb in ops_of(s, p) if op != "W"] == ops_of(base, p)
    assert max(activations_peak(s, p) for p in range(4)) == max(activations_peak(base, p) for p in range(4))


def test_fold_zb_orders_weights_by_deadline():
    """fold's forwards and, as I, its backward order; then the W of chunk 0 (the next step's first), 1, ..."""
    s = build_schedule("fold-zb", 2, 2, 2, "per-chunk", True)
    assert ops_of(s, 0) == [
        ("F", 0, 0), ("F", 0, 1), ("F", 2, 0), ("F", 2, 1),
        ("I", 2, 1), ("I", 2, 0), ("I", 0, 1), ("I", 0, 0),
        ("W", 0, 1), ("W", 0, 0), ("W", 2, 1), ("W", 2, 0),
    ]  # fmt: skip
    acts = [str(a) for a in s.ranks[0]]
    # chunk 0's reduction launches first and is the one not deferred: the next iteration's first forward needs it
    assert acts.index("LR(c0)") < acts.index("LR(c2)")
    assert acts.index("WR(c2)") < acts.index("F(c2,m0)") and acts.index("WR(c0)") > acts.index("LR(c2)")


def test_input_gradient_sent_after_i_not_w():
    s = build_schedule("zb-h1", 2, 1, 2)
    acts = s.ranks[1]
    for i, a in enumerate(acts):
        if a.op is Op.SEND_GRAD:
            assert acts[i - 1].op in BACKWARD_OPS and acts[i - 1].mb == a.mb


def test_unit_costs_zb_h1_idles_less_than_1f1b():
    """With W free to fill the cool-down (t_I = t_W = 1, t_F = 1) ZB-H1 idles (P - 1)(t_F + t_I - t_W) per
    rank where 1F1B idles (P - 1)(t_F + t_B): 3 against 9 units at P = 4."""
    t = {n: simulate_order(build_schedule(n, 4, 1, 8)) for n in ("1f1b", "zb-h1")}
    assert t["1f1b"]["makespan"] == 8 * 3 + 3 * 3
    assert t["zb-h1"]["makespan"] == 8 * 3 + 3 * 1


def _mutate(sched, p, fn):
    ranks = [list(r) for r in sched.ranks]
    ranks[p] = fn(ranks[p])
    return Schedule(sched.name, sched.pp, sched.virtual, sched.microbatches, sched.dp_sync, sched.defer_reduce, ranks)


def test_validator_catches_split_backward_mistakes():
    s = build_schedule("zb-h1", 2, 1, 2)

    def swap_w_before_i(acts):
        i = next(k for k, a in enumerate(acts) if a.op is Op.BACKWARD_INPUT)
        w = next(k for k, a in enumerate(acts) if a.op is Op.BACKWARD_WEIGHT and a.mb == acts[i].mb)
        acts.insert(i, acts.pop(w))
        return acts

    with pytest.raises(ScheduleError, match="weight gradient before its input gradient"):
        validate_schedule(_mutate(s, 1, swap_w_before_i))
    with pytest.raises(ScheduleError, match="W\\(c0,m1\\) is missing"):
        validate_schedule(_mutate(s, 0, lambda acts: [a for a in acts if str(a) != "W(c0,m1)"]))
    with pytest.raises(ScheduleError, match="both B and a split backward"):
        validate_schedule(_mutate(s, 0, lambda acts: [*acts[:-3], Action(Op.BACKWARD, 0, 1), *acts[-3:]]))


@pytest.mark.parametrize(
    "name,v,m,hint",
    [
        ("zb-h1", 2, 4, "interleaved-zb or fold-zb"),
        ("interleaved-zb", 1, 4, "zb-h1"),
        ("interleaved-zb", 2, 3, "2 or 4"),
    ],
)
def test_bad_shapes_name_the_fix(name, v, m, hint):
    with pytest.raises(ConfigError, match=hint):
        build_schedule(name, 2, v, m)


def test_defer_applies_to_fold_zb_only_among_new_ones():
    build_schedule("fold-zb", 2, 2, 4, "per-chunk", True)
    with pytest.raises(ConfigError, match="fold or fold-zb"):
        build_schedule("zb-h1", 2, 1, 4, "per-chunk", True)


def test_zbv_places_segments_in_a_v_and_orders_as_zb_v():
    """Rank p holds segments p and 2P-1-p; the turn (P-1 -> P on rank P-1) and the tie's two ends (rank 0) need no
    transfer; rank 0 warms up with 2P-1 forwards of its down segment, then the last segment's F, I, W at once."""
    s = build_schedule("zbv", 4, 2, 8)
    assert s.placement == "v" and [s.chunks_of(p) for p in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [s.rank_of(seg) for seg in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    comms = [a for acts in s.ranks for a in acts if a.op in (Op.SEND_ACT, Op.RECV_ACT, Op.SEND_GRAD, Op.RECV_GRAD)]
    assert not [a for a in comms if {a.chunk, a.chunk + (1 if a.op in (Op.SEND_ACT, Op.RECV_GRAD) else -1)} == {3, 4}]
    assert ops_of(s, 0)[:10] == [("F", 0, mb) for mb in range(7)] + [("F", 7, 0), ("I", 7, 0), ("W", 7, 0)]
    # 1F1B's activation memory: at most 2P half-size chunks' micro-batches alive on every rank (P full stages')
    assert [activations_peak(s, p) for p in range(4)] == [8, 8, 8, 8]
    # fewer micro-batches than the warm-up needs (2P-1): the same order with the missing ones dropped
    few = build_schedule("zbv", 4, 2, 3)
    assert ops_of(few, 0) == [x for x in ops_of(build_schedule("zbv", 4, 2, 7), 0) if x[2] < 3]


def test_zbv_needs_per_kind_channels_and_two_chunks():
    """A pair of ranks carries activations of one chain and gradients of the other the same way: FIFO per kind
    holds (the executor's gradients get their own groups), one FIFO per pair would not."""
    s = build_schedule("zbv", 2, 2, 4)
    validate_schedule(s)  # channels_of(s) == "per-kind"
    with pytest.raises(ScheduleError, match="order mismatch"):
        validate_schedule(s, channels="per-pair")
    for v in (1, 3):
        with pytest.raises(ConfigError, match="zbv runs exactly two chunks per rank.*--parallel.virtual 2"):
            build_schedule("zbv", 2, v, 4)


def test_split_backward_names_exactly_the_schedules_with_i_actions():
    """The planner prices SPLIT_BACKWARD's fill as F + I: the set must be the schedules that emit I / W."""
    from foldtrain.schedules import SPLIT_BACKWARD

    for name in SCHEDULE_NAMES:
        s = build_schedule(name, 2, 2 if name not in ("1f1b", "zb-h1") else 1, 4)
        assert (name in SPLIT_BACKWARD) == any(a.op is Op.BACKWARD_INPUT for acts in s.ranks for a in acts), name
