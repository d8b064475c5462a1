"""Bucket plans and their ordered launch, without a process group."""

from __future__ import annotations

from foldtrain.parallel.dp.buckets import OrderedLauncher, fixed_plan, timed_plan


def test_fixed_plan_small_first_bucket_then_cap():
    sizes = [10, 10, 10, 10, 10, 10, 50]
    assert fixed_plan(sizes, [6, 5, 4, 3, 2, 1, 0], first_bytes=15, cap_bytes=30) == [[6], [5, 4, 3], [2, 1, 0]]
    assert fixed_plan(sizes, [0, 1, 2], first_bytes=25, cap_bytes=100) == [[0, 1, 2]]
    # a parameter at least as large as the cap (or alone_bytes) is a bucket alone: the bucket before it closes
    # early; no bucket after the first passes the cap
    assert fixed_plan([10, 40, 10, 10, 10], [0, 1, 2, 3, 4], first_bytes=5, cap_bytes=30) == [[0], [1], [2, 3, 4]]
    assert fixed_plan([10, 10, 40, 10], [0, 1, 2, 3], first_bytes=5, cap_bytes=30) == [[0], [1], [2], [3]]
    assert fixed_plan([1, 20, 20, 16, 5], [0, 1, 2, 3, 4], first_bytes=15, cap_bytes=30, alone_bytes=15) == [
        [0],
        [1],
        [2],
        [3],
        [4],
    ]
    assert fixed_plan([1, 20, 12, 12, 12, 5], [0, 1, 2, 3, 4, 5], first_bytes=15, cap_bytes=30) == [
        [0, 1],
        [2, 3],
        [4, 5],
    ]


def test_timed_plan_cuts_on_size_and_on_cycle_time():
    sizes = [4] * 6
    events = [(5, 0.000), (4, 0.001), (3, 0.002), (2, 0.010), (1, 0.011), (0, 0.030)]
    # no time flush: only the byte thresholds (first 8 bytes, then 12)
    assert timed_plan(events, sizes, 6, 8, 12, 0) == [[5, 4], [3, 2, 1], [0]]
    # a 5 ms cycle: the gap before parameter 2 and the one before parameter 0 close buckets
    assert timed_plan(events, sizes, 6, 100, 100, 0.005) == [[5, 4, 3], [2, 1], [0]]
    # parameters that never got a gradient form a last bucket; repeated events count once
    assert timed_plan([(2, 0.0), (2, 0.1), (0, 0.2)], [4, 4, 4, 4], 4, 100, 100, 0) == [[2, 0], [1, 3]]


def test_launch_order_is_the_plan_order_whatever_the_ready_order():
    launched = []
    plan = [[3, 2], [1], [0]]
    lau = OrderedLauncher(plan, launched.append)
    lau.ready(1)  # bucket 1 complete, but bucket 0 is not: wait
    assert launched == []
    lau.ready(0)
    lau.ready(2)  # bucket 0 incomplete still
    assert launched == []
    lau.ready(3)  # bucket 0 complete: 0, then the already complete 1 and 2
    assert launched == [0, 1, 2] and lau.log == [0, 1, 2]
    lau.reset()
    lau.ready(3)
    lau.finish()  # the rest, in order, ready or not
    assert launched == [0, 1, 2, 0, 1, 2]
