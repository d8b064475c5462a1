"""docs/validation-gpu.md: the published runs, the conversions of their metrics, and the doc being current."""

from __future__ import annotations

from pathlib import Path

import pytest

from foldtrain.sim import ops
from foldtrain.sim.costs import CostModel
from foldtrain.sim.validation import gpu

DOC = Path(__file__).resolve().parents[2] / "docs" / "validation-gpu.md"
approx = pytest.approx


def _run(**over) -> dict:
    run = {"id": "t", "n_layer": 2, "d_model": 64, "seq": 128, "vocab": 1000, "gpus": 4, "global_batch": 8}
    return run | over


def test_flop_counts_follow_their_sources_formulas():
    """Narayanan et al.'s count (with a full recomputation) is 4/3 of Korthikanti et al.'s model FLOPs but for
    the logit term, whose backward they count the same; 6n and palm from the parameters."""
    run = _run()
    n, h, s, v = 2, 64, 128, 1000
    assert gpu.flops_per_token(run, "megatron") == approx(96 * n * h * h * (1 + s / (6 * h) + v / (16 * n * h)))
    assert gpu.flops_per_token(run, "megatron-mfu") == approx(72 * n * h * h * (1 + s / (6 * h) + v / (12 * n * h)))
    params = n * (12 * h * h + 13 * h) + v * h + s * h
    assert gpu.flops_per_token(run, "palm") - gpu.flops_per_token(run, "6n") == approx(12 * n * h * s)
    assert gpu.flops_per_token(run, "6n") == approx(6 * params)


def test_published_metrics_convert_to_tokens_per_second_per_gpu():
    it = _run(metric="iteration_s", value=2.0)
    assert gpu.published_tokens_per_gpu(it) == approx(8 * 128 / 2.0 / 4)
    tf = _run(metric="model_tflops_per_gpu", value=100.0, flops_formula="6n")
    assert gpu.published_tokens_per_gpu(tf) == approx(100e12 / gpu.flops_per_token(tf, "6n"))
    assert gpu.published_tokens_per_gpu(_run(metric="tokens_per_s", value=400.0)) == approx(100.0)


def test_the_published_runs_are_complete_cited_and_not_the_held_out_table():
    runs = gpu.load_runs()
    assert len(runs) >= 8
    assert len({r["id"] for r in runs}) == len(runs)
    for r in runs:
        assert r["source"] and r["url"] and r["quote"], r["id"]
        assert r["dp"] * r["pp"] * r["tp"] == r["gpus"], r["id"]
        assert "Using Megatron-LM" not in r["source"], r["id"]  # Narayanan et al. (SC'21): the held-out check
        assert gpu.published_tokens_per_gpu(r) > 0


def test_the_doc_holds_the_current_predictions():
    """The table in docs/validation-gpu.md is what the generator gives now (regenerate it with the command the
    doc names when the model or the presets change)."""
    rows = gpu.evaluate(gpu.load_runs())
    fresh = [line for line in gpu.table(rows) if line.startswith("| [")]
    doc = [line for line in DOC.read_text().splitlines() if line.startswith("| [")]
    assert doc == fresh


def test_runs_are_simulated_with_their_published_precision_and_attention_kernel():
    """LLM Foundry's "amp_bf16 | DEFAULT" runs autocast over fp32 parameters, gathered in fp32 (foldtrain's fsdp
    under bf16, no masters); "bf16 | PURE" gathers half weights (bf16-master). MPT's Triton attention runs at
    ATTENTION_SPEED of the preset's FlashAttention-2 figures: the attention's time doubles, nothing else moves."""
    runs = {r["id"]: r for r in gpu.load_runs()}
    default, pure = runs["mpt-7b-a100-80gb-8gpu"], runs["mpt-7b-a100-40gb-128gpu-ac"]
    assert default["fsdp_mixed_precision"] == "DEFAULT" and "amp_bf16 | DEFAULT" in default["quote"]
    assert pure["fsdp_mixed_precision"] == "PURE" and "bf16 | PURE" in pure["quote"]

    def precision(run):
        args = gpu.run_args(run)
        return args[args.index("--precision") + 1]

    assert precision(default) == "bf16" and gpu.autocast(default)
    assert precision(pure) == "bf16-master" and not gpu.autocast(pure)
    assert default["attention"] == "triton" and gpu.ATTENTION_SPEED["triton"] == 0.5
    triton = gpu.predict(default)
    flash = gpu.predict(default | {"attention": "flash"})
    assert triton.step_time > flash.step_time
    slow, fast = CostModel(triton.setup, triton.cluster), CostModel(flash.setup, flash.cluster)
    att = [op for op in ops.block_forward(slow.priced) + ops.block_backward(slow.priced) if op.kind == "attention"]
    for op in att:
        kernel = slow.c.kernel_time
        assert slow.op_time(op) - kernel == approx(2 * (fast.op_time(op) - kernel))
