"""The benchmark's pure parts: metrics.jsonl -> medians -> tables and target ratios; error lines;
run planning; one launch through ``run_job`` with a fake (torch-free) script."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from foldtrain.bench import common, dp, pipeline
from foldtrain.bench.overlap import bound_ratios, zero_bubble_ratios
from foldtrain.bench.results import RunResult, error_line, load_results, read_metrics, save_results, summarize_records
from foldtrain.bench.runner import Job, run_job
from foldtrain.bench.tables import (
    DP_HEADERS,
    PIPE_HEADERS,
    bytes_per_step,
    dp_ratios,
    dp_rows,
    markdown_table,
    pipeline_ratios,
    pipeline_rows,
    report_markdown,
    text_table,
)
from foldtrain.errors import FoldtrainError
from foldtrain.netem.cluster import format_rate, parse_rate, tbf_burst_bytes


def write_metrics(path: Path, step_times: list[float], tokens: int = 2048, **per_step) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "metrics.jsonl", "w") as f:
        for i, dt in enumerate(step_times):
            rec = {
                "step": i + 1,
                "loss": 5.0 - 0.1 * i,
                "lr": 1e-3,
                "step_time_s": dt,
                "tokens_per_s": tokens / dt,
                "peak_mem_mb": 100.0 + i,
            }
            for k, v in per_step.items():
                rec[k] = v[i] if isinstance(v, list) else v
            f.write(json.dumps(rec) + "\n")
        f.write("not json\n")
    return path / "metrics.jsonl"


def run_from(
    tmp: Path,
    name: str,
    step_times,
    impl="foldtrain",
    variant="none",
    ranks=1,
    network="loopback",
    precision="fp32",
    workers=None,
    bench="dp",
    warmup=2,
    wire=None,
    info=None,
    **per_step,
) -> RunResult:
    m = write_metrics(tmp / name, step_times, **per_step)
    return RunResult(
        bench,
        impl,
        variant,
        precision,
        ranks,
        network,
        workers or ranks,
        metrics=summarize_records(read_metrics(m), warmup),
        wire=wire,
        info=info or {},
    )


# ---------------------------------------------------------------- medians


def test_summarize_skips_warmup_and_takes_medians(tmp_path):
    recs = read_metrics(
        write_metrics(
            tmp_path / "r",
            [9.0, 8.0, 1.0, 3.0, 2.0],
            comm_bytes_sent=100,
            comm_bytes_recv=[1, 2, 50, 70, 60],
            comm_wait_s=[0, 0, 0.5, 1.5, 0.5],
            compute_s=0.2,
        )
    )
    assert len(recs) == 5  # the non-JSON line is skipped
    s = summarize_records(recs, warmup=2)
    assert s["step_time_s"] == 2.0
    assert s["tokens_per_s"] == pytest.approx(2048 / 2.0)
    assert s["peak_mem_mb"] == 104.0  # high-water mark: max, not median
    assert s["comm_bytes"] == 160.0  # median of sent + received per step (150, 170, 160)
    assert s["comm_wait_share"] == pytest.approx(0.5)  # median of 0.5/1, 1.5/3, 0.5/2
    assert s["steps_measured"] == 3 and "warmup_short" not in s
    assert "loss" not in s and "step" not in s


def test_step_time_is_the_wall_period_between_step_starts(tmp_path):
    """What the loop does between steps (logging, collectives queued behind reductions a step left in flight)
    counts: the step time is the period from one step's start to the next's, the loop's own figure is
    ``engine_step_s``; a step missing from the records gives no period."""
    starts = [0.0, 9.0, 10.5, 14.0, 16.5, 18.0, 30.0]  # time_s at each step's end; step 6 missing below
    recs = [dict(r, time_s=t) for r, t in zip(read_metrics(write_metrics(tmp_path / "r", [1.0] * 7)), starts)]
    del recs[5]  # (steps 1-5, 7: step 7's period is unknown)
    s = summarize_records(recs, warmup=2)
    assert s["step_time_s"] == pytest.approx(2.5)  # median of 1.5, 3.5, 2.5
    assert s["engine_step_s"] == pytest.approx(1.0)
    assert s["tokens_per_s"] == pytest.approx(2048 / 2.5)
    assert s["steps_measured"] == 4 and "time_s" not in s


def test_summarize_short_run_uses_last_record(tmp_path):
    s = summarize_records(read_metrics(write_metrics(tmp_path / "r", [5.0, 4.0])), warmup=3)
    assert s["step_time_s"] == 4.0 and s["warmup_short"] == 1.0
    assert summarize_records([], 3) == {}
    assert read_metrics(tmp_path / "missing") == []


# ---------------------------------------------------------------- errors


def test_error_line_prefers_foldtrain_error_over_torchrun_report():
    text = """[W socket.cpp] warning
foldtrain: error: --dp.strategy ps is not available in this build; use --dp.strategy none
E1130 torch.distributed.elastic.multiprocessing.api: failed (exitcode: 2) local_rank: 0
Traceback (most recent call last):
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
Root Cause (first observed failure):
[0]:
  exitcode  : 2 (pid: 123)
