"""``foldtrain calibrate``: run the probes and write the cluster file."""

from __future__ import annotations

import argparse
import dataclasses
import os
from datetime import datetime, timezone

from foldtrain.errors import FoldtrainError

from .comm import _comm_probe, check_network_prerequisites, links, measure_loopback, measure_network
from .compute import DTYPES, HEAD_SHAPES, RATIO_SHAPES, SIZES, measure_compute, measure_oversubscription
from .device import parse_options
from .device import run as device_run
from .executor import measure_action_overhead
from .fsdp import BLOCKS, measure_fsdp_host
from .memory import LOSS_SHAPE, LOSS_TOKENS, measure_loss_buffers


@dataclasses.dataclass
class Probes:
    """What the probes measured on this machine, for the cluster and for the notes saying where each number
    comes from."""

    ranks: int  # the runs' ranks: nodes x ranks_per_node
    cores: int
    conc: int  # processes the compute probe ran at once
    comp: dict
    over: float  # oversubscribed efficiency (1.0 when not measured)
    over_ratios: list
    loss_buffers: float
    loop: dict  # gloo on loopback over ranks_per_node ranks
    net: dict | None  # gloo across the emulated nodes, with --network
    busy: dict  # the loopback probe with the runs' number of processes
    memory_total: int  # bytes
    fsdp_host: dict = dataclasses.field(default_factory=dict)  # FSDP2's host work: fit_fsdp_host's Cluster fields


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="foldtrain calibrate",
        description="measure this machine and write a cluster file for foldtrain simulate --cluster FILE",
    )
    ap.add_argument("--out", required=True, help="cluster TOML file to write")
    ap.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: this machine's cores and gloo; cuda: its GPUs and NCCL (torchrun: one process per GPU)",
    )
    ap.add_argument(
        "--probes",
        choices=("fitted", "kernels"),
        help="fitted (the default on cpu): the CPU cost model fitted to real blocks; kernels (on cuda): each "
        "operation's kernel at the models' shapes and the collectives among torchrun's ranks",
    )
    ap.add_argument("--network", help="emulated link rate between nodes, e.g. 1gbit (needs root and iproute2)")
    ap.add_argument("--nodes", type=int, default=1, help="emulated nodes (with --network)")
    ap.add_argument(
        "--ranks_per_node",
        type=int,
        help="fitted: ranks per node the runs will have (default 2); kernels: torchrun's ranks per node "
        "(default its --nproc_per_node)",
    )
    ap.add_argument("--name", default="", help="cluster name (default: the file's stem)")
    kernels = ap.add_argument_group("kernels", "the shapes --probes kernels measures (comma-separated lists)")
    kernels.add_argument("--preset", default="gpt2-small", help="model presets the runs will train")
    kernels.add_argument("--precision", default="bf16", help="fp32, bf16, fp16; the first sets the fitted curves")
    kernels.add_argument("--tp", default="1", help="tensor-parallel sizes")
    kernels.add_argument("--micro_batch", default="8", help="micro-batch sizes")
    kernels.add_argument("--seq", default="", help="sequence lengths (default: each preset's context)")
    kernels.add_argument("--vocab_multiple", type=int, default=1, help="as --model.vocab_multiple")
    kernels.add_argument(
        "--links", default="", help="cluster preset for the links a launch cannot measure (default: by device name)"
    )
    a = ap.parse_args(argv)
    a.probes = a.probes or ("kernels" if a.device == "cuda" else "fitted")
    if a.device == "cuda" and a.probes == "fitted":
        raise FoldtrainError("calibrate --probes fitted fits the CPU cost model; on --device cuda drop --probes")
    if a.probes == "kernels":
        return _check_kernels(a)
    a.ranks_per_node = 2 if a.ranks_per_node is None else a.ranks_per_node
    if a.nodes < 1 or a.ranks_per_node < 1:
        raise FoldtrainError(f"--nodes and --ranks_per_node must be >= 1, got {a.nodes} and {a.ranks_per_node}")
    if a.network:
        if a.nodes < 2:
            raise FoldtrainError("calibrate --network needs --nodes 2 or more to measure a link between nodes")
        check_network_prerequisites()
    return a


