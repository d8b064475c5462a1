"""``foldtrain calibrate --device cuda`` (and ``--device cpu --probes kernels``, its twin on a CPU): measure each
operation of a step on this machine's device (:mod:`.gpu`, rank 0) and the collectives among torchrun's ranks
(:mod:`.nccl`, every rank), and write the cluster file the per-operation cost model reads (rank 0).

The shapes come from the models the runs will train (``--preset``, ``--precision``, ``--tp``, ``--micro_batch``,
``--seq``): the ``[gemm.<dtype>]`` table holds exactly :func:`foldtrain.sim.ops.gemm_shapes` of each."""

from __future__ import annotations

import argparse
import dataclasses
import os

from foldtrain.errors import ConfigError
from foldtrain.sim import ops
from foldtrain.sim.cluster import KIND_BANDWIDTH

from . import gpu, nccl, report

ACT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
TIMEOUT_S = 1800.0  # the other ranks wait in their first collective while rank 0 probes kernels


@dataclasses.dataclass(frozen=True)
class Scale:
    min_s: float  # per timed run of calls
    squares: tuple  # n of the (n x n) @ (n x n) products for the peak and the efficiency curve
    stream_bytes: int  # copy, add and AdamW tensors
    sizes: tuple  # collective message sizes
    budget: int  # bytes per collective size and kind
    overlap: tuple  # (n, all-reduce bytes, dtype) of the products timed beside the all-reduces


CUDA_SCALE = Scale(
    0.02, (256, 512, 1024, 2048, 4096, 8192), 256 << 20, nccl.CUDA_SIZES, nccl.CUDA_BUDGET, (8192, 256 << 20, "bf16")
)
CPU_SCALE = Scale(0.01, (32, 64, 128), 4 << 20, nccl.CPU_SIZES, nccl.CPU_BUDGET, (256, 1 << 20, "fp32"))


@dataclasses.dataclass(frozen=True)
class Case:
    """One shape the runs will train: a preset's block on one tensor-parallel rank, and its padded vocabulary."""

    preset: str
    shape: ops.BlockShape
    vocab: int

    def at(self, dtype: str) -> ops.BlockShape:
        """The block as foldtrain trains it in ``dtype`` (its own model; autocast over fp32 weights in half)."""
        return dataclasses.replace(self.shape, e=ACT_BYTES[dtype], native=True, autocast=dtype != "fp32")

    @property
    def label(self) -> str:
        s = self.shape
        return f"{self.preset} b {s.b} L {s.L} tp {s.t}"


@dataclasses.dataclass(frozen=True)
class Options:
    device: str
    cases: tuple[Case, ...]
    dtypes: tuple[str, ...]  # the first sets efficiency, half_size, attention's curve and the bandwidths
    links: str  # cluster preset for the links not measured ("": by device name)
    world: int
    per_node: int