============================================================"""
    assert (
        error_line(text) == "foldtrain: error: --dp.strategy ps is not available in this build; use --dp.strategy none"
    )


def test_error_line_finds_the_exception_and_falls_back():
    tb = (
        "Traceback (most recent call last):\n  File x\nRuntimeError: Connection closed by peer\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n====\nRoot Cause "
        "(first observed failure):\n"
    )
    assert error_line(tb) == "RuntimeError: Connection closed by peer"
    assert error_line("some output\nlast words\n") == "last words"
    assert error_line("") == "failed without output"
    assert len(error_line("ValueError: " + "x" * 500)) == 200


def test_error_line_sees_through_launcher_prefixes():
    """torch 2.13 prefixes a child's lines with ``[rankN]:``; horovodrun with ``[N]<stderr>:`` and ends with its
    own RuntimeError."""
    torch_text = """[rank1]: Traceback (most recent call last):
[rank1]:   File "x.py", line 3, in <module>
[rank1]: TypeError: _DistributedOptimizer.zero_grad() got an unexpected keyword argument 'set_to_none'
E1130 torch.distributed.elastic.multiprocessing.api: failed (exitcode: 1) local_rank: 1
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
[1]:
  exitcode  : 1 (pid: 123)"""
    assert (
        error_line(torch_text)
        == "TypeError: _DistributedOptimizer.zero_grad() got an unexpected keyword argument 'set_to_none'"
    )
    hvd_text = (
        """[1]<stderr>:Traceback (most recent call last):
[1]<stderr>:ValueError: bad shape
[0]<stdout>:step 1
Process 1 exit with status code 1.
Terminating remaining workers after failure of Process 1.
Traceback (most recent call last):
RuntimeError: Horovod detected that one or more processes exited with non-zero status, """
        """thus causing the job to be terminated. The first process to do so was:
