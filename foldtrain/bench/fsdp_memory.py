"""``--dp.strategy fsdp``: what each rank holds, measured, against 1/N of the model and the simulator.

One launch of N ranks trains two steps of FSDP2 (``fully_shard`` per block and on the root) and measures on
every rank: the sharded state it keeps (its parameter shards, their gradients as AdamW sees them, AdamW's
moments), and the most unsharded parameters and gradients it held at once, sampled as every module's forward
runs, as every module's output gradient arrives in the backward and as every unsharded gradient is
accumulated (FSDP2 gathers a unit's parameters before these points, and reduce-scatters and frees its
gradients after), and at each reduce-scatter FSDP2 issues (the gradients it took and their fp32 input). Between
those moments nothing is seen: the figure is a lower bound. The two steps are also measured exactly: the most
bytes of tensors alive at once (every tensor, activations included: :func:`allocated_peak`, from the profiler's
allocator events). The simulator's memory model (``foldtrain simulate``: ``params + grads + optimizer``,
``comm_buffers`` and ``activations``) predicts all three from the configuration alone.

    foldtrain bench fsdp-memory [--preset gpt2-small] [--vocab 8192] [--ranks 4] [--reshard true]
                                [--shard_vocab true] [--pp 2 [--schedule 1f1b]]

``--shard_vocab`` is ``--dp.shard_vocab``: the tied embedding and head split by rows over the ranks (the default),
or gathered whole in the root's unit (``false``, as the plain script and torchtitan keep them).

With ``--pp`` the ranks run the 3D engine (dp = ranks / pp, every chunk sharded over dp, 4 micro-batches of one
row) and each rank is held against the simulator's memory of its pipeline stage: there FSDP accumulates every
micro-batch's gradients unsharded in fp32 and keeps the chunk's blocks gathered until the chunk's reduction, as
torch pipelining drives it, so the sampling sees them.

Reads FSDP2's private ``FSDPParam`` state (``_unsharded_param``) for the unsharded bytes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from foldtrain.bench.common import gather_from_workers

MB = 2**20


def config_args(a) -> list[str]:
    common = [
        *("--model.preset", a.preset, "--model.vocab_size", str(a.vocab)),
        *("--dp.strategy", "fsdp", "--dp.reshard_after_forward", a.reshard),
        *("--precision", a.precision, "--train.device", "cpu", "--train.seq_len", str(a.seq_len)),
    ]
    if a.pp == 1:
        mb = str(a.micro_batch)
        rows = ["--train.global_batch", str(a.micro_batch * a.ranks), "--train.micro_batch", mb]
        return [*common, *rows, "--dp.shard_vocab", a.shard_vocab]
    dp = a.ranks // a.pp  # the 3D engine: every chunk sharded over dp, 4 micro-batches of one row
    layout = ["--parallel.dp", str(dp), "--parallel.pp", str(a.pp), "--parallel.schedule", a.schedule]
    return [*common, *layout, "--train.global_batch", str(4 * dp), "--train.micro_batch", "1"]


def fsdp_params(model) -> list:
    """Every ``FSDPParam`` of the model's FSDP units (private FSDP2 state); ``model``: the replicated engine's
    model, or the 3D engine's chunks."""
    from torch.distributed.fsdp import FSDPModule

    out = []
    for m in model.modules():
        if isinstance(m, FSDPModule):
            group = m._get_fsdp_state()._fsdp_param_group
            out += list(group.fsdp_params) if group is not None else []
    return out


def optimizers(engine) -> list:
    """The engine's AdamW instances: the replicated engine's one, or the 3D engine's one per chunk."""
    steps = getattr(engine, "steps", None)
    return list(steps.optimizers.values()) if steps is not None else [engine.state.optimizer]


