"""The tied embedding's gradient when the pipeline splits the tie (``P > 1``).

The token embedding (segment 0, pipeline rank 0) and the output projection (the last segment,
pipeline rank P-1) are one weight held as two copies. The weight's gradient is the sum of both
copies' gradients over every data-parallel replica, averaged over dp. The two copies' gradients
are ready at opposite ends of the backward: the head's after the last segment's backward (early,
in fold the first chunk to finish), the embedding's after segment 0's (the very end). So each end
reduces its own copy over its data-parallel group first, and only then are the two sums added
within the replica:

* **head** (``launch`` at the last segment's ``LR``): its dense gradient, averaged over dp, in
  one all-reduce issued at once, overlapping the rest of the backward;
* **embedding** (``launch`` at segment 0's ``LR``): its gradient is zero except in the rows of the
  tokens this replica saw. One small all-reduce (MAX of a per-row "touched" byte) gives every
  replica the same union of rows; only those rows are packed and all-reduced (dense when the union
  is more than half the rows);
* **handoff** (each end once its dp reduction is done, at the latest at its first ``WR`` / ``OS``
  after the ``LR``, or at the end of the iteration): an all-reduce of the two dp-averaged copies
  over the replica's tie group (``topo.tie_group``: pipeline ranks 0 and P-1), which leaves the
  full gradient on both ends, bit for bit the same.

On a commodity network this moves the dense tied gradient off the end of the iteration: what
crosses the data-parallel link after segment 0's backward is the touched rows only. Deadlock-free
because the handoff needs nothing beyond the end's own ``LR`` and its dp peers (which run the same
actions); the rank that waits for the handoff (a ``WR`` of an end) waits, as before, for the other
end to have finished its backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class TieSide:
    """One end's part of the tied gradient: its dp reduction, then the handoff to the other end."""

    def __init__(self, head: bool, topo, wait):
        self.head = head
        self.topo = topo
        self.dp = topo.dp
        self.wait_fn = wait  # (work, what) -> None, bounded by --dp.timeout_s
        self.grad: torch.Tensor | None = None
        self.dp_work = None
        self.rows: torch.Tensor | None = None  # the embedding's union of touched rows (sparse path)
        self.packed: torch.Tensor | None = None
        self.pair_work = None
        self.state = "idle"  # idle -> launched -> handed -> idle
        self.last_rows: int | None = None  # rows the embedding's last dp reduction sent (None: dense)

    def launch(self, g: torch.Tensor) -> None:
        """Start this end's data-parallel reduction of its copy's local gradient ``g`` (in place)."""
        self.grad, self.state = g, "launched"
        if self.dp == 1:
            return
        group = self.topo.dp_group
        if self.head:
            self.dp_work = dist.all_reduce(g.div_(self.dp), group=group, async_op=True)
            return
        touched = (g != 0).any(dim=1).to(torch.uint8)  # rows with any gradient (NaN / inf count too)
        self.wait_fn(dist.all_reduce(touched, op=dist.ReduceOp.MAX, group=group, async_op=True),
                     "union of the tied embedding's touched rows")
        rows = touched.nonzero().squeeze(1)
        if 2 * rows.numel() <= g.shape[0]:
            self.rows, self.packed, self.last_rows = rows, g.index_select(0, rows).div_(self.dp), rows.numel()
            self.dp_work = dist.all_reduce(self.packed, group=group, async_op=True)
        else:  # most rows touched: the dense gradient is no more bytes
            self.last_rows = None
            self.dp_work = dist.all_reduce(g.div_(self.dp), group=group, async_op=True)

    def handoff(self) -> None:
        """Once this end's dp reduction landed: launch the sum of the two ends (idempotent)."""
        if self.state != "launched":
            return
        if self.dp_work is not None:
            self.wait_fn(self.dp_work, "data-parallel all-reduce of the tied embedding's gradient")
            self.dp_work = None
        if self.rows is not None:  # every row outside the union is zero on every replica already
            self.grad.index_copy_(0, self.rows, self.packed)
            self.rows = self.packed = None
        self.pair_work = dist.all_reduce(self.grad, group=self.topo.tie_group, async_op=True)
        self.state = "handed"

    def wait(self) -> None:
        if self.state == "idle":
            return
        self.handoff()
        self.wait_fn(self.pair_work, "tied-embedding gradient sum of pipeline ranks 0 and P-1")
        self.pair_work = self.grad = None
        self.state = "idle"

    def reset(self) -> None:
        self.grad = self.dp_work = self.rows = self.packed = self.pair_work = None
        self.state = "idle"
