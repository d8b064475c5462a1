"""Cost of checkpoint checksums next to the save itself.

For each model shape: build the model and an AdamW state (one step), then per repetition
time (a) the save as foldtrain does it without checksums — DCP save of model + optimizer into a
fresh directory plus the per-rank file — and (b) hashing every file of that directory with xxh3-128
(what the save adds, and what a load verifies), sha256, crc32 and blake2b, on the same files in
the same invocation. Prints per-repetition times and the median ratios hash / save.

    OMP_NUM_THREADS=1 foldtrain bench hashing --reps 3
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import statistics
import tempfile
import time
import warnings
import zlib
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from foldtrain.checkpoint.integrity import describe, file_digest
from foldtrain.checkpoint.safe_load import save_rank_state
from foldtrain.model import GPT, GPTShape

SHAPES = {
    "tiny": dict(n_layer=4, d_model=96, n_head=4, context=256, vocab_size=8192),
    "gpt2-small": dict(n_layer=12, d_model=768, n_head=12, context=1024, vocab_size=50257),
}


def other_hash(directory: Path, kind: str) -> None:
    buf = bytearray(8 << 20)
    view = memoryview(buf)
    for p in sorted(directory.iterdir()):
        h = hashlib.blake2b() if kind == "blake2b" else None
        crc = 0
        with open(p, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                if h is not None:
                    h.update(view[:n])
                else:
                    crc = zlib.crc32(view[:n], crc)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="foldtrain bench hashing", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--shapes", default="tiny,gpt2-small")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    root = Path(args.dir or tempfile.mkdtemp(prefix="ckpt-hash-"))
    for name in args.shapes.split(","):
        torch.manual_seed(0)
        model = GPT(GPTShape(**SHAPES[name], dropout=0.0))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        opt.step()
        state = {
            "model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, opt),
            "lr_scheduler": {"last_epoch": 1},
        }
        rows = []
        for rep in range(args.reps):
            d = root / f"{name}_{rep}"
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
            t0 = time.perf_counter()
            dcp.save(state, checkpoint_id=str(d), no_dist=True)
            save_rank_state(d / "rank0.pt", {})
            t_save = time.perf_counter() - t0
            t0 = time.perf_counter()
            describe(d, [p.name for p in d.iterdir()])  # xxh3-128, exactly as a save does
            t_xxh = time.perf_counter() - t0
            t0 = time.perf_counter()
            for p in d.iterdir():
                file_digest(p, "sha256")
            t_sha = time.perf_counter() - t0
            t0 = time.perf_counter()
            other_hash(d, "crc32")
            t_crc = time.perf_counter() - t0
            t0 = time.perf_counter()
            other_hash(d, "blake2b")
            t_b2 = time.perf_counter() - t0
            size = sum(p.stat().st_size for p in d.iterdir())
            rows.append((t_save, t_xxh, t_sha, t_crc, t_b2))
            print(
                f"{name} rep {rep}: {size / 2**20:8.1f} MiB  save {t_save:7.3f} s  xxh3_128 {t_xxh:6.3f} s  "
                f"sha256 {t_sha:6.3f} s  crc32 {t_crc:6.3f} s  blake2b {t_b2:6.3f} s",
                flush=True,
            )
            shutil.rmtree(d)
        med = [statistics.median(c) for c in zip(*rows)]
        print(
            f"{name}: median save {med[0]:.3f} s; xxh3_128 {med[1]:.3f} s = {med[1] / med[0]:.1%} of the save "
            f"({size / 2**30 / med[1]:.2f} GiB/s); sha256 {med[2] / med[0]:.1%}; crc32 {med[3] / med[0]:.1%}; "
            f"blake2b {med[4] / med[0]:.1%}",
            flush=True,
        )
    shutil.rmtree(root, ignore_errors=True)
    return 0
