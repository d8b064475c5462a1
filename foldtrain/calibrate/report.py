"""The cluster file of ``calibrate --probes kernels``: the :class:`~foldtrain.sim.cluster.Cluster` of the probes'
numbers, each with a note saying how it was measured, and for the links a launch cannot measure (one process,
one node) which preset they come from."""

from __future__ import annotations

import os
from datetime import datetime, timezone

from . import nccl
from .nccl import KINDS

SAME_DEVICE = "not measured: each rank has a device of its own (the field applies with shared_cores)"
NOT_ON_DEVICE = "not measured by the kernel probes: {what}"


def versions(device) -> str:
    import torch

    out = f"torch {torch.__version__}"
    if device.type == "cuda":
        out += f", CUDA {torch.version.cuda}"
        try:
            v = torch.cuda.nccl.version()  # a tuple; an int in older torch
            out += ", NCCL " + (".".join(map(str, v)) if isinstance(v, tuple) else str(v))
        except (AttributeError, RuntimeError):
            out += ", NCCL unknown"
    return out


def _size(nbytes: float) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes:g} B"


def _list(vals, scale: float = 1e-9) -> str:
    return ", ".join(f"{v * scale:.3g}" for v in vals)


def link(curve: dict):
    """The :class:`~foldtrain.sim.cluster.Link` of a measured curve: the largest size's bus bandwidths."""
    from foldtrain.sim.cluster import Link

    bw = {kind: curve["busbw"][kind][-1] for kind in KINDS}
    return Link(
        bw["all_reduce"],
        curve["latency"],
        curve["hop"],
        p2p_bw=bw["send_recv"],
        rs_bw=bw["reduce_scatter"],
        ag_bw=bw["all_gather"],
    )


def build_cluster(name: str, opts, k, links: dict, device):
    """The cluster of the probes' numbers; the links not measured from ``--links`` (else the device's preset)."""
    import torch

    from foldtrain.sim.cluster import KIND_BANDWIDTH, Cluster, Measured, load_cluster

    preset = load_cluster(opts.links or k.links)
    gpus = opts.per_node if opts.world > 1 else (torch.cuda.device_count() if device.type == "cuda" else 1)
    memory = k.memory["total"] if device.type == "cuda" else k.memory["total"] / opts.per_node
    attn = {d: {sh: r[0] for sh, r in t.items()} for d, t in k.attn.items()}
    attn_b = {d: {sh: r[1] for sh, r in t.items()} for d, t in k.attn.items()}
    eff, half = k.curve
    fwd_block, bwd_block = k.block
    return Cluster(
        name=name,
        gpus_per_node=gpus,
        memory=memory,
        tflops=dict(k.peaks),
        mem_bw=k.streams["mem_bw"],
        efficiency=eff,
        half_size=half,
        layer_overhead=k.overhead[0],
        intra=link(links["intra"]) if links["intra"] else preset.intra,
        inter=link(links["inter"]) if links["inter"] else preset.inter,
        runtime=max(k.memory["runtime"], 0.0),
        backward_ratio=0.0,  # the backward priced per operation from the tables; the block's ratio is a note
        elem_bw=k.streams["elem"],
        launch=k.launch,
        attn_eff=k.attention[0],
        attn_bwd_eff=k.attention[1],
        attn_half_seq=k.attention[2],
        **{attr: _median(k.bw[kind]) for kind, attr in KIND_BANDWIDTH.items()},
        adamw_bw=k.streams["adamw"],
        overlap_slowdown=preset.overlap_slowdown if links.get("overlap") is None else links["overlap"],
        gemm=Measured({d: dict(t) for d, t in k.gemm.items()}),
        attn_fwd=Measured(attn),
        attn_bwd=Measured(attn_b),
    )


def _median(xs) -> float:
    import statistics

    return statistics.median(xs)


def peak_notes(src: str, k) -> dict[str, str]:
    notes = {}
    for d in k.peaks:
        best = max([*k.squares.get(d, []), *k.gemm.get(d, {}).values()], default=0.0)
        if d in k.table_peaks:
            measured = f"best measured {best / 1e12:.4g} TFLOP/s ({src})" if best else f"not measured in {d}"
            notes[f"device.{d}_tflops"] = (
                f"dense peak of the {k.name} (datasheet, foldtrain/calibrate/gpu.py PEAKS); {measured}"
            )
        else:
            notes[f"device.{d}_tflops"] = (
                f"{src}: the {k.name} is not in the peak table (foldtrain/calibrate/gpu.py PEAKS): "
                "the best rate of any product measured"
            )
    return notes


