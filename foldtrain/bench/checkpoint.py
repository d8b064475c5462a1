"""``foldtrain bench checkpoint``: how long a save stalls training, with and without ``--checkpoint.async``.

One process trains a GPT (real forward, backward and AdamW step) for ``--steps`` steps three ways, alternated
in each of ``--repeat`` rounds: without saves, saving every ``--every`` steps synchronously (foldtrain's
:class:`~foldtrain.checkpoint.CheckpointManager`, checksums included), and saving in the background (DCP
``async_save``, the same manager). The stall per save is a mode's loop time minus the loop without saves,
divided by its saves, each pending save completed before the loop's clock stops; the blocking part is the
median time inside ``save()`` itself (staging to host memory for the background mode).

    OMP_NUM_THREADS=2 foldtrain bench checkpoint --repeat 3
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from foldtrain.checkpoint import CheckpointManager
from foldtrain.model import GPT, GPTShape

MODES = ("none", "sync", "async")


def build(n_layer: int, d_model: int):
    torch.manual_seed(0)
    model = GPT(GPTShape(n_layer=n_layer, n_head=max(1, d_model // 64), d_model=d_model, context=64, vocab_size=8192))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def step(model, opt, x) -> None:
    logits = model(x)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def run(mode: str, model, opt, root: Path, steps: int, every: int) -> tuple[float, list[float]]:
    """The loop's wall time and the time each save() call blocked."""
    shutil.rmtree(root, ignore_errors=True)
    ckpt = CheckpointManager(root, keep=2)
    x = torch.randint(0, 8192, (2, 64))
    blocked = []
    t0 = time.perf_counter()
    for s in range(1, steps + 1):
        step(model, opt, x)
        if mode != "none" and s % every == 0:
            state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
            t = time.perf_counter()
            ckpt.save(s, state, {"data_step": s}, background=mode == "async")
            blocked.append(time.perf_counter() - t)
    ckpt.wait()
    return time.perf_counter() - t0, blocked


def checkpoint_bytes(root: Path) -> int:
    latest = CheckpointManager(root).latest()
    return sum(p.stat().st_size for p in latest.iterdir()) if latest else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="foldtrain bench checkpoint", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--n_layer", type=int, default=12)
    ap.add_argument("--d_model", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where checkpoints are written (default: a temporary directory)")
    a = ap.parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    root = Path(a.dir or tempfile.mkdtemp(prefix="ft-bench-ckpt-"))
    model, opt = build(a.n_layer, a.d_model)
    step(model, opt, torch.randint(0, 8192, (2, 64)))  # warm-up; the optimizer state exists from here on
    loops: dict[str, list[float]] = {m: [] for m in MODES}
    blocked: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(a.repeat):
        for mode in MODES:
            wall, b = run(mode, model, opt, root / mode, a.steps, a.every)
            loops[mode].append(wall)
            blocked[mode] += b
    size = checkpoint_bytes(root / "sync")
    saves = a.steps // a.every
    params = sum(p.numel() for p in model.parameters())
    base = statistics.median(loops["none"])
    print(f"# {params / 1e6:.0f}M parameters, checkpoint {size / 2**30:.2f} GiB, {saves} saves in {a.steps} steps")
    print("| mode | loop s (median) | stall per save s | save() blocks s (median) |")
    print("|---|---|---|---|")
    stall = {m: (statistics.median(loops[m]) - base) / saves if m != "none" else 0.0 for m in MODES}
    for mode in MODES:
        block = statistics.median(blocked[mode]) if blocked[mode] else 0.0
        print(f"| {mode} | {statistics.median(loops[mode]):.2f} | {stall[mode]:.2f} | {block:.2f} |")
    if stall["sync"] > 0:
        print(f"async stall / sync stall: {stall['async'] / stall['sync']:.2f}")
    if a.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0
