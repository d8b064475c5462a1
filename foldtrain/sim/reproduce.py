"""Reproduce both papers at scale with the simulator: ``python -m foldtrain.sim.reproduce``.

Writes ``docs/reproduction.md`` and ``docs/img/sim_fold_gain_vs_bandwidth.png`` (``--out``
changes the directory). Nothing is launched; every figure is a prediction.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from foldtrain.config import build_config

from .cluster import load_cluster
from .memory import GB
from .setup import resolve_setup
from .simulate import Result, simulate_setup

CMD = "python -m foldtrain.sim.reproduce"


def _run(cluster, args: list[str], **replace) -> Result:
    s = resolve_setup(build_config(args))
    if replace:
        s = dataclasses.replace(s, **replace)
    return simulate_setup(s, cluster, check_memory=False)


# --------------------------------------------------------------------------- HP3C'22

HP3C = [  # label, strategy, precision, sequences per GPU (the paper's batches)
    ("single GPU", "none", "fp32", 4),
    ("SPS (torch.nn.DataParallel)", "dataparallel", "fp32", 1),
    ("DPS (DDP)", "ddp", "fp32", 2),
    ("Horovod (ring all-reduce, fusion)", "allreduce", "fp32", 4),
    ("DPS + Apex O2", "ddp", "fp16-master", 4),
    ("Horovod + Apex O1", "allreduce", "fp16", 4),
]


HP3C_MODEL = ["--model.preset", "bai2022", "--train.seq_len", "512"]


def sps_break_even(c) -> tuple[float, float, float]:
    """The host time per kernel launch (``launch_us``) at which SPS on 4 GPUs is as fast as one GPU paying
    the same, by bisection: ``(seconds, SPS's GPU utilisation, the single GPU's)`` there. The single GPU's
    share is its step without host work over its step with it (the event engine counts a launch-bound
    pass's host time inside the pass)."""
    single = [*HP3C_MODEL, "--train.global_batch", "4"]
    sps_args = [*single, "--dp.strategy", "dataparallel", "--parallel.dp", "4"]
    at = lambda h: dataclasses.replace(c, launch=h)  # noqa: E731
    faster = lambda h: _run(at(h), sps_args).tokens_per_s > _run(at(h), single).tokens_per_s  # noqa: E731
    lo, hi = c.launch, 1.0
    if faster(lo):
        for _ in range(40):
            mid = (lo * hi) ** 0.5
            lo, hi = (mid, hi) if faster(mid) else (lo, mid)
    else:
        hi = lo
    device_only = _run(at(0.0), single).step_time
    return hi, 1 - _run(at(hi), sps_args).bubble, device_only / _run(at(hi), single).step_time


def hp3c(lines: list[str]) -> None:
    c = load_cluster("hal-v100")
    lines += [
        "## HP3C'22 (Bai 2022) on `hal-v100`",
        "",
        "GPT-2 `bai2022` (12 layers, d 768, context 512, vocab 26.7k, ~106M parameters), AdamW, sequences of 512; "
        "the paper's batch per GPU (SPS: 4 in total, DPS: 2 per GPU, the others 4 per GPU). "
        "GPU utilisation = share of the step the device computes, mean over the GPUs (SPS: their kernels only; "
        "the other rows count a pass's host work within the pass, as the simulator's engine times it). "
        "SPS is `--dp.strategy dataparallel`: one process drives the GPUs of one node, so it has no 2-node row.",
        "",
        "| strategy | GPUs | nodes | tokens/s | vs single GPU | GPU utilisation | peak memory GB | fits 16 GB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    res = {}
    for label, strat, prec, per in HP3C:
        for n in (1, 4, 8):
            if (strat == "none" and n > 1) or (strat == "dataparallel" and n > c.gpus_per_node):
                continue
            args = [*HP3C_MODEL, "--precision", prec, "--train.global_batch", str(per * n)]
            if strat != "none" and n > 1:
                args += ["--dp.strategy", strat, "--parallel.dp", str(n)]
            res[(label, n)] = _run(c, args)
    base = res[("single GPU", 1)].tokens_per_s
    for (label, n), r in res.items():
        lines.append(
            f"| {label} | {n} | {1 if n <= 4 else 2} | {r.tokens_per_s:,.0f} | {r.tokens_per_s / base:.2f}x | "
            f"{1 - r.bubble:.0%} | {r.peak_mem / GB:.2f} | {'yes' if r.fits else 'no'} |"
        )
    g = lambda lab, n: res[(lab, n)].tokens_per_s  # noqa: E731
    sps, dps, hvd = HP3C[1][0], HP3C[2][0], HP3C[3][0]
    dpsa, hvda = HP3C[4][0], HP3C[5][0]
    lines += [
        "",
        "Published findings against the simulation:",
        "",
        "| finding (paper) | simulated | agrees? |",
        "|---|---|---|",
    ]
    rows = [
        ("SPS slower than one GPU (4 GPUs)", f"SPS/single = {g(sps, 4) / base:.2f}", g(sps, 4) < base),
        (
            "DPS fastest on one node (4 GPUs, fp32 strategies)",
            f"DPS {g(dps, 4):,.0f} vs Horovod {g(hvd, 4):,.0f} vs SPS {g(sps, 4):,.0f} tokens/s",
            g(dps, 4) >= max(g(hvd, 4), g(sps, 4)),
        ),
        ("Apex ~2x for DPS (4 GPUs)", f"{g(dpsa, 4) / g(dps, 4):.2f}x", 1.6 <= g(dpsa, 4) / g(dps, 4) <= 2.5),
        (
            "Apex ~4x for Horovod (8 GPUs, 2 nodes)",
            f"{g(hvda, 8) / g(hvd, 8):.2f}x",
            3.0 <= g(hvda, 8) / g(hvd, 8) <= 5.0,
        ),
        (
            "Horovod+Apex robust across nodes (8 vs 4 GPUs)",
            f"8/4 GPUs = {g(hvda, 8) / g(hvda, 4):.2f}x",
            g(hvda, 8) / g(hvda, 4) > 1.6,
        ),
        (
            "GPU utilisation: single 85%, SPS 11-17%, DPS 89-94%",
            f"single {1 - res[('single GPU', 1)].bubble:.0%}, SPS {1 - res[(sps, 4)].bubble:.0%}, "
            f"DPS {1 - res[(dps, 4)].bubble:.0%}",
            1 - res[(sps, 4)].bubble < 0.3,
        ),
    ]
    for f, sim, ok in rows:
        lines.append(f"| {f} | {sim} | {'yes' if ok else '**no**'} |")
    h, sps_util, one_util = sps_break_even(c)
    lines += [
        "",
        f"SPS on 4 GPUs would be as slow as one GPU only if the host took {h * 1e6:,.1f} µs to launch a kernel "
        f"(the preset: {c.launch * 1e6:,.1f} µs), with the single GPU paying it too; "
        f"SPS's GPU utilisation would then be {sps_util:.0%}, the single GPU's {one_util:.0%}.",
        "",
    ]


# --------------------------------------------------------------------------- Fold3D


def _fold_args(shape: list[str], dp: int, pp: int, tp: int, v: int, mb: int, gb: int, seq: int) -> list[str]:
    return shape + [
        "--parallel.dp",
        str(dp),
        "--parallel.pp",
        str(pp),
        "--parallel.tp",
        str(tp),
        "--parallel.virtual",
        str(v),
        "--train.micro_batch",
        str(mb),
        "--train.global_batch",
        str(gb),
        "--train.seq_len",
        str(seq),
        "--precision",
        "fp16",
        "--ac",
        "full",
        "--optim.grad_clip",
        "0",
        "--model.vocab_size",
        "50304",
    ]


MEGATRON_WIRE = dict(grad_bytes=2, p2p_scatter=True)  # fp16 gradient all-reduce, scatter/gather p2p


def fold_compare(c, args: list[str], wire: dict | None = None) -> dict[str, Result]:
    wire = MEGATRON_WIRE if wire is None else wire
    base = _run(c, args + ["--parallel.schedule", "interleaved-1f1b", "--parallel.dp_sync", "after-flush"], **wire)
    fold = _run(c, args + ["--parallel.schedule", "fold", "--parallel.dp_sync", "per-chunk"], **wire)
    # deferral: foldtrain's trainer rejects it with fp16 (loss scaling must skip all chunks together);
    # the simulator times it as if that half precision needed no joint skip
    defer = _run(c, args + ["--parallel.schedule", "fold", "--parallel.dp_sync", "per-chunk"], defer=True, **wire)
    return {"megatron": base, "fold": fold, "defer": defer}


CASES = [  # label, shape flags, dp, pp, tp, V, micro-batch, global batch, seq
    (
        "public example (6.7B shape, seq 1024)",
        ["--model.preset", "gpt3-6.7b", "--model.context", "1024"],
        2,
        4,
        4,
        4,
        8,
        128,
        1024,
    ),
    ("GPT-3 6.7B", ["--model.preset", "gpt3-6.7b"], 4, 4, 8, 2, 1, 512, 2048),
    ("GPT-3 6.7B", ["--model.preset", "gpt3-6.7b"], 8, 4, 8, 2, 1, 512, 2048),
    ("GPT-3 13B", ["--model.preset", "gpt3-13b"], 4, 8, 8, 2, 1, 512, 2048),
    ("GPT-3 13B", ["--model.preset", "gpt3-13b"], 8, 4, 8, 2, 1, 512, 2048),
    ("GPT-3 175B", ["--model.preset", "gpt3-175b"], 4, 16, 8, 4, 1, 1536, 2048),
]


FOLD3D_INTRO = [
    "## Fold3D (Li et al., TPDS 2023) on `cloud-v100-25g`",
    "",
    "Megatron-LM v3 = `interleaved-1f1b` + `after-flush`; Fold3D = `fold` + `per-chunk` (and with deferral). "
    "fp16 autocast, full recomputation, no clipping, and Megatron's wire format for both (fp16 gradients in the "
    "data-parallel all-reduce, pipeline activations scattered over the TP ranks; foldtrain's own executor sends "
    "fp32 gradients and whole activations per TP rank: see the last row). "
    "All-GPU idle = share of the step in which no GPU of the pipeline computes (the paper: > 44% for Megatron).",
    "",
    "| model | GPUs (dp x pp x tp, V) | Megatron tokens/s | all-GPU idle | fold tokens/s | idle | gain | "
    "fold+defer tokens/s | idle | gain | peak GB (fold) |",
    "|---|---|---|---|---|---|---|---|---|---|---|",
]


def _fold3d_rows(c, lines: list[str]) -> list[float]:
    """One table row per case (Megatron's wire format), then the first case with foldtrain's; the gains
    of the first rows (fold and fold+defer over Megatron)."""
    gains = []
    for label, shape, dp, pp, tp, v, mb, gb, seq in CASES:
        r = fold_compare(c, _fold_args(shape, dp, pp, tp, v, mb, gb, seq))
        m, f, d = r["megatron"], r["fold"], r["defer"]
        gf, gd = f.tokens_per_s / m.tokens_per_s - 1, d.tokens_per_s / m.tokens_per_s - 1
        gains += [gf, gd]
        lines.append(
            f"| {label} | {dp * pp * tp} ({dp}x{pp}x{tp}, V={v}) | {m.tokens_per_s:,.0f} | {m.all_rank_idle:.1%} | "
            f"{f.tokens_per_s:,.0f} | {f.all_rank_idle:.1%} | {gf:+.1%} | "
            f"{d.tokens_per_s:,.0f} | {d.all_rank_idle:.1%} | {gd:+.1%} | "
            f"{f.peak_mem / GB:.1f}{'' if f.fits else ' (>16)'} |"
        )
    label, shape, dp, pp, tp, v, mb, gb, seq = CASES[0]
    r = fold_compare(c, _fold_args(shape, dp, pp, tp, v, mb, gb, seq), wire={})
    m, f, d = r["megatron"], r["fold"], r["defer"]
    lines.append(
        f"| {label}, foldtrain's wire format | {dp * pp * tp} ({dp}x{pp}x{tp}, V={v}) | {m.tokens_per_s:,.0f} | "
        f"{m.all_rank_idle:.1%} | {f.tokens_per_s:,.0f} | {f.all_rank_idle:.1%} | "
        f"{f.tokens_per_s / m.tokens_per_s - 1:+.1%} | {d.tokens_per_s:,.0f} | {d.all_rank_idle:.1%} | "
        f"{d.tokens_per_s / m.tokens_per_s - 1:+.1%} | {f.peak_mem / GB:.1f} |"
    )
    return gains


def _gain_vs_bandwidth(c, rates: list[int]) -> list[tuple[int, float, float, float]]:
    """On the public example (the first case), per inter-node rate in Gbit/s: ``(rate, fold gain,
    fold+defer gain, Megatron's all-GPU idle)``."""
    label, shape, dp, pp, tp, v, mb, gb, seq = CASES[0]
    args = _fold_args(shape, dp, pp, tp, v, mb, gb, seq)
    pts = []
    for gbit in rates:
        cc = dataclasses.replace(c, inter=dataclasses.replace(c.inter, bw=gbit * 1e9 / 8), name=f"{gbit} Gbit/s")
        r = fold_compare(cc, args)
        megatron = r["megatron"].tokens_per_s
        fold_gain = r["fold"].tokens_per_s / megatron - 1
        defer_gain = r["defer"].tokens_per_s / megatron - 1
        pts.append((gbit, fold_gain, defer_gain, r["megatron"].all_rank_idle))
    return pts


def _plot_gain(pts: list[tuple[int, float, float, float]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], "o-", label="fold + per-chunk")
    ax.plot([p[0] for p in pts], [100 * p[2] for p in pts], "s--", label="fold + per-chunk + defer")
    ax.axhspan(25.2, 42.1, color="#ddd", label="Fold3D paper: 25.2-42.1%")
    ax.set_xscale("log")
    ax.set_xlabel("inter-node bandwidth (Gbit/s per node)")
    ax.set_ylabel("throughput gain over Megatron (%)")
    ax.set_title("simulated, cloud-v100-25g, public example")
    ax.legend(fontsize=8)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)


def fold3d(lines: list[str], img_dir: Path) -> None:
    c = load_cluster("cloud-v100-25g")
    lines += FOLD3D_INTRO
    gains = _fold3d_rows(c, lines)
    lines += [
        "",
        f"Simulated gains (Megatron wire format): {min(gains):+.1%} to {max(gains):+.1%} "
        "(paper: +25.2% to +42.1% over four baselines).",
        "",
    ]
    pts = _gain_vs_bandwidth(c, [10, 25, 50, 100, 200, 400, 800])
    lines += [
        "### Gain against network bandwidth (public example, 32 GPUs)",
        "",
        "| network Gbit/s per node | Megatron all-GPU idle | fold gain | fold+defer gain |",
        "|---|---|---|---|",
    ]
    lines += [f"| {g} | {idle:.1%} | {a:+.1%} | {b:+.1%} |" for g, a, b, idle in pts]
    png = img_dir / "sim_fold_gain_vs_bandwidth.png"
    try:
        _plot_gain(pts, png)
        lines += ["", f"![gain vs bandwidth](img/{png.name})", ""]
    except ImportError:
        lines += ["", "(matplotlib missing: no plot)", ""]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=CMD, description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="docs", help="directory for reproduction.md and img/")
    a = ap.parse_args(argv)
    out = Path(a.out)
    t0 = time.time()
    lines = [
        "# Reproducing the papers with the simulator",
        "",
        f"Regenerate with `{CMD}` (writes this file and `img/sim_fold_gain_vs_bandwidth.png`). "
        "Every number here is a prediction of `foldtrain simulate` on a cluster preset "
        "(`foldtrain/sim/clusters/`, each number with its source); nothing ran on GPUs.",
        "",
    ]
    hp3c(lines)
    fold3d(lines, out / "img")
    lines += [f"_Generated in {time.time() - t0:.0f} s._", ""]
    out.mkdir(parents=True, exist_ok=True)
    body = "\n".join(lines)
    marker = "<!-- discussion -->"
    path = out / "reproduction.md"
    if path.is_file() and marker in path.read_text():
        body += "\n" + path.read_text()[path.read_text().index(marker) :]
    path.write_text(body)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
