"""Worker for the data-parallel tests: ``torchrun --nproc-per-node W dp_worker.py SPEC.json OUT_DIR``
(or ``horovodrun -np W -H localhost:W python dp_worker.py SPEC.json OUT_DIR``).

SPEC.json is a list of cases (config overrides plus what to do); every rank runs them in order,
each on a fresh engine built exactly as the trainer builds it (``build_engine``), and writes what
it observed to ``OUT_DIR/rank{r}.pt``; pytest compares that with single-process runs made by
``run_case`` in its own process. A case that raises is recorded as ``{"error": ...}`` so one
failure does not hide the others. A case with ``"die": {"rank": R, "step": S}`` is the dead-rank
check: rank R ``os._exit(1)``s before step S and the others report what the engine raised, as the
CLI would, and exit 2. ``"poison": {"rank": R, "step": S}`` makes one parameter's gradient inf on
rank R at step S (the fp16 loss scaler must skip that step on every rank).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from foldtrain.checkpoint import CheckpointManager
from foldtrain.config import build_config, dp_workers, validate
from foldtrain.distributed import DistEnv
from foldtrain.engine import build_engine
from foldtrain.errors import FoldtrainError
from foldtrain.model import GPT, GPTShape
from tests.support import SyntheticSampler, all_reduced_dtypes

HEADS, D_MODEL = 2, 32
MODEL = [
    "--model.n_layer",
    "2",
    "--model.n_head",
    str(HEADS),
    "--model.d_model",
    str(D_MODEL),
    "--model.context",
    "32",
    "--model.vocab_size",
    "128",
]
BASE = [
    *MODEL,
    "--train.seq_len",
    "16",
    "--train.global_batch",
    "12",
    "--optim.warmup_steps",
    "2",
    "--train.device",
    "cpu",
]


def make_engine(args: list[str], env: DistEnv):
    cfg = build_config([*BASE, *args])
    validate(cfg, env.world_size)
    torch.manual_seed(cfg.train.seed)
    model = GPT(GPTShape.from_config(cfg.model), cfg.train.seed)
    workers = dp_workers(cfg, env.world_size)
    return cfg, build_engine(cfg, model, env, cfg.train.micro_batch or cfg.train.global_batch // workers)


def params_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, whole (a sharded DTensor is gathered: a collective, every rank calls this)."""
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().clone()
        for n, p in model.named_parameters()
    }


def poison_grads(engine):
    """Make this step's gradients inf on this rank: the first parameter's, or (FSDP: its sharded parameters
    see no autograd hook) everything behind the embedding's output. The handle to remove afterwards."""
    p = engine.state.named_params[0][1]
    if not hasattr(p, "to_local"):
        return p.register_hook(lambda g: torch.full_like(g, float("inf")))

    def poison_output(_module, _inputs, out):
        out.register_hook(lambda g: torch.full_like(g, float("inf")))

    return engine.model.parts[0].register_forward_hook(poison_output)


STEP_START = [0.0]  # when the current step began (the dead-rank case reports how long its error took)


def train(
    engine, cfg, sampler, start: int, stop: int, rank: int, case: dict, ckpt: CheckpointManager | None = None
) -> dict:
    rec = {"losses": [], "grad_norms": [], "stats": []}
    store = dist.distributed_c10d._get_default_store() if case.get("lag") else None
    for step in range(start, stop):
        STEP_START[0] = time.perf_counter()
        die = case.get("die")
        if die and rank == die["rank"] and step == die["step"]:
            sys.stdout.flush()
            os._exit(1)
        lag = case.get(
            "lag"
        )  # {"rank": R, "steps": S, "peers": [...]}: rank R starts step t only once its peers finished t+S-1
        if lag and rank == lag["rank"] and step + lag["steps"] - 1 < stop:
            store.wait([f"{case['name']}/done/{peer}/{step + lag['steps'] - 1}" for peer in lag["peers"]])
        x, y = engine.batch(sampler, step)
        poison = case.get("poison")
        hook = None
        if poison and rank == poison["rank"] and step == poison["step"]:  # an overflowing gradient on one rank
            hook = poison_grads(engine)
        rec["losses"].append(engine.train_step(x, y))
        if hook is not None:
            hook.remove()
        if lag and rank in lag["peers"]:
            store.set(f"{case['name']}/done/{rank}/{step}", "1")
        rec["grad_norms"].append(engine.last_grad_norm)
        rec["stats"].append(engine.stats())
        if ckpt is not None and step + 1 == case.get("ckpt_at"):
            ckpt.save(step + 1, engine.state_dict(), {"step": step + 1}, extra=engine.extra_state())
    return rec


def record_p2p(comm) -> list:
    """[op, peer, tag] of every isend / irecv a strategy posts through ``comm`` (its ``CommStats``), in order."""
    log, send, recv = [], comm.isend, comm.irecv

    def isend(t, dst, tag):
        log.append(["send", dst, tag])
        return send(t, dst, tag)

    def irecv(t, src, tag, count=True):
        log.append(["recv", src, tag])
        return recv(t, src, tag, count)

    comm.isend, comm.irecv = isend, irecv
    return log


