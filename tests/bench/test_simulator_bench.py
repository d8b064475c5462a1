"""The validation bench's choices that no run checks: which calibration and which per-action cost it uses."""

from foldtrain.bench.simulator import least_disturbed, overhead_at


def test_the_calibration_least_disturbed_is_kept():
    slow = {"blocks": [[1.0, 2.0], [2.0, 4.0]], "heads": [3.0]}
    fast = {"blocks": [[0.8, 1.6], [1.7, 3.4]], "heads": [2.5]}
    assert least_disturbed(iter([slow, fast])) is fast
    assert least_disturbed([fast, slow]) is fast


def test_the_per_action_cost_comes_from_the_nearest_process_count():
    measured = {"2": 4e-4, "4": 6e-4}
    assert overhead_at(measured, 2) == 4e-4
    assert overhead_at(measured, 4) == 6e-4
    assert overhead_at(measured, 8) == 6e-4  # the most processes measured
    assert overhead_at(measured, 1) == 4e-4
    assert overhead_at(3e-4, 4) == 3e-4  # one measurement for every process count
