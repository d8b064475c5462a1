"""torchrun worker for the 3D-engine tests: many cases in one launch, JSON results on rank 0.

    torchrun --nproc-per-node N tests/parallel/pipeline/worker.py SUITE OUT_DIR

SUITE: ``equiv``: every case of ``cases.equivalence_cases(N)``, plus the checkpoint cases for
N = 4, and for N = 2 the profile cases and, last, the stalled-rank scenario (rank 1 stops
answering at step 2; it ends the launch with a non-zero status, its result in ``stall.json``).

Equivalence: each case builds a ``PipelineEngine`` for its (layout, schedule, dp_sync, ...),
trains ``STEPS`` steps on deterministic synthetic batches and compares on rank 0 every step's
loss, the final parameters (gathered by ``eval_model``) and an evaluation loss with the
single-process ``Engine`` on the same global batch and micro-batch size (on rank 0, cached per
setting). The config of a case, its batches, that reference run and the comparison are in
``tests.equivalence``. A failing case is recorded with its traceback and the suite goes on.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from tests.equivalence import (  # noqa: E402
    DEVICE,
    batches,
    build_model,
    compare,
    make_cfg,
    norm_rel,
    val_data,
)
from tests.parallel.pipeline.cases import (  # noqa: E402
    CKPT_CASES,
    DEADLINE_CASES,
    ORDER_CASES,
    PROFILE_CASES,
    STEPS,
    equivalence_cases,
)
from tests.support import all_reduced_dtypes  # noqa: E402

PROFILE_STEPS = 3  # steps (the timelines of all of them are kept)


def dp_rows(engine, x, y):
    b = x.shape[0] // engine.dp_world
    lo = engine.dp_rank * b
    return x[lo : lo + b], y[lo : lo + b]


def run_engine(cfg, steps_range, engine=None, seed=None):
    """Train ``engine`` (a new one from ``cfg`` if None) on this rank's rows of the steps ``steps_range``:
    (engine, losses, gradient norms), one of each per step."""
    from foldtrain.engine.pipeline import PipelineEngine

    if engine is None:
        engine = PipelineEngine(build_model(cfg, seed), cfg, DEVICE)
    data = batches(cfg.train.global_batch, cfg.train.steps, vocab=cfg.model.vocab_size)
    losses, grad_norms = [], []
    rank = float(dist.get_rank())
    for s in steps_range:  # as the training loop does, with a share of floats carried by the loss's collective
        losses.append(engine.train_step(*dp_rows(engine, *data[s]), share=lambda: [rank, 1.5]))
        grad_norms.append(engine.last_grad_norm)
        engine.between_steps()  # as the training loop does, after its own per-step collectives
    return engine, losses, grad_norms


def tied_copies_equal(engine) -> bool | None:
    """On global rank 0: whether the output projection's tied copy (the last segment's holder in replica 0, TP
    rank 0: pipeline rank P-1, or rank 0 itself in the V placement) is bit for bit the token embedding's after
    training; None where the pipeline does not split the tie."""
    from foldtrain.parallel.pipeline.p2p import local_part

    lay, topo = engine.layout, engine.topo
    d, p, t = topo.coords
    head_rank = engine.pipeline_schedule.rank_of(lay.segments - 1)
    if lay.pp == 1 or (d, t) != (0, 0) or p not in (0, head_rank):
        return None
    head = (
        local_part(engine.chunks[lay.segments - 1].head.lm_head.weight).detach().contiguous()
        if p == head_rank
        else None
    )
    if p != 0:
        dist.send(head, dst=topo.pipeline_peer(0))
        return None
    w = local_part(engine.chunks[0].parts["0"].wte.weight).detach()
    if head is None:
        head = torch.empty_like(w)
        dist.recv(head, src=topo.pipeline_peer(head_rank))
    return bool(torch.equal(w, head))


@contextlib.contextmanager
def masters_in_fp32(on: bool):
    """A master precision with fp32 in place of its half dtype (on both sides: the single-process reference runs
    under it too): the masters' machinery (fp32 owners, gradient hand-over, steps, copies back) is then held to
    the fp32 tolerance, which pure half-precision arithmetic cannot be."""
    import tests.equivalence as eq
    from foldtrain.optim.precision import Precision

    if not on:
        yield
        return
    saved = Precision.param_dtype
    Precision.param_dtype = property(lambda self: torch.float32)
    eq._REF.clear()  # a reference computed under the swap must not serve the real precision, and vice versa
    try:
        yield
    finally:
        Precision.param_dtype = saved
        eq._REF.clear()


def equivalence_case(case: dict) -> dict | None:
    with masters_in_fp32(case.get("masters_in_fp32", False)):
        return _equivalence_case(case)


@contextlib.contextmanager
def counting_reduce_scatters():
    """Count the reduce-scatters FSDP2 issues: on gloo through foldtrain's ``InPlaceReduceScatter``, elsewhere
    ``torch.distributed.reduce_scatter_single`` (torch 2.13; ``reduce_scatter_tensor`` in 2.11)."""
    from foldtrain.parallel.fsdp_gloo import InPlaceReduceScatter

    calls = [0]
    owners = [(dist, n) for n in ("reduce_scatter_single", "reduce_scatter_tensor") if hasattr(dist, n)]
    owners.append((InPlaceReduceScatter, "__call__"))
    real = {(o, n): getattr(o, n) for o, n in owners}

    def counting(key):
        def counted(*args, **kwargs):
            calls[0] += 1
            return real[key](*args, **kwargs)

        return counted

    for key in owners:
        setattr(*key, counting(key))
    try:
        yield calls
    finally:
        for key in owners:
            setattr(*key, real[key])


@contextlib.contextmanager
def counting_tied_steps():
    """Count the tied copy's slices stepped apart at an iteration's start (``ChunkShards.step_tied``)."""
    from foldtrain.parallel.pipeline.zero import ChunkShards

    calls, real = [0], ChunkShards.step_tied

    def counted(self, *args):
        calls[0] += 1
        return real(self, *args)

    ChunkShards.step_tied = counted
    try:
        yield calls
    finally:
        ChunkShards.step_tied = real


def fsdp_groups(engine) -> int:
    """The FSDP parameter groups of this rank's chunks (each reduce-scatters its gradients as one)."""
    from foldtrain.parallel.pipeline.fsdp import param_groups

    return sum(len(param_groups(c)) for c in engine.chunks.values())