Process name: 1
Exit code: 1"""
    )
    assert error_line(hvd_text) == "ValueError: bad shape"
    assert (
        error_line(
            "[1,0]<stderr>:foldtrain: error: no data\nRuntimeError: Horovod detected that one or more processes exited"
        )
        == "foldtrain: error: no data"
    )


# ---------------------------------------------------------------- dp table and ratios


@pytest.fixture
def dp_runs(tmp_path):
    t = tmp_path
    runs = [
        run_from(t, "none", [9, 9, 1.0, 1.0, 1.0]),
        run_from(
            t,
            "ar2",
            [9, 9, 0.6, 0.6, 0.6],
            variant="allreduce",
            ranks=2,
            comm_bytes_sent=5e6,
            comm_bytes_recv=5e6,
            comm_wait_s=0.15,
        ),
        run_from(
            t,
            "sps2",
            [9, 9, 0.8, 0.8, 0.8],
            variant="sharded-ps",
            ranks=2,
            comm_bytes_sent=4e6,
            comm_bytes_recv=4e6,
            grad_optim_mem_mb=12.25,
        ),
        run_from(t, "plain2", [9, 9, 0.5, 0.5, 0.5], impl="ddp_plain", variant="", ranks=2),
        # throttled, 4 ranks: ps's rank 0 is the server; workers' bytes come from the link counters
        run_from(
            t,
            "ps4",
            [9, 9, 2.0, 2.0, 2.0],
            variant="ps",
            ranks=4,
            network="100mbit",
            comm_bytes_sent=9e6,
            comm_bytes_recv=9e6,
            wire=[(9.5e6, 9.5e6), (3.1e6, 3.1e6), (3.0e6, 3.0e6), (2.9e6, 2.9e6)],
        ),
        run_from(
            t,
            "ar4",
            [9, 9, 1.0, 1.0, 1.0],
            variant="allreduce",
            ranks=4,
            network="100mbit",
            comm_bytes_sent=4e6,
            comm_bytes_recv=4e6,
            wire=[(4.2e6, 4.2e6)] * 4,
        ),
        run_from(
            t,
            "plain4",
            [9, 9, 1.25, 1.25, 1.25],
            impl="ddp_plain",
            variant="",
            ranks=4,
            network="100mbit",
            wire=[(4.1e6, 4.1e6)] * 4,
        ),
        RunResult(
            "dp", "foldtrain", "horovod", "fp32", 2, "loopback", 2, error="foldtrain: error: horovod is not available"
        ),
    ]
    return runs


def test_dp_rows_speedup_efficiency_bytes(dp_runs):
    rows = {(r[0], r[2], r[3]): r for r in dp_rows(dp_runs)}
    h = {k: i for i, k in enumerate(DP_HEADERS)}
    none = rows[("none", "1", "loopback")]
    assert none[h["speed-up"]] == "1.00x" and none[h["efficiency"]] == "100.0%"
    ar = rows[("allreduce", "2", "loopback")]
    assert ar[h["time/step ms"]] == "600.0" and ar[h["tokens/s"]] == "3,413"
    assert ar[h["speed-up"]] == "1.67x" and ar[h["efficiency"]] == "83.3%"
    assert ar[h["MB/step/worker"]] == "10.00" and ar[h["MB/step server"]] == "—"
    assert ar[h["comm wait"]] == "25.0%"
    assert (
        ar[h["grad+optim MB/rank"]] == "—" and rows[("sharded-ps", "2", "loopback")][h["grad+optim MB/rank"]] == "12.2"
    )
    ps = rows[("ps", "4", "100mbit")]
    assert ps[h["MB/step server"]] == "18.00"  # rank 0's counters
    assert ps[h["MB/step/worker"]] == "6.00*"  # mean of nodes 1..3 from the links, starred
    assert ps[h["wire MB/step n0/others"]] == "19.00/6.00"
    plain = rows[("ddp_plain", "4", "100mbit")]
    assert plain[h["MB/step/worker"]] == "8.20*"  # no counters: link bytes
    failed = rows[("horovod", "2", "loopback")]
    assert len(failed) == len(DP_HEADERS) and failed[-1] == "FAILED: foldtrain: error: horovod is not available"
    assert failed[h["tokens/s"]] == "—"


def test_dp_ratios(dp_runs):
    ratios = {r.name: r for r in dp_ratios(dp_runs)}
    assert ratios["allreduce / ddp_plain tokens/s [loopback, fp32, 2 ranks]"].value == pytest.approx(0.5 / 0.6)
    assert ratios["sharded-ps / ddp_plain tokens/s [loopback, fp32, 2 ranks]"].value == pytest.approx(0.5 / 0.8)
    assert ratios["allreduce / ddp_plain tokens/s [100mbit, fp32, 4 ranks]"].value == pytest.approx(1.25)
    # sharded-ps did not run on 100mbit: named, no value
    sps = ratios["sharded-ps / ddp_plain tokens/s [100mbit, fp32, 4 ranks]"]
    assert sps.value is None and "sharded-ps not run" in sps.detail
    assert ratios["allreduce / ps (colocated) tokens/s [100mbit, fp32, 4 ranks]"].value == pytest.approx(2.0)
    srv = ratios["ps server / worker bytes per step [100mbit, fp32, 4 ranks]"]
    assert srv.value == pytest.approx(18e6 / 6e6)
    assert "counters+links" in srv.detail
    assert all("n/a" not in r.line() or r.detail for r in ratios.values())


def test_bytes_prefer_explicit_worker_server_keys(tmp_path):
    r = run_from(
        tmp_path,
        "ps",
        [1, 1, 1, 1],
        variant="ps",
        ranks=3,
        comm_bytes_sent=1,
        comm_bytes_recv=1,
        worker_comm_bytes=10.0,
        server_comm_bytes=40.0,
    )
    assert bytes_per_step(r) == (10.0, 40.0, "counters")
    loop = run_from(tmp_path, "ps2", [1, 1, 1, 1], variant="ps", ranks=2, comm_bytes_sent=3, comm_bytes_recv=3)
    w, s, _ = bytes_per_step(loop)
    assert w is None and s == 6.0
    ratio = [x for x in dp_ratios([loop]) if "server" in x.name][0]
    assert ratio.value is None and "loopback" in ratio.detail


def test_failed_ratio_is_named(dp_runs):
    dp_runs[1].error = "RuntimeError: boom"
    r = {x.name: x for x in dp_ratios(dp_runs)}["allreduce / ddp_plain tokens/s [loopback, fp32, 2 ranks]"]
    assert r.value is None and r.detail == "allreduce failed" and r.line().endswith("n/a  (allreduce failed)")


def test_tables_render(dp_runs, tmp_path):
    rows = dp_rows(dp_runs)
    txt = text_table(DP_HEADERS, rows)
    lines = txt.splitlines()
    assert lines[0].startswith("strategy") and set(lines[1]) <= {"-", " "} and len(lines) == 2 + len(rows)
    md = markdown_table(DP_HEADERS, rows)
    assert md.splitlines()[0].count("|") == len(DP_HEADERS) + 1
    assert "FAILED: foldtrain: error" in md
    rep = report_markdown("t", DP_HEADERS, rows, dp_ratios(dp_runs), ["a note"])
    assert rep.startswith("# t") and "## Ratios" in rep and "- a note" in rep
    assert text_table(DP_HEADERS, []) == "(no runs)"
    save_results(dp_runs, tmp_path / "res.json")
    back = load_results(tmp_path / "res.json")
    assert [r.label for r in back] == [r.label for r in dp_runs] and back[4].wire == dp_runs[4].wire


# ---------------------------------------------------------------- pipeline table and ratios


def test_pipeline_rows_and_ratios(tmp_path):
    t = tmp_path

    def mk(name, times, impl, variant, v, sync, **kw):
        return run_from(
            t,
            name,
            times,
            impl=impl,
            variant=variant,
            ranks=4,
            workers=2,
            network="1gbit",
            bench="pipeline",
            info={"virtual": v, "dp_sync": sync},
            **kw,
        )

    runs = [
        mk(
            "il",
            [9, 9, 1.2, 1.2],
            "foldtrain",
            "interleaved-1f1b",
            2,
            "after-flush",
            all_rank_idle_fraction=0.4,
            bubble_fraction=0.5,
            exposed_dp_comm_s=0.3,
        ),
        mk("fold_af", [9, 9, 2.0, 2.0], "foldtrain", "fold", 2, "after-flush", all_rank_idle_fraction=0.5),
        mk(
            "fold",
            [9, 9, 1.0, 1.0],
            "foldtrain",
            "fold",
            2,
            "per-chunk",
            all_rank_idle_fraction=0.1,
            bubble_fraction=0.45,
            exposed_dp_comm_s=0.05,
        ),
        mk("bfs", [9, 9, 1.1, 1.1], "torch", "looped-bfs", 2, "after-flush", wire=[(3e6, 3e6), (3e6, 3e6)]),
        RunResult(
            "pipeline",
            "foldtrain",
            "gpipe",
            "fp32",
            4,
            "1gbit",
            2,
            error="RuntimeError: x",
            info={"virtual": 1, "dp_sync": "after-flush"},
        ),
    ]
    rows = pipeline_rows(runs)
    h = {k: i for i, k in enumerate(PIPE_HEADERS)}
    fold = rows[2]
    assert fold[h["all-rank idle"]] == "10.0%" and fold[h["exposed DP comm ms"]] == "50.0" and fold[h["V"]] == "2"
    assert rows[3][h["wire MB/step/node"]] == "6.00" and rows[3][h["all-rank idle"]] == "—"
    assert rows[4][-1] == "FAILED: RuntimeError: x" and len(rows[4]) == len(PIPE_HEADERS)
    r = {x.name: x.value for x in pipeline_ratios(runs)}
    assert r["fold / interleaved-1f1b (after-flush) tokens/s [1gbit]"] == pytest.approx(1.2)  # the per-chunk fold run
    assert r["fold / interleaved-1f1b all-rank idle fraction [1gbit]"] == pytest.approx(0.25)
    assert r["fold / torch LoopedBFS+DDP tokens/s [1gbit]"] == pytest.approx(1.1)


# ---------------------------------------------------------------- rates, planning


def test_parse_rate():
    assert parse_rate("1gbit") == 10**9 and parse_rate("100mbit") == 10**8 and parse_rate("12.5mbps") == 10**8
    assert format_rate(10**8) == "100mbit"
    assert tbf_burst_bytes(10**9) == 625000 and tbf_burst_bytes(10**6) == 32768
    for bad in ("fast", "0mbit", "10 parsecs"):
        with pytest.raises(FoldtrainError, match="not a rate"):
            parse_rate(bad)


def test_dp_plan_shapes_the_study():
    a = dp.parser().parse_args(
        [
            "--strategies",
            "none,allreduce,ps",
            "--precisions",
            "fp32,bf16",
            "--ranks",
            "1,2,4",
            "--networks",
            "loopback,1gbit",
            "--anchors",
            "ddp_plain,horovod",
            "--ps_servers",
            "1",
            "--global_batch",
            "12",
        ]
    )
    notes = []
    jobs = dp.plan(a, "/data", horovod_ok=False, notes=notes)
    assert notes == []
    loop, slow = jobs["loopback"], jobs["1gbit"]
    ids = {(j.result.impl, j.result.variant, j.result.precision, j.result.ranks) for j in loop}
    assert ("foldtrain", "none", "bf16", 1) in ids and ("ddp_plain", "", "fp32", 1) in ids
    assert ("foldtrain", "none", "fp32", 2) not in ids  # none runs one process only
    assert not any(j.result.impl == "horovod" for j in loop)  # not installed
    assert all(j.result.ranks > 1 and j.nnodes == j.result.ranks and j.nproc_per_node == 1 for j in slow)
    ps4 = next(j for j in slow if j.result.variant == "ps" and j.result.ranks == 4)
    assert ps4.result.workers == 3 and ps4.args[ps4.args.index("--dp.ps_servers") + 1] == "1"
    ar2 = next(j for j in loop if j.result.variant == "allreduce" and j.result.ranks == 2)
    cmd = ar2.command(Path("/o"))
    assert cmd[1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    assert cmd[6:9] == ["-m", "foldtrain", "train"] and cmd[-2:] == ["--out", "/o"]
    assert "--data.path" in cmd and "--dp.strategy" in cmd and "--precision" in cmd
    a.global_batch = 16  # 3 ps workers at 4 ranks cannot split 16 rows: skipped, with a note
    jobs = dp.plan(a, "/data", notes=notes)
    assert not any(j.result.variant == "ps" and j.result.ranks == 4 for js in jobs.values() for j in js)
    assert notes and "16" in notes[0] and "ps" in notes[0]
    with pytest.raises(FoldtrainError, match="unknown"):
        dp.plan(dp.parser().parse_args(["--strategies", "magic"]), "")


def test_dp_plan_horovod_rows(monkeypatch):
    """With Horovod: foldtrain's `horovod` and the `horovod_plain` anchor, named apart, under horovodrun on loopback and
    the hand-made Horovod launch on the emulated network, each with the cycle time(s) asked for."""
    hvdrun = lambda n: ["/env/bin/horovodrun", "-np", str(n), "-H", f"localhost:{n}", "/env/bin/python"]  # noqa: E731
    monkeypatch.setattr(dp, "horovodrun_command", hvdrun)
    a = dp.parser().parse_args(
        [
            "--strategies",
            "none,horovod",
            "--precisions",
            "fp32",
            "--ranks",
            "1,2",
            "--networks",
            "loopback,1gbit",
            "--anchors",
            "ddp_plain,horovod",
            "--horovod_cycle_ms",
            "1,20",
        ]
    )
    jobs = dp.plan(a, "/data", horovod_ok=True, notes=[])
    hvd = [j for js in jobs.values() for j in js if j.horovod]
    assert sorted({j.result.label for j in hvd}) == ["horovod", "horovod_plain"]
    assert len(hvd) == 8  # 2 rows x 2 networks x 2 cycle times
    for j in hvd:
        assert (
            j.env["HOROVOD_CYCLE_TIME"] == j.result.info["cycle_ms"]
            and j.result.info["note"] == f"cycle {j.result.info['cycle_ms']} ms"
        )
        if j.result.network == "loopback":
            cmd = j.command(Path("/o"))
            assert cmd[:6] == hvdrun(2) and cmd[-2:] == ["--out", "/o"]
        else:
            assert j.launcher is None and (j.nnodes, j.nproc_per_node) == (2, 1)
    assert len({common.run_name(j.result) for j in hvd}) == 8  # every run its own directory
    a = dp.parser().parse_args(["--strategies", "none,horovod", "--ranks", "2", "--networks", "loopback"])
    notes = []
    assert not any(j.horovod for js in dp.plan(a, "/data", horovod_ok=False, notes=notes).values() for j in js)
    assert any("horovod strategy skipped" in n for n in notes)


def test_quick_keeps_explicit_options():
    a = common.parse_args(dp.parser(), ["--quick", "--networks", "loopback", "--steps", "4"], dp.QUICK)
    assert a.networks == "loopback" and a.steps == 4 and a.global_batch == dp.QUICK["global_batch"]


def test_pipeline_plan():
    a = pipeline.parser().parse_args(
        [
            "--schedules",
            "gpipe,fold,fold:after-flush,fold+defer",
            "--torch_schedules",
            "1f1b,looped-bfs",
            "--networks",
            "1gbit,loopback",
        ]
    )
    jobs = pipeline.plan(a, "/data", deepspeed_ok=False)
    slow = jobs["1gbit"]
    # every foldtrain run twice: plain (its speed is reported) and a profiled twin (its idle figures)
    assert [
        (
            j.result.impl,
            j.result.variant,
            j.result.info["virtual"],
            j.result.info["dp_sync"],
            bool(j.result.info.get("profiled_twin")),
        )
        for j in slow
    ] == [
        ("foldtrain", "gpipe", 1, "after-flush", False),
        ("foldtrain", "gpipe", 1, "after-flush", True),
        ("foldtrain", "fold", 2, "per-chunk", False),
        ("foldtrain", "fold", 2, "per-chunk", True),
        ("foldtrain", "fold", 2, "after-flush", False),
        ("foldtrain", "fold", 2, "after-flush", True),
        ("foldtrain", "fold", 2, "per-chunk", False),
        ("foldtrain", "fold", 2, "per-chunk", True),
        ("torch", "1f1b", 1, "after-flush", False),
        ("torch", "looped-bfs", 2, "after-flush", False),
    ]
    assert all(j.nnodes == 2 and j.nproc_per_node == 2 for j in slow)
    assert all(j.nnodes == 1 and j.nproc_per_node == 4 for j in jobs["loopback"])
    fold, twin, defer = slow[2], slow[3], slow[6]
    assert (
        "--profile" not in fold.args
        and "--profile" in twin.args
        and fold.args[fold.args.index("--parallel.microbatches") + 1] == "4"
    )
    assert "--fold.defer_reduce" in defer.args and defer.result.info["defer"]
    assert len({common.run_name(j.result) for j in slow}) == len(slow)  # every run its own directory
    with pytest.raises(FoldtrainError, match="unknown schedule"):
        pipeline.parse_schedule("zigzag", 2)
    with pytest.raises(FoldtrainError, match="unknown schedule option"):
        pipeline.parse_schedule("fold+later", 2)
    assert pipeline.parse_schedule("fold+zero+defer", 2) == ("fold", 2, "per-chunk", ("defer", "zero"))
    assert pipeline.parse_schedule("zbv", 4) == ("zbv", 2, "after-flush", ())  # always two chunks in a V


def test_pipeline_plan_zero_bubble_and_bound():
    """The zero-bubble schedules take their V and sync like their parents; torch's V-shaped ones always run 2
    stages per rank; --bound adds, right after each plain foldtrain run, the same run at the bound rate."""
    a = pipeline.parser().parse_args(
        [
            "--schedules",
            "zb-h1,interleaved-zb,fold-zb+defer",
            "--torch_schedules",
            "interleaved-zb,zbv,dualpipev",
            "--virtual",
            "4",
            "--networks",
            "1gbit,loopback",
            "--bound",
            "40gbit",
            "--no_profile",
        ]
    )
    jobs = pipeline.plan(a, "/data", deepspeed_ok=False)
    got = [(j.result.impl, j.result.variant, j.result.network, j.result.info["virtual"]) for j in jobs["1gbit"]]
    assert got == [
        ("foldtrain", "zb-h1", "1gbit", 1),
        ("foldtrain", "zb-h1", "40gbit", 1),
        ("foldtrain", "interleaved-zb", "1gbit", 4),
        ("foldtrain", "interleaved-zb", "40gbit", 4),
        ("foldtrain", "fold-zb", "1gbit", 4),
        ("foldtrain", "fold-zb", "40gbit", 4),
        ("torch", "interleaved-zb", "1gbit", 4),
        ("torch", "zbv", "1gbit", 2),
        ("torch", "dualpipev", "1gbit", 2),
    ]
    bound = jobs["1gbit"][5]
    assert bound.result.info["link_rate"] == "40gbit" and bound.result.info["bound_of"] == "1gbit"
    assert bound.args == jobs["1gbit"][4].args and bound.result.info["defer"]
    assert jobs["1gbit"][4].result.info["dp_sync"] == "per-chunk" and jobs["1gbit"][2].result.info["dp_sync"] == (
        "after-flush"
    )
    assert not any(j.result.info.get("link_rate") for j in jobs["loopback"])  # nothing to change on loopback
    assert len({common.run_name(j.result) for j in jobs["1gbit"]}) == len(jobs["1gbit"])


def test_zero_bubble_and_bound_ratios(tmp_path):
    def mk(name, step_s, impl, variant, net="1gbit", **info):
        metrics = {k: info.pop(k) for k in ("all_rank_idle_fraction", "peak_mem_mb") if k in info}
        return run_from(
            tmp_path,
            name,
            [9, 9, step_s, step_s],
            impl=impl,
            variant=variant,
            ranks=4,
            workers=2,
            network=net,
            bench="pipeline",
            info={"virtual": 2, "dp_sync": "after-flush", **info},
            **metrics,
        )

    runs = [
        mk("1f1b", 2.0, "foldtrain", "1f1b", all_rank_idle_fraction=0.4, peak_mem_mb=100.0),
        mk("zb", 1.6, "foldtrain", "zb-h1", all_rank_idle_fraction=0.2, peak_mem_mb=100.0),
        mk("il", 2.0, "foldtrain", "interleaved-1f1b"),
        mk("fzd", 1.25, "foldtrain", "fold-zb", dp_sync="per-chunk", defer=True),
        mk("fzd40", 1.0, "foldtrain", "fold-zb", net="40gbit", dp_sync="per-chunk", defer=True, bound_of="1gbit"),
        mk("fd", 1.5, "foldtrain", "fold", dp_sync="per-chunk", defer=True),
        mk("tzbv", 2.5, "torch", "zbv"),
        mk("tdual", 2.0, "torch", "dualpipev"),
    ]
    r = {x.name: x.value for x in zero_bubble_ratios(runs) + bound_ratios(runs)}
    assert r["zb-h1 / 1f1b tokens/s [1gbit]"] == pytest.approx(1.25)
    assert r["zb-h1 / 1f1b all rank idle fraction [1gbit]"] == pytest.approx(0.5)
    assert r["zb-h1 / 1f1b peak mem mb [1gbit]"] == pytest.approx(1.0)
    assert r["fold-zb+defer / fold+defer tokens/s [1gbit]"] == pytest.approx(1.2)
    assert r["fold-zb+defer / interleaved-1f1b tokens/s [1gbit]"] == pytest.approx(1.6)
    assert r["fold-zb+defer / torch zbv tokens/s [1gbit]"] == pytest.approx(2.0)
    assert r["best foldtrain (fold-zb+defer) / best torch (torch:dualpipev) tokens/s [1gbit]"] == pytest.approx(1.6)
    assert r["fold-zb+defer [1gbit] / the same at 40gbit (its limit) tokens/s"] == pytest.approx(0.8)
    assert not any("[40gbit]" in k for k in r)  # a bound run is no network of its own


def test_order_bound_of_a_deferring_fold_run(tmp_path):
    """bench pipeline's lines for fold + deferral: per node, its bytes at the link's rate plus the mean idle window of
    the profiled twin's timeline.json (its order's: the last deferred wait's end to the first launch; any order's:
    the last chunk's forwards after its first), the largest over the nodes, over the step; with a --bound twin, that
    twin's step over the bound."""
    from foldtrain.bench.overlap import layout_bounds, merge_profiled, order_bounds
    from foldtrain.profile import write_chrome_trace

    def ranks_of(windows, pp=2):  # len(windows[0]) nodes x pp ranks (global rank = node * pp + p), a step per row
        out = [[] for _ in range(len(windows[0]) * pp)]
        for step, row in enumerate(windows, start=1):
            t = 10.0 * step
            for n, w in enumerate(row):
                first, last = n * pp, n * pp + pp - 1
                wait = {"name": "WR c2", "kind": "reduce_wait", "start": t, "end": t + 0.01, "step": step}
                out[first].append({**wait, "args": {"deferred": True}})
                launch = {"name": "tie", "kind": "reduce_launch", "start": t + 0.01 + w, "end": t + 0.02 + w}
                out[last].append({**launch, "step": step, "args": {}})
                for r in range(first, last + 1):
                    out[r].append({"name": "s", "kind": "step", "start": t, "end": t + 1, "step": step, "args": {}})
                # the last chunk's forwards on the node's last rank: 10, 20, 30 ms x (node + 1), the first left out
                # of the layout's window (node 0's 50 ms, the least); another chunk's F and a W do not count
                s0 = t + 0.1
                for m, (op, c, d) in enumerate(
                    [("F", 3, 0.01), ("F", 1, 0.5), ("F", 3, 0.02), ("W", 3, 0.2), ("F", 3, 0.03)]
                ):
                    d *= n + 1
                    args = {"op": op, "chunk": c, "mb": m}
                    out[last].append(
                        {"name": op, "kind": "compute", "start": s0, "end": s0 + d, "step": step, "args": args}
                    )
                    s0 += d
        return out

    twin_dir = tmp_path / "twin"
    # 3 nodes x 2 ranks (dp 3, pp 2); node windows: 50 and 110 ms (mean 80), 20 ms, 300 ms
    write_chrome_trace(twin_dir / "timeline.json", ranks_of([(0.05, 0.02, 0.3), (0.11, 0.02, 0.3)]))
    info = {"virtual": 2, "dp_sync": "per-chunk", "defer": True}
    wire = [(40e6, 50e6), (45e6, 60e6), (5e6, 6e6)]  # at 125 MB/s: 400, 480 and 48 ms

    def mk(name, step_s, net="1gbit", **more):
        return run_from(
            tmp_path,
            name,
            [9, 9, step_s, step_s],
            variant="fold-zb",
            ranks=6,
            workers=3,
            network=net,
            bench="pipeline",
            wire=wire,
            info={**info, **more},
        )

    run, twin = mk("fzd", 0.6), mk("fzd-p", 0.7, profiled_twin=True)
    twin.out_dir = str(twin_dir)
    limit = mk("fzd40", 0.35, net="40gbit", bound_of="1gbit")
    (line,) = order_bounds(merge_profiled([run, twin, limit]))
    # node 0: 400 + 80 = 480 ms, node 1: 480 + 20 = 500 ms (the bound), node 2: 48 + 300 = 348 ms
    assert line.value == pytest.approx(0.5 / 0.6)
    assert "link 480 ms + its mean idle window 20 ms (of 2 steps: 20-20) = 500 ms" in line.detail, line.detail
    assert "its limit at 40gbit 350 ms = 0.700 of this bound" in line.detail, line.detail
    # any order of the layout: the same links + the last chunk's forwards after its first, 50 ms on every node
    (layout,) = layout_bounds(merge_profiled([run, twin, limit]))
    assert layout.value == pytest.approx(0.53 / 0.6), layout.detail  # node 1: 480 + 50 ms
    assert "480 ms + the last chunk's forwards after its first 50 ms (of 2 steps: 50-50) = 530 ms" in layout.detail
    assert "its limit at 40gbit 350 ms = 0.660 of this bound" in layout.detail, layout.detail
    (missing,) = order_bounds([mk("plain", 0.6)])  # no profiled twin: no value, and why
    assert missing.value is None and "profiled twin" in missing.detail
    (zero,) = order_bounds([mk("z", 0.6, zero=True)])  # the distributed optimizer's all-gathers use the window
    assert zero.value is None and "all-gathers" in zero.detail