def _check_kernels(a: argparse.Namespace) -> argparse.Namespace:
    """``--probes kernels``: a GPU must be visible for ``--device cuda``; the shapes must make sense."""
    if a.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            build = "built without CUDA" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
            raise FoldtrainError(
                f"calibrate --device cuda: no CUDA device is visible (torch {torch.__version__}, {build}); "
                "run it on a machine with an NVIDIA GPU, or use --device cpu"
            )
    a.kernels = parse_options(a)
    return a


def run_probes(a: argparse.Namespace) -> Probes:
    """Compute, oversubscription, the loss's buffers, gloo on loopback (and across the emulated nodes)."""
    ranks = a.nodes * a.ranks_per_node
    cores = os.cpu_count() or 1
    conc = min(ranks, cores)  # each process on a core of its own; the simulator shares the cores among more ranks
    print(f"calibrate: compute with {conc} concurrent processes ...", flush=True)
    comp = measure_compute(conc)
    over, over_ratios = 1.0, []
    if ranks > cores:
        print(f"calibrate: compute with {ranks} processes on {cores} cores ...", flush=True)
        over, over_ratios = measure_oversubscription(ranks, cores)
    print("calibrate: memory at the loss ...", flush=True)
    loss_buffers = measure_loss_buffers()
    print(f"calibrate: FSDP2's host work with {conc} concurrent processes ...", flush=True)
    fsdp_host = measure_fsdp_host(conc)
    print("calibrate: gloo on loopback ...", flush=True)
    loop = measure_loopback(a.ranks_per_node)
    net = None
    if a.network:
        print(f"calibrate: gloo across {a.nodes} emulated nodes at {a.network} ...", flush=True)
        net = measure_network(a.network, a.nodes)
    with open("/proc/meminfo") as f:
        total = int(next(line for line in f if line.startswith("MemTotal")).split()[1]) * 1024
    # a collective's step with as many processes as the runs have on this machine (on shared cores the
    # host's scheduling, not the wire, is most of it)
    busy = loop if ranks <= max(a.ranks_per_node, 2) else measure_loopback(ranks)
    return Probes(ranks, cores, conc, comp, over, over_ratios, loss_buffers, loop, net, busy, total, fsdp_host)


def build_cluster(name: str, ranks_per_node: int, m: Probes):
    """The cluster of the probes' numbers, without the executor's work per action."""
    from foldtrain.sim.cluster import Cluster

    comp = m.comp
    # across nodes never shorter than on loopback
    intra, inter = links(m.loop, m.net, m.busy["collective_latency_s"])
    return Cluster(
        name=name,
        gpus_per_node=ranks_per_node,
        memory=m.memory_total / m.ranks,
        shared_cores=float(m.cores),
        tflops={d: comp[d][0] for d in DTYPES},
        mem_bw=comp["mem_bw"],
        efficiency=1.0,
        half_size=comp["fp32"][1],
        layer_overhead=comp["block_overhead"],
        intra=intra,
        inter=inter,
        runtime=comp["runtime"],
        backward_ratio=comp["backward_ratio"],
        split_ratio=comp["split_ratio"],
        split_weight_share=comp["split_weight_share"],
        elem_bw=comp["elem_bw"],
        softmax_rate=comp["softmax_rate"],
        loss_buffers=m.loss_buffers,
        rows_half_size=comp["rows_half_size"],
        head_weight_rate=comp["head_weight_rate"],
        optim_rate=comp["optim_rate"],
        comm_cpu=(m.net or m.loop).get("cpu_per_byte", 0.0),
        oversubscribed=m.over,
        collective_cpu=m.busy.get("collective_cpu_s", 0.0),
        **m.fsdp_host,
    )


