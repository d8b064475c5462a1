"""The validation bench's choices that no run checks: which calibration and which per-action cost it uses."""

from foldtrain.bench.simulator import calibration_table, fsdp_fields, least_disturbed, overhead_at


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


def test_the_calibration_table_names_each_figure_and_leaves_out_what_was_not_measured():
    comp = {
        1: {"fp32": [1.01e11, 1.8, []], "action_overhead": {"4": 4.3e-4, "2": 2.3e-4}, "backward_ratio": 1.884},
        4: {"fp32": [5.07e10, 0.001, []]},
    }
    loop = {2: {"collective_latency_s": 2.4e-4, "allreduce_bw": 1.39e9}, 4: {"collective_latency_s": 7.6e-4}}
    lines = calibration_table(comp, loop, {"allreduce_bw": 1.21e8})
    rows = {line.split("|")[2].strip(" `"): line.split("|")[3].strip() for line in lines if line.startswith("| ")}
    assert rows["device.action_overhead_us"] == "0.23 ms (2 processes), 0.43 ms (4 processes)"
    assert rows["device.fp32_tflops"] == "101 GFLOP/s (1 process), 51 GFLOP/s (4 processes)"
    assert rows["device.backward_ratio"] == "1.88"
    assert rows["intra.collective_latency_us"] == "0.24 ms (2 ranks), 0.76 ms (4 ranks)"
    assert rows["intra.bw_gbs"] == "1.39 GB/s (2 ranks)"
    assert rows["inter.bw_gbs"] == "0.121 GB/s"
    # not in this calibration: no row rather than an empty or invented one
    assert not {"device.loss_buffers", "node.collective_cpu_us", "inter.collective_latency_us"} & set(rows)
    assert calibration_table({1: {"fp32": [1e11, 1.0, []], "action_overhead": 3e-4}}, {}, {})[5].endswith("| 0.30 ms |")


def test_fsdps_host_work_reaches_the_cluster_and_the_table_from_new_and_older_calibrations():
    new = {"fp32": [1e11, 1.0, []], "fsdp_host": {"fsdp_unit": 4e-4, "fsdp_root": 5e-5, "fsdp_gather": 2e-4}}
    old = {"fp32": [1e11, 1.0, []], "fsdp_host": [4e-4, 2e-4]}  # saved before the root had its own figure
    assert fsdp_fields(new) == new["fsdp_host"]
    assert fsdp_fields(old) == {"fsdp_unit": 4e-4, "fsdp_gather": 2e-4}
    key = "device.fsdp_unit_us, device.fsdp_root_us, device.fsdp_gather_us"
    for comp, shown in ((new, "0.40 ms; 0.05 ms; 0.20 ms"), (old, "0.40 ms; —; 0.20 ms")):
        lines = calibration_table({1: comp}, {}, {})
        rows = {line.split("|")[2].strip(" `"): line.split("|")[3].strip() for line in lines if line.startswith("| ")}
        assert rows[key] == shown
