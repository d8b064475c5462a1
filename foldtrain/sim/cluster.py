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
    half_size = 256          # matrix dimension at which the efficiency is half of that
    layer_overhead_us = 60   # fixed cost per transformer block and pass (kernel launches, Python)
    runtime_gb = 1.0         # optional: memory the framework takes per rank (CUDA context, ...)
    backward_ratio = 2.0     # optional: a block's backward time / its forward time (FLOPs: 2)
    elem_gbs = 2039          # optional: effective bandwidth of element-wise work (absent: mem_bw_gbs)
    softmax_gelems = 50      # optional: log-softmax forward + backward, G elements/s (absent: memory-bound)
    rows_half_size = 256     # optional: half_size of products with few rows (tokens) (absent: half_size)
    head_weight_gelems = 0.6 # optional: the fused head's cost per weight element beyond FLOPs, G/s (absent: none)
    optim_gparams = 0.3      # optional: optimizer step, G parameters/s (absent: memory-bound at mem_bw_gbs)
    loss_buffers = 3         # optional: fp32 (b, L, V) tensors resident at the loss (absent: 3, the live ones)
    action_overhead_us = 40  # optional: the pipeline executor's own CPU time per action of a rank's list (absent: 0)
    [intra]                  # between ranks of one node (NVLink, or loopback here)
    bw_gbs = 300             # GB/s per rank and direction
    latency_us = 5           # one message, point to point
    collective_latency_us = 5  # optional: one step of a collective (a ring's hop) with every rank of the
                             # run communicating (absent: latency_us; on shared cores it is far more)
    [inter]                  # the node's network interface, shared by the node's ranks
    bw_gbs = 200             # GB/s per node and direction
    latency_us = 10
    collective_latency_us = 10  # optional, as for intra

Efficiency of a matrix product whose smallest dimension is ``n``:
``efficiency * n / (n + half_size)``.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
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
    bw: float  # bytes/s
    latency: float  # s: one message, point to point
    hop: float = 0.0  # s: one step of a collective with every rank of the run communicating (0: latency)

    @property
    def coll(self) -> float:
        """The per-step latency of a collective (a ring's hop, a tree's level)."""
        return self.hop or self.latency


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
    backward_ratio: float = 2.0  # a block's backward / forward time (2: the FLOP ratio)
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
    # with shared_cores: the cores' throughput when twice as many ranks as cores are busy (1: none lost)
    oversubscribed: float = 1.0
    # core-seconds per rank of one step of a collective (with shared_cores: taken from compute); 0: free
    collective_cpu: float = 0.0

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


def from_dict(data: dict, src: str = "<dict>") -> Cluster:
    """Validate ``data`` (a parsed cluster file) and build the :class:`Cluster`."""
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
            if not math.isfinite(v) or v <= 0:
                raise _bad(src, key, f"must be positive, got {v}")
            vals[key] = float(v)
    if vals["device.efficiency"] > 1:
        raise ConfigError(
            f"cluster file {src}: field device.efficiency {vals['device.efficiency']} is a fraction of peak; "
            "give a value in (0, 1]"
        )
    gpus = vals["node.gpus"]
    if not gpus.is_integer():
        raise ConfigError(f"cluster file {src}: field node.gpus must be a whole number, got {gpus}")
    return Cluster(
        name=str(data.get("name", Path(src).stem)),
        gpus_per_node=int(gpus),
        memory=vals["device.memory_gb"] * 1e9,
        tflops={d: vals[f"device.{d}_tflops"] * 1e12 for d in ("fp32", "bf16", "fp16")},
        mem_bw=vals["device.mem_bw_gbs"] * 1e9,
        efficiency=vals["device.efficiency"],
        half_size=vals["device.half_size"],
        layer_overhead=vals["device.layer_overhead_us"] * 1e-6,
        intra=Link(
            vals["intra.bw_gbs"] * 1e9,
            vals["intra.latency_us"] * 1e-6,
            _optional(data, "intra", "collective_latency_us", src) * 1e-6,
        ),
        inter=Link(
            vals["inter.bw_gbs"] * 1e9,
            vals["inter.latency_us"] * 1e-6,
            _optional(data, "inter", "collective_latency_us", src) * 1e-6,
        ),
        source=src,
        runtime=_optional(data, "device", "runtime_gb", src) * 1e9,
        backward_ratio=_optional(data, "device", "backward_ratio", src, default=2.0, positive=True),
        shared_cores=_optional(data, "node", "shared_cores", src),
        elem_bw=_optional(data, "device", "elem_gbs", src) * 1e9,
        softmax_rate=_optional(data, "device", "softmax_gelems", src) * 1e9,
        loss_buffers=_optional(data, "device", "loss_buffers", src, default=3.0, positive=True),
        rows_half_size=_optional(data, "device", "rows_half_size", src),
        head_weight_rate=_optional(data, "device", "head_weight_gelems", src) * 1e9,
        optim_rate=_optional(data, "device", "optim_gparams", src) * 1e9,
        comm_cpu=_optional(data, "node", "comm_cpu_ns", src) * 1e-9,
        action_overhead=_optional(data, "device", "action_overhead_us", src) * 1e-6,
        oversubscribed=_fraction(data, "node", "oversubscribed_efficiency", src),
        collective_cpu=_optional(data, "node", "collective_cpu_us", src) * 1e-6,
    )