def run_case(case: dict, env: DistEnv, tmp: Path | None = None) -> dict:
    """Train ``case['steps']`` steps; optionally save at ``ckpt_at`` and train again from that checkpoint."""
    if case.get("poison"):  # rank -1: the last one
        case = {**case, "poison": {**case["poison"], "rank": case["poison"]["rank"] % env.world_size}}
    cfg, engine = make_engine(case["args"], env)
    sampler = SyntheticSampler(cfg.model.vocab_size, cfg.train.seq_len, case.get("toy", False))
    ckpt = CheckpointManager(tmp / "ckpt", keep=5) if tmp is not None and case.get("ckpt_at") else None
    p2p = record_p2p(engine.strategy.comm) if case["name"].startswith("async") else None
    with all_reduced_dtypes() as reduced:
        out = train(engine, cfg, sampler, 0, case["steps"], env.rank, case, ckpt)
    if p2p is not None:
        out["p2p"] = p2p
    out["all_reduced"] = reduced  # elements by dtype
    engine.flush()  # sharded-ps: the last step's all-gathers land at the next forward, or here
    out["replica"] = params_of(engine.model)
    out["params"] = params_of(engine.eval_model())  # collective for sharded / server layouts
    out["eval_loss"] = engine.eval_loss(
        [sampler.rank_batch(999, cfg.train.global_batch, 0, 1)]
    )  # every rank, the same batch
    out["dp_rank"], out["dp_world"], out["engine"] = engine.dp_rank, engine.dp_world, type(engine.strategy).__name__
    out["batch_rows"] = int(engine.batch(sampler, 0)[0].shape[0])

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    # what this rank keeps (FSDP: its shards): parameters, and AdamW's first moments
    out["held_elems"] = sum(local(p).numel() for p in engine.strategy.optimizer_params())
    moments = [st["exp_avg"] for st in engine.state.optimizer.state.values() if "exp_avg" in st]
    out["moment_elems"] = sum(local(m).numel() for m in moments)
    out["scale"] = engine.precision.scaler.scale
    strat = engine.strategy
    if hasattr(strat, "launch_log"):  # allreduce: its bucket plan and the order buckets were launched, per step
        out["plan"], out["launch_log"] = strat.plan, strat.launch_log
    if hasattr(strat, "grad_optim_bytes"):  # sharded-ps: what its memory figure is made of
        out["memory"] = {
            "bytes": strat.grad_optim_bytes(),
            "shard_elems": strat.n_decay + strat.n_plain,
            "total": strat.total,
            "bucket_elems": [b.decay.n + b.plain.n for b in strat.buckets],
            "bucket_padded": [strat.world * b.width for b in strat.buckets],
            "budget": strat.budget,
            "slices": [len(b.decay.slices) + len(b.plain.slices) for b in strat.buckets],
            "slice_bytes": max(
                (e - a) * strat.params[0].element_size()
                for b in strat.buckets
                for pt in (b.decay, b.plain)
                for a, e in pt.slices
            ),
            "all_to_all": strat.a2a,
            "ramped": any(b.decay.ramp for b in strat.buckets),
        }
    if ckpt is not None:
        _, again = make_engine(case["args"], env)
        state = again.state_dict()
        ckpt.load(ckpt.latest(), state)
        again.load_state_dict(state)
        rec = train(again, cfg, sampler, case["ckpt_at"], case["steps"], env.rank, {**case, "ckpt_at": None})
        out["resumed_losses"] = rec["losses"]
        out["resumed_params"] = params_of(again.eval_model())
        if case.get("mismatch"):  # the same checkpoint into an engine made with other args: the error it raises
            _, other = make_engine([*case["args"], *case["mismatch"]], env)
            state = other.state_dict()
            try:
                ckpt.load(ckpt.latest(), state)
                other.load_state_dict(state)
                out["mismatch_error"] = None
            except FoldtrainError as e:
                out["mismatch_error"] = f"{type(e).__name__}: {e}"
    return out


def main() -> int:
    import torch.distributed as dist

    spec, out_dir = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    torch.set_num_threads(1)
    timeout = min((c.get("timeout_s", 120.0) for c in spec), default=120.0)
    from foldtrain.distributed import init_distributed

    env = init_distributed("cpu", timeout)  # torchrun's or horovodrun's world
    rank = env.rank
    results = {}
    try:
        for case in spec:
            tmp = None
            if case.get("ckpt_at"):  # every rank must use the same directory
                holder = [
                    tempfile.mkdtemp(prefix=case["name"].replace("/", "_") + "_", dir=out_dir) if rank == 0 else None
                ]
                dist.broadcast_object_list(holder, src=0)
                tmp = Path(holder[0])
            t0 = time.perf_counter()
            try:
                results[case["name"]] = run_case(case, env, tmp)
            except FoldtrainError as e:
                if case.get("die"):
                    print(f"foldtrain: error: {e}", file=sys.stderr, flush=True)
                    print(
                        f"error after {time.perf_counter() - STEP_START[0]:.3f} s of the step",
                        file=sys.stderr,
                        flush=True,
                    )
                    return 2
                results[case["name"]] = {"error": f"{type(e).__name__}: {e}"}
            except Exception as e:  # noqa: BLE001 - recorded for the test to show
                if case.get("die"):
                    print(f"unexpected {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                    return 3
                results[case["name"]] = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
            results[case["name"]]["seconds"] = time.perf_counter() - t0
        torch.save(results, out_dir / f"rank{rank}.pt")
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