class Sampler:
    """The most unsharded parameter and gradient bytes held at once, sampled at every module's forward and at
    every module output's gradient."""

    def __init__(self, model):
        self.params = fsdp_params(model)
        self.peak = 0
        for m in model.modules():
            if not list(m.children()):
                m.register_forward_hook(self.on_forward)

    def held(self) -> int:
        total = 0
        for p in self.params:
            full = getattr(p, "_unsharded_param", None)
            if full is None:
                continue
            total += full.untyped_storage().nbytes()
            if full.grad is not None:
                total += full.grad.untyped_storage().nbytes()
            acc = getattr(p, "unsharded_accumulated_grad", None)  # gradients accumulated in the reduce dtype
            total += acc.untyped_storage().nbytes() if acc is not None else 0
        return total

    def sample(self) -> None:
        self.peak = max(self.peak, self.held())

    def on_forward(self, _module, _inputs, out) -> None:
        self.sample()
        if hasattr(out, "requires_grad") and out.requires_grad:
            out.register_hook(lambda g: self.sample())

    def watch_reduce_scatters(self) -> None:
        """Sample at each reduce-scatter FSDP2 issues: by then its post-backward has taken the group's unsharded
        gradients from the parameters (so :meth:`held` no longer sees them) but still holds them, and has
        copied them into one flat fp32 input: twice the input's bytes beside what is held
        (``dist.reduce_scatter_single`` in torch 2.13, ``reduce_scatter_tensor`` before)."""
        import torch.distributed as dist

        for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
            original = getattr(dist, name, None)
            if original is None:
                continue

            def sampled(*args, _original=original, **kwargs):
                inp = kwargs.get("input", kwargs.get("input_tensor", args[1] if len(args) > 1 else None))
                extra = 2 * inp.untyped_storage().nbytes() if inp is not None else 0
                self.peak = max(self.peak, self.held() + extra)
                return _original(*args, **kwargs)

            setattr(dist, name, sampled)

    def watch_gradients(self) -> None:
        """Sample as each unsharded parameter's gradient is accumulated, before FSDP2 reduce-scatters and frees
        it (FSDP2 builds the unsharded parameters at the first all-gather: call this after a step)."""
        fulls = [getattr(p, "_unsharded_param", None) for p in self.params]
        if not any(f is not None for f in fulls):
            raise RuntimeError(
                "FSDP2's private FSDPParam._unsharded_param is not there in this torch: the unsharded bytes "
                "cannot be sampled; adapt foldtrain/bench/fsdp_memory.py to it"
            )
        for full in fulls:
            if full is not None and full.requires_grad:
                full.register_post_accumulate_grad_hook(lambda _t: self.sample())


def tensors_alive() -> int:
    """Bytes of every CPU tensor storage reachable from Python now, each storage once (a DTensor's local one)."""
    import gc
    import warnings

    import torch

    storages: dict[int, int] = {}
    with warnings.catch_warnings():  # isinstance() on torch.distributed's deprecated objects warns
        warnings.simplefilter("ignore", FutureWarning)
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.device.type == "cpu"]
    for o in tensors:
        st = (o.to_local() if hasattr(o, "to_local") else o).untyped_storage()
        if st.data_ptr():
            storages[st.data_ptr()] = st.nbytes()
    return sum(storages.values())


def allocated_peak(run) -> int:
    """The most bytes of CPU tensors alive at once while ``run()`` runs, exactly (the CPU's
    ``torch.cuda.max_memory_allocated``): those alive before it plus the highest running total of PyTorch's CPU
    allocator, which the profiler reports with every allocation and free from its start. Call it before the
    first step: then only Python holds tensors (after a step, collectives' work objects may still hold some)."""
    import torch
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    before = tensors_alive()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    todo, totals = list(prof.profiler.kineto_results.experimental_event_tree()), [0]
    while todo:
        node = todo.pop()
        todo += node.children
        if node.tag == _EventType.Allocation and node.extra_fields.device == torch.device("cpu"):
            totals.append(node.extra_fields.total_allocated)
    return before + max(totals)