def device_notes(src: str, opts, scale, k) -> dict[str, str]:
    d = opts.dtypes[0]
    cases = "; ".join(c.label for c in opts.cases)
    first = opts.cases[0]
    backend = k.backend.get(d, "?")
    mem = "torch.cuda.mem_get_info" if k.memory.get("peak") else "MemTotal / ranks per node"
    notes = {
        "device.memory_gb": f"{src}: the device's memory ({mem})",
        "device.mem_bw_gbs": f"{src}: copy of {_size(scale.stream_bytes)} (read + write)",
        "device.efficiency": f"{src}: {d} products fitted to peak x efficiency x n / (n + half_size), n the "
        f"smallest dimension, over [gemm.{d}] and (n x n) @ (n x n) for n = {', '.join(map(str, scale.squares))} "
        f"({_list(k.squares[d], 1e-12)} TFLOP/s)",
        "device.half_size": f"{src}: the same fit",
        "device.layer_overhead_us": f"{src}: a tiny fp32 block's forward + backward ({k.overhead[1] * 1e6:.1f} us, "
        "host time) less launch_us for each kernel ops counts in it, / 3",
        "device.runtime_gb": f"{src}: device memory in use less max_memory_allocated after 3 training steps of a "
        f"2-block {first.preset} (b {first.shape.b}, L {first.shape.L}, {d}), after the collectives"
        if k.memory.get("peak")
        else f"{src}: peak resident size of the calibrating process",
        "device.backward_ratio": f"0: the backward is priced per operation from the tables; for comparison a real "
        f"{first.preset} block's backward / forward time was {k.block[1] / k.block[0]:.2f} "
        f"(b {first.shape.b}, L {first.shape.L}, {d}: {k.block[0] * 1e3:.3g} and {k.block[1] * 1e3:.3g} ms)",
        "device.elem_gbs": f"{src}: element-wise add of {_size(scale.stream_bytes)} tensors (3 of them)",
        "device.launch_us": f"{src}: 500 adds of 1-element tensors back to back, host time per launch, median of 5",
        "device.attention_efficiency": f"{src}: causal SDPA forward ({backend}) in {d} at "
        f"{attention_sweep(k)}, fitted to peak x efficiency x L / (L + attention_half_seq)",
        "device.attention_bwd_efficiency": f"{src}: its backward on the same curve (median)",
        "device.attention_half_seq": f"{src}: the same fit" + ("" if k.attention[2] else " (one sequence length)"),
        "device.norm_gbs": f"{src}: layer norm forward + backward (fp32 residual stream under autocast), ops' "
        f"bytes over the time at {cases}: median of {_list(k.bw['norm'])} GB/s",
        "device.gelu_gbs": f"{src}: GELU (tanh) forward + backward, the same way: {_list(k.bw['gelu'])} GB/s",
        "device.softmax_gbs": f"{src}: foldtrain's lm_loss (fp32 cross-entropy of the {d} logits) forward + "
        f"backward, 24 bytes a logit: {_list(k.bw['softmax'])} GB/s",
        "device.cast_gbs": f"{src}: the residual add of a {d} branch into the fp32 stream and a {d} tensor's cast "
        f"to fp32, the same way: {_list(k.bw['cast'])} GB/s",
        "device.pack_gbs": f"{src}: q, k and v's gradients packed into the qkv product's as foldtrain's attention "
        f"does (a stack, a copy), the same way: {_list(k.bw['pack'])} GB/s",
        "device.reduce_gbs": f"{src}: the four linear layers' bias gradients (sums over the tokens), the same way: "
        f"{_list(k.bw['reduce'])} GB/s",
        "device.adamw_gbs": f"{src}: fused AdamW step of {scale.stream_bytes // 4 / 1e6:g} M fp32 parameters, "
        "28 bytes each",
    }
    for key, what in (
        ("softmax_gelems", "the CPU model's log-softmax rate (0: off; softmax_gbs prices the loss)"),
        ("head_weight_gelems", "the CPU model's fused-head refinement (0: off)"),
        ("optim_gparams", "the CPU model's optimizer rate (0: off; adamw_gbs prices the step)"),
        ("rows_half_size", "the CPU model's few-row curve (0: half_size)"),
        ("loss_buffers", "the 3 fp32 logit-sized tensors live at the loss's backward"),
        ("action_overhead_us", "the pipeline executor's host time per action (0: none)"),
        ("fsdp_unit_us", "FSDP2's host time per unit and pass (0: none)"),
        ("fsdp_root_us", "FSDP2's host time per pass in a root's own hooks (0: none)"),
        ("fsdp_gather_us", "FSDP2's host time per unit gathered (0: none)"),
    ):
        notes[f"device.{key}"] = NOT_ON_DEVICE.format(what=what)
    return notes


