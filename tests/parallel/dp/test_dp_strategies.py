"""Data-parallel strategies over gloo on CPU against the single-process engine: three torchrun launches.

* 2 ranks: every strategy in fp32 (10 steps, checkpoint round trip), with gradient accumulation
  and active clipping, with wire compression, in every half precision, and the asynchronous
  server colocated on rank 0;
* 4 ranks: the same in fp32, the parameter server colocated, with 1 and with 2 dedicated
  servers, some half precisions, and the asynchronous server with a dedicated server and a slow
  worker on a learnable toy task;
* 2 ranks, rank 1 dies at step 3: rank 0 must exit with one line naming rank 1.

``dp_worker.py`` runs the cases and writes what each rank saw; the single-process references are
computed here, in this process, with the same code (``run_case`` with one process).
"""

from __future__ import annotations

import functools
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from foldtrain.distributed import DistEnv
from tests.equivalence import scalar_rel, worst_param
from tests.parallel.dp.dp_worker import BASE, D_MODEL, HEADS, make_engine, run_case
from tests.support import failed, torchrun

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
TOL = 1e-5  # fp32: every loss and every parameter within 1e-5 relative of the single-process run
STRATEGY_KEYS = (
    "--dp.strategy",
    "--dp.ps_servers",
    "--dp.fusion_mb",
    "--dp.compression",
    "--dp.ps_staleness",
    "--dp.shard_collective",
)
CLIP = ["--train.micro_batch", "2", "--optim.grad_clip", "0.05"]  # 6 micro-batches per step overall; clipping active
HALF = ("bf16", "fp16", "bf16-master", "fp16-master")


def s(name: str, args: list[str], steps: int, **kw) -> dict:
    return {"name": name, "args": args, "steps": steps, **kw}


def strategies(world: int) -> dict[str, list[str]]:
    out = {
        "ddp": ["--dp.strategy", "ddp"],
        "allreduce": ["--dp.strategy", "allreduce"],
        "sharded-ps": ["--dp.strategy", "sharded-ps"],
        "ps": ["--dp.strategy", "ps"],
        "fsdp": ["--dp.strategy", "fsdp"],
    }
    if world == 4:
        out["ps-1server"] = ["--dp.strategy", "ps", "--dp.ps_servers", "1"]
    return out


def spec(world: int) -> list[dict]:
    cases = []
    for name, args in strategies(world).items():
        extra = (
            {"mismatch": ["--dp.shard_slice_mb", "0.001"]} if name == "sharded-ps" else {}
        )  # reloaded with other slices
        cases.append(s(f"fp32/{name}", args, 10, ckpt_at=5, **extra))
        micro = "2" if world == 2 or name == "ps-1server" else "1"  # per-worker rows: 6, 3 or 4
        cases.append(s(f"clip/{name}", [*args, *CLIP[:1], micro, *CLIP[2:]], 6))
    cases += vocab_cases(world)
    if world == 2:
        cases.append(
            s("fp32/allreduce-fusion", ["--dp.strategy", "allreduce", "--dp.fusion_mb", "0.02"], 10, ckpt_at=5)
        )
        for wire in ("fp16", "bf16"):
            cases.append(s(f"wire/{wire}", ["--dp.strategy", "allreduce", "--dp.compression", wire], 4))
        cases.append(s("wire/ddp-bf16", ["--dp.strategy", "ddp", "--dp.compression", "bf16"], 4))
        cases.append(s("wire/fsdp-bf16", ["--dp.strategy", "fsdp", "--dp.compression", "bf16"], 4))
        for prec in HALF:
            for name, args in strategies(2).items():
                cases.append(s(f"{prec}/{name}", [*args, "--precision", prec], 3, **half_extras(prec)))
        cases.append(
            s("async/colocated", ["--dp.strategy", "ps", "--dp.ps_staleness", "1", "--train.steps", "6"], 6, ckpt_at=3)
        )
    else:
        cases += overlap_cases()
        cases.append(
            s(
                "clip/ps-2servers",
                [
                    "--dp.strategy",
                    "ps",
                    "--dp.ps_servers",
                    "2",
                    "--train.micro_batch",
                    "2",
                    "--optim.grad_clip",
                    "0.05",
                ],
                6,
            )
        )
        for prec in ("bf16", "fp16-master"):
            for name in ("sharded-ps", "ps-1server"):
                cases.append(s(f"{prec}/{name}", [*strategies(4)[name], "--precision", prec], 3, **half_extras(prec)))
        toy = [
            "--dp.strategy",
            "ps",
            "--dp.ps_servers",
            "1",
            "--dp.ps_staleness",
            "2",
            "--train.steps",
            "40",
            "--optim.warmup_steps",
            "0",
            "--optim.lr",
            "2e-2",
        ]
        cases.append(s("async/dedicated", toy, 40, toy=True, lag={"rank": 1, "steps": 2, "peers": [2, 3]}))
        cases.append(
            s(
                "async/2servers-bf16-master",
                [
                    "--dp.strategy",
                    "ps",
                    "--dp.ps_servers",
                    "2",
                    "--dp.ps_staleness",
                    "1",
                    "--precision",
                    "bf16-master",
                    "--train.steps",
                    "4",
                ],
                4,
            )
        )
    return cases


