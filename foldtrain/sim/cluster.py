"""Clusters the simulator predicts for: a TOML file per cluster, presets in ``clusters/``.

A cluster file (copy a preset and edit it; every number is required and positive)::

    name = "my-cluster"
    [node]
    gpus = 8                 # devices (ranks) per node
    shared_cores = 2         # optional: every rank of every node shares this many CPU cores
                             # (a cluster emulated on one machine; absent or 0: own devices)
    comm_cpu_ns = 1.3        # optional, with shared_cores: CPU ns per byte a collective sends (absent: 0)
    collective_cpu_us = 360  # optional, with shared_cores: CPU us per rank that one step of a collective
                             # takes there (waking gloo's threads, its syscalls; absent: 0)
    oversubscribed_efficiency = 0.85  # optional, with shared_cores: share of the cores' work done when
                             # twice as many ranks as cores are busy (context switches, caches; absent: 1)
    [device]
    memory_gb = 80           # usable device memory per rank
    fp32_tflops = 19.5       # peak dense throughput per dtype, TFLOP/s
    bf16_tflops = 312
    fp16_tflops = 312
    mem_bw_gbs = 2039        # device memory bandwidth, GB/s (optimizer step)
    efficiency = 0.7         # best fraction of peak a large matrix product reaches
    half_size = 256          # matrix dimension at which the efficiency is half of that (without sms)
    sms = 108                # optional: streaming multiprocessors; a product then runs at efficiency x
                             # the share of the SMs its tiles' last wave keeps busy x K / (K + gemm_k_half)
    gemm_k_half = 512        # optional, with sms (absent: 0)
    kernel_us = 3            # optional: device time every kernel takes beyond its work (absent: 0)
    overlap_slowdown = 0.19  # optional: compute takes this much longer while a data-parallel collective runs
                             # beside it (its kernels take SMs and memory bandwidth; absent: 0)
    layer_overhead_us = 60   # fixed cost per transformer block and pass (kernel launches, Python)
    runtime_gb = 1.0         # optional: memory the framework takes per rank (CUDA context, ...)
    backward_ratio = 1.9     # optional: a block's backward time / its forward time, measured (absent: the
                             # backward's operations priced one by one)
    split_ratio = 1.06       # optional: a block's backward split into I and W (zero-bubble schedules) / its
                             # whole backward, measured (absent: 1)
    split_weight_share = 0.45 # optional: W's share of that split backward, measured (absent: priced per operation)
    elem_gbs = 2039          # optional: effective bandwidth of element-wise work (absent: mem_bw_gbs)
    softmax_gelems = 50      # optional: log-softmax forward + backward, G elements/s (absent: memory-bound)
    rows_half_size = 256     # optional: half_size of products with few rows (tokens) (absent: half_size)
    head_weight_gelems = 0.6 # optional: the fused head's cost per weight element beyond FLOPs, G/s (absent: none)
    optim_gparams = 0.3      # optional: optimizer step, G parameters/s (absent: memory-bound at mem_bw_gbs)
    loss_buffers = 3         # optional: fp32 (b, L, V) tensors resident at the loss (absent: 3, the live ones)
    action_overhead_us = 40  # optional: the pipeline executor's own CPU time per action of a rank's list (absent: 0)
    fsdp_unit_us = 400       # optional: FSDP2's host time per unit with parameters and pass (its hooks) (absent: 0)
    fsdp_root_us = 40        # optional: its time per pass in a root's own hooks, beyond its unit's (absent: 0)
    fsdp_gather_us = 400     # optional: its host time per unit gathered and resharded, beyond the transfer (absent: 0)
    launch_us = 5            # optional: host time to launch one kernel in eager mode; a pass takes at least
                             # its kernels x this (absent: 0)
    attention_efficiency = 0.6      # optional: fused attention forward, fraction of peak at long sequences
    attention_bwd_efficiency = 0.5  # optional: its backward (absent: attention runs as two matrix products)
    attention_half_seq = 512        # optional: sequence length at which attention reaches half of those (absent: 0)
    attention_half_head_dim = 48    # optional: the same for the head dimension (absent: 0)
    norm_gbs = 1500          # optional: achieved bandwidth of layer norm (absent: elem_gbs)
    gelu_gbs = 1700          # optional: of GELU (absent: elem_gbs)
    softmax_gbs = 1600       # optional: of softmax and cross-entropy (absent: elem_gbs)
    cast_gbs = 2000          # optional: of element-wise work converting half to fp32 (absent: elem_gbs)
    pack_gbs = 1200          # optional: of packing q, k, v's gradients into qkv's (absent: elem_gbs)
    reduce_gbs = 2500        # optional: of a bias gradient's sum over the tokens (absent: elem_gbs)
    adamw_gbs = 1500         # optional: of the fused AdamW step (absent: mem_bw_gbs)
    [gemm.bf16]              # optional, per dtype: measured matrix products (M x K) @ (K x N); a product of
    shapes = [[8192, 2304, 768]]   # one of these shapes runs at its measured rate, others on the curve
    layouts = ["nt"]         # optional: the operand stored transposed (foldtrain.sim.ops; absent: "nn")
    tflops = [250.0]
    [attention.bf16]         # optional, per dtype: measured fused attention at (batch, heads, seq, head_dim)
    shapes = [[8, 12, 1024, 64]]
    fwd_tflops = [180.0]
    bwd_tflops = [150.0]
    [intra]                  # between ranks of one node (NVLink, or loopback here)
    bw_gbs = 300             # GB/s per rank and direction
    latency_us = 5           # one message, point to point
    collective_latency_us = 5  # optional: one step of a collective (a ring's hop) with every rank of the
                             # run communicating (absent: latency_us; on shared cores it is far more)
    [inter]                  # the node's network interface, shared by the node's ranks
    bw_gbs = 200             # GB/s per node and direction
    latency_us = 10
    collective_latency_us = 10  # optional, as for intra
    p2p_gbs = 25             # optional, [intra] or [inter]: point-to-point send/recv bandwidth (absent: bw_gbs)
    reduce_scatter_busbw_gbs = 180  # optional: bus bandwidth of a reduce-scatter (absent: bw_gbs)
    all_gather_busbw_gbs = 180      # optional: of an all-gather (absent: bw_gbs)
    queue_ms = 50            # optional, [inter]: how long a small message may wait behind the bulk transfers
                             # queued ahead of it on the interface (a FIFO's depth, which bulk TCP keeps full:
                             # tc tbf's latency on the emulated cluster; absent: 0, it never waits)

``bw_gbs`` is the all-reduce's bus bandwidth (nccl-tests' busbw: algorithm bandwidth x 2 (n-1) / n).

Efficiency of a matrix product (M x K) @ (K x N) without ``sms`` (a CPU): ``efficiency * n / (n + half_size)`` of
its smallest dimension ``n``. With ``sms`` (a GPU): the output is cut into tiles (the best of cuBLAS's
256x128 ... 64x64 for the shape), which run in waves of ``sms``; ``efficiency * tiles / (waves * sms) *
K / (K + gemm_k_half)``.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from pathlib import Path

from foldtrain.config.load import tomllib  # tomli on Python 3.10
from foldtrain.errors import ConfigError

PRESET_DIR = Path(__file__).with_name("clusters")

FIELDS: dict[str, tuple[str, ...]] = {
    "node": ("gpus",),
    "device": (
        "memory_gb",
        "fp32_tflops",
        "bf16_tflops",
        "fp16_tflops",
        "mem_bw_gbs",
        "efficiency",
        "half_size",
        "layer_overhead_us",
    ),
    "intra": ("bw_gbs", "latency_us"),
    "inter": ("bw_gbs", "latency_us"),
}


@dataclass(frozen=True)
class Link:
    bw: float  # bytes/s: all-reduce bus bandwidth
    latency: float  # s: one message, point to point
    hop: float = 0.0  # s: one step of a collective with every rank of the run communicating (0: latency)
    p2p_bw: float = 0.0  # bytes/s of a send/recv (0: bw)
    rs_bw: float = 0.0  # bytes/s bus bandwidth of a reduce-scatter (0: bw)
    ag_bw: float = 0.0  # bytes/s bus bandwidth of an all-gather (0: bw)
    queue: float = 0.0  # s: the most a small message waits behind the bulk bytes queued ahead of it (0: never)

    @property
    def coll(self) -> float:
        """The per-step latency of a collective (a ring's hop, a tree's level)."""
        return self.hop or self.latency


@dataclass(frozen=True)
class Measured:
    """Rates measured at given shapes (``foldtrain calibrate --device cuda``): ``dtype -> {shape: value}``."""

    rates: dict = field(default_factory=dict)

    def get(self, dtype: str, shape: tuple) -> float:
        key = tuple(x if isinstance(x, str) else int(x) for x in shape)
        return self.rates.get(dtype, {}).get(key, 0.0)


# the memory-bound operation kinds of foldtrain.sim.ops priced at an achieved bandwidth of their own (the Cluster
# field holding it; 0 there falls back to elem_bw): what calibrate's kernel probes measure for each
KIND_BANDWIDTH = {
    "norm": "norm_bw",
    "gelu": "gelu_bw",
    "softmax": "softmax_bw",
    "cast": "cast_bw",
    "pack": "pack_bw",
    "reduce": "reduce_bw",
}


@dataclass(frozen=True)
class Cluster:
    name: str
    gpus_per_node: int
    memory: float  # bytes per rank
    tflops: dict[str, float]  # dtype ("fp32", "bf16", "fp16") -> peak FLOP/s
    mem_bw: float  # bytes/s
    efficiency: float
    half_size: float
    layer_overhead: float  # s
    intra: Link
    inter: Link
    source: str = ""
    runtime: float = 0.0  # bytes per rank the framework itself takes (CUDA context, interpreter)
    backward_ratio: float = 0.0  # a block's backward / forward time, measured (0: priced per operation)
    split_ratio: float = 0.0  # a block's split backward (I + W) / its whole backward, measured (0: 1)
    split_weight_share: float = 0.0  # W's share of the split backward, measured (0: priced per operation)
    shared_cores: float = 0.0  # > 0: all ranks share this many CPU cores (an emulated cluster on one machine)
    elem_bw: float = 0.0  # bytes/s of element-wise work (norms, GELU, softmax, residuals); 0: mem_bw
    softmax_rate: float = 0.0  # elements/s of the loss's log-softmax forward + backward; 0: memory-bound at mem_bw
    # weight elements/s the fused head costs beyond its FLOPs (stream W, accumulate dW); 0: free
    head_weight_rate: float = 0.0
    comm_cpu: float = 0.0  # core-seconds per byte a collective sends (with shared_cores: taken from compute); 0: free
    optim_rate: float = 0.0  # parameters/s of the optimizer step (AdamW + clipping norm); 0: memory-bound at mem_bw
    rows_half_size: float = 0.0  # half_size of products whose smallest dimension is their rows (tokens); 0: half_size
    # fp32 (b, L, V) tensors a rank's memory holds at the loss (3 live; more where the allocator keeps holes)
    loss_buffers: float = 3.0
    # s of the pipeline executor's own host work per action (bookkeeping, posting, waking up); 0: free
    action_overhead: float = 0.0
    # s of FSDP2's host work per unit with parameters and pass (its hooks), per pass in a root's own hooks (which
    # begin and end the pass; beyond its unit's where it holds parameters), and per unit all-gathered and
    # resharded (copies in and out, frees) beyond the collective; on shared cores (gloo) on the training thread;
    # 0: free (hidden behind a GPU's kernels)
    fsdp_unit: float = 0.0
    fsdp_root: float = 0.0
    fsdp_gather: float = 0.0
    # with shared_cores: the cores' throughput when twice as many ranks as cores are busy (1: none lost)
    oversubscribed: float = 1.0
    # core-seconds per rank of one step of a collective (with shared_cores: taken from compute); 0: free
    collective_cpu: float = 0.0
    launch: float = 0.0  # s of host time to launch one kernel (eager mode); 0: free
    attn_eff: float = 0.0  # fused attention forward, fraction of peak at long sequences; 0: two matrix products
    attn_bwd_eff: float = 0.0  # its backward
    attn_half_seq: float = 0.0  # sequence length at which fused attention reaches half of attn_eff
    attn_half_hd: float = 0.0  # head dimension at which fused attention reaches half of attn_eff
    norm_bw: float = 0.0  # bytes/s of layer norm; 0: elem_bw
    gelu_bw: float = 0.0  # bytes/s of GELU; 0: elem_bw
    softmax_bw: float = 0.0  # bytes/s of softmax and cross-entropy; 0: elem_bw
    cast_bw: float = 0.0  # bytes/s of element-wise work that converts a half tensor to fp32; 0: elem_bw
    pack_bw: float = 0.0  # bytes/s of packing q, k and v's gradients into the qkv product's; 0: elem_bw
    reduce_bw: float = 0.0  # bytes/s of a bias gradient's sum over the tokens; 0: elem_bw
    adamw_bw: float = 0.0  # bytes/s of the fused AdamW step; 0: mem_bw
    sms: float = 0.0  # streaming multiprocessors: > 0 prices products by their tiles' waves (a GPU)
    gemm_k_half: float = 0.0  # inner dimension at which a product's tiles reach half of their rate
    kernel_time: float = 0.0  # s of device time every kernel takes beyond its work (ramp-up, tail)
    overlap_slowdown: float = 0.0  # compute's extra time while a data-parallel collective runs beside it
    gemm: Measured = field(default_factory=Measured)  # FLOP/s at (M, N, K), per dtype
    attn_fwd: Measured = field(default_factory=Measured)  # FLOP/s at (batch, heads, seq, head_dim), per dtype
    attn_bwd: Measured = field(default_factory=Measured)

    def matmul_efficiency(self, n: float, rows: bool = False) -> float:
        """Efficiency of a product whose smallest dimension is ``n`` (``rows``: that dimension is its rows)."""
        h = self.rows_half_size if rows and self.rows_half_size > 0 else self.half_size
        return self.efficiency * n / (n + h)

    def peak(self, dtype: str) -> float:
        return self.tflops[dtype]


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml"))


def _bad(src: str, key: str, problem: str) -> ConfigError:
    return ConfigError(
        f"cluster file {src}: field {key} {problem}; give a positive number (see a preset in {PRESET_DIR})"
    )


# required fields a GPU preset may set to 0 (the per-operation model prices kernel launches one by one)
MAY_BE_ZERO = ("device.layer_overhead_us",)
# optional fields: "section.key" -> (Cluster or Link attribute, file unit per attribute unit, default in file units)
OPTIONAL: dict[str, tuple[str, float, float]] = {
    "node.shared_cores": ("shared_cores", 1.0, 0.0),
    "node.comm_cpu_ns": ("comm_cpu", 1e9, 0.0),
    "node.collective_cpu_us": ("collective_cpu", 1e6, 0.0),
    "node.oversubscribed_efficiency": ("oversubscribed", 1.0, 1.0),
    "device.runtime_gb": ("runtime", 1e-9, 0.0),
    "device.backward_ratio": ("backward_ratio", 1.0, 0.0),
    "device.split_ratio": ("split_ratio", 1.0, 0.0),
    "device.split_weight_share": ("split_weight_share", 1.0, 0.0),
    "device.elem_gbs": ("elem_bw", 1e-9, 0.0),
    "device.softmax_gelems": ("softmax_rate", 1e-9, 0.0),
    "device.loss_buffers": ("loss_buffers", 1.0, 3.0),
    "device.rows_half_size": ("rows_half_size", 1.0, 0.0),
    "device.head_weight_gelems": ("head_weight_rate", 1e-9, 0.0),
    "device.optim_gparams": ("optim_rate", 1e-9, 0.0),
    "device.action_overhead_us": ("action_overhead", 1e6, 0.0),
    "device.fsdp_unit_us": ("fsdp_unit", 1e6, 0.0),
    "device.fsdp_root_us": ("fsdp_root", 1e6, 0.0),
    "device.fsdp_gather_us": ("fsdp_gather", 1e6, 0.0),
    "device.launch_us": ("launch", 1e6, 0.0),
    "device.attention_efficiency": ("attn_eff", 1.0, 0.0),
    "device.attention_bwd_efficiency": ("attn_bwd_eff", 1.0, 0.0),
    "device.attention_half_seq": ("attn_half_seq", 1.0, 0.0),
    "device.attention_half_head_dim": ("attn_half_hd", 1.0, 0.0),
    "device.norm_gbs": ("norm_bw", 1e-9, 0.0),
    "device.gelu_gbs": ("gelu_bw", 1e-9, 0.0),
    "device.softmax_gbs": ("softmax_bw", 1e-9, 0.0),
    "device.cast_gbs": ("cast_bw", 1e-9, 0.0),
    "device.pack_gbs": ("pack_bw", 1e-9, 0.0),
    "device.reduce_gbs": ("reduce_bw", 1e-9, 0.0),
    "device.adamw_gbs": ("adamw_bw", 1e-9, 0.0),
    "device.sms": ("sms", 1.0, 0.0),
    "device.gemm_k_half": ("gemm_k_half", 1.0, 0.0),
    "device.kernel_us": ("kernel_time", 1e6, 0.0),
    "device.overlap_slowdown": ("overlap_slowdown", 1.0, 0.0),
}
LINK_OPTIONAL: dict[str, tuple[str, float]] = {
    "collective_latency_us": ("hop", 1e6),
    "p2p_gbs": ("p2p_bw", 1e-9),
    "reduce_scatter_busbw_gbs": ("rs_bw", 1e-9),
    "all_gather_busbw_gbs": ("ag_bw", 1e-9),
    "queue_ms": ("queue", 1e3),
}
FRACTIONS = ("node.oversubscribed_efficiency", "device.attention_efficiency", "device.attention_bwd_efficiency")
POSITIVE = ("device.loss_buffers", "node.oversubscribed_efficiency")
# measured tables: [section.dtype] with shapes = [[...], ...] and one list of TFLOP/s per rate
TABLES: dict[str, tuple[int, tuple[tuple[str, str], ...]]] = {
    "gemm": (3, (("tflops", "gemm"),)),  # (M, N, K)
    "attention": (4, (("fwd_tflops", "attn_fwd"), ("bwd_tflops", "attn_bwd"))),  # (batch, heads, seq, head_dim)
}


def _required(data: dict, src: str) -> dict[str, float]:
    vals: dict[str, float] = {}
    for sec, keys in FIELDS.items():
        table = data.get(sec)
        if not isinstance(table, dict):
            raise ConfigError(f"cluster file {src}: section [{sec}] is missing; add it with {', '.join(keys)}")
        for k in keys:
            key = f"{sec}.{k}"
            if k not in table:
                raise _bad(src, key, "is missing")
            v = table[k]
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise _bad(src, key, f"is not a number ({v!r})")
            if not math.isfinite(v) or v < 0 or (v == 0 and key not in MAY_BE_ZERO):
                raise _bad(src, key, f"must be positive, got {v}")
            vals[key] = float(v)
    if vals["device.efficiency"] > 1:
        raise ConfigError(
            f"cluster file {src}: field device.efficiency {vals['device.efficiency']} is a fraction of peak; "
            "give a value in (0, 1]"
        )
    if not vals["node.gpus"].is_integer():
        raise ConfigError(f"cluster file {src}: field node.gpus must be a whole number, got {vals['node.gpus']}")
    return vals


def _link(data: dict, sec: str, vals: dict[str, float], src: str) -> Link:
    extra = {attr: _optional(data, sec, k, src) / unit for k, (attr, unit) in LINK_OPTIONAL.items()}
    return Link(vals[f"{sec}.bw_gbs"] * 1e9, vals[f"{sec}.latency_us"] * 1e-6, **extra)


def _tables(data: dict, src: str) -> dict[str, Measured]:
    """The measured tables (``[gemm.bf16]``, ``[attention.fp16]``, ...) as :class:`Measured` rates in FLOP/s."""
    out: dict[str, dict] = {attr: {} for _, rates in TABLES.values() for _, attr in rates}
    for sec, (dims, rates) in TABLES.items():
        for dtype, table in data.get(sec, {}).items():
            where = f"cluster file {src}: [{sec}.{dtype}]"
            if dtype not in ("fp32", "bf16", "fp16") or not isinstance(table, dict):
                raise ConfigError(f"{where} is not a table of fp32, bf16 or fp16; name one of those dtypes")
            shapes = table.get("shapes", [])
            ok = all(isinstance(sh, list) and len(sh) == dims and all(isinstance(x, int) for x in sh) for sh in shapes)
            for key, attr in rates:
                vals = table.get(key, [])
                good = isinstance(vals, list) and len(vals) == len(shapes)
                if (
                    not ok
                    or not good
                    or any(isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0 for v in vals)
                ):
                    raise ConfigError(
                        f"{where}: give shapes = a list of {dims} whole numbers each and {key} = as many positive "
                        "TFLOP/s"
                    )
                keys = [tuple(sh) for sh in shapes]
                if sec == "gemm":
                    keys = [(*k, lay) for k, lay in zip(keys, _layouts(table, len(shapes), where))]
                out[attr][dtype] = {k: v * 1e12 for k, v in zip(keys, vals)}
    return {attr: Measured(rates) for attr, rates in out.items()}


GEMM_LAYOUTS = ("nn", "nt", "tn")


def _layouts(table: dict, n: int, where: str) -> list[str]:
    """A ``[gemm.*]`` table's ``layouts`` (which operand each product stores transposed, foldtrain.sim.ops);
    absent: "nn", as calibrate measured every product before it told them apart."""
    layouts = table.get("layouts", ["nn"] * n)
    if not isinstance(layouts, list) or len(layouts) != n or any(x not in GEMM_LAYOUTS for x in layouts):
        raise ConfigError(f"{where}: give layouts = one of {', '.join(GEMM_LAYOUTS)} per shape (or leave it out)")
    return layouts


def from_dict(data: dict, src: str = "<dict>") -> Cluster:
    """Validate ``data`` (a parsed cluster file) and build the :class:`Cluster`."""
    vals = _required(data, src)
    optional = {}
    for key, (attr, unit, default) in OPTIONAL.items():
        sec, k = key.split(".")
        v = _optional(data, sec, k, src, default=default, positive=key in POSITIVE)
        if key in FRACTIONS and v > 1:
            raise ConfigError(f"cluster file {src}: field {key} {v} is a fraction; give a value in (0, 1]")
        optional[attr] = v / unit
    return Cluster(
        name=str(data.get("name", Path(src).stem)),
        gpus_per_node=int(vals["node.gpus"]),
        memory=vals["device.memory_gb"] * 1e9,
        tflops={d: vals[f"device.{d}_tflops"] * 1e12 for d in ("fp32", "bf16", "fp16")},
        mem_bw=vals["device.mem_bw_gbs"] * 1e9,
        efficiency=vals["device.efficiency"],
        half_size=vals["device.half_size"],
        layer_overhead=vals["device.layer_overhead_us"] * 1e-6,
        intra=_link(data, "intra", vals, src),
        inter=_link(data, "inter", vals, src),
        source=src,
        **optional,
        **_tables(data, src),
    )


def _optional(data: dict, sec: str, k: str, src: str, default: float = 0.0, positive: bool = False) -> float:
    v = data.get(sec, {}).get(k, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (positive and v == 0):
        kind = "positive" if positive else "non-negative"
        raise _bad(src, f"{sec}.{k}", f"must be a {kind} number, got {v!r}")
    return float(v)


def load_cluster(name_or_file: str) -> Cluster:
    """A preset by name (``hal-v100``, ...) or a TOML file path."""
    p = Path(name_or_file)
    if p.suffix == ".toml" or p.is_file() or "/" in name_or_file:
        if not p.is_file():
            raise ConfigError(
                f"cluster file {p} not found; pass a preset ({', '.join(preset_names())}) or an existing TOML file"
            )
    else:
        p = PRESET_DIR / f"{name_or_file}.toml"
        if not p.is_file():
            near = difflib.get_close_matches(name_or_file, preset_names(), n=1)
            hint = f"did you mean '{near[0]}'? " if near else ""
            raise ConfigError(
                f"unknown cluster '{name_or_file}'; {hint}use a preset ({', '.join(preset_names())}) or a TOML file"
            )
    try:
        data = tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"cluster file {p} is not valid TOML ({e}); fix the syntax") from None
    return from_dict(data, str(p))


def _number(k: str, v: float, integer: bool = False) -> str:
    if integer:
        return f"{k} = {int(v)}"
    txt = f"{v:.6g}"
    return f"{k} = {txt}" + ("" if any(ch in txt for ch in ".en") else ".0")


def to_toml(c: Cluster, comments: dict[str, str] | None = None) -> str:
    """A cluster file for ``c`` (``comments``: ``"section.field" -> source``); optional fields at their default
    are left out, except those the CPU calibration always writes."""
    comments = comments or {}
    vals = {
        "node.gpus": c.gpus_per_node,
        "device.memory_gb": c.memory / 1e9,
        "device.fp32_tflops": c.tflops["fp32"] / 1e12,
        "device.bf16_tflops": c.tflops["bf16"] / 1e12,
        "device.fp16_tflops": c.tflops["fp16"] / 1e12,
        "device.mem_bw_gbs": c.mem_bw / 1e9,
        "device.efficiency": c.efficiency,
        "device.half_size": c.half_size,
        "device.layer_overhead_us": c.layer_overhead * 1e6,
    }
    for sec in ("intra", "inter"):
        link = getattr(c, sec)
        vals[f"{sec}.bw_gbs"] = link.bw / 1e9
        vals[f"{sec}.latency_us"] = link.latency * 1e6
        for k, (attr, unit) in LINK_OPTIONAL.items():
            if getattr(link, attr) or k == "collective_latency_us":
                vals[f"{sec}.{k}"] = getattr(link, attr) * unit
    for key, (attr, unit, default) in OPTIONAL.items():
        v = getattr(c, attr) * unit
        if v != default or key in ALWAYS_WRITTEN:
            vals[key] = v
    lines = [f'name = "{c.name}"']
    for sec in FIELDS:
        lines += ["", f"[{sec}]"]
        for key, v in vals.items():
            if key.startswith(sec + "."):
                k = key.split(".", 1)[1]
                note = comments.get(key)
                lines.append(_number(k, v, integer=key == "node.gpus") + (f"  # {note}" if note else ""))
    return "\n".join(lines + _table_lines(c, comments)) + "\n"


# the optional fields the CPU calibration measures: written even where they equal their default
ALWAYS_WRITTEN = (
    "node.shared_cores",
    "node.comm_cpu_ns",
    "node.collective_cpu_us",
    "node.oversubscribed_efficiency",
    "device.runtime_gb",
    "device.backward_ratio",
    "device.elem_gbs",
    "device.softmax_gelems",
    "device.loss_buffers",
    "device.rows_half_size",
    "device.head_weight_gelems",
    "device.optim_gparams",
    "device.action_overhead_us",
    "device.fsdp_unit_us",
    "device.fsdp_root_us",
    "device.fsdp_gather_us",
)


def _table_lines(c: Cluster, comments: dict[str, str]) -> list[str]:
    lines: list[str] = []
    for sec, (_, rates) in TABLES.items():
        first: Measured = getattr(c, rates[0][1])
        for dtype, by_shape in first.rates.items():
            shapes = list(by_shape)
            note = comments.get(f"{sec}.{dtype}")
            lines += ["", f"[{sec}.{dtype}]" + (f"  # {note}" if note else "")]
            dims = [[x for x in sh if not isinstance(x, str)] for sh in shapes]
            lines.append("shapes = [" + ", ".join("[" + ", ".join(str(x) for x in sh) + "]" for sh in dims) + "]")
            if sec == "gemm":
                lines.append("layouts = [" + ", ".join(f'"{sh[-1]}"' for sh in shapes) + "]")
            for key, attr in rates:
                m: Measured = getattr(c, attr)
                lines.append(f"{key} = [" + ", ".join(f"{m.get(dtype, sh) / 1e12:.4g}" for sh in shapes) + "]")
    return lines
