"""The kernel probes of ``foldtrain calibrate --device cuda`` run on the CPU (their twin): what each counts, that
it measures, the fits, the device table, bus bandwidth as nccl-tests computes it, and the one-line errors."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from foldtrain.calibrate import fsdp, gpu, nccl
from foldtrain.cli import main
from foldtrain.sim import ops
from foldtrain.sim.cluster import KIND_BANDWIDTH

CPU = torch.device("cpu")
SHAPE = ops.BlockShape(b=2, L=16, d=32, heads=4, t=2, e=2)


def finite_positive(*xs) -> bool:
    return all(isinstance(x, float) and math.isfinite(x) and x > 0 for x in xs)


@pytest.fixture
def one_second(monkeypatch):
    """Every device timing takes 1 s, after calling the timed function once (its result kept)."""
    results = []

    def fake(fn, device, min_s, reps=3):
        results.append(fn())
        return 1.0

    monkeypatch.setattr(gpu, "device_time", fake)
    return results


def test_bus_bandwidth_as_nccl_tests_computes_it():
    # algbw = 1 GB/s
    assert nccl.bus_bw("all_reduce", 1e9, 1.0, 8) == pytest.approx(1e9 * 2 * 7 / 8)
    assert nccl.bus_bw("reduce_scatter", 1e9, 1.0, 8) == pytest.approx(1e9 * 7 / 8)
    assert nccl.bus_bw("all_gather", 1e9, 1.0, 8) == pytest.approx(1e9 * 7 / 8)
    assert nccl.bus_bw("send_recv", 1e9, 1.0, 8) == pytest.approx(1e9)
    assert nccl.bus_bw("all_reduce", 2e9, 4.0, 2) == pytest.approx(0.5e9)  # 2 ranks: busbw = algbw
    assert nccl.message_bytes(8192, 3) % (4 * 3) == 0 and nccl.message_bytes(8, 4) == 16


def test_node_groups():
    intra, inter = nccl.node_groups(8, 4)
    assert intra == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert inter == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert nccl.node_groups(2, 2) == ([[0, 1]], [[0], [1]])
    assert nccl.node_groups(2, 1) == ([[0], [1]], [[0, 1]])


@pytest.mark.parametrize(
    "name,bf16,fp32,links",
    [
        ("NVIDIA H100 80GB HBM3", 989.4, 66.9, "dgx-h100"),
        ("NVIDIA H200", 989.4, 66.9, "dgx-h100"),
        ("NVIDIA H100 PCIe", 756.5, 51.2, "dgx-h100"),
        ("NVIDIA A100-SXM4-80GB", 312.0, 19.5, "dgx-a100"),
        ("NVIDIA L4", 121.0, 30.3, "dgx-h100"),
        ("NVIDIA L40S", 362.05, 91.6, "dgx-h100"),
        ("Tesla V100-SXM2-16GB", None, 15.7, "cloud-v100-25g"),
        ("NVIDIA H100 NVL", None, None, "dgx-h100"),
        ("CPU (x86_64)", None, None, "dgx-h100"),
    ],
)
def test_device_peak_table(name, bf16, fp32, links):
    peaks, preset = gpu.known_peaks(name)
    assert preset == links
    assert peaks.get("bf16") == (bf16 and bf16 * 1e12)
    assert peaks.get("fp32") == (fp32 and fp32 * 1e12)


def test_gemm_rate_counts_2mnk_over_the_time(one_second):
    shapes = [(3, 5, 7, "nn"), (4, 2, 6, "nt")]
    assert gpu.measure_gemms(shapes, "bf16", CPU, 0.0) == [2.0 * 3 * 5 * 7, 2.0 * 4 * 2 * 6]
    assert [tuple(r.shape) for r in one_second] == [(3, 5), (4, 2)]
    assert {r.dtype for r in one_second} == {torch.bfloat16}


def test_gemm_operands_are_stored_as_the_layout_says():
    a, b = gpu.operands(3, 5, 7, "nt", torch.float32, CPU)  # x W^T: the weight (N, K) row-major
    assert a.shape == (3, 7) and b.shape == (7, 5) and b.t().is_contiguous() and a.is_contiguous()
    a, b = gpu.operands(3, 5, 7, "tn", torch.float32, CPU)  # x^T dy: the input (K, M) row-major
    assert a.shape == (3, 7) and a.t().is_contiguous() and b.is_contiguous()


def test_gemm_rates_are_measured():
    rates = gpu.measure_gemms([(64, 96, 32, "tn"), (8, 8, 8, "nn")], "fp32", CPU, 0.005)
    assert finite_positive(*rates)


def test_attention_flops_as_ops_counts_them(one_second):
    fwd, bwd, backend = gpu.measure_attention((2, 3, 16, 8), "fp32", CPU, 0.0)
    flops = 2.0 * 2 * 3 * 16 * 16 * 8  # causal: half of 4 b h L^2 hd
    op = ops.attention_forward(ops.BlockShape(b=2, L=16, d=24, heads=3))[0]
    assert fwd == flops == op.flops
    assert bwd == 2.5 * flops == ops.attention_backward(ops.BlockShape(b=2, L=16, d=24, heads=3))[0].flops
    assert backend == "flash (CPU)"


def test_attention_is_measured_and_its_backend_named():
    fwd, bwd, backend = gpu.measure_attention((1, 2, 32, 16), "bf16", CPU, 0.005)
    assert finite_positive(fwd, bwd) and backend == "flash (CPU)"
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, 2, 8, 4, requires_grad=True)
    with sdpa_kernel([SDPBackend.MATH]):
        assert gpu.sdpa_backend(torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)) == "math"


def test_memory_bound_bytes_as_ops_counts_them(one_second):
    bw = gpu.measure_memory_bound(SHAPE, 64, "bf16", CPU, 0.0)
    by = {op.name: op.bytes for op in ops.memory_forward(SHAPE) + ops.memory_backward(SHAPE)}
    # forward and backward: 2 s each
    assert bw["norm"] == (by["ln1"] + by["ln1.bwd"]) / 2
    assert bw["gelu"] == (by["gelu"] + by["gelu.bwd"]) / 2
    assert bw["softmax"] == 24.0 * SHAPE.tokens * (64 // 2) / 2
    # as the model runs them under bf16 autocast: the norm reads the fp32 residual stream, GELU the bf16
    # activation of one tensor-parallel rank, the loss the bf16 logits of its vocabulary slice
    norm_out, _, gelu_out, _, loss, _, add, cast, (pack,), sums = one_second
    assert norm_out.dtype == torch.float32 and norm_out.shape == (SHAPE.tokens, SHAPE.d)
    assert gelu_out.dtype == torch.bfloat16 and gelu_out.shape == (SHAPE.tokens, 4 * SHAPE.d // 2)
    assert loss.dim() == 0
    # foldtrain's own block: the casting kernels (1 s each), the qkv gradient's pack, the bias gradients
    amp = dataclasses.replace(SHAPE, native=True, autocast=True)
    by = {op.name: op.bytes for op in ops.memory_forward(amp) + ops.memory_backward(amp)}
    assert bw["cast"] == (by["residual1"] + by["ln1.cast.bwd"]) / 2
    assert add.dtype == cast.dtype == torch.float32 and add.shape == (SHAPE.tokens, SHAPE.d)
    assert bw["pack"] == by["qkv.grad_pack"] and pack.shape == (SHAPE.b, SHAPE.L, 3 * SHAPE.d // 2)
    assert bw["reduce"] == by["bias.grad"] and [g.shape[0] for g in sums] == [3 * 32 // 2, 32, 4 * 32 // 2, 32]


def test_memory_bound_streams_launch_block_and_overhead_are_measured():
    bw = gpu.measure_memory_bound(SHAPE, 64, "fp32", CPU, 0.005)
    assert finite_positive(*bw.values()) and set(bw) == set(KIND_BANDWIDTH)
    st = gpu.measure_streams(1 << 20, CPU, 0.005)
    assert finite_positive(*st.values()) and set(st) == {"mem_bw", "elem", "adamw"}
    launch = gpu.measure_launch(CPU)
    assert finite_positive(launch) and launch < 1e-3
    fwd, bwd = gpu.measure_block(SHAPE, "fp32", CPU, 0.005)
    assert finite_positive(fwd, bwd) and 0.3 < bwd / fwd < 20
    overhead, tiny = gpu.measure_block_overhead(CPU, launch, 0.005)
    assert finite_positive(overhead, tiny) and overhead < tiny
    mem = gpu.memory_overhead(SHAPE, 64, "fp32", CPU)
    assert finite_positive(mem["runtime"], mem["total"]) and mem["runtime"] < mem["total"]


def test_fits_recover_their_curves():
    peak = 100e12
    dims = [256, 512, 768, 1024, 4096]
    eff, half = gpu.fit_gemm_curve(dims, [peak * 0.8 * n / (n + 300) for n in dims], peak)
    assert eff == pytest.approx(0.8) and half == pytest.approx(300)
    # never above the peak: a device rated below what it measured
    assert gpu.fit_gemm_curve(dims, [2 * peak] * len(dims), peak)[0] == 1.0
    seqs = [256, 512, 1024]
    fwd = [peak * 0.6 * L / (L + 200) for L in seqs]
    bwd = [peak * 0.45 * L / (L + 200) for L in seqs]
    assert gpu.fit_attention(seqs, fwd, bwd, peak) == pytest.approx((0.6, 0.45, 200))
    assert gpu.fit_attention([1024], [peak / 2], [peak / 4], peak) == (0.5, 0.25, 0.0)


def test_fsdp_host_fit_recovers_the_block_the_root_and_the_gather():
    """Chunks of 1 and 4 blocks: the excess per pass is root + blocks x unit kept gathered, and gather more per
    block resharded; the fit returns each as measured, the root not spread over the blocks."""
    unit, root, gather = 0.4e-3, 1.5e-3, 0.6e-3
    times = []
    for n in fsdp.BLOCKS:
        plain = 0.01 * n
        kept = plain + 2 * (root + n * unit)  # forward and backward
        times.append((plain, kept, kept + n * gather))
    fit = fsdp.fit_fsdp_host(times)
    assert fit == pytest.approx({"fsdp_unit": unit, "fsdp_root": root, "fsdp_gather": gather})
    assert set(fit) == set(fsdp.FIELDS)


def _err(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("foldtrain: error: ") and err.count("\n") == 1
    return err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
def test_device_cuda_without_a_gpu_is_one_line(capsys):
    err = _err(capsys, ["calibrate", "--device", "cuda", "--out", "/tmp/never.toml"])
    assert "no CUDA device is visible" in err and "--device cpu" in err


def test_bad_kernel_options_are_one_line(capsys, monkeypatch):
    k = ["calibrate", "--device", "cpu", "--probes", "kernels", "--out", "/tmp/never.toml"]
    assert "does not divide gpt2-small's 12 heads" in _err(capsys, [*k, "--tp", "5"])
    assert "give fp32, bf16 or fp16" in _err(capsys, [*k, "--precision", "fp8"])
    assert "unknown model preset" in _err(capsys, [*k, "--preset", "gpt9"])
    assert "whole numbers >= 1" in _err(capsys, [*k, "--micro_batch", "0"])
    assert "--links" in _err(capsys, [*k, "--links", "nowhere"])
    assert "--network" in _err(capsys, [*k, "--network", "1gbit"])
    assert "drop --probes" in _err(capsys, ["calibrate", "--device", "cuda", "--probes", "fitted", "--out", "x"])
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert "does not divide the 4 ranks" in _err(capsys, [*k, "--ranks_per_node", "3"])
    assert "--ranks_per_node 0" in _err(capsys, [*k, "--ranks_per_node", "0"])