def vocab_cases(world: int) -> list[dict]:
    """fsdp's tied weight: in the root's FSDP2 unit (``--dp.shard_vocab false``), and split by rows (the default)
    unevenly (125 rows over 4 ranks: 32, 32, 32, 29) or with padding rows past the words (120 words in 128 rows
    over 2 ranks: the second slice ends in 8 rows that take no probability), checkpoint round trips included."""
    fsdp = ["--dp.strategy", "fsdp"]
    if world == 2:
        return [
            s("fp32/fsdp-root-vocab", [*fsdp, "--dp.shard_vocab", "false"], 10, ckpt_at=5),
            s("clip/fsdp-padded-vocab", [*fsdp, "--model.vocab_size", "120", "--model.vocab_multiple", "64", *CLIP], 6),
        ]
    return [s("fp32/fsdp-uneven-vocab", [*fsdp, "--model.vocab_size", "125"], 6, ckpt_at=3)]


# Bucketed overlap at 4 ranks: allreduce with a cycle time so short that (nearly) every gradient
# closes a bucket, and ZeRO-2 with buckets of a few kilobytes, with accumulation and clipping.
CYCLE = [
    "--dp.strategy",
    "allreduce",
    "--dp.first_bucket_mb",
    "0.001",
    "--dp.fusion_mb",
    "0.02",
    "--dp.cycle_ms",
    "0.001",
]
ZERO2 = [
    "--dp.strategy",
    "sharded-ps",
    "--dp.first_bucket_mb",
    "0.002",
    "--dp.shard_bucket_mb",
    "0.02",
    "--dp.shard_slice_mb",
    "0.004",
]


def overlap_cases() -> list[dict]:
    # zero2-rs: the same with the backend's reduce-scatter (NCCL's path: a one-row receive, also into the
    # ramped embedding's reduced prefix) instead of gloo's all-to-all
    zero2 = [*ZERO2, "--train.micro_batch", "1", "--optim.grad_clip", "0.05"]
    return [
        s("overlap/allreduce-cycle", CYCLE, 4),
        s("overlap/zero2", zero2, 4),
        s("overlap/zero2-rs", [*zero2, "--dp.shard_collective", "reduce_scatter"], 4),
    ]


def half_extras(prec: str) -> dict:
    """Master precisions also round-trip a checkpoint; fp16 ones get an overflowing gradient on the
    last rank at step 2 (it is a worker in every layout, never only a server)."""
    extras = {"ckpt_at": 2} if prec.endswith("master") else {}
    if prec.startswith("fp16"):
        extras["poison"] = {"rank": -1, "step": 1}
    return extras


def launch(
    world: int, cases: list[dict], out: Path, monitor_s: float = 0.1, timeout: float = 600
) -> subprocess.CompletedProcess:
    (out / "spec.json").write_text(json.dumps(cases))
    return torchrun(
        world, str(HERE / "dp_worker.py"), str(out / "spec.json"), str(out), timeout=timeout, monitor_s=monitor_s
    )