def _equivalence_case(case: dict) -> dict | None:
    cfg = make_cfg(case)
    with counting_reduce_scatters() as reduce_scatters, counting_tied_steps() as tied_steps:
        small = [0]  # all-reduces of under 64 elements
        with all_reduced_dtypes(small) as reduced:
            engine, losses, norms = run_engine(cfg, range(STEPS))
    tied_steps = torch.tensor([float(tied_steps[0])])
    dist.all_reduce(tied_steps)  # (the head's end is on the last pipeline rank)
    fsdp = {"reduce_scatters": reduce_scatters[0], "fsdp_groups": fsdp_groups(engine)} if case.get("fsdp") else {}
    ev = engine.eval_loss(val_data(cfg.model.vocab_size))
    full = engine.eval_model()
    tie_equal = tied_copies_equal(engine)
    if dist.get_rank() != 0:
        return None
    tie = engine.executor.reducers[0].tie if engine.layout.pp > 1 else None
    return {
        **compare(cfg, losses, full, ev, norms),
        "tie_rows": tie.last_rows if tie else None,
        "tie_slice": tie.slices.length if tie and tie.slices else None,  # --optim.shard_tied: elements exchanged
        "tied_steps_apart": int(tied_steps.item()),
        "shared": engine.shared,
        "small_all_reduces": small[0],
        "tie_equal": tie_equal,
        "all_reduced": reduced,  # elements by dtype
        **optimizer_share(engine),
        **fsdp,
    }


def optimizer_share(engine) -> dict:
    """Rank 0's parameter elements (the local parts; and the whole tensors') and the elements AdamW steps there
    (its masters or slices)."""
    from foldtrain.parallel.pipeline.p2p import local_part

    stepped = sum(
        local_part(p).numel() for o in engine.steps.optimizers.values() for g in o.param_groups for p in g["params"]
    )
    return {
        "param_elems": sum(local_part(p).numel() for p in engine.model.parameters()),
        "full_elems": sum(p.numel() for p in engine.model.parameters()),  # DTensors: the whole tensor's
        "tied_elems": sum(local_part(t).numel() for t in engine.tied.values()),
        "optim_elems": stepped,
    }


