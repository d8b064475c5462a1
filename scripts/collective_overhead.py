"""What one collective costs beyond its bytes: the same 16 MiB through ``all_to_all_single`` (the
reduce-scatter ``sharded-ps`` runs on gloo) in 1, 4, 16 and 64 pieces, two in flight at a time
like ``sharded-ps``' slices. Prints, per split, the median time over the repetitions and the fixed
cost per collective against the one-piece run (docs/benchmarks.md, "ZeRO-2 on loopback").

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 4 scripts/collective_overhead.py [--mib 16] [--reps 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

IN_FLIGHT = 2


def timed(total_mib: float, pieces: int, reps: int, world: int) -> float:
    """Median seconds to move ``total_mib`` through ``pieces`` all-to-alls (all ranks start together)."""
    n = int(total_mib * 2**20 / 4 / pieces) // world * world
    send, recv = torch.randn(n), torch.empty(n)
    times = []
    for _ in range(reps + 1):  # the first one warms the connections up
        dist.barrier()
        t = time.perf_counter()
        works = []
        for _ in range(pieces):
            works.append(dist.all_to_all_single(recv, send, async_op=True))
            if len(works) > IN_FLIGHT:
                works.pop(0).wait()
        for w in works:
            w.wait()
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=float, default=16.0)
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    one = timed(a.mib, 1, a.reps, world)
    if rank == 0:
        print(f"{world} ranks, gloo, {a.mib:g} MiB in all")
        print(f"{'pieces':>6} {'MiB each':>9} {'total ms':>9} {'fixed ms per collective':>24}")
    for pieces in (1, 4, 16, 64):
        t = one if pieces == 1 else timed(a.mib, pieces, a.reps, world)
        if rank == 0:
            extra = "" if pieces == 1 else f"{(t - one) / (pieces - 1) * 1e3:.2f}"
            print(f"{pieces:>6} {a.mib / pieces:>9.2f} {t * 1e3:>9.1f} {extra:>24}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