def rank_batch(cfg, g, rank: int, ranks: int):
    """This rank's share (every ``ranks``-th row from ``rank``) of one random global batch drawn from ``g``:
    (inputs, targets), the same batches for foldtrain's engine and the plain FSDP2 script."""
    import torch

    x = torch.randint(0, cfg.model.vocab_size, (cfg.train.global_batch, cfg.train.seq_len + 1), generator=g)
    mine = x[rank::ranks]
    return mine[:, :-1].contiguous(), mine[:, 1:].contiguous()


def local_bytes(t) -> int:
    return (t.to_local() if hasattr(t, "to_local") else t).nbytes


def worker(out: Path, argv: list[str]) -> None:
    """Under torchrun: two steps; every rank's figures gathered on rank 0."""
    import torch
    import torch.distributed as dist

    from foldtrain.config import build_config
    from foldtrain.distributed import DistEnv
    from foldtrain.engine import build_engine
    from foldtrain.train.trainer import build_model

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = build_config(argv)
    engine = build_engine(cfg, build_model(cfg), DistEnv(rank, world, rank, torch.device("cpu")), 2)
    sampler = Sampler(engine.model)
    sampler.watch_reduce_scatters()
    seen: dict[int, int] = {}
    opts = optimizers(engine)
    for i, opt in enumerate(opts):
        opt.register_step_pre_hook(
            lambda o, *_, i=i: seen.__setitem__(
                i, sum(local_bytes(p.grad) for g in o.param_groups for p in g["params"] if p.grad is not None)
            )
        )
    dp_rank, dp = getattr(engine, "dp_rank", rank), getattr(engine, "dp_world", world)
    g = torch.Generator().manual_seed(0)

    def two_steps() -> None:
        for step in range(2):
            engine.train_step(*rank_batch(cfg, g, dp_rank, dp))
            if step == 0:
                sampler.watch_gradients()

    allocated = allocated_peak(two_steps)
    row = {
        "pp_rank": getattr(getattr(engine, "topo", None), "pp_rank", 0),
        "params": sum(local_bytes(p) for p in engine.model.parameters()),
        "grads": sum(seen.values()),
        "optimizer": sum(local_bytes(t) for o in opts for st in o.state.values() for k, t in st.items() if k != "step"),
        "unsharded_peak": sampler.peak,  # a lower bound (the module docstring says why)
        "allocated_peak": allocated,  # every tensor, activations included: exact
    }
    write_gathered(out, row)


def write_gathered(out: Path, row: dict) -> None:
    """Every rank's ``row``, gathered and written by rank 0 to ``OUT/bytes.json``; the group is then closed."""
    import torch.distributed as dist

    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, row)
    if dist.get_rank() == 0:
        (out / "bytes.json").write_text(json.dumps(every))
    dist.destroy_process_group()


def plain_worker(out: Path, argv: list[str]) -> None:
    """Under torchrun: the plain FSDP2 script's model, sharding and step (:mod:`foldtrain.bench.anchors.fsdp_plain`)
    for two steps on the same batches; its exact peak of tensors alive, per rank."""
    import torch
    import torch.distributed as dist

    from foldtrain.bench.anchors.common import adamw, loss_fn
    from foldtrain.bench.anchors.fsdp_plain import shard
    from foldtrain.config import build_config
    from foldtrain.model import GPT, GPTShape

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = build_config(argv)
    model = shard(GPT(GPTShape.from_config(cfg.model), cfg.train.seed), cfg, world, torch.device("cpu"))
    opt = adamw(model.parameters(), cfg.optim)
    g = torch.Generator().manual_seed(0)

    def two_steps() -> None:
        for _ in range(2):
            inputs, targets = rank_batch(cfg, g, rank, world)
            loss_fn(model(inputs), targets).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)

    write_gathered(out, {"allocated_peak": allocated_peak(two_steps)})


def model_sizes(argv: list[str]) -> tuple[int, int, int, int]:
    """Parameters of the whole model (tied weight once), of one block, of the root unit (the rest) and of the tied
    weight."""
    import torch

    from foldtrain.config import build_config
    from foldtrain.model import GPT, GPTShape

    cfg = build_config(argv)
    with torch.device("meta"):
        model = GPT(GPTShape.from_config(cfg.model))
    total = sum(p.numel() for p in model.parameters())
    block = sum(p.numel() for p in model.blocks[0].parameters())
    return total, block, total - cfg.model.n_layer * block, model.embedding.wte.weight.numel()