def test_overlap_efficiency_from_the_runs():
    from foldtrain.bench.overlap import dp_overlap, efficiency, merge_profiled, pipeline_overlap

    # T_af 1.0 s, T_run 0.7 s, compute 0.5 s, link 0.6 s: 0.3 of the 0.4 s that could be hidden
    v, detail = efficiency(1.0, 0.7, 0.5, 0.6)
    assert v == pytest.approx(0.75) and "max(compute 500, link 600)" in detail
    assert efficiency(0.5, 0.5, 0.5, 0.1)[0] is None  # nothing to hide
    info = {"virtual": 2, "dp_sync": "per-chunk"}
    base = RunResult(
        "pipeline",
        "foldtrain",
        "interleaved-1f1b",
        network="1gbit",
        metrics={"step_time_s": 1.0},
        info={"virtual": 2, "dp_sync": "after-flush"},
    )
    fold = RunResult(
        "pipeline",
        "foldtrain",
        "fold",
        network="1gbit",
        metrics={"step_time_s": 0.7},
        info=dict(info),
        wire=[(75e6, 70e6), (60e6, 75e6)],  # 75 MB at 125 MB/s: 0.6 s
    )
    twin = RunResult(
        "pipeline",
        "foldtrain",
        "fold",
        network="1gbit",
        info={**info, "profiled_twin": True},
        metrics={"step_time_s": 0.9, "profiled_step_s": 0.8, "exposed_dp_comm_s": 0.3, "all_rank_idle_fraction": 0.2},
    )
    # the same schedule with other options (+zero, +zero+tied) has twins of its own: none takes another's
    dist, tied = (
        dataclasses.replace(fold, metrics={"step_time_s": 0.75}, info={**info, **extra})
        for extra in ({"zero": True}, {"zero": True, "tied": True})
    )
    dist_twin, tied_twin = (
        dataclasses.replace(twin, metrics={"all_rank_idle_fraction": x}, info={**twin.info, **r.info})
        for x, r in ((0.3, dist), (0.4, tied))
    )
    runs = merge_profiled([base, fold, dist, tied, tied_twin, dist_twin, twin])
    assert runs == [base, fold, dist, tied] and fold.metrics["step_time_s"] == 0.7
    idle = [r.metrics["all_rank_idle_fraction"] for r in (fold, dist, tied)]
    assert idle == [0.2, 0.3, 0.4]
    runs = [base, fold]
    (r,) = pipeline_overlap(runs)
    assert r.value == pytest.approx(0.75), r.line()  # compute = 0.8 - 0.3 s
    dp = RunResult(
        "dp",
        "foldtrain",
        "allreduce",
        ranks=4,
        workers=4,
        network="1gbit",
        wire=[(12.5e6, 12.5e6)],
        metrics={"step_time_s": 0.25, "compute_s": 0.2},  # link 0.1 s: after-flush 0.3, bound 0.2
    )
    (r,) = dp_overlap([dp])
    assert r.value == pytest.approx(0.5)