def _ints(flag: str, text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or any(v < 1 for v in vals):
        raise ConfigError(f"calibrate {flag} {text!r}: give whole numbers >= 1, comma-separated (e.g. {flag} 1,2)")
    return vals


def _cases(a: argparse.Namespace) -> list[Case]:
    from foldtrain.model.presets import PRESETS, padded_vocab

    cases = []
    for name in [p.strip() for p in a.preset.split(",") if p.strip()]:
        if name not in PRESETS:
            raise ConfigError(f"calibrate --preset {name}: unknown model preset; choose from {', '.join(PRESETS)}")
        p = PRESETS[name]
        for t in _ints("--tp", a.tp):
            if p["n_head"] % t:
                raise ConfigError(
                    f"calibrate --tp {t} does not divide {name}'s {p['n_head']} heads; give a tp that divides them"
                )
            for b in _ints("--micro_batch", a.micro_batch):
                for L in _ints("--seq", a.seq) if a.seq else [p["context"]]:
                    shape = ops.BlockShape(b=b, L=L, d=p["d_model"], heads=p["n_head"], t=t)
                    cases.append(Case(name, shape, padded_vocab(p["vocab_size"], a.vocab_multiple, t)))
    if not cases:
        raise ConfigError("calibrate --preset is empty; name a model preset, e.g. --preset gpt2-small")
    return cases


def parse_options(a: argparse.Namespace) -> Options:
    """The ``--probes kernels`` options, checked before any process group starts; ConfigError names the bad one."""
    dtypes = tuple(d.strip() for d in a.precision.split(",") if d.strip())
    bad = [d for d in dtypes if d not in ACT_BYTES]
    if bad or not dtypes:
        raise ConfigError(f"calibrate --precision {a.precision!r}: give fp32, bf16 or fp16, comma-separated")
    if a.vocab_multiple < 1:
        raise ConfigError(f"calibrate --vocab_multiple {a.vocab_multiple}: give a whole number >= 1")
    if a.network:
        raise ConfigError("calibrate --network emulates nodes for the CPU model (--probes fitted); drop it here")
    if a.links:
        from foldtrain.sim.cluster import load_cluster

        try:
            load_cluster(a.links)  # a bad name is one line now, not after the probes
        except ConfigError as e:
            raise ConfigError(f"calibrate --links: {e}") from None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if a.ranks_per_node is None else a.ranks_per_node
    if per_node < 1 or world % per_node:
        raise ConfigError(
            f"calibrate --ranks_per_node {per_node} does not divide the {world} ranks torchrun started; "
            "give the ranks of one node (default: torchrun's --nproc_per_node)"
        )
    return Options(a.device, tuple(_cases(a)), dtypes, a.links, world, per_node)


@dataclasses.dataclass
class Kernels:
    """What rank 0's kernel probes measured (rates in FLOP/s and bytes/s, times in s)."""

    name: str
    peaks: dict = dataclasses.field(default_factory=dict)
    table_peaks: dict = dataclasses.field(default_factory=dict)
    links: str = ""  # the links preset the device table names
    squares: dict = dataclasses.field(default_factory=dict)  # dtype -> rates at scale.squares
    gemm: dict = dataclasses.field(default_factory=dict)  # dtype -> {(M, N, K): rate}
    attn: dict = dataclasses.field(default_factory=dict)  # dtype -> {(b, h, L, hd): (fwd, bwd)}
    backend: dict = dataclasses.field(default_factory=dict)  # dtype -> SDPA backend
    curve: tuple = (1.0, 1.0)  # (efficiency, half_size)
    attention: tuple = (0.0, 0.0, 0.0)  # (efficiency, bwd efficiency, half_seq)
    attn_sweep: list = dataclasses.field(default_factory=list)  # the shapes attention's curve is fitted to
    bw: dict = dataclasses.field(default_factory=dict)  # norm/gelu/softmax -> per case
    streams: dict = dataclasses.field(default_factory=dict)
    launch: float = 0.0
    block: tuple = (0.0, 0.0)
    overhead: tuple = (0.0, 0.0)  # (per pass, the tiny block's time)
    memory: dict = dataclasses.field(default_factory=dict)


def device_name(device) -> str:
    import platform

    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.machine() or 'unknown'})"


def _gemm_probes(opts: Options, device, scale: Scale, k: Kernels) -> None:
    """The ``[gemm.<dtype>]`` tables, the square products, the peaks and the efficiency curve."""
    for d in opts.dtypes:
        shapes = sorted({sh for c in opts.cases for sh in ops.gemm_shapes(c.at(d), c.vocab)})
        print(f"calibrate: {len(shapes)} {d} matrix products ...", flush=True)
        k.gemm[d] = dict(zip(shapes, gpu.measure_gemms(shapes, d, device, scale.min_s)))
    for d in sorted(set(opts.dtypes) | (set(ACT_BYTES) - set(k.table_peaks))):
        k.squares[d] = gpu.measure_gemms([(n, n, n, "nn") for n in scale.squares], d, device, scale.min_s)
    for d in ACT_BYTES:
        k.peaks[d] = k.table_peaks.get(d) or max([*k.squares[d], *k.gemm.get(d, {}).values()])
    d = opts.dtypes[0]
    dims = [min(sh[:3]) for sh in k.gemm[d]] + list(scale.squares)
    k.curve = gpu.fit_gemm_curve(dims, [*k.gemm[d].values(), *k.squares[d]], k.peaks[d])