def gflops(rates) -> str:
    return ", ".join(f"{r / 1e9:.1f}" for r in rates)


def node_notes(src: str, m: Probes) -> dict[str, str]:
    if m.over_ratios:
        over = (
            f"blocks of {RATIO_SHAPES} timed with {m.cores} and with {m.ranks} single-threaded processes at once, "
            f"alternated: {m.cores} / {m.ranks} of the time per block at {m.cores} over the time at {m.ranks}, "
            f"median of {', '.join(f'{r:.2f}' for r in m.over_ratios)}"
            + (f" (scaled to {2 * m.cores} busy ranks)" if m.ranks != 2 * m.cores else "")
        )
    else:
        over = f"not measured: the runs have no more ranks ({m.ranks}) than cores ({m.cores})"
    return {
        "node.gpus": f"--ranks_per_node ({src})",
        "node.shared_cores": "os.cpu_count(): every emulated node's ranks run on this machine's cores",
        "node.oversubscribed_efficiency": over,
        "node.comm_cpu_ns": f"{src}: CPU time of a rank (all threads) over the bytes it sends in the "
        + ("emulated nodes'" if m.net else "loopback")
        + " all-reduce",
        "node.collective_cpu_us": f"{src}: CPU time of a rank (all threads) over the 4 KB all-reduces of "
        f"collective_latency_us, per step",
    }


def device_notes(src: str, m: Probes, probe_dp: int, ov_measured: float, ov_sim: float) -> dict[str, str]:
    comp = m.comp
    notes = {
        f"device.{d}_tflops": f"{src}: fitted peak of (512 x n) @ (n x 4n), n = {SIZES}; "
        f"measured {gflops(comp[d][2])} GFLOP/s"
        for d in DTYPES
    }
    replicas = "2 replicas of " if probe_dp > 1 else ""
    notes.update(
        {
            "device.memory_gb": "MemTotal / ranks (nodes x ranks_per_node)",
            "device.mem_bw_gbs": f"{src}: 64 MB copy",
            "device.efficiency": "folded into the fitted peaks",
            "device.half_size": f"{src}: fp32 fit (the half-precision fits give "
            + ", ".join(f"{comp[d][1]:.0f}" for d in ("bf16", "fp16"))
            + ")",
            "device.layer_overhead_us": f"{src}: forward + backward of a tiny block / 3",
            "device.backward_ratio": f"{src}: backward / forward time of a block, "
            f"mean over (d, heads, batch, seq) = {RATIO_SHAPES}",
            "device.split_ratio": f"{src}: the same blocks' backward split into I and W (the zero-bubble schedules' "
            "split_backward) / their whole backward",
            "device.split_weight_share": f"{src}: W's share of that split backward",
            "device.elem_gbs": f"{src}: fitted so that the cost model's block forward equals the measured one "
            f"at {RATIO_SHAPES}",
            "device.softmax_gelems": f"{src}: per logit, fitted with head_weight_gelems to the real fused head "
            f"(norm, projection, fp32 cross-entropy, forward + backward) at (d, V, tokens) = {HEAD_SHAPES} "
            "beyond its matrix products",
            "device.head_weight_gelems": f"{src}: per element of the head's weight, the same fit",
            "device.action_overhead_us": f"{src}: {replicas}a 2-rank pipeline of a negligible model "
            f"(interleaved-1f1b, V 2, 16 micro-batches) took {ov_measured * 1e3:.1f} ms a step, "
            f"the simulator without it {ov_sim * 1e3:.1f} ms; the core-seconds per action with which it takes as long",
            "device.fsdp_unit_us": f"{src}: pipeline chunks of {', '.join(map(str, BLOCKS))} tiny blocks "
            "sharded over one rank (blocks kept gathered, gradients accumulated), forward + backward, against the "
            "same chunk unsharded, in alternating rounds: per block and pass (the slope of the excess over the "
            "block count)",
            "device.fsdp_root_us": f"{src}: the same: per pass in the chunk's own unit, holding no parameters "
            "(the intercept)",
            "device.fsdp_gather_us": f"{src}: the same chunk resharded after each forward against it kept "
            "gathered: per block's all-gather and reshard",
            "device.optim_gparams": f"{src}: fused AdamW step and gradient-norm clipping of 4 M fp32 parameters",
            "device.rows_half_size": f"{src}: fp32 F.linear of (n x 256) with a 1024 x 256 weight, n = {SIZES}, "
            f"at the fitted fp32 peak; measured {gflops(comp['fp32_rows'])} GFLOP/s",
            "device.loss_buffers": f"{src}: peak resident size of 16 training steps at {LOSS_TOKENS} tokens "
            f"of a {LOSS_SHAPE} GPT, per token, less the activations the cost model counts, over 4 V bytes",
            "device.runtime_gb": f"{src}: resident size of a process that imported the trainer "
            "and ran 3 steps of a negligible model",
        }
    )
    return notes