def test_bench_cli_help(capsys):
    from foldtrain.bench import main

    assert main(["--help"]) == 0 and "dp" in capsys.readouterr().out
    assert main(["nonsense"]) == 2
    with pytest.raises(SystemExit) as e:
        main(["dp", "--help"])
    assert e.value.code == 0 and "--strategies" in capsys.readouterr().out


# ---------------------------------------------------------------- run_job with fake scripts (no torch)

FAKE_OK = """
import json, sys, os
out = sys.argv[sys.argv.index('--out') + 1]
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, 'metrics.jsonl'), 'w') as f:
    for i in range(5):
        f.write(json.dumps({'step': i + 1, 'step_time_s': 0.5, 'tokens_per_s': 100.0, 'peak_mem_mb': 1.0}) + '\\n')
"""
FAKE_FAIL = (
    "import sys; print('Traceback (most recent call last):', file=sys.stderr); "
    "print('ValueError: boom', file=sys.stderr); sys.exit(3)"
)


def test_run_job_success_failure_timeout(tmp_path):
    ok = Job(RunResult("dp", "fake", "ok"), [], [], launcher=[sys.executable, "-c", FAKE_OK])
    r = run_job(ok, tmp_path / "ok", warmup=2, steps=5, timeout_s=60)
    assert r.ok and r.metrics["tokens_per_s"] == 100.0 and r.metrics["steps_measured"] == 3
    bad = Job(RunResult("dp", "fake", "bad"), [], [], launcher=[sys.executable, "-c", FAKE_FAIL])
    r = run_job(bad, tmp_path / "bad", warmup=2, steps=5, timeout_s=60)
    assert not r.ok and r.error == "ValueError: boom"
    slow = Job(RunResult("dp", "fake", "slow"), [], [], launcher=[sys.executable, "-c", "import time; time.sleep(60)"])
    r = run_job(slow, tmp_path / "slow", warmup=2, steps=5, timeout_s=1)
    assert r.error.startswith("timed out after 1 s") and r.info["wall_s"] < 20
    empty = Job(RunResult("dp", "fake", "empty"), [], [], launcher=[sys.executable, "-c", "pass"])
    assert "logged no step metrics" in run_job(empty, tmp_path / "empty", 2, 5, 60).error