def checkpoint_case(case: dict, out: Path) -> dict | None:
    """Train 6 steps saving at 3; reload step 3 into an engine built from other weights; continue."""
    from foldtrain.checkpoint import CheckpointManager
    from foldtrain.checkpoint.manager import _state_bytes
    from foldtrain.parallel.pipeline.p2p import local_part

    root = out / case["id"]
    cfg = make_cfg(case, steps=6, out=str(root))
    ckpt = CheckpointManager(root / "checkpoints", keep=5)
    engine, first, _ = run_engine(cfg, range(3))
    saved = engine.state_dict()
    # AdamW's moments this rank hands DCP (its own slices with --optim.distributed), against all of its chunks'
    held = _state_bytes(saved["optim"]["state"])
    moments = 8 * sum(local_part(p).numel() for c in engine.chunks.values() for p in c.parameters())
    ckpt.save(3, saved, {"step": 3}, background=case.get("background", False))  # staged now, written meanwhile
    full3 = engine.eval_model()
    _, rest, _ = run_engine(cfg, range(3, 6), engine)
    full_a = engine.eval_model()
    ckpt.save(6, engine.state_dict(), {"step": 6})  # completes step 3's first
    from foldtrain.engine.pipeline import PipelineEngine

    engine_b = PipelineEngine(build_model(cfg, seed=12345), cfg, DEVICE)  # different weights: the load must restore all
    state = engine_b.state_dict()
    ckpt.load(root / "checkpoints" / "step_00000003", state)
    engine_b.load_state_dict(state)
    _, resumed, _ = run_engine(cfg, range(3, 6), engine_b)
    full_b = engine_b.eval_model()
    if dist.get_rank() != 0:
        return None
    torch.save({k: v.detach().cpu() for k, v in full3.state_dict().items()}, root / "params_step3.pt")
    torch.save({k: v.detach().cpu() for k, v in full_a.state_dict().items()}, root / "params_step6.pt")
    sa, sb = full_a.state_dict(), full_b.state_dict()
    return {
        "losses": first + rest,
        "resumed": resumed,
        "ckpt_dir": str(root / "checkpoints"),
        "param_err": max(norm_rel(sb[k], sa[k]) for k in sa),
        "loss_err": max(abs(a - b) for a, b in zip(rest, resumed)),
        "moments_held": held / moments,
        "cfg": {"n_layer": cfg.model.n_layer, "global_batch": cfg.train.global_batch, "grad_clip": cfg.optim.grad_clip},
    }


def profile_case(case: dict, out: Path) -> dict | None:
    from foldtrain.engine.pipeline import PipelineEngine
    from foldtrain.profile import summarize

    root = out / case["id"]
    cfg = make_cfg(case, steps=PROFILE_STEPS, out=str(root), profile=True)
    engine, losses, _ = run_engine(cfg, range(PROFILE_STEPS), PipelineEngine(build_model(cfg), cfg, DEVICE))
    if dist.get_rank() != 0:
        return None
    events = engine.profile_events()
    schedule = engine.pipeline_schedule
    expected = [
        [a.op.value + f" c{a.chunk} m{a.mb}" for a in schedule.ranks[p] if a.op.value in ("F", "B")]
        for p in range(schedule.pp)
    ]
    steps = sorted({ev["step"] for evs in events for ev in evs if ev["kind"] == "compute"})
    recorded = {
        st: [
            [ev["name"] for ev in sorted(evs, key=lambda e: e["start"]) if ev["kind"] == "compute" and ev["step"] == st]
            for evs in events
        ]
        for st in steps
    }
    overlaps = 0
    for evs in events:
        spans = sorted((ev["start"], ev["end"]) for ev in evs if ev["kind"] in ("compute", "optim"))
        overlaps += sum(1 for (_, e0), (s1, _) in zip(spans, spans[1:]) if s1 < e0)
    mean = summarize(events)[-1]
    return {
        "expected": expected,
        "recorded": {str(k): v for k, v in recorded.items()},
        "overlaps": overlaps,
        "bubble": mean["bubble"],
        "all_idle": mean["all_idle"],
        "stats": engine.stats(),
        "profiled": [json.loads(line) for line in (root / "profile.jsonl").read_text().splitlines()],
        "out": str(root),
        "losses": losses,
    }


def deadline_case(case: dict) -> dict | None:
    """Train STEPS profiled steps (fold, deferral, dp 2, a bucket per tensor): equivalence, and every rank's
    reduction buckets (issue -> completion, deadline, issue order) and reduction launches. A bucket per
    tensor (12 a block) outnumbers the actions between a chunk's backward and the iteration's end, each of
    which issues at most one: the buckets of several chunks are left for the end-of-iteration sort however
    fast the ranks run (with a few per chunk, a fast run had issued all but one chunk's)."""
    from foldtrain.engine.pipeline import PipelineEngine

    # no run directory: the events are kept in memory, and no timeline.json or gantt.png (a second) is written
    cfg = make_cfg(case, profile=True, **{"fold.bucket_mb": 1e-9})  # one tensor per bucket
    engine, losses, norms = run_engine(cfg, range(STEPS), PipelineEngine(build_model(cfg), cfg, DEVICE))
    ev = engine.eval_loss(val_data(cfg.model.vocab_size))
    full = engine.eval_model()
    if dist.get_rank() != 0:
        return None
    keep = [[e for e in evs if e["kind"] in ("reduce", "reduce_launch")] for evs in engine.profile_events()]
    return {
        **compare(cfg, losses, full, ev, norms),
        "events": keep,
        "deferred": [engine.pipeline_schedule.deferred_chunks(p) for p in range(2)],
    }