def link_notes(src: str, a: argparse.Namespace, m: Probes) -> dict[str, str]:
    net, loop = m.net, m.loop
    same = "no --network: same as intra"
    return {
        "intra.bw_gbs": f"{src}: gloo all-reduce of 16 MB over {max(a.ranks_per_node, 2)} local ranks "
        f"(p2p {loop['p2p_bw'] / 1e9:.2f} GB/s)",
        "intra.latency_us": f"{src}: gloo ping-pong / 2",
        "intra.p2p_gbs": f"{src}: gloo send/recv of 16 MB between 2 local ranks",
        "inter.bw_gbs": (
            f"{src}: gloo all-reduce over {a.nodes} emulated nodes at {a.network} (p2p {net['p2p_bw'] / 1e9:.3f} GB/s)"
            if net
            else same
        ),
        "inter.latency_us": f"{src}: ping-pong across emulated nodes" if net else same,
        "inter.p2p_gbs": f"{src}: gloo send/recv of 16 MB across emulated nodes" if net else same,
        "intra.collective_latency_us": f"{src}: a 4 KB gloo all-reduce over {m.busy['world']} local ranks "
        "/ its 2 (n-1) steps, median of 40",
        "inter.collective_latency_us": (
            f"{src}: the same across {a.nodes} emulated nodes, or the local one if longer" if net else same
        ),
    }


def main(argv: list[str]) -> int:
    if argv == ["--_comm_probe"]:
        _comm_probe()
        return 0
    a = parse_args(argv)
    if a.probes == "kernels":
        return device_run(a.kernels, argv, a.out, a.name)
    from foldtrain.sim.cluster import to_toml

    m = run_probes(a)
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    name = a.name or os.path.splitext(os.path.basename(a.out))[0]
    c = build_cluster(name, a.ranks_per_node, m)
    print("calibrate: the pipeline executor's own work per action ...", flush=True)
    probe_dp = 2 if m.ranks >= 4 else 1  # with the runs' contention: 4 processes when they have 4 or more
    # the probe's 2 x probe_dp ranks on one node
    ov, ov_measured, ov_sim = measure_action_overhead(dataclasses.replace(c, gpus_per_node=2 * probe_dp), dp=probe_dp)
    c = dataclasses.replace(c, action_overhead=ov)
    src = f"foldtrain calibrate, {when}, {m.conc} concurrent processes"
    notes = device_notes(src, m, probe_dp, ov_measured, ov_sim)
    notes.update(node_notes(src, m))
    notes.update(link_notes(src, a, m))
    text = f"# measured by foldtrain calibrate {' '.join(argv)}\n" + to_toml(c, notes)
    with open(a.out, "w") as f:
        f.write(text)
    print(f"wrote {a.out}")
    return 0
