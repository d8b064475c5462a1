"""The reduce-scatter as each backend does it best (the sharded strategies' and the distributed optimizer's).

NCCL's ``reduce_scatter_single`` is a ring that puts (W-1)/W of the tensor on the wire. gloo's is an
all-reduce followed by a slice, 2(W-1)/W (measured on loopback, 4 ranks: 101 MB for a 16 MB tensor, like
``all_reduce``), and it lost its place among collectives running at once on two groups of the same ranks
(a collective mismatch, seen with the 3D engine's deferred reductions). On gloo the W pieces go through one
``all_to_all_single`` instead (piece j to rank j, the bandwidth-optimal (W-1)/W) and each rank sums the W
pieces it received.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from foldtrain import collectives


def uses_all_to_all(choice: str) -> bool:
    """``--dp.shard_collective``: ``auto`` is the all-to-all on gloo (whose reduce-scatter is an
    all-reduce), the backend's reduce-scatter elsewhere (NCCL's ring)."""
    return choice == "all_to_all" or (choice == "auto" and dist.get_backend() == "gloo")


def recv_elems(world: int, width: int, a2a: bool) -> int:
    """Elements :func:`exchange_rows` receives for W x width rows: all of them by all-to-all, one row otherwise."""
    return world * width if a2a else width


def exchange_rows(
    rows: torch.Tensor, a2a: bool, into: torch.Tensor | None = None, group=None
) -> tuple[dist.Work, torch.Tensor, bool]:
    """Start the reduce-scatter of ``rows`` (W x width): (work, buffer, summed). After ``work.wait()``
    the buffer holds this rank's summed row (``summed``) or, by all-to-all (``a2a``), the W rows to
    sum (dim 0). ``into``: a flat buffer of :func:`recv_elems` elements to receive into (else a new one);
    ``group``: the ranks (default: all)."""
    if a2a:
        recv = torch.empty_like(rows) if into is None else into.view(rows.shape)
        return collectives.all_to_all_single(recv, rows, group=group, async_op=True), recv, False
    out = torch.empty(rows.shape[1], dtype=rows.dtype, device=rows.device) if into is None else into
    return collectives.reduce_scatter_single(out, rows.reshape(-1), group=group, async_op=True), out, True


def summed_row(buf: torch.Tensor, summed: bool) -> torch.Tensor:
    """This rank's row of a finished :func:`exchange_rows`, in fp32: the buffer itself where the backend summed it,
    else the W rows the all-to-all delivered, summed here."""
    return buf.float() if summed else buf.float().sum(0)