def _fraction(data: dict, sec: str, k: str, src: str) -> float:
    v = _optional(data, sec, k, src, default=1.0, positive=True)
    if v > 1:
        raise ConfigError(
            f"cluster file {src}: field {sec}.{k} {v} is a fraction of the cores' throughput; give a value in (0, 1]"
        )
    return v


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


def to_toml(c: Cluster, comments: dict[str, str] | None = None) -> str:
    """A cluster file for ``c`` (``comments``: ``"section.field" -> source``)."""
    comments = comments or {}
    vals = {
        "node.gpus": c.gpus_per_node,
        "node.shared_cores": c.shared_cores,
        "device.memory_gb": c.memory / 1e9,
        "device.fp32_tflops": c.tflops["fp32"] / 1e12,
        "device.bf16_tflops": c.tflops["bf16"] / 1e12,
        "device.fp16_tflops": c.tflops["fp16"] / 1e12,
        "device.mem_bw_gbs": c.mem_bw / 1e9,
        "device.efficiency": c.efficiency,
        "device.half_size": c.half_size,
        "device.layer_overhead_us": c.layer_overhead * 1e6,
        "device.runtime_gb": c.runtime / 1e9,
        "device.backward_ratio": c.backward_ratio,
        "device.elem_gbs": c.elem_bw / 1e9,
        "device.softmax_gelems": c.softmax_rate / 1e9,
        "device.loss_buffers": c.loss_buffers,
        "device.rows_half_size": c.rows_half_size,
        "device.head_weight_gelems": c.head_weight_rate / 1e9,
        "device.optim_gparams": c.optim_rate / 1e9,
        "node.comm_cpu_ns": c.comm_cpu * 1e9,
        "device.action_overhead_us": c.action_overhead * 1e6,
        "node.oversubscribed_efficiency": c.oversubscribed,
        "node.collective_cpu_us": c.collective_cpu * 1e6,
        "intra.bw_gbs": c.intra.bw / 1e9,
        "intra.latency_us": c.intra.latency * 1e6,
        "inter.bw_gbs": c.inter.bw / 1e9,
        "inter.latency_us": c.inter.latency * 1e6,
        "intra.collective_latency_us": c.intra.hop * 1e6,
        "inter.collective_latency_us": c.inter.hop * 1e6,
    }
    lines = [f'name = "{c.name}"']
    for sec, keys in FIELDS.items():
        keys = keys + {
            "device": (
                "runtime_gb",
                "backward_ratio",
                "elem_gbs",
                "softmax_gelems",
                "loss_buffers",
                "rows_half_size",
                "head_weight_gelems",
                "optim_gparams",
                "action_overhead_us",
            ),
            "node": ("shared_cores", "comm_cpu_ns", "collective_cpu_us", "oversubscribed_efficiency"),
            "intra": ("collective_latency_us",),
            "inter": ("collective_latency_us",),
        }.get(sec, ())
        lines += ["", f"[{sec}]"]
        for k in keys:
            v = vals[f"{sec}.{k}"]
            txt = f"{k} = {v:.6g}" if not isinstance(v, int) else f"{k} = {v}"
            if "." not in txt.split("=")[1] and sec != "node" and "e" not in txt.split("=")[1]:
                txt += ".0"
            note = comments.get(f"{sec}.{k}")
            lines.append(txt + (f"  # {note}" if note else ""))
    return "\n".join(lines) + "\n"