ORDER_STEPS = 3
LAUNCH_KINDS = ("send", "recv_wait", "reduce_launch")


def launch_labels(events: list[dict], step: int) -> list[str]:
    """A rank's communication launches in ``step``, in the order it started them: its sends and receives,
    the tie's and the chunks' reductions, and the iteration's norm (``clip``)."""
    mine = [e for e in events if e["step"] == step]
    launches = [e for e in mine if e["kind"] in LAUNCH_KINDS or e["name"] == "clip"]
    return [e["name"] for e in sorted(launches, key=lambda e: e["start"])]


def order_case(case: dict) -> dict | None:
    """Train ORDER_STEPS profiled steps; on rank 0 every global rank's launch order per step."""
    cfg = make_cfg(case, steps=ORDER_STEPS, profile=True)  # the events in memory, no files (as deadline_case)
    engine, _, _ = run_engine(cfg, range(ORDER_STEPS))
    if dist.get_rank() != 0:
        return None
    events = engine.profile_events()
    steps = sorted({e["step"] for evs in events for e in evs})
    return {"steps": steps, "launches": [[launch_labels(evs, st) for st in steps] for evs in events]}


def stall_suite(out: Path) -> None:
    """Rank 1 stops answering at step 2 (``--dp.timeout_s 5``); rank 0 must fail with a
    DistributedError naming it, shut down cleanly, and exit. Never returns (it ends the launch)."""
    from foldtrain.distributed import shutdown
    from foldtrain.engine.pipeline import PipelineEngine
    from foldtrain.errors import DistributedError

    case = dict(layout=(1, 2, 1, 1), schedule="1f1b", n_layer=2)
    cfg = make_cfg(case, steps=6, **{"dp.timeout_s": 5})
    engine = PipelineEngine(build_model(cfg), cfg, DEVICE)
    data = batches(cfg.train.global_batch, 6)
    rank = dist.get_rank()
    t0 = time.time()
    try:
        for s in range(6):
            if s == 2:
                t0 = time.time()
                if rank == 1:
                    print("rank 1: stalling", flush=True)
                    time.sleep(3600)
            engine.train_step(*data[s])
    except DistributedError as e:
        detected = time.time() - t0
        print(f"rank {rank}: DistributedError after {detected:.1f}s: {e}", flush=True)
        shutdown()  # what the trainer does on its way out: must not hang on the dead peer
        res = {"error": str(e), "type": type(e).__name__, "detected_s": detected, "shutdown_s": time.time() - t0}
        (out / "stall.json").write_text(json.dumps(res))
        os._exit(3)
    (out / "stall.json").write_text(json.dumps({"error": None}))
    os._exit(0)


def main() -> None:
    out = Path(sys.argv[2])  # sys.argv[1] is the suite: ``equiv``, the only one
    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=120))
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.set_num_threads(1)
    only = os.environ.get("FOLDTRAIN_TEST_ONLY")
    jobs = [("equiv", c) for c in equivalence_cases(world)]
    if world == 4:
        jobs += [("ckpt", c) for c in CKPT_CASES] + [("deadline", c) for c in DEADLINE_CASES]
    if world == 2:
        jobs += [("profile", c) for c in PROFILE_CASES]
    jobs += [("order", c) for c in ORDER_CASES.get(world, [])]
    results = {}
    for kind, c in jobs:
        if only and only not in c["id"]:
            continue
        t0 = time.time()
        try:
            fn = {
                "equiv": equivalence_case,
                "ckpt": lambda c: checkpoint_case(c, out),
                "profile": lambda c: profile_case(c, out),
                "deadline": deadline_case,
                "order": order_case,
            }[kind]
            r = fn(c)
            ok = True
        except Exception:
            r, ok = {"error": traceback.format_exc()}, False
            print(f"rank {rank}: case {c['id']} failed:\n{r['error']}", flush=True)
        # a case that failed on some rank must not leave the others waiting in a collective: the
        # suite aborts as a whole when any rank failed (the failure is in the JSON / output)
        flag = torch.tensor([0 if ok else 1])
        dist.all_reduce(flag)
        if rank == 0:
            results[c["id"]] = {"ok": ok, "seconds": time.time() - t0, **(r or {})}
            (out / f"results_w{world}.json").write_text(json.dumps(results, indent=1, default=str))
        if int(flag):
            if rank == 0:
                results[c["id"]]["ok"] = False
                results[c["id"]].setdefault("error", "failed on another rank (see output)")
                (out / f"results_w{world}.json").write_text(json.dumps(results, indent=1, default=str))
            os._exit(1)
    dist.barrier()
    if world == 2:
        stall_suite(out)  # last: it ends the launch (rank 0 exits with the error, torchrun stops rank 1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
