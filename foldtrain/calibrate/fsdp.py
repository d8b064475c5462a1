"""FSDP2's own host work (``device.fsdp_unit_us``, ``device.fsdp_root_us``, ``device.fsdp_gather_us``), timed in
processes of one rank.

``fully_shard`` puts hooks around every unit's forward and backward, and a gathering unit copies its shard into
the all-gather's input, the output into its unsharded parameters, and frees them again when it reshards. On
shared cores (gloo) that runs on the training thread, beside the collectives themselves, which the simulator
prices from the links. Here a chunk of tiny blocks, sharded as the 3D engine shards a pipeline chunk
(:func:`foldtrain.parallel.pipeline.fsdp.shard_chunk`, the backwards accumulating unsharded gradients and the
blocks kept gathered after them, as between a chunk's first backward and its ``LR``) over a one-rank mesh (its
collectives copy and return), runs forward and backward beside the same chunk unsharded:

* blocks kept gathered (``reshard_after_forward false``): the hooks of every pass, a line over chunks of 1, 2
  and 4 blocks: per block (a unit with parameters), and per pass for the chunk's own unit, the root, whose
  hooks also begin and end the pass (its own, holding no parameters here: a root that holds some runs a unit's
  hooks for them too, as the simulator prices it);
* resharded after each forward: one all-gather and one reshard more per block and iteration.

The three run in turn, round after round, and each keeps its median: this VM's speed drifts by tens of percent
within a minute, which timing them one after the other would read as FSDP's work.
"""

from __future__ import annotations

import os
import tempfile

BLOCKS = (1, 2, 4)  # blocks per chunk: the points of the per-unit line


def _chunk(n_blocks: int):
    import torch.nn as nn

    from foldtrain.model.gpt import Block, GPTShape

    class Chunk(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block(GPTShape(1, 2, 16, 8, 16)) for _ in range(n_blocks))

        def body(self, h):
            for b in self.blocks:
                h = b(h)
            return h

        def forward(self, h):
            return self.body(h)

    return Chunk()


ROUNDS = 9  # rounds of the three variants in turn: a drift of the machine's speed shifts them alike


def _pass_times(mesh, n_blocks: int) -> tuple[float, float, float]:
    """Forward + backward of an ``n_blocks`` chunk: unsharded, sharded and kept gathered, sharded and resharded
    after each forward; seconds each, the median over :data:`ROUNDS` rounds that time the three in turn."""
    import statistics

    import torch

    from foldtrain.optim.precision import Precision
    from foldtrain.parallel.pipeline.fsdp import shard_chunk

    from .compute import _time

    h = torch.randn(1, 4, 16, requires_grad=True)
    passes = []
    for shard, reshard in ((False, False), (True, False), (True, True)):
        chunk = _chunk(n_blocks)
        if shard:
            shard_chunk(chunk, mesh, reshard, Precision("fp32", torch.device("cpu")))
            chunk.set_is_last_backward(False)  # as the engine between a chunk's first backward and its LR
            chunk.set_reshard_after_backward(False)
            chunk.set_requires_gradient_sync(False)
        passes.append(lambda chunk=chunk: chunk(h).sum().backward())
    rounds = [[_time(fn, min_s=0.05, reps=1) for fn in passes] for _ in range(ROUNDS)]
    plain, kept, resharded = (statistics.median(r[i] for r in rounds) for i in range(3))
    return plain, kept, resharded


def _fsdp_probe(barrier, queue) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    path = tempfile.mktemp(prefix="ft-cal-fsdp-")
    try:
        dist.init_process_group("gloo", store=dist.FileStore(path, 1), rank=0, world_size=1)
        mesh = init_device_mesh("cpu", (1,))
        _pass_times(mesh, 1)  # warm up
        barrier.wait()
        queue.put([_pass_times(mesh, n) for n in BLOCKS])
        dist.destroy_process_group()
    finally:
        if os.path.exists(path):
            os.remove(path)


FIELDS = ("fsdp_unit", "fsdp_root", "fsdp_gather")  # the Cluster's fields, in the order fit_fsdp_host returns them


def fit_fsdp_host(times: list[tuple[float, float, float]]) -> dict[str, float]:
    """The :data:`FIELDS` (seconds) from the :data:`BLOCKS` chunks' times ``(unsharded, kept gathered,
    resharded)``: the kept chunks' excess per pass is a line over the block count (least squares), its slope the
    hooks per block (``fsdp_unit``), its intercept those of the chunk's own unit, the root of every pass
    (``fsdp_root``); the resharded chunks' excess over the kept ones per block is the gather's (``fsdp_gather``)."""
    n = list(BLOCKS)
    excess = [(k - p) / 2 for p, k, _ in times]  # per pass: a forward and a backward
    n_mean, e_mean = sum(n) / len(n), sum(excess) / len(excess)
    slope = sum((x - n_mean) * (e - e_mean) for x, e in zip(n, excess, strict=True)) / sum((x - n_mean) ** 2 for x in n)
    slope = max(0.0, slope)
    root = max(0.0, e_mean - slope * n_mean)
    gather = max(0.0, sum((r - k) / x for x, (_, k, r) in zip(n, times, strict=True)) / len(n))
    return dict(zip(FIELDS, (slope, root, gather), strict=True))


def measure_fsdp_host(concurrency: int) -> dict[str, float]:
    """:func:`fit_fsdp_host` of the mean times of ``concurrency`` processes probing at once."""
    from .compute import _concurrently

    res = _concurrently(_fsdp_probe, concurrency)
    mean = [tuple(sum(r[i][j] for r in res) / len(res) for j in range(3)) for i in range(len(BLOCKS))]
    return fit_fsdp_host(mean)
