"""foldtrain's single-process trainer vs a minimal plain-PyTorch loop: tokens/s and overhead.

Both train the same model (same init), on the same batches of the same prepared data, with the
same AdamW, LR schedule and clipping, for the same number of steps. The trainer is the real
`foldtrain train` loop (progress bar, metrics.jsonl, logging); its per-step time comes from its
metrics.jsonl, the plain loop times itself the same way. Repetitions alternate A/B so machine
noise hits both; the median step time over all repetitions (after warm-up) gives tokens/s.

    foldtrain bench overhead [--reps 3] [--steps 40] [--warmup 5] [--preset tiny]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from foldtrain.config import build_config
from foldtrain.data import SequenceSampler, TokenData, resolve_data
from foldtrain.model import GPT, GPTShape
from foldtrain.optim import WarmupCosine
from foldtrain.train.trainer import train


def plain_loop(cfg, data: TokenData, steps: int) -> list[float]:
    """The minimal loop anyone would write: no logging, no checkpoints, no abstractions."""
    torch.manual_seed(cfg.train.seed)
    model = GPT(GPTShape.from_config(cfg.model), cfg.train.seed)
    o = cfg.optim
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=o.lr,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
        foreach=True,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, WarmupCosine(o.lr, o.min_lr, o.warmup_steps, cfg.train.steps))
    sampler = SequenceSampler(data.split("train"), cfg.train.seq_len, cfg.train.seed)
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        x, y = sampler.global_batch(step, cfg.train.global_batch)
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip, foreach=True)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        times.append(time.perf_counter() - t0)
    return times


def foldtrain_loop(args, steps: int, out: Path) -> list[float]:
    cfg = build_config(
        [
            "--model.preset",
            args.preset,
            "--train.steps",
            str(steps),
            "--train.global_batch",
            str(args.batch),
            "--train.seq_len",
            str(args.seq_len),
            "--train.eval_every",
            "0",
            "--train.sample_tokens",
            "0",
            "--checkpoint.every",
            "0",
            "--checkpoint.safetensors",
            "false",
            "--out",
            str(out),
        ]
    )
    train(cfg)
    return [json.loads(line)["step_time_s"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="foldtrain bench overhead", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq_len", type=int, default=128)
    args = ap.parse_args(argv)
    cfg = build_config(
        [
            "--model.preset",
            args.preset,
            "--train.steps",
            str(args.steps),
            "--train.global_batch",
            str(args.batch),
            "--train.seq_len",
            str(args.seq_len),
        ]
    )
    data = TokenData.open(resolve_data(cfg.data))
    tokens = args.batch * args.seq_len
    ft, plain = [], []
    root = Path(tempfile.mkdtemp(prefix="ft-bench-"))
    try:
        for rep in range(args.reps):
            p = plain_loop(cfg, data, args.steps)[args.warmup :]
            f = foldtrain_loop(args, args.steps, root / f"rep{rep}")[args.warmup :]
            plain += p
            ft += f
            plain_tps, foldtrain_tps = tokens / statistics.median(p), tokens / statistics.median(f)
            print(f"rep {rep}: plain {plain_tps:8.0f} tok/s   foldtrain {foldtrain_tps:8.0f} tok/s", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    tp, tf = tokens / statistics.median(plain), tokens / statistics.median(ft)
    print(
        f"\nmodel {args.preset}, batch {args.batch}x{args.seq_len}, {args.reps} reps x {args.steps} steps "
        f"(first {args.warmup} dropped), torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(f"plain PyTorch loop : {tp:9.0f} tokens/s")
    print(f"foldtrain trainer  : {tf:9.0f} tokens/s")
    print(f"ratio foldtrain/plain = {tf / tp:.3f}  (overhead {100 * (1 - tf / tp):+.1f}%, target <= 3%)")
    return 0
