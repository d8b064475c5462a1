"""The distributed optimizer's checkpoint without gathering: each rank saves, and loads, only what it owns.

A rank's slice of a chunk's bucket cuts its parameters at arbitrary elements. Each segment (the elements
``start:end`` of one parameter's flattened local part) is cut into at most three rectangles of the parameter's
full shape (a partial first row, whole rows, a partial last row) and given to DCP as the local shards of a
``ShardedTensor`` under the single-process name and shape (the parameter's global offset added where tensor
parallelism splits it). DCP writes each rank's rectangles, keeps one of identical ones (the tied copies at the two
ends of the pipeline, a parameter replicated over the TP ranks), and on load reads into each rank's rectangles
whatever checkpoint layout holds them, so a checkpoint of any layout loads here and this one loads anywhere,
while no rank ever holds more than its own slices. The rectangles' tensors are views into the live state (AdamW's
moments, the fp32 masters), so a load writes straight into it.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from foldtrain.parallel.pipeline.zero import ensure_state

STATE_KEYS = ("exp_avg", "exp_avg_sq")


def rectangles(start: int, end: int, shape: tuple[int, ...]) -> list[tuple[tuple, tuple, int, int]]:
    """The flat range ``start:end`` of a row-major tensor of ``shape`` (1-D or 2-D) as rectangles:
    ``(offsets, sizes, flat start, flat end)``, in order."""
    if len(shape) == 1:
        return [((start,), (end - start,), start, end)]
    cols = shape[1]
    r0, c0 = divmod(start, cols)
    r1, c1 = divmod(end, cols)
    if r0 == r1:
        return [((r0, c0), (1, c1 - c0), start, end)]
    out = []
    if c0:
        out.append(((r0, c0), (1, cols - c0), start, (r0 + 1) * cols))
        r0 += 1
    if r1 > r0:
        out.append(((r0, 0), (r1 - r0, cols), r0 * cols, r1 * cols))
    if c1:
        out.append(((r1, 0), (1, c1), r1 * cols, end))
    return out


def global_offset(p) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(local shape, offset in the full parameter)`` of ``p``'s local part (a DTensor's TP shard, or all of it)."""
    if hasattr(p, "device_mesh"):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        return tuple(shape), tuple(offset)
    return tuple(p.shape), (0,) * p.dim()


def complement(local: tuple[int, ...], offset: tuple[int, ...], size: tuple[int, ...], start: int, end: int):
    """Rectangles ``(offsets, sizes)`` tiling a tensor of ``size`` but for the flat range ``start:end`` of its
    block ``local`` at ``offset`` (the block a TP rank holds)."""
    inside = rectangles(0, start, local) + rectangles(end, math.prod(local), local)
    out = [(tuple(o + g for o, g in zip(off, offset)), sz) for off, sz, _, _ in inside]
    if len(size) == 1:
        out += [((0,), (offset[0],)), ((offset[0] + local[0],), (size[0] - offset[0] - local[0],))]
    else:
        (r0, c0), (rows, cols), (gr, gc) = offset, local, size
        out += [((0, 0), (r0, gc)), ((r0 + rows, 0), (gr - r0 - rows, gc))]
        out += [((r0, 0), (rows, c0)), ((r0, c0 + cols), (rows, gc - c0 - cols))]
    return [(off, sz) for off, sz in out if math.prod(sz) > 0]


def sharded(pieces: list[tuple[tuple, tuple, torch.Tensor]], part: dict):
    """A ``ShardedTensor`` of the parameter ``part`` describes (``size``, its ``local`` block at ``offset``, this
    rank's flat ``range`` of it) whose local shards are ``pieces`` (``(offsets, sizes, tensor)``). Its metadata
    must tile the tensor: the rest is listed as other ranks' shards, which nothing reads (DCP saves and loads
    each rank's local shards and merges the ranks' plans)."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    rank, world = dist.get_rank(), dist.get_world_size()
    device = pieces[0][2].device
    shards = [Shard(t, ShardMetadata(list(off), list(sz), f"rank:{rank}/{device}")) for off, sz, t in pieces]
    other = f"rank:{(rank + 1) % world}/{device}"
    rest = [ShardMetadata(list(off), list(sz), other) for off, sz in complement(**part)]
    props = TensorProperties(dtype=pieces[0][2].dtype, layout=torch.strided, requires_grad=False, pin_memory=False)
    meta = ShardedTensorMetadata([s.metadata for s in shards] + rest, torch.Size(part["size"]), props)
    return ShardedTensor._init_from_local_shards_and_global_metadata(shards, meta)


def segment_pieces(shards, names: dict[int, str]) -> dict[str, dict[str, list]]:
    """This rank's segments of a chunk's :class:`~foldtrain.parallel.pipeline.zero.ChunkShards` as rectangles:
    parameter name -> ``{"exp_avg": [...], "exp_avg_sq": [...], "master": [...] (fp32 copies of half weights
    only), "step": [tensor], "part": what :func:`sharded` needs}``, views into the live state; ``names``:
    ``id(parameter)`` -> its name (a parameter has at most one segment on a rank: a slice is contiguous)."""
    out: dict[str, dict[str, list]] = {}
    for b in shards.buckets:
        for sg in b.segments:
            p = b.params[sg.index]
            shape, offset = global_offset(p)
            st = ensure_state(shards.optimizer, sg.tensor)
            part = dict(local=shape, offset=offset, size=tuple(p.shape), start=sg.start, end=sg.end)
            entry = out.setdefault(names[id(p)], {"part": part, "step": [st["step"]]})
            sources = {k: st[k] for k in STATE_KEYS}
            if b.owns_copies:
                sources["master"] = sg.tensor
            for off, sz, a, z in rectangles(sg.start, sg.end, shape):
                at = tuple(o + g for o, g in zip(off, offset))
                for key, t in sources.items():
                    entry.setdefault(key, []).append((at, sz, t[a - sg.start : z - sg.start].view(sz)))
    return out


def load_masters(shards, wait) -> None:
    """After the masters were loaded into this rank's segments: the chunk's half weights take them (all-gathered)."""
    shards.pushed = [(b, x) for b in shards.buckets if b.owns_copies and (x := b.push()) is not None]
    shards.land(wait)
