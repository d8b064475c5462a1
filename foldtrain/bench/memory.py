"""Memory of a pipeline rank: peak RSS per rank at the first step against the analytic state it owns.

Every rank of a 3D run builds the model on the meta device and materialises only its own chunks,
so its memory is its share of parameters, gradients and AdamW's two moments (16 bytes per fp32
parameter) plus what any process of this kind holds anyway. That baseline is measured in the same
invocation: the same launch with the model cut down to one block per rank and a tiny vocabulary.

    foldtrain bench memory [--preset gpt2-medium] [--pp 8] [--vocab 8192]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

BYTES_PER_PARAM = 16  # fp32 parameter + gradient + AdamW exp_avg + exp_avg_sq


def per_rank_params(n_layer: int, d_model: int, n_head: int, context: int, vocab: int, pp: int) -> list[int]:
    """Parameters each pipeline rank holds (V = 1, even split; the last rank's tied copy counted)."""
    import torch

    from foldtrain.model import GPT, GPTShape
    from foldtrain.parallel.pipeline.stage import part_ranges
    from foldtrain.schedules.layout import chunk_layers

    with torch.device("meta"):
        model = GPT(GPTShape(n_layer, n_head, d_model, context, vocab))
    ranges = part_ranges(n_layer, chunk_layers(n_layer, pp))
    out = []
    for p, parts in enumerate(ranges):
        n = sum(q.numel() for i in parts for q in model.parts[i].parameters())
        if p == pp - 1 and pp > 1:
            n += model.embedding.wte.weight.numel()  # its own copy of the tied output projection
        out.append(n)
    return out


def launch(pp: int, model_args: list[str], out: Path) -> list[float]:
    """One ``foldtrain train`` step on ``pp`` pipeline ranks; every rank's peak RSS (MB)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(pp),
        "-m",
        "foldtrain",
        "train",
        *model_args,
        "--parallel.pp",
        str(pp),
        "--parallel.schedule",
        "1f1b",
        "--train.steps",
        "1",
        "--train.global_batch",
        str(pp),
        "--train.seq_len",
        "32",
        "--train.eval_batches",
        "1",
        "--train.sample_tokens",
        "0",
        "--train.progress",
        "false",
        "--checkpoint.every",
        "0",
        "--checkpoint.safetensors",
        "false",
        "--out",
        str(out),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"foldtrain bench memory: the run failed:\n{r.stderr[-3000:]}")
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    return record["peak_mem_mb_ranks"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="foldtrain bench memory", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--preset", default="gpt2-medium")
    ap.add_argument("--pp", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    a = ap.parse_args(argv)
    from foldtrain.config import build_config

    m = build_config(["--model.preset", a.preset, "--model.vocab_size", str(a.vocab)]).model
    root = Path(tempfile.mkdtemp(prefix="ft-mem-"))
    base_args = [
        "--model.preset",
        a.preset,
        "--model.n_layer",
        str(a.pp),
        "--model.d_model",
        "64",
        "--model.n_head",
        "4",
        "--model.vocab_size",
        "512",
        "--data.vocab_size",
        "512",
    ]
    baseline = launch(a.pp, base_args, root / "baseline")
    full = launch(a.pp, ["--model.preset", a.preset, "--model.vocab_size", str(a.vocab)], root / "model")
    params = per_rank_params(m.n_layer, m.d_model, m.n_head, m.context, m.vocab_size, a.pp)
    print(f"{a.preset} (vocab {m.vocab_size}) on {a.pp} pipeline ranks, peak RSS at the first step (MB)")
    print(f"{'rank':>4} {'params':>12} {'state MB':>9} {'baseline':>9} {'measured':>9} {'ratio':>6}")
    worst = 0.0
    for p in range(a.pp):
        state = params[p] * BYTES_PER_PARAM / 2**20
        ratio = full[p] / (1.25 * state + baseline[p])
        worst = max(worst, ratio)
        measured_over_state = full[p] / (state + baseline[p])
        print(f"{p:>4} {params[p]:>12,} {state:>9.0f} {baseline[p]:>9.0f} {full[p]:>9.0f} {measured_over_state:>6.2f}")
    print(f"largest measured / (1.25 x state + baseline) = {worst:.2f} (target <= 1)")
    whole = sum(params) * BYTES_PER_PARAM / 2**20
    print(f"(the whole model's state would be {whole:.0f} MB on every rank if each built it all)")
    return 0
