"""The 3D engine's distributed optimizer: per-rank optimizer state and masters, measured, against the default.

One launch of ``dp x pp`` ranks builds the 3D engine three times on the same model and layout: without
``--optim.distributed``, with it, and with it and ``--optim.shard_tied``; it trains two steps each and counts on
every rank the bytes of the tensors AdamW keeps (its moments, and the fp32 masters: the master precisions'
copies, or the distributed optimizer's slices). The simulator's memory model (``foldtrain simulate``'s
``optimizer`` + ``masters``) predicts the same figures from the configuration alone.

    foldtrain bench dist-optim [--preset gpt2-small] [--dp 2] [--pp 2] [--precision bf16-master]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from foldtrain.bench.common import gather_from_workers

MB = 2**20
# the engines compared: name -> the options added to the configuration
VARIANTS = {
    "default": ["--optim.distributed", "false"],
    "distributed": ["--optim.distributed", "true"],
    "shard_tied": ["--optim.distributed", "true", "--optim.shard_tied", "true"],
}


def config_args(a) -> list[str]:
    return [
        "--model.preset",
        a.preset,
        "--model.vocab_size",
        str(a.vocab),
        "--parallel.dp",
        str(a.dp),
        "--parallel.pp",
        str(a.pp),
        "--parallel.virtual",
        "2",
        "--parallel.schedule",
        "fold",
        "--parallel.dp_sync",
        "per-chunk",
        "--train.seq_len",
        "32",
        "--train.global_batch",
        str(4 * a.dp),
        "--train.micro_batch",
        "1",
        "--precision",
        a.precision,
        "--train.device",
        "cpu",
    ]


def optimizer_bytes(engine) -> tuple[int, int, int]:
    """``(moments, masters, tied)``: bytes of AdamW's state tensors, of the tensors it steps where those have
    storage of their own (the master precisions' fp32 copies), not the model's weights (or views into them),
    and the part of both that belongs to the tied weight's copy (which the distributed optimizer does not slice over
    dp: it keeps it whole, or splits it between the pipeline's two ends)."""
    from foldtrain.parallel.pipeline.p2p import local_part

    moments = masters = tied = 0
    own = {local_part(p).untyped_storage().data_ptr() for p in engine.model.parameters()}
    # the tensors AdamW steps for the tied weight's copies: the copies, their masters, or the buckets not over dp
    tied_ids = {id(t) for t in engine.tied.values()}
    steps = engine.steps
    tied_ids |= {id(m) for pairs in steps.pairs.values() for p, m in pairs if id(p) in tied_ids}
    for z in (steps.shards or {}).values():
        tied_ids |= {
            id(sg.tensor) for b in z.buckets if b.whole or z.tied_halves and b is z.buckets[-1] for sg in b.segments
        }
    for o in steps.optimizers.values():
        for group in o.param_groups:
            for p in group["params"]:
                st = o.state.get(p, {})
                state = sum(local_part(t).nbytes for k, t in st.items() if k != "step")
                copy = local_part(p).nbytes if local_part(p).untyped_storage().data_ptr() not in own else 0
                moments, masters = moments + state, masters + copy
                if id(p) in tied_ids:
                    tied += state + copy
    return moments, masters, tied


def worker(out: Path, argv: list[str]) -> None:
    """Under torchrun: both engines, two steps each, every rank's bytes gathered on rank 0."""
    import torch
    import torch.distributed as dist

    from foldtrain.config import build_config
    from foldtrain.engine.pipeline import PipelineEngine
    from foldtrain.train.trainer import build_model

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rows = {}
    for name, extra in VARIANTS.items():
        cfg = build_config([*argv, *extra])
        engine = PipelineEngine(build_model(cfg, meta=True), cfg, torch.device("cpu"))
        g = torch.Generator().manual_seed(0)
        for _ in range(2):
            x = torch.randint(0, cfg.model.vocab_size, (cfg.train.global_batch, cfg.train.seq_len + 1), generator=g)
            rows_x = x[engine.dp_rank :: engine.dp_world]
            engine.train_step(rows_x[:, :-1].contiguous(), rows_x[:, 1:].contiguous())
        mine = [engine.topo.dp_rank, engine.topo.pp_rank, *optimizer_bytes(engine)]
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        rows[name] = every
        del engine
    if dist.get_rank() == 0:
        (out / "bytes.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


def predicted(argv: list[str], variant: str) -> list[float]:
    """The simulator's optimizer + masters bytes per pipeline rank."""
    from foldtrain.config import build_config
    from foldtrain.sim.cluster import load_cluster
    from foldtrain.sim.setup import resolve_setup
    from foldtrain.sim.simulate import simulate_setup

    cfg = build_config([*argv, *VARIANTS[variant]])
    r = simulate_setup(resolve_setup(cfg), load_cluster("dgx-a100"), check_memory=False)
    return [m["optimizer"] + m["masters"] for m in r.memory]


def main(argv: list[str] | None = None) -> int:
    if argv and argv[0] == "--worker":
        worker(Path(argv[1]), argv[2:])
        return 0
    ap = argparse.ArgumentParser(
        prog="foldtrain bench dist-optim", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--preset", default="gpt2-small")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--precision", default="bf16-master", help="fp32, bf16 or a master precision")
    a = ap.parse_args(argv)
    args = config_args(a)
    rows = gather_from_workers("dist-optim", a.dp * a.pp, args)
    pred = {k: predicted(args, k) for k in rows}
    print(
        f"{a.preset} (vocab {a.vocab}), dp {a.dp} x pp {a.pp}, fold V=2, {a.precision}: AdamW's moments + fp32 "
        "masters per rank (MB), measured after two steps"
    )
    print(
        f"{'dp':>3} {'pp':>3} {'default':>9} {'distributed':>12} {'of it tied':>11} {'ratio':>6} "
        f"{'x dp, untied':>13} {'shard_tied':>11} {'ratio':>6} {'error':>6}"
    )
    worst = {"untied": 0.0, "tied": 0.0, "dist": 0.0, "err": 0.0}
    for (d, p, m0, s0, t0), (_, _, m1, s1, t1), (_, _, m2, s2, _t2) in zip(*(rows[k] for k in VARIANTS)):
        base, dist_, tied = (m0 + s0) / MB, (m1 + s1) / MB, (m2 + s2) / MB
        untied = (dist_ - t1 / MB) / (base - t0 / MB) * a.dp  # the sharded part against 1/dp of today's
        worst["untied"] = max(worst["untied"], untied)
        worst["tied"] = max(worst["tied"], tied / base * a.dp)
        worst["dist"] = max(worst["dist"], dist_ / base * a.dp)
        errs = [
            abs(pred[k][p] / MB / x - 1) for k, x in (("default", base), ("distributed", dist_), ("shard_tied", tied))
        ]
        worst["err"] = max(worst["err"], *errs)
        print(
            f"{d:>3} {p:>3} {base:>9.1f} {dist_:>12.1f} {t1 / MB:>11.1f} {dist_ / base:>6.3f} {untied:>13.3f} "
            f"{tied:>11.1f} {tied / base:>6.3f} {max(errs):>6.1%}"
        )
    print(
        f"largest (distributed - tied) / (default - tied) x dp: {worst['untied']:.3f} (target <= 1, up to the "
        "slices' padding); without --optim.shard_tied the two ends of the pipeline split the tied weight's copy, "
        "half each (whole where a deferred head cannot step early: see docs/3d-parallel.md)"
    )
    print(f"largest distributed / default x dp: {worst['dist']:.3f} (target <= 1, up to the padding; dp 2: the halves)")
    print(f"largest shard_tied / default x dp: {worst['tied']:.3f} (target <= 1, up to the slices' padding)")
    print(f"largest simulator error (all three runs): {worst['err']:.1%} (target <= 15%)")
    return 0
