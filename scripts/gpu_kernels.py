"""The kernels of a block and of a training step, as the device runs them (torch.profiler): what the simulator's
per-operation model (foldtrain/sim/ops.py) is held against, kernel by kernel.

    PYTHONPATH=. python scripts/gpu_kernels.py OUT.md [--block gpt2-medium:32] [--step gpt2-small:64]

On a GPU it times CUDA kernels; without one, CPU operators (a dry run of the same code).
"""

from __future__ import annotations

import argparse
import collections
import time

import torch
from torch.profiler import ProfilerActivity, profile

from foldtrain.model.gpt import Block, GPTShape
from foldtrain.model.presets import PRESETS


def kernel_table(prof, cuda: bool) -> list[tuple[str, int, float]]:
    """(name, calls, total µs) of every device kernel (CPU: every leaf operator), longest first."""
    totals: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if cuda:
            if e.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = e.time_range.elapsed_us()  # a kernel's own span on the device
        else:
            if e.cpu_children:
                continue
            us = e.self_cpu_time_total
        t = totals[e.name[:110]]
        t[0] += 1
        t[1] += us
    return sorted(((n, c, us) for n, (c, us) in totals.items()), key=lambda r: -r[2])


def lines_of(title: str, rows, wall_us: float | None = None, top: int = 45) -> list[str]:
    busy = sum(us for _, _, us in rows)
    out = [f"## {title}", "", f"kernels: {sum(c for _, c, _ in rows)}, device busy {busy / 1e3:.3f} ms"]
    if wall_us:
        out[-1] += f", wall {wall_us / 1e3:.3f} ms"
    out += ["", "| kernel | calls | total ms | share |", "|---|---|---|---|"]
    out += [f"| `{n}` | {c} | {us / 1e3:.3f} | {us / busy:.1%} |" for n, c, us in rows[:top]]
    return out + [""]


def profile_block(preset: str, b: int, L: int, device, cuda: bool) -> list[str]:
    p = PRESETS[preset]
    blk = Block(GPTShape(1, p["n_head"], p["d_model"], L, 16)).to(device)
    x = torch.randn(b, L, p["d_model"], device=device, requires_grad=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    out = []
    for _ in range(3):  # warm-up
        with torch.autocast(device.type, dtype=torch.bfloat16):
            y = blk(x)
        y.backward(torch.ones_like(y))
    for label in ("forward", "backward"):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            y = blk(x) if label == "backward" else None
        g = torch.randn_like(y) if y is not None else None
        if cuda:
            torch.cuda.synchronize()
        with profile(activities=acts) as prof:
            if label == "forward":
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    y = blk(x)
            else:
                y.backward(g)
            if cuda:
                torch.cuda.synchronize()
        out += lines_of(f"{preset} block {label}, b {b} L {L}, bf16 autocast", kernel_table(prof, cuda))
    return out


def profile_step(preset: str, b: int, L: int, device, cuda: bool) -> list[str]:
    """foldtrain's engine, one step of ``preset`` at micro-batch ``b`` on random tokens (after warm-up)."""
    from foldtrain.config import build_config
    from foldtrain.distributed import DistEnv
    from foldtrain.engine import build_engine
    from foldtrain.train.trainer import build_model

    cfg = build_config(
        ["--model.preset", preset, "--precision", "bf16", "--train.global_batch", str(b)]
        + ["--train.micro_batch", str(b), "--train.seq_len", str(L), "--train.device", device.type]
    )
    engine = build_engine(cfg, build_model(cfg), DistEnv(0, 1, 0, device), b)
    V = cfg.model.vocab_size
    xs = [torch.randint(0, V, (b, L)) for _ in range(2)]
    for _ in range(3):
        engine.train_step(xs[0], xs[1])
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        engine.train_step(xs[0], xs[1])
        wall = (time.perf_counter() - t0) * 1e6
    return lines_of(
        f"{preset} training step (foldtrain's engine), micro-batch {b} x {L}, bf16", kernel_table(prof, cuda), wall, 60
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--block", default="gpt2-medium:32")
    ap.add_argument("--step", default="gpt2-small:64")
    ap.add_argument("--seq", type=int, default=1024)
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    name = torch.cuda.get_device_name() if cuda else "CPU (dry run)"
    lines = [f"# Kernels on {name}, torch {torch.__version__}", ""]
    for spec, fn in ((a.block, profile_block), (a.step, profile_step)):
        for one in spec.split(","):
            preset, b = one.split(":")
            lines += fn(preset, int(b), a.seq, device, cuda)
            with open(a.out, "w") as f:
                f.write("\n".join(lines) + "\n")
    print("\n".join(lines[:60]))


if __name__ == "__main__":
    main()