def predicted(argv: list[str], ranks: int, pp: int) -> list[dict[str, float]]:
    """The simulator's memory per pipeline rank (without a pipeline it takes the ranks as ``--parallel.dp``), for
    ranks sharing this machine's cores: there FSDP2's collectives run on the training thread
    (``foldtrain.sim.pipeline_fsdp.on_thread``). The preset's other numbers (a GPU's) enter none of the terms
    compared here."""
    import dataclasses
    import os

    from foldtrain.config import build_config
    from foldtrain.sim.cluster import load_cluster
    from foldtrain.sim.simulate import simulate

    cfg = build_config(argv if pp > 1 else [*argv, "--parallel.dp", str(ranks)])
    here = dataclasses.replace(load_cluster("dgx-a100"), shared_cores=float(os.cpu_count() or 1))
    return simulate(cfg, here, check_memory=False).memory


SIM_TOTAL = ("params", "grads", "optimizer", "masters", "comm_buffers", "activations")


def allocated_table(rows: list[dict], preds: list[dict], plain: list[dict] | None = None) -> None:
    """Each rank's exact peak of every tensor alive against the simulator's sum of what it counts for that rank
    (``preds[i]``; the process's runtime aside) and, without a pipeline, the plain FSDP2 script's (``plain``)."""
    print()
    print(
        "| rank | every tensor alive at once, MB (exact) | simulator: state + unsharded buffers + activations "
        "| error |" + (" plain FSDP2 script, MB (exact) |" if plain else "")
    )
    print("|---|---|---|---|" + ("---|" if plain else ""))
    for i, (m, p) in enumerate(zip(rows, preds)):
        sim = sum(p.get(k, 0.0) for k in SIM_TOTAL)
        anchor = f" {plain[i]['allocated_peak'] / MB:.1f} |" if plain else ""
        print(
            f"| {i} | {m['allocated_peak'] / MB:.1f} | {sim / MB:.1f} | {sim / m['allocated_peak'] - 1:+.1%} |{anchor}"
        )