def test_slug_and_csv():
    assert common.slug("dp", "foldtrain", "fold:per-chunk", "", "1gbit") == "dp_foldtrain_fold-per-chunk_1gbit"
    assert common.csv(" a, b,,c ") == ["a", "b", "c"]
    assert common.csv_ints("1,2,4") == [1, 2, 4]


def test_merge_repeats(tmp_path):
    from foldtrain.bench.results import merge_repeats

    a = run_from(
        tmp_path, "a", [9, 9, 1.0, 1.0], variant="allreduce", ranks=2, network="1gbit", wire=[(1.0, 2.0), (3.0, 4.0)]
    )
    b = run_from(
        tmp_path, "b", [9, 9, 3.0, 3.0], variant="allreduce", ranks=2, network="1gbit", wire=[(3.0, 4.0), (5.0, 6.0)]
    )
    c = run_from(tmp_path, "c", [9, 9, 2.0, 2.0], variant="allreduce", ranks=2, network="1gbit")
    c.wire = None
    bad = RunResult("dp", "foldtrain", "allreduce", "fp32", 2, "1gbit", 2, error="RuntimeError: flaky")
    m = merge_repeats([a, bad, b, c])
    assert m.ok and m.metrics["step_time_s"] == 2.0 and m.metrics["steps_measured"] == 6
    assert m.metrics["tokens_per_s"] == pytest.approx(2048 / 2.0)  # consistent with the median step time
    ab = merge_repeats([a, b])  # an even count: the median falls between, tokens/s still agrees with it
    assert ab.metrics["step_time_s"] == 2.0 and ab.metrics["tokens_per_s"] == pytest.approx(1024)
    assert m.metrics["peak_mem_mb"] == 103.0
    assert m.wire == [(2.0, 3.0), (4.0, 5.0)]
    assert m.info["repeats"] == 4 and "1 of 4 repetitions failed (RuntimeError: flaky)" in m.info["note"]
    assert a.metrics["step_time_s"] == 1.0  # inputs untouched
    allbad = merge_repeats([bad, bad])
    assert not allbad.ok and allbad.error == "RuntimeError: flaky"
    assert merge_repeats([a]) is a


def test_execute_without_root_runs_the_loopback_part(tmp_path, monkeypatch):
    """No root: one clear line, the throttled runs are left out, the loopback runs still run."""
    from foldtrain.netem import cluster as netns
    from foldtrain.netem.cluster import NEEDS_ROOT

    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    a = dp.parser().parse_args(["--steps", "5", "--warmup", "2", "--device", "cpu", "--repeat", "2"])

    def fake(variant, net):
        return Job(RunResult("dp", "fake", variant, network=net), [], [], launcher=[sys.executable, "-c", FAKE_OK])

    jobs = {"loopback": [fake("a", "loopback")], "1gbit": [fake("b", "1gbit")]}
    ws = common.Workspace(str(tmp_path / "ws"), "dp")
    lines = []
    results = common.execute(jobs, a, ws, {"1gbit": 2}, lines.append)
    assert f"foldtrain bench: {NEEDS_ROOT}" in lines
    assert [(r.variant, r.network, r.ok, r.info.get("repeats")) for r in results] == [("a", "loopback", True, 2)]
    assert sorted(p.name for p in ws.runs.iterdir()) == [
        "dp_fake_a_fp32_1r_loopback_rep1",
        "dp_fake_a_fp32_1r_loopback_rep2",
    ]
