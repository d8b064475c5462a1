"""The 3D engine (data x pipeline x tensor parallel) against the single-process Engine, on gloo.

Few launches: ONE torchrun per world size (2, 4, 8) runs every case of that size in-process
(``worker.py``, cases in ``cases.py``; the 2-rank one ends with the stalled-rank scenario) and
writes JSON; each case is a test here. Plus one end-to-end ``foldtrain train`` run with ``--profile``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from foldtrain.schedules import build_schedule, step_policy, tie_segments
from foldtrain.schedules.layout import distributed_optimizer
from foldtrain.sim import UnitCosts
from foldtrain.sim.events import run_schedule
from tests.equivalence import HEADS, D, batches, make_cfg, norm_rel, without_key_bias
from tests.parallel.pipeline.cases import (
    CKPT_CASES,
    DEADLINE_CASES,
    MICRO,
    ORDER_CASES,
    PROFILE_CASES,
    STEPS,
    equivalence_cases,
)
from tests.support import torchrun

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
WORKER = HERE / "worker.py"
FP32_TOL = 1e-5
HALF_TOL = 1e-3  # bf16 / fp16 autocast: both sides autocast, rounding differs in the order of reductions
# Parameters after several AdamW steps under autocast: the half-precision matmuls round gradient elements to
# a bf16 / fp16 ulp, a different order of sums (stages, micro-batches) can round an element the other way, and
# Adam divides every element by its own running RMS, so a small element carries that ulp at the size of the
# learning rate (bf16: up to 3.9e-3 on an AMD EPYC, while losses and eval stay within HALF_TOL). fp32
# parameters are held at FP32_TOL like everything else.
PARAM_TOL = {"fp32": FP32_TOL, "half": 1e-2}
# Half-precision weights with fp32 masters: the model computes in half precision throughout, so every
# activation, gradient, reduction and stage-to-stage transfer is rounded (autocast rounds only the matmuls
# and keeps fp32 gradients). Losses, evaluation and norms then agree to the dtype's precision (bf16
# 2^-8 = 3.9e-3, fp16 2^-11 = 4.9e-4, observed up to 2.7e-3 and 5e-4); in the parameters Adam turns an
# ulp of disagreement in a small gradient element into an update of the learning rate's size, so a small
# tensor (a LayerNorm bias after 5 steps at lr 1e-2) moves by up to 21% (bf16) and 2% (fp16) of its norm.
# The machinery is held to FP32_TOL by the ``masters_in_fp32`` cases (fp32 in place of the half dtype).
MASTER_TOL = {"bf16-master": (4e-3, 0.5), "fp16-master": (1e-3, 5e-2)}  # (loss, eval, norm), parameters
# --dp.compression: each replica's gradient and their mean rounded to the wire dtype once per step, all else fp32.
# Losses, evaluation and norms agree to the wire dtype's precision (its ulp: bf16 2^-8, fp16 2^-11; observed
# 2.4e-5 and 4.8e-5); the parameters, as with the master precisions, do not: Adam divides each element by its own
# running RMS, so the rounding of a near-zero bias gradient (fp16: into its subnormals) becomes an update of the
# learning rate's size (observed 12% and 9% of a bias's norm). That the reductions really travelled in the wire
# dtype is asserted from the dtypes the all-reduces carried.
WIRE_TOL = {"bf16": (3.9e-3, 0.3), "fp16": (4.9e-4, 0.3)}  # (loss, eval, norm), parameters
WIRE_DTYPE = {"bf16": "torch.bfloat16", "fp16": "torch.float16", None: "torch.float32"}


_RESULTS: dict[int, tuple[dict, str]] = {}


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    """``suite(world)`` -> (results by case id, launch output); one launch per world size."""

    def get(world: int) -> tuple[dict, str]:
        if world not in _RESULTS:
            out = tmp_path_factory.mktemp(f"pipeline_w{world}")
            r = torchrun(world, str(WORKER), "equiv", str(out), timeout=600)
            f = out / f"results_w{world}.json"
            data = json.loads(f.read_text()) if f.is_file() else {}
            data["__out__"] = str(out)
            _RESULTS[world] = (data, (r.stdout + r.stderr)[-6000:])
        return _RESULTS[world]

    return get


def result(suite, world: int, case_id: str) -> dict:
    data, log = suite(world)
    assert case_id in data, f"case {case_id} did not run (an earlier case aborted the launch?)\n{log}"
    r = data[case_id]
    assert r["ok"], r.get("error", "") + "\n" + log
    return r


EQUIV = [(w, c) for w in (2, 4, 8) for c in equivalence_cases(w)]


@pytest.mark.parametrize("world,case", EQUIV, ids=[f"w{w}-{c['id']}" for w, c in EQUIV])
def test_matches_single_process(suite, world, case):
    """Every step's loss and gradient norm, all final parameters and an evaluation loss equal the
    single-process run."""
    r = result(suite, world, case["id"])
    precision = "fp32" if case.get("masters_in_fp32") else case.get("precision", "fp32")
    tol, param_tol = MASTER_TOL.get(precision) or (
        (HALF_TOL, PARAM_TOL["half"]) if precision != "fp32" else (FP32_TOL, FP32_TOL)
    )
    if case.get("wire"):
        tol, param_tol = WIRE_TOL[case["wire"]]
    assert r["loss_err"] <= tol, (r["losses"], r["ref_losses"])
    # the loss's all-gather carried every rank's share (the training loop's stop vote and memory figure)
    assert r["shared"] == [[float(i), 1.5] for i in range(world)], r["shared"]
    if not case["defer"]:
        assert r["norm_err"] <= tol, (r["norms"], r["ref_norms"])
    if case.get("grad_clip"):  # the case exists to clip: the norm must exceed the threshold on every step
        assert min(r["ref_norms"]) > r["grad_clip"], (r["ref_norms"], r["grad_clip"])
    assert r["param_err"] <= param_tol, (r["worst_param"], r["param_err"])
    assert r["eval_err"] <= tol
    # with deferral and no clipping a step meets the other ranks only in the loss's all-gather: no norm, and the
    # deadline queue's agreement on its issued buckets rides on that all-gather (each small all-reduce would wait
    # behind the deferred bytes in flight on a slow link)
    dp, v = case["layout"][0], case["layout"][3]
    if case.get("defer") and v > 1 and dp > 1 and not case.get("clip") and "fp16" not in case.get("precision", ""):
        assert r["small_all_reduces"] == 0, r["small_all_reduces"]
    # the distributed optimizer: AdamW steps 1/dp of the elements (buckets padded to dp slices), the tied
    # weight's copies (all-reduced in full for the tie) split between the pipeline's two ends (rank 0 steps half of
    # its copy), or whole where a deferred head could step only after the embedding's forward (clipping, fp16's
    # scaler, tp: no early steps) or where one rank holds both (zbv), or sliced over dp with shard_tied
    pp, tp, shard_tied = case["layout"][1], case["layout"][2], case.get("shard_tied")
    no_early = case.get("clip") or case.get("precision", "fp32").startswith("fp16") or tp > 1
    split = (
        case.get("zero") and pp > 1 and case["schedule"] != "zbv" and not shard_tied and case.get("split_tied", True)
    )
    split = split and not (case["defer"] and no_early)
    tied = r["tied_elems"] / dp if shard_tied else r["tied_elems"] / 2 if split else r["tied_elems"]
    share = (r["param_elems"] - r["tied_elems"]) / dp + tied if case.get("zero") else r["param_elems"]
    assert share <= r["optim_elems"] <= share + 2 * case["layout"][3] * dp, (r["param_elems"], r["optim_elems"])
    # the gradients' all-reduces carried the wire dtype of --dp.compression, and fp32 without it
    if dp > 1 and precision == "fp32" and not (case.get("zero") or case.get("fsdp")):
        assert set(r["all_reduced"]) == {WIRE_DTYPE[case.get("wire")]}, r["all_reduced"]
    if case.get("fsdp") and case.get("wire"):  # FSDP's reduce-scatters (on gloo: in-place all-reduces) in bf16; in
        # fp32 only the tied copy's shard summed between the pipeline's two ends (inside the replica)
        assert r["all_reduced"].get(WIRE_DTYPE[case["wire"]], 0) > r["param_elems"] * STEPS, r["all_reduced"]
        assert r["all_reduced"].get("torch.float32", 0) <= r["tied_elems"] * STEPS, r["all_reduced"]
    # FSDP: every parameter is sharded over dp (on top of tp): rank 0 holds about 1/dp of its chunks' elements
    # outside tensor parallelism's shards, and AdamW steps only those; the micro-batches' gradients accumulate
    # unsharded and each FSDP group reduce-scatters once per step, not once per micro-batch
    if case.get("fsdp"):
        assert r["param_elems"] <= r["full_elems"] / dp + 2 * r["full_elems"] / (dp * D), r
        assert r["reduce_scatters"] == STEPS * r["fsdp_groups"] > 0, (r["reduce_scatters"], r["fsdp_groups"])
    # a padded vocabulary: the embedding and the head (one tensor, two names) had padding rows, which stayed zero
    padded = (2, 0.0) if case.get("vocab_pad") else (0, 0.0)
    assert (r["padding_rows"], r["padding_abs_max"]) == padded, r
    # the two tied copies (pipeline ranks 0 and P-1) end every step bit for bit the same (tie.py's exchange)
    assert r["tie_equal"] is (True if case["layout"][1] > 1 else None)
    # shard_tied: the tie reduces and exchanges only each dp rank's slice of the copy (the head reduce-scatters)
    sliced = case.get("shard_tied") and dp > 1 and case["layout"][1] > 1
    copy = r["tied_elems"] // (2 if case["schedule"] == "zbv" else 1)  # zbv: both copies on rank 0
    assert r["tie_slice"] == (-(-copy // dp) if sliced else None), (r["tie_slice"], r["tied_elems"])
    # ... and a deferred chunk's tied slice steps apart at the end of every iteration (rules.early_tie), on each dp
    # rank of the head's end
    apart = dp * STEPS if (sliced or split) and case["defer"] and not no_early else 0
    assert r["tied_steps_apart"] == apart, r["tied_steps_apart"]
    if case.get("vocab"):  # the tied embedding's dp reduction sent only the touched rows, not the dense gradient
        assert r["tie_rows"] is not None and 0 < r["tie_rows"] <= case["vocab"] // 2, r["tie_rows"]
    elif case["layout"][0] > 1 and case["layout"][1] > 1:  # 64 tokens of a 64-word vocabulary: dense
        assert r["tie_rows"] is None, r["tie_rows"]


@pytest.mark.parametrize("case", CKPT_CASES, ids=[c["id"] for c in CKPT_CASES])
def test_checkpoint_resume_and_interchange(suite, case):
    """Save at 3 of 6, reload into an engine with other weights, continue: identical losses and weights.
    The 3D checkpoint also loads into a single-process GPT and a single-process Engine (which then
    continues exactly like the 3D run)."""
    from foldtrain.checkpoint import CheckpointManager
    from foldtrain.checkpoint.manager import load_model_weights
    from foldtrain.engine import ReplicatedEngine as Engine
    from foldtrain.model.gpt import GPT, GPTShape

    r = result(suite, 4, case["id"])
    assert r["loss_err"] == 0.0 and r["param_err"] == 0.0, r
    ckpt_dir = Path(r["ckpt_dir"])
    root = ckpt_dir.parent
    # the weights alone, into a plain GPT (what `foldtrain eval` / `generate` do)
    cfg = make_cfg(case, steps=6)
    model = GPT(GPTShape.from_config(cfg.model))
    load_model_weights(model, ckpt_dir / "step_00000003")
    want = torch.load(root / "params_step3.pt")
    got = model.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    # the whole training state, into the single-process Engine: it continues like the 3D run
    eng = Engine(GPT(GPTShape.from_config(cfg.model), seed=777), cfg, torch.device("cpu"), MICRO)
    state = eng.state_dict()
    CheckpointManager(ckpt_dir).load(ckpt_dir / "step_00000003", state)
    eng.load_state_dict(state)
    data = batches(cfg.train.global_batch, 6, vocab=cfg.model.vocab_size)  # (the worker's tokens)
    losses = [eng.train_step(*data[s]) for s in range(3, 6)]
    tol, param_tol = MASTER_TOL.get(case.get("precision", "fp32"), (FP32_TOL, FP32_TOL))
    assert max(abs(a - b) / b for a, b in zip(losses, r["losses"][3:])) <= tol, (losses, r["losses"][3:])
    final = torch.load(root / "params_step6.pt")
    sd = eng.state.owner().state_dict()  # the weights of record: the fp32 masters in a master precision
    errs = {k: norm_rel(without_key_bias(k, sd[k], HEADS, D), without_key_bias(k, final[k], HEADS, D)) for k in final}
    assert max(errs.values()) <= param_tol, max(errs.items(), key=lambda kv: kv[1])
    # the distributed optimizer hands DCP only its slices of AdamW's moments (about 1/dp), never all of them;
    # without it a rank's whole state (less the V placement's second tied copy, saved once)
    held = r["moments_held"]
    assert held <= 0.6 if case.get("zero") else held >= 0.9, held


@pytest.mark.parametrize("case", PROFILE_CASES, ids=[c["id"] for c in PROFILE_CASES])
def test_profile_records_the_schedule(suite, case):
    """--profile records, on every rank and for every kept step, exactly the schedule's forwards and
    backwards in the schedule's order, never two at once on a rank; the idle figures are fractions;
    timeline.json is a valid Chrome trace and gantt.png a PNG; profile.jsonl holds each step's figures,
    gathered once at the end (metrics carry none). (The bubble's size is checked analytically on the
    simulator, which runs the same action lists: tests/profile, tests/sim.)"""
    r = result(suite, 2, case["id"])
    assert len(r["recorded"]) == 3
    for step, per_rank in r["recorded"].items():
        assert per_rank == r["expected"], (step, per_rank)
    assert r["overlaps"] == 0
    assert all(0.0 <= b < 1.0 for b in r["bubble"]) and 0.0 <= r["all_idle"] < 1.0
    assert r["stats"] == {}
    steps = [x["step"] for x in r["profiled"]]
    assert len(steps) == 3 and steps == sorted(set(steps)), steps
    for x in r["profiled"]:
        assert 0.0 <= x["bubble_fraction"] <= x["bubble_fraction_max"] < 1.0, x
        assert 0.0 <= x["all_rank_idle_fraction"] < 1.0 and x["exposed_dp_comm_s"] >= 0.0, x
    out = Path(r["out"])
    trace = json.loads((out / "timeline.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any(n.startswith("F c0 m0") for n in names) and any(n.startswith("B c") for n in names)
    assert (out / "gantt.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("case", DEADLINE_CASES, ids=[c["id"] for c in DEADLINE_CASES])
def test_deadline_order_in_the_trace(suite, case):
    """Fold V=4 with deferral over 2 data-parallel replicas: the single-process result, and in the
    --profile trace of every rank: deferred reductions travel in several buckets; no deferred bucket
    is issued while an urgent (same-iteration) reduction is in flight; the deferred buckets still
    queued when the iteration ends (after the ranks agreed on the prefix already issued) are issued
    in deadline order (chunk 1 first)."""
    r = result(suite, 4, case["id"])
    assert r["loss_err"] <= FP32_TOL and r["param_err"] <= PARAM_TOL["fp32"] and r["eval_err"] <= FP32_TOL
    sorted_groups = 0
    for rank, evs in enumerate(r["events"]):
        red = sorted((e for e in evs if e["kind"] == "reduce"), key=lambda e: e["args"]["order"])
        urgent = [e for e in red if not e["args"]["deferred"]]
        deferred = [e for e in red if e["args"]["deferred"]]
        assert urgent and len(deferred) > 3 * len({e["args"]["chunk"] for e in deferred}), rank  # buckets
        for d in deferred:
            assert not any(u["start"] <= d["start"] < u["end"] for u in urgent), (rank, d, urgent)
        launches = sorted(e["start"] for e in evs if e["kind"] == "reduce_launch")
        for u in urgent:  # deferred buckets issued after an urgent reduction, before the next launch: by deadline
            nxt = min((t for t in launches if t > u["end"]), default=float("inf"))
            tail = [d for d in deferred if u["end"] <= d["start"] < nxt and d["args"]["by_deadline"]]
            deadlines = [d["args"]["deadline"] for d in tail]
            assert deadlines == sorted(deadlines), (rank, deadlines)
            sorted_groups += len({d["args"]["chunk"] for d in tail}) > 1
    assert sorted_groups > 0  # some iteration really had several deferred chunks to reorder


def test_stalled_rank_fails_fast(suite):
    """Rank 1 stops answering at step 2 (--dp.timeout_s 5): rank 0 fails with a DistributedError
    naming rank 1 after the 5 s receive timeout (not the 120 s process-group one), shuts down
    without hanging, and the launch ends (the last scenario of the 2-rank launch)."""
    data, log = suite(2)
    f = Path(data["__out__"]) / "stall.json"
    assert f.is_file(), log
    r = json.loads(f.read_text())
    assert r["type"] == "DistributedError", r
    assert "pipeline rank 0 (global rank 0) waited up to 5 s for gradients of chunk 0 microbatch 0" in r["error"]
    assert "from pipeline rank 1 (global rank 1); that rank stalled or died" in r["error"]
    assert 4.5 <= r["detected_s"] <= 20 and r["shutdown_s"] <= 25, r


def test_trainer_end_to_end_with_profile(small_data, tmp_path):
    """`foldtrain train` under torchrun with a folded pipeline and --profile: metrics, profile files,
    checkpoints, exported weights; `foldtrain eval` reads the 3D checkpoint in one process."""
    from foldtrain.cli import main
    from tests.conftest import tiny_run_args

    out = tmp_path / "run"
    args = tiny_run_args(
        small_data,
        out,
        "--train.steps",
        "4",
        "--model.n_layer",
        "4",
        "--parallel.pp",
        "2",
        "--parallel.virtual",
        "2",
        "--parallel.schedule",
        "fold",
        "--parallel.dp_sync",
        "per-chunk",
        "--train.micro_batch",
        "2",
        "--checkpoint.every",
        "2",
        "--profile",
        "--train.device",
        "cpu",
    )
    r = torchrun(2, "-m", "foldtrain", "train", *args, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-5000:]
    rec = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rec] == [1, 2, 3, 4]
    profiled = [json.loads(line) for line in (out / "profile.jsonl").read_text().splitlines()]
    assert [x["step"] for x in profiled] == [1, 2, 3, 4]
    assert all(
        0.0 <= x["bubble_fraction"] < 1.0 and "all_rank_idle_fraction" in x and "exposed_dp_comm_s" in x
        for x in profiled
    )
    assert "val_loss" in rec[-1] and all(x["loss"] > 0 for x in rec)
    assert json.loads((out / "timeline.json").read_text())["traceEvents"]
    assert (out / "gantt.png").is_file() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in (out / "checkpoints").iterdir())[-1] == "step_00000004"
    assert main(["eval", "--out", str(out)]) == 0


class _TiedCosts(UnitCosts):
    """Unit costs with the tied embedding's reduction at its two ends and deferred chunks in buckets: the
    launch order does not depend on durations, only on what is launched."""

    def __init__(self, sched, clip: bool):
        super().__init__(1.0, 2.0, 0.1, 0.5, 0.1)
        self.ties, self.clip = set(tie_segments(sched)), clip

    def tie(self, p, c):
        return {"dp": [("delay", 0.2)], "send": [("delay", 0.1)]} if c in self.ties else None

    def deferred_buckets(self, p, c):
        return [[("delay", 0.3)], [("delay", 0.3)]]

    def before_steps(self):
        return 0.1

    def policy(self):
        return step_policy(self.clip, False, 1)


ORDER = [(w, c) for w, cs in ORDER_CASES.items() for c in cs]


@pytest.mark.parametrize("world,case", ORDER, ids=[f"w{w}-{c['id']}" for w, c in ORDER])
def test_executor_and_simulator_launch_in_the_same_order(suite, world, case):
    """The executor (on gloo, its launches read from its trace) and the simulator, on the same schedule,
    launch each pipeline rank's communication (sends, receives, the tie's and the chunks' reductions, the
    norm) in the same order in every iteration, the first (deferred WRs skipped) included."""
    r = result(suite, world, case["id"])
    cfg = make_cfg(case)
    dp, pp, tp, v = case["layout"]
    M = cfg.train.global_batch // dp // MICRO
    par = cfg.parallel
    sched = build_schedule(par.schedule, pp, v, M, par.dp_sync, cfg.fold.defer_reduce, distributed_optimizer(cfg))
    sim = run_schedule(sched, _TiedCosts(sched, cfg.optim.grad_clip > 0), iterations=len(r["steps"]))
    for p in range(pp):
        for i, step in enumerate(r["steps"]):
            measured = r["launches"][p * tp][i]  # replica 0, TP rank 0 of pipeline rank p
            simulated = [label for it, label in sim.ranks[p].launches if it == i]  # the simulator counts from 0
            first = next((k for k, (m, s) in enumerate(zip(measured, simulated)) if m != s), None)
            assert measured == simulated, (
                f"pipeline rank {p}, step {step}: first difference at launch #{first}: "
                f"executor {measured[first or 0 :][:4]} simulator {simulated[first or 0 :][:4]} "
                f"({len(measured)} vs {len(simulated)} launches)"
            )
            assert any(lb.startswith("LR") for lb in measured)
        if pp > 1 and p in (sched.rank_of(0), sched.rank_of(sched.segments - 1)):  # the tie's ends
            assert any(lb.startswith("tie") for lb in r["launches"][p * tp][0])