def dp_report(a, args: list[str], rows: list[dict], pred: dict, plain: list[dict]) -> None:
    """Without a pipeline: each rank against the model's 1/N + one block, and rank 0 against the simulator."""
    total, block, root, tied = model_sizes(args)
    full, one = 16 * total, 16 * block  # fp32 parameter, gradient and AdamW's two moments
    print(f"fsdp over {a.ranks} ranks, {a.preset} with a {a.vocab}-word vocabulary, {a.precision},")
    print(f"reshard_after_forward {a.reshard}: {total / 1e6:.1f} M parameters, a block {block / 1e6:.2f} M, the root ")
    print(f"unit (embedding, head, final norm) {root / 1e6:.2f} M = {root / block:.1f} blocks", end="")
    if a.shard_vocab == "true":
        print(f"; shard_vocab true: its tied weight ({tied / 1e6:.2f} M) split by rows over the {a.ranks} ranks, ")
        print("never gathered")
    else:
        print("; shard_vocab false: gathered whole")
    print()
    print(
        "| rank | params MB | grads MB | AdamW MB | sharded state / (model's / N) | unsharded peak MB, at least | "
        "state + unsharded peak, MB | every tensor alive, MB (exact) | <= model's / N + one block's |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    bound = full / a.ranks + one
    for i, m in enumerate(rows):
        state = m["params"] + m["grads"] + m["optimizer"]
        held = state + m["unsharded_peak"]
        # the sampled figure bounds what the rank holds from below, every tensor alive from above
        verdict = "yes" if m["allocated_peak"] <= bound else "no" if held > bound else "not shown"
        print(
            f"| {i} | {m['params'] / MB:.1f} | {m['grads'] / MB:.1f} | {m['optimizer'] / MB:.1f} | "
            f"{state / (full / a.ranks):.3f} | {m['unsharded_peak'] / MB:.1f} | {held / MB:.1f} | "
            f"{m['allocated_peak'] / MB:.1f} | {verdict} ({bound / MB:.1f}) |"
        )
    state0 = sum(rows[0][k] for k in ("params", "grads", "optimizer"))
    sim_state = pred["params"] + pred["grads"] + pred["optimizer"]
    print()
    print(
        f"simulator, rank 0: sharded state {sim_state / MB:.1f} MB ({sim_state / state0 - 1:+.1%} against the "
        f"measured), unsharded buffers {pred['comm_buffers'] / MB:.1f} MB "
        f"({pred['comm_buffers'] / max(rows[0]['unsharded_peak'], 1) - 1:+.1%} against the sampled lower bound)"
    )
    allocated_table(rows, [pred] * len(rows), plain)


def pipeline_report(a, rows: list[dict], preds: list[dict]) -> None:
    """With a pipeline: each rank's sharded state and unsharded peak against the simulator's for its stage."""
    dp = a.ranks // a.pp
    print(f"fsdp in the 3D engine: dp {dp} x pp {a.pp} ({a.schedule}, 4 micro-batches), {a.preset} with a ")
    print(f"{a.vocab}-word vocabulary, {a.precision}, reshard_after_forward {a.reshard}")
    print()
    print("| rank | stage | sharded state MB | simulator | error | unsharded peak MB, at least | simulator | error |")
    print("|---|---|---|---|---|---|---|---|")
    for i, m in enumerate(rows):
        p = preds[m["pp_rank"]]
        state = m["params"] + m["grads"] + m["optimizer"]
        sim_state = p["params"] + p["grads"] + p["optimizer"]
        held, sim_held = m["unsharded_peak"], p["comm_buffers"]
        print(
            f"| {i} | {m['pp_rank']} | {state / MB:.1f} | {sim_state / MB:.1f} | {sim_state / state - 1:+.1%} | "
            f"{held / MB:.1f} | {sim_held / MB:.1f} | {sim_held / max(held, 1) - 1:+.1%} |"
        )
    allocated_table(rows, [preds[m["pp_rank"]] for m in rows])


def main(argv: list[str] | None = None) -> int:
    if argv and argv[0] == "--worker":
        if argv[2:3] == ["--plain"]:
            plain_worker(Path(argv[1]), argv[3:])
        else:
            worker(Path(argv[1]), argv[2:])
        return 0
    ap = argparse.ArgumentParser(
        prog="foldtrain bench fsdp-memory", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--preset", default="gpt2-small")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages: fsdp in the 3D engine over ranks / pp")
    ap.add_argument("--schedule", default="1f1b", help="with --pp: the pipeline schedule")
    ap.add_argument("--reshard", choices=("true", "false"), default="true", help="--dp.reshard_after_forward")
    ap.add_argument("--shard_vocab", choices=("true", "false"), default="true", help="--dp.shard_vocab (without --pp)")
    ap.add_argument("--precision", default="fp32", help="--precision (e.g. bf16-master: bf16 weights gathered)")
    ap.add_argument("--seq_len", type=int, default=32, help="tokens per row (fewer: fewer activations)")
    ap.add_argument("--micro_batch", type=int, default=2, help="rows per rank, without --pp")
    a = ap.parse_args(argv)
    if a.ranks % a.pp or a.ranks // a.pp < 2:
        raise SystemExit(f"foldtrain bench fsdp-memory: --ranks {a.ranks} needs at least 2 x --pp {a.pp}, a multiple")
    args = config_args(a)
    rows = gather_from_workers("fsdp-memory", a.ranks, args)
    preds = predicted(args, a.ranks, a.pp)
    if a.pp == 1:
        dp_report(a, args, rows, preds[0], gather_from_workers("fsdp-memory", a.ranks, ["--plain", *args]))
    else:
        pipeline_report(a, rows, preds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