def attention_shapes(case: Case) -> list[tuple]:
    """The case's SDPA shape, and at a half and a quarter of its sequence (for attention_half_seq)."""
    b, h, L, hd = ops.attention_shape(case.shape)
    return [(b, h, s, hd) for s in sorted({L // 4, L // 2, L}) if s >= 8 or s == L]


def _attention_probes(opts: Options, device, scale: Scale, k: Kernels) -> None:
    for d in opts.dtypes:
        shapes = sorted({sh for c in opts.cases for sh in attention_shapes(c)})
        print(f"calibrate: {len(shapes)} {d} attention shapes ...", flush=True)
        k.attn[d] = {}
        for sh in shapes:
            fwd, bwd, k.backend[d] = gpu.measure_attention(sh, d, device, scale.min_s)
            k.attn[d][sh] = (fwd, bwd)
    d = opts.dtypes[0]
    k.attn_sweep = sweep = attention_shapes(opts.cases[0])
    fwd, bwd = [k.attn[d][sh][0] for sh in sweep], [k.attn[d][sh][1] for sh in sweep]
    k.attention = gpu.fit_attention([sh[2] for sh in sweep], fwd, bwd, k.peaks[d])


def measure_kernels(opts: Options, device, scale: Scale) -> Kernels:
    name = device_name(device)
    table, links = gpu.known_peaks(name)
    k = Kernels(name, table_peaks=table, links=links)
    _gemm_probes(opts, device, scale, k)
    _attention_probes(opts, device, scale, k)
    d = opts.dtypes[0]
    print("calibrate: memory-bound kernels, launches, a block ...", flush=True)
    per_case = [gpu.measure_memory_bound(c.at(d), c.vocab, d, device, scale.min_s) for c in opts.cases]
    k.bw = {kind: [m[kind] for m in per_case] for kind in KIND_BANDWIDTH}
    k.streams = gpu.measure_streams(scale.stream_bytes, device, scale.min_s)
    k.launch = gpu.measure_launch(device)
    first = dataclasses.replace(opts.cases[0].at(d), t=1)
    k.block = gpu.measure_block(first, d, device, scale.min_s)
    k.overhead = gpu.measure_block_overhead(device, k.launch, scale.min_s)
    return k


def run(opts: Options, argv: list[str], out: str, name: str) -> int:
    """Every rank: init the process group (NCCL on GPUs, gloo on a CPU), probe, write on rank 0."""
    from foldtrain.distributed import init_distributed, shutdown

    env = init_distributed(opts.device, timeout_s=TIMEOUT_S)
    try:
        scale = CUDA_SCALE if env.device.type == "cuda" else CPU_SCALE
        k = measure_kernels(opts, env.device, scale) if env.rank == 0 else None
        if env.rank == 0 and opts.world > 1:
            print(f"calibrate: collectives among {opts.world} ranks, {opts.per_node} per node ...", flush=True)
        links = nccl.measure_links(env.device, opts.per_node, scale.sizes, scale.budget)
        n, nbytes, dtype = scale.overlap
        links["overlap"] = nccl.compute_beside_collectives(env.device, n, nbytes, gpu.torch_dtype(dtype))
        if env.rank == 0:
            c = opts.cases[0]
            d = opts.dtypes[0]
            first = dataclasses.replace(c.at(d), t=1)
            k.memory = gpu.memory_overhead(first, c.vocab, d, env.device)
            report.write_cluster_file(out, name, argv, opts, scale, k, links, env.device)
            print(f"wrote {out}")
    finally:
        shutdown()
    return 0