def attention_sweep(k) -> str:
    b, h, _, hd = k.attn_sweep[-1]
    return f"(b {b}, heads {h}, head_dim {hd}) and L = {', '.join(str(sh[2]) for sh in k.attn_sweep)}"


def link_notes(src: str, sec: str, curve: dict | None, why: str, preset: str, backend: str) -> dict[str, str]:
    if curve is None:
        keys = ("bw_gbs", "latency_us", "collective_latency_us", "p2p_gbs", "reduce_scatter_busbw_gbs")
        keys += ("all_gather_busbw_gbs",)
        return {f"{sec}.{key}": f"not measured ({why}): from preset {preset}" for key in keys}
    n, groups, sizes = curve["n"], curve["groups"], curve["sizes"]
    where = (
        f"over the {n} ranks of a node ({groups} nodes at once, median)"
        if sec == "intra"
        else f"over {groups} groups of one rank on each of {n} nodes at once, summed (the node's interfaces)"
    )
    at = f"at {_size(sizes[-1])}; GB/s at {_size(sizes[0])} to {_size(sizes[-1])} (x4):"
    bus = curve["busbw"]
    return {
        f"{sec}.bw_gbs": f"{src}: {backend} all-reduce bus bandwidth {where} {at} {_list(bus['all_reduce'])}",
        f"{sec}.latency_us": f"{src}: one-element send/recv, half a round trip, median",
        f"{sec}.collective_latency_us": f"{src}: a {_size(sizes[0])} all-reduce / its 2 (n-1) steps",
        f"{sec}.p2p_gbs": f"{src}: send/recv bandwidth {at} {_list(bus['send_recv'])}",
        f"{sec}.reduce_scatter_busbw_gbs": f"{src}: reduce-scatter bus bandwidth {at} {_list(bus['reduce_scatter'])}",
        f"{sec}.all_gather_busbw_gbs": f"{src}: all-gather bus bandwidth {at} {_list(bus['all_gather'])}",
    }


def all_notes(src: str, opts, scale, k, links: dict, device) -> dict[str, str]:
    preset = opts.links or k.links
    notes = device_notes(src, opts, scale, k)
    notes.update(peak_notes(src, k))
    one = opts.world == 1
    per_node = (
        "torchrun's ranks per node"
        if not one
        else ("torch.cuda.device_count() (one process)" if device.type == "cuda" else "one process")
    )
    notes["node.gpus"] = f"{src}: {per_node}"
    for key in ("shared_cores", "comm_cpu_ns", "collective_cpu_us", "oversubscribed_efficiency"):
        notes[f"node.{key}"] = SAME_DEVICE
    backend = "NCCL" if device.type == "cuda" else "gloo"
    alone = "one GPU" if device.type == "cuda" else "one process"
    intra_why = alone if one else "one rank per node"
    inter_why = alone if one else "one node"
    n, nbytes, dtype = scale.overlap
    notes["device.overlap_slowdown"] = (
        f"not measured ({alone}): from preset {preset}"
        if links.get("overlap") is None
        else f"{src}: ({n} x {n}) products in {dtype} (at least {nccl.OVERLAP_PRODUCTS} and "
        f"{nccl.OVERLAP_MIN_S:g} s) beside {backend} all-reduces of {_size(nbytes)} over every rank / the same alone, "
        f"less 1, the slowest rank's: the median of {nccl.OVERLAP_PAIRS} alternated pairs"
    )
    notes.update(link_notes(src, "intra", links["intra"], intra_why, preset, backend))
    notes.update(link_notes(src, "inter", links["inter"], inter_why, preset, backend))
    for d in opts.dtypes:
        notes[f"gemm.{d}"] = (
            f"{src}: (M x K) @ (K x N) in {d}, the operand layouts says stored transposed, device time; "
            "foldtrain.sim.ops.gemm_shapes of " + "; ".join(c.label for c in opts.cases)
        )
        notes[f"attention.{d}"] = f"{src}: causal SDPA ({k.backend[d]}), forward and backward, FLOPs as ops counts them"
    return notes


def write_cluster_file(out: str, name: str, argv: list[str], opts, scale, k, links: dict, device) -> None:
    from foldtrain.sim.cluster import to_toml

    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    src = f"measured on the {k.name}, {when}"
    cluster = build_cluster(name or os.path.splitext(os.path.basename(out))[0], opts, k, links, device)
    head = (
        f"# measured by foldtrain calibrate {' '.join(argv)}\n"
        f"# on {k.name}, {when}, {versions(device)}, {opts.world} process(es), {opts.per_node} per node\n"
    )
    with open(out, "w") as f:
        f.write(head + to_toml(cluster, all_notes(src, opts, scale, k, links, device)))