def run_world(world: int, tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp(f"dp{world}")
    proc = launch(world, spec(world), out)
    assert proc.returncode == 0, failed(proc)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return run_world(2, tmp_path_factory)


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return run_world(4, tmp_path_factory)


# ---------------------------------------------------------------------- single-process references
ONE = DistEnv(0, 1, 0, torch.device("cpu"))


def reference_args(args: list[str]) -> tuple[str, ...]:
    out, i = [], 0
    while i < len(args):
        if args[i] in STRATEGY_KEYS:
            i += 2
            continue
        out += args[i : i + 2]
        i += 2
    return tuple(out)


@functools.cache
def reference(args: tuple[str, ...], steps: int, poison_step: int | None = None) -> dict:
    poison = {"poison": {"rank": 0, "step": poison_step}} if poison_step is not None else {}
    return run_case({"name": "ref", "args": list(args), "steps": steps, **poison}, ONE)


def reference_of(case: dict) -> dict:
    return reference(reference_args(case["args"]), case["steps"], case.get("poison", {}).get("step"))


rel = scalar_rel  # test_horovod.py imports the scalar measure from here under this name


def param_rel(got: dict, ref: dict) -> tuple[float, str]:
    """Largest over tensors of the relative error |a - b| / |b| (2-norms), leaving out the
    attention key biases (``tests.equivalence.worst_param``), and that tensor's name. (Single entries whose
    gradients nearly cancel carry more Adam-amplified rounding noise: up to ~6e-5 of their tensor's largest
    entry with 3 workers, whose 1/3 average is inexact; the tensors as a whole stay below 4e-6.)"""
    return worst_param(got, ref, HEADS, D_MODEL)


def assert_matches_single_process(results: list[dict], name: str, case: dict) -> dict:
    """Every rank's losses, rank 0's gradient norms and parameters equal the single-process run of
    ``case`` (fp32: 1e-5 relative); returns rank 0's record."""
    ref = reference_of(case)
    for r, res in enumerate(results):
        got = res[name]
        assert len(got["losses"]) == case["steps"]
        worst = max(scalar_rel(a, b) for a, b in zip(got["losses"], ref["losses"]))
        assert worst < TOL, f"{name} rank {r}: loss off by {worst:.2e}"
    rank0 = results[0][name]
    assert max(scalar_rel(a, b) for a, b in zip(rank0["grad_norms"], ref["grad_norms"])) < TOL, name
    worst, tensor = param_rel(rank0["params"], ref["params"])
    assert worst < TOL, f"{name}: {tensor} off by {worst:.2e}"
    return rank0


def cases_of(results: list[dict], prefix: str) -> list[str]:
    return [k for k in results[0] if k.startswith(prefix)]


def workers(results: list[dict], name: str) -> list[dict]:
    return [r[name] for r in results if r[name]["batch_rows"] > 0]


# ---------------------------------------------------------------------- tests
@pytest.mark.parametrize("world", [2, 4])
def test_every_case_ran(world, request):
    results = request.getfixturevalue(f"world{world}")
    names = [c["name"] for c in spec(world)]
    for r, res in enumerate(results):
        errors = {k: v["error"] for k, v in res.items() if "error" in v}
        assert not errors, f"rank {r}: {errors}"
        assert sorted(res) == sorted(names)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("group", ["fp32/", "clip/"])
def test_fp32_equals_single_process(world, group, request):
    """Every step's loss, the gradient norm and every parameter equal the single-process run (1e-5)."""
    results = request.getfixturevalue(f"world{world}")
    spec_of = {c["name"]: c for c in spec(world)}
    names = cases_of(results, group)
    assert len(names) >= 4
    for name in names:
        case = spec_of[name]
        rank0 = assert_matches_single_process(results, name, case)
        for got in workers(results, name):  # every computing replica holds the same weights
            assert all(torch.equal(got["replica"][k], rank0["params"][k]) for k in rank0["params"]), name
        if group == "clip/":  # the clip (0.05) really scaled the gradients
            assert min(reference_of(case)["grad_norms"]) > 0.05


@pytest.mark.parametrize("world", [2, 4])
def test_checkpoint_round_trip_continues_identically(world, request):
    """Save (DCP, through CheckpointManager) at step 5 of 10, load into fresh engines, train on: identical."""
    results = request.getfixturevalue(f"world{world}")
    resumed = [c for c in spec(world) if c.get("ckpt_at")]
    assert {c["args"][1] for c in resumed} >= {"ddp", "allreduce", "sharded-ps", "ps"}
    for case in resumed:
        rank0 = results[0][case["name"]]
        if world == 4 and case["args"][1] == "ddp":
            # a fresh DDP packs its buckets in parameter order for its first step and then rebuilds them
            # in gradient-ready order; a 4-rank ring sums an element in an order that depends on its
            # place in the bucket, so the first resumed step may differ in the last bit
            pairs = zip(rank0["resumed_losses"], rank0["losses"][case["ckpt_at"] :])
            assert max(scalar_rel(a, b) for a, b in pairs) < 1e-6
            assert param_rel(rank0["resumed_params"], rank0["params"])[0] < 1e-6
            continue
        for r, res in enumerate(results):
            got = res[case["name"]]
            assert got["resumed_losses"] == got["losses"][case["ckpt_at"] :], f"{case['name']} rank {r}"
        for k, v in rank0["params"].items():
            assert torch.equal(rank0["resumed_params"][k], v), f"{case['name']}: {k}"
    # sharded-ps' shards depend on the bucket and slice sizes: a run with other slices refuses the checkpoint
    for res in results:
        err = res["fp32/sharded-ps"]["mismatch_error"]
        assert (
            err.startswith("CheckpointError: this checkpoint's sharded-ps shards") and "--dp.shard_slice_mb" in err
        ), err


# Half precisions against single-process runs of the same precision. Partial gradients are rounded
# to the half dtype on each rank before they are summed (and travel half in the master modes),
# where one process rounds the full sum once: bf16 keeps 8 significant bits (2^-8 = 4e-3), fp16
# 11 (5e-4). AdamW turns a relative gradient difference d into an update difference of about
# d * lr, so after 3 steps the weights differ by ~1e-5 and the loss (about 4.9) by well under 1e-3
# relative; the tolerance is that bound, 50x above what is observed for fp32.
HALF_TOL = 1e-3


@pytest.mark.parametrize("world", [2, 4])
def test_half_precisions_match_single_process(world, request):
    results = request.getfixturevalue(f"world{world}")
    cases = [c for c in spec(world) if c["name"].split("/")[0] in HALF]
    assert len(cases) >= (16 if world == 2 else 4)
    for case in cases:
        ref = reference_of(case)
        for r, res in enumerate(results):
            got = res[case["name"]]
            worst = max(scalar_rel(a, b) for a, b in zip(got["losses"], ref["losses"]))
            assert worst < HALF_TOL, f"{case['name']} rank {r}: loss off by {worst:.2e}"
            assert all(math.isfinite(v) for v in got["losses"])
            assert got["scale"] == ref["scale"], f"{case['name']}: loss scaler decisions differ"
        if case.get("ckpt_at"):
            assert results[0][case["name"]]["resumed_losses"] == results[0][case["name"]]["losses"][case["ckpt_at"] :]


@pytest.mark.parametrize("world", [2, 4])
def test_fp16_overflow_on_one_rank_skips_the_step_everywhere(world, request):
    """The last rank's gradient overflows at step 2: every rank skips that step and halves the loss
    scale, exactly as one process does, although in sharded-ps / ps only some ranks see the inf."""
    results = request.getfixturevalue(f"world{world}")
    cases = [c for c in spec(world) if c.get("poison")]
    assert {c["args"][1] for c in cases} >= (
        {"ddp", "allreduce", "sharded-ps", "ps"} if world == 2 else {"sharded-ps", "ps"}
    )
    for case in cases:
        ref = reference_of(case)
        assert ref["scale"] == 2.0**15  # one skipped step
        assert {r[case["name"]]["scale"] for r in results} == {ref["scale"]}, case["name"]


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp_keeps_a_shard_of_the_parameters_and_of_adamw_state(world, request):
    """FSDP2: each rank holds 1/W of every parameter (rows rounded up) and AdamW moments only for that."""
    results = request.getfixturevalue(f"world{world}")
    total = sum(v.numel() for v in results[0]["fp32/fsdp"]["params"].values())  # named_parameters: the tied weight once
    for res in results:
        got = res["fp32/fsdp"]
        assert got["engine"] == "FSDPStrategy"
        assert total / world <= got["held_elems"] <= total / world * 1.1, (got["held_elems"], total)
        assert got["moment_elems"] == got["held_elems"]
    assert results[0]["fp32/ddp"]["held_elems"] == total  # a replica, for contrast


def test_wire_compression_close_to_fp32(world2):
    """fp16 / bf16 on the wire (the allreduce strategy's and DDP's buckets, FSDP's reduce-scatters): the gradients
    lose precision once per step; losses stay close and the gradients' reductions carried the wire dtype (allreduce
    and DDP: only it, half of fp32's bytes; FSDP: its reduce-scatters, beside the vocabulary-sharded head's fp32
    activations)."""
    for name, strategy, tol, wire in (
        ("wire/fp16", "allreduce", 1e-4, "torch.float16"),
        ("wire/bf16", "allreduce", 1e-3, "torch.bfloat16"),
        ("wire/ddp-bf16", "ddp", 1e-3, "torch.bfloat16"),
        ("wire/fsdp-bf16", "fsdp", 1e-3, "torch.bfloat16"),
    ):
        got, fp32 = world2[0][name], world2[0][f"fp32/{strategy}"]
        ref = reference((), 4)
        assert max(scalar_rel(a, b) for a, b in zip(got["losses"], ref["losses"])) < tol
        assert got["losses"] != ref["losses"]  # rounded: not bit for bit the fp32 run
        per_step = fp32["all_reduced"]["torch.float32"] / len(fp32["losses"])  # elements the fp32 run reduced
        assert got["all_reduced"].get(wire, 0) / len(got["losses"]) > 0.9 * per_step, got["all_reduced"]
        if strategy != "fsdp":
            assert set(got["all_reduced"]) == {wire}, got["all_reduced"]
            assert got["stats"][-1]["comm_bytes_sent"] < 0.6 * fp32["stats"][-1]["comm_bytes_sent"]


def test_dedicated_servers_compute_nothing(world4):
    for name, k in (("fp32/ps-1server", 1), ("clip/ps-2servers", 2)):
        for rank, res in enumerate(world4):
            got = res[name]
            if rank < k:
                assert got["batch_rows"] == 0
            else:
                assert got["batch_rows"] == 12 // (4 - k) and (got["dp_rank"], got["dp_world"]) == (rank - k, 4 - k)


def test_async_parameter_server(world2, world4):
    """Bounded staleness: never more than S steps stale, actually stale with a worker held S steps behind
    the others (deterministically, through the rendezvous store), and learning."""
    toy = world4[0]["async/dedicated"]
    observed = max(st["ps_staleness_max"] for st in toy["stats"])
    assert 0 < observed <= 2, observed
    losses = toy["losses"]  # the server reports the mean over workers of each step's losses
    assert sum(losses[-5:]) / 5 < 0.5 * losses[0], losses
    for res in world4[1:]:  # the workers' own losses fall too
        assert sum(res["async/dedicated"]["losses"][-5:]) / 5 < 0.5 * res["async/dedicated"]["losses"][0]
    col = world2[0]["async/colocated"]
    assert max(st["ps_staleness_max"] for st in col["stats"]) <= 1
    assert col["resumed_losses"] == col["losses"][3:]  # resumes at a quiescent step: deterministic
    assert all(math.isfinite(v) for res in world4 for v in res["async/2servers-bf16-master"]["losses"])
    for server, workers in ((toy, (1, 2, 3)), (col, (1,))):
        for w in workers:
            assert replies_precede_the_next_receive([op for op, peer, _ in server["p2p"] if peer == w]), w


def replies_precede_the_next_receive(ops: list[str]) -> bool:
    """A server's transfers with one worker: the first receives (header and gradient) posted at the start, then
    each reply before the receives of the worker's next gradient. NCCL runs a pair's transfers in the order they
    were posted, so a receive posted before the reply would wait for a gradient that comes only after it."""
    rounds = [ops[i : i + 3] for i in range(2, len(ops) - 1, 3)]
    return ops[:2] == ["recv", "recv"] and all(r == ["send", "recv", "recv"] for r in rounds) and ops[-1] == "send"


def test_a_dead_rank_is_named(tmp_path):
    """Rank 1 os._exit(1)s before step 3; rank 0 exits non-zero with one line naming it.

    gloo reports the closed connection at once and rank 0 sees that rank 1's process has exited
    (tens of milliseconds). torchrun also stops the surviving workers when it notices a dead one
    (every ``--monitor-interval``, 0.1 s by default), usually while the survivor is tearing down,
    after the line is printed; ``--monitor-interval 2`` here only makes the race a non-issue.
    torchrun's own report names the failed rank too ("Root Cause ... rank: 1").
    """
    case = s("die", ["--dp.strategy", "allreduce", "--dp.timeout_s", "10"], 6, timeout_s=10, die={"rank": 1, "step": 2})
    proc = launch(2, [case], tmp_path, monitor_s=2, timeout=120)  # a hang would end here
    assert proc.returncode != 0
    line = re.search(r"foldtrain: error: (.*)", proc.stderr)
    assert line, proc.stderr[:3000]
    assert re.fullmatch(
        r"rank 1 stopped responding during all-reduce at step 3 \(timeout 10 s\); check that rank's log", line.group(1)
    ), line.group(1)
    took = float(re.search(r"error after ([0-9.]+) s of the step", proc.stderr).group(1))
    assert took < 10 + 5, took  # within the timeout (plus the naming grace), measured on the survivor's own clock


def test_overlap_cases_equal_single_process(world4):
    for case in overlap_cases():
        ref = reference_of(case)
        for r, res in enumerate(world4):
            got = res[case["name"]]
            assert "error" not in got, got.get("error")
            worst = max(scalar_rel(a, b) for a, b in zip(got["losses"], ref["losses"]))
            assert worst < TOL, f"{case['name']} rank {r}: loss off by {worst:.2e}"
        worst, tensor = param_rel(world4[0][case["name"]]["params"], ref["params"])
        assert worst < TOL, f"{case['name']}: {tensor} off by {worst:.2e}"


def test_allreduce_buckets_identical_on_every_rank(world4):
    """The cycle-time flush cuts buckets from rank 0's clock once; every rank gets that plan and
    launches the buckets in one order, every step, although each rank's own clock differs."""
    got = [res["overlap/allreduce-cycle"] for res in world4]
    plan = got[0]["plan"]
    assert len(plan) >= 4  # the cycle time really cut (the model fits one 0.02 MB fusion buffer ~5 times)
    assert sorted(i for b in plan for i in b) == list(range(sum(len(b) for b in plan)))  # each parameter once
    for g in got[1:]:
        assert g["plan"] == plan
        assert g["launch_log"] == got[0]["launch_log"]
    assert all(log == list(range(len(plan))) for log in got[0]["launch_log"])  # the plan's order, every step
    for fixed in ("fp32/allreduce", "clip/allreduce"):  # default flags: the whole tiny model still splits
        assert all(res[fixed]["plan"] == world4[0][fixed]["plan"] for res in world4)


def test_zero2_memory_is_a_shard_plus_a_bucket(world4):
    """Gradient shard + fp32 shard weights + two AdamW moments = 16 bytes per shard element (+ the two
    step counters), the shard being 1/W of the parameters plus padding; transient: the gradients and
    slice buffers alive at once stay within one bucket (the plan's largest), plus one slice's send and
    receive buffers when a slice must go with nothing in flight; every bucket went in several slices."""
    for name in ("overlap/zero2", "overlap/zero2-rs"):  # gloo's all-to-all, and the reduce-scatter (1/W receives)
        for r, res in enumerate(world4):
            m = res[name]["memory"]
            assert m["all_to_all"] == (name == "overlap/zero2") and m["ramped"], (name, m["all_to_all"], m["ramped"])
            persistent, transient = m["bytes"]
            assert persistent == 16 * m["shard_elems"] + 2 * 4, (name, r, persistent, m["shard_elems"])
            assert (
                m["total"] / 4 <= m["shard_elems"] <= m["total"] / 4 + 2 * len(m["bucket_elems"])
            )  # each part padded to a multiple of W
            assert m["budget"] == 4 * max(m["bucket_padded"])  # fp32: one bucket's bytes
            assert 0 < transient <= m["budget"] + 2 * m["slice_bytes"], (
                name,
                r,
                transient,
                m["budget"],
                m["slice_bytes"],
            )
            assert len(m["bucket_elems"]) >= 4 and sum(m["slices"]) >= 3 * len(m["slices"]), m["slices"]
            mb = res[name]["stats"][-1]["grad_optim_mem_mb"]
            assert mb == pytest.approx((persistent + transient) / 2**20)
            assert mb < 0.5 * 16 * m["total"] / 2**20  # well under a replica's gradients + optimizer


# ---------------------------------------------------------------------- no process group needed
def test_bad_configs_fail_before_any_process_group(monkeypatch):
    from foldtrain.config import build_config, validate
    from foldtrain.errors import ConfigError

    def check(args, world, needle):
        with pytest.raises(ConfigError, match=needle):
            validate(build_config([*BASE, *args]), world)

    monkeypatch.setitem(sys.modules, "horovod", None)  # as if Horovod were not installed (find_spec -> None)
    check(["--dp.strategy", "horovod"], 2, r"needs Horovod, which is not installed .* use --dp.strategy allreduce")
    check(["--dp.strategy", "ps", "--dp.ps_servers", "2"], 2, "leaves no worker")
    check(
        ["--dp.strategy", "ps", "--dp.ps_servers", "1"], 6, "not divisible by data-parallel workers"
    )  # 12 rows, 5 workers
    check(["--dp.strategy", "sharded-ps", "--train.micro_batch", "4"], 2, "not divisible")  # 6 rows per rank
    check(["--dp.strategy", "nope"], 2, "not valid")
    check(["--dp.strategy", "sharded-ps", "--dp.shard_slice_mb", "0"], 2, "shard_slice_mb")
    check(["--dp.strategy", "sharded-ps", "--dp.shard_budget_mb", "-1"], 2, "shard_budget_mb")
    check(["--dp.strategy", "sharded-ps", "--dp.shard_collective", "ring"], 2, "shard_collective")


def test_one_process_is_the_single_process_engine():
    from foldtrain.engine import ReplicatedEngine
    from foldtrain.parallel.dp import Strategy

    for strategy in ("ddp", "allreduce", "sharded-ps", "ps"):
        _, engine = make_engine(["--dp.strategy", strategy], ONE)
        assert type(engine) is ReplicatedEngine and type(engine.strategy) is Strategy


def test_an_fsdp_run_trains_and_its_sharded_checkpoint_loads_into_one_process(small_data, tmp_path):
    """`foldtrain train --dp.strategy fsdp` on 2 ranks; its last DCP checkpoint, resharded into one process
    by `foldtrain export`, holds exactly the weights the run gathered for its own model.safetensors."""
    from safetensors.torch import load_file

    from foldtrain.cli import main
    from tests.conftest import tiny_run_args

    run, hf = tmp_path / "run", tmp_path / "hf"
    args = tiny_run_args(small_data, run, "--train.steps", "4", "--dp.strategy", "fsdp", "--train.device", "cpu")
    proc = torchrun(2, "-m", "foldtrain", "train", *args, timeout=300)
    assert proc.returncode == 0, failed(proc)
    assert "strategy fsdp" in (run / "train.log").read_text()
    assert main(["export", "--out", str(run), "--hf", str(hf)]) == 0
    ours, exported = load_file(str(run / "model.safetensors")), load_file(str(hf / "model.safetensors"))
    assert torch.equal(ours["parts.0.wte.weight"], exported["transformer.wte.weight"])
    assert torch.equal(ours["parts.1.mlp.fc.bias"], exported["transformer.h.0.mlp.c_fc.bias"])
