"""The tied embedding's gradient when the pipeline splits the tie (``P > 1``).

The token embedding (segment 0, pipeline rank 0) and the output projection (the last segment,
pipeline rank P-1) are one weight held as two copies. The weight's gradient is the sum of both
copies' gradients over every data-parallel replica, averaged over dp. The two copies' gradients
are ready at opposite ends of the backward: the head's after the last segment's backward (early,
in fold the first chunk to finish), the embedding's after segment 0's (the very end). So each end
reduces its own copy over its data-parallel group first, and then the two ends exchange what the
other lacks, within the replica, over ``topo.tie_group`` (pipeline ranks 0 and P-1):

* **embedding rows** (``begin`` at the start of the iteration): the embedding's gradient is zero
  outside the rows of the tokens its replicas read. The replica's token ids are all-gathered over
  dp (a few KB, asynchronous, long done by the end of the backward), so every replica knows the
  same union of rows without waiting for anybody at its ``LR``;
* **head** (``launch`` at the last segment's ``LR``, or with per-chunk sync right after its last
  forward, where the fused head made it final): its dense gradient, averaged over dp, in one
  all-reduce issued at once; the moment it lands (``progress``, polled after every action) it is
  sent to the embedding end, which posted its receive when the iteration started (gloo delivers a
  send only into a posted receive);
* **embedding** (``launch`` at segment 0's ``LR``): only the union's rows are packed, averaged over
  dp and all-reduced (dense when the union is more than half the rows); once they land they are
  sent to the head end (their count, their indices, their values);
* **wait** (at the chunk's ``WR``): each end adds what it received: the head adds the rows, the
  embedding takes the head's dense copy and adds its own rows. ``a + b == b + a`` in IEEE
  arithmetic, so both copies are bit for bit the same.

With ``--optim.shard_tied`` the distributed optimizer steps only this dp rank's slice of each copy
(:meth:`TieSide.share_slices`), so only that slice of the sum is needed at either end: the head's dense
copy is reduce-scattered over dp instead of all-reduced, and the head sends the embedding end its slice, not
the dense copy (the embedding's dense fallback sends its slice too). The head's all-gather of the stepped
weight then moves the bytes the all-reduce no longer does. Elements outside the slice are left as they
were: nothing reads them before the optimizer takes its slice.

With the V placement (zbv) both ends are on pipeline rank 0: :class:`LocalTie` adds the two copies there and
reduces the sum over dp.

On a commodity network this moves the dense tied gradient off the end of the iteration: what
crosses the data-parallel link after segment 0's backward is the rows only, and the head's dense
copy crosses the pipeline's link during the backward, not after it. Deadlock-free: an end's sends
need nothing beyond its own ``LR`` and its dp peers (which run the same actions); the embedding
end posts its receive (at ``begin``) before its sends, and the head its send before its receives, so even
NCCL's one stream per pair (operations in posting order) matches them.
"""

from __future__ import annotations

import torch

from foldtrain import collectives
from foldtrain.parallel.pipeline.zero import reduce_scatter_mean
from foldtrain.parallel.scatter import summed_row
from foldtrain.parallel.wire import mean_all_reduce


class Slices:
    """This dp rank's slice of a tied copy, flat and padded to ``dp`` slices of ``length`` elements: what the
    distributed optimizer steps with ``--optim.shard_tied`` (its :class:`~.zero.FlatShard` of the copy)."""

    def __init__(self, topo, length: int):
        self.dp, self.group, self.length = topo.dp, topo.dp_group, length
        self.lo = topo.dp_rank * length
        self.inflight = None  # the reduce-scatter's (buffer, summed, packed input)

    def of(self, g: torch.Tensor) -> torch.Tensor:
        """The slice of ``g``, a view (the last rank's is shorter by the padding)."""
        return g.view(-1)[self.lo : self.lo + self.length]

    def padded(self, g: torch.Tensor) -> torch.Tensor:
        """The slice of ``g`` in a new tensor of ``length`` elements (a message both ends size alike)."""
        out = g.new_zeros(self.length)
        mine = self.of(g)
        out[: mine.numel()] = mine
        return out

    def scatter(self, g: torch.Tensor):
        """Start the reduce-scatter of ``g`` averaged over dp; returns its work (:meth:`take` once done)."""
        work, *self.inflight = reduce_scatter_mean([g], self.dp, self.length, self.group)
        return work

    def take(self, g: torch.Tensor) -> torch.Tensor:
        """The reduce-scatter landed: the summed slice (in ``g``'s dtype) becomes ``g``'s; returned padded."""
        buf, summed, _packed = self.inflight
        self.inflight = None
        mine = summed_row(buf, summed).to(g.dtype)
        part = self.of(g)
        part.copy_(mine[: part.numel()])
        return mine


class TieSide:
    """One end's part of the tied gradient: its dp reduction, then the exchange with the other end.

    Every message between the two ends has a size both know in advance, so each end posts all its
    receives by its hand-off (the embedding its one at ``begin``) and no message outlives the
    iteration it belongs to: the embedding's
    rows travel as ``[n, rows..., padding]`` indices and a ``(T, d)`` block of values (``T``: the
    tokens of the global batch, at least the union's size ``n``) when ``T`` is at most half the rows
    (``sparse``), else as its dense copy. The dp reduction always sends only the union's ``n`` rows
    when ``n`` is at most half of them: every replica knows the same ``n``."""

    def __init__(
        self,
        head: bool,
        topo,
        wait,
        row_offset: int = 0,
        like: torch.Tensor | None = None,
        wire: torch.dtype | None = None,  # --dp.compression: the dtype of the dp reduction on the link
    ):
        self.head = head
        self.wire = wire
        self.topo = topo
        self.dp = topo.dp
        self.wait_fn = wait  # (work, what, p2p=False) -> None, bounded by --dp.timeout_s
        self.row_offset = row_offset  # first vocabulary row of this rank's shard (vocab-parallel TP)
        self.like = like  # the local tied weight: shape, dtype and device of the head's copy to receive
        self.early_recv = None  # (work, buffer): the head's copy, received from the start of the iteration
        self.other = topo.pipeline_peer(0 if head else topo.pp - 1)  # the other end's global rank
        self.tokens_per_step: int | None = None  # T, the same on both ends (set_tokens, by the engine)
        self.grad: torch.Tensor | None = None
        self.dp_work = None
        self.tok_work = self.tokens = None  # the replica's token ids, all-gathered over dp (embedding end)
        self.rows: torch.Tensor | None = None  # local row indices of the union (None: dense)
        self.packed: torch.Tensor | None = None
        self.works: list = []  # the exchange's sends and receives in flight
        self.bufs: list = []  # their tensors (received into, or kept alive until sent)
        self.state = "idle"  # idle -> launched -> handed -> idle
        self.last_rows: int | None = None  # rows the embedding's last dp reduction sent (None: dense)
        self.slices: Slices | None = None  # --optim.shard_tied: only this dp rank's slice is exchanged

    def share_slices(self, length: int) -> None:
        """``--optim.shard_tied``: the optimizer steps only elements ``[r * length, (r + 1) * length)`` of the flat
        copy on dp rank ``r`` (the copy padded to ``dp`` slices), so only those of the sum are exchanged."""
        if self.dp > 1:
            self.slices = Slices(self.topo, length)

    def set_tokens(self, tokens_per_step: int) -> None:
        """``T``, the tokens of one global batch (both ends: it fixes the exchange's message sizes)."""
        self.tokens_per_step = tokens_per_step

    def sparse(self, n_rows: int) -> bool:
        return self.tokens_per_step is not None and 2 * self.tokens_per_step <= n_rows

    # ------------------------------------------------------------------ the embedding end's rows
    def begin(self, xs: list[torch.Tensor], every: torch.Tensor | None = None) -> None:
        """Start of an iteration (embedding end): all-gather this replica's token ids over dp (``every``: gathered
        already, by the distributed optimizer's embedding copy, :meth:`.zero.ChunkShards.start_rows`)."""
        if self.head:
            return
        if self.like is not None and self.topo.tie_group is not None and self.early_recv is None:
            # gloo delivers a send only into a posted receive: posted now, the head's dense copy crosses
            # while this rank still computes, not after its own rows have landed
            buf = torch.empty_like(self.like) if self.slices is None else self.like.new_empty(self.slices.length)
            self.early_recv = (collectives.irecv(buf, src=self.other, group=self.topo.tie_group), buf)
        tokens = torch.cat([x.reshape(-1) for x in xs])
        if self.tokens_per_step is not None and tokens.numel() * self.dp > self.tokens_per_step:
            raise ValueError(
                f"the pipeline got {tokens.numel() * self.dp} tokens in a step, more than the "
                f"{self.tokens_per_step} of --train.global_batch x --train.seq_len; pass batches of that shape"
            )
        if self.dp == 1 or every is not None:
            self.tokens = tokens if every is None else every
            return
        self.tokens = [torch.empty_like(tokens) for _ in range(self.dp)]
        self.tok_work = collectives.all_gather(self.tokens, tokens, group=self.topo.dp_group, async_op=True)

    def _union_rows(self, n_rows: int) -> torch.Tensor:
        if self.tok_work is not None:
            self.wait_fn(self.tok_work, "all-gather of the replicas' token ids (the tied embedding's rows)")
            self.tok_work = None
        if self.tokens is None:
            raise RuntimeError("the tied embedding's LR ran without begin(): no token ids for its rows")
        tokens = torch.cat(self.tokens) if isinstance(self.tokens, list) else self.tokens
        self.tokens = None
        rows = torch.unique(tokens) - self.row_offset  # sorted: the same order on every replica
        return rows[(rows >= 0) & (rows < n_rows)]

    # ------------------------------------------------------------------ the protocol
    def launch(self, g: torch.Tensor) -> None:
        """Start this end's data-parallel reduction of its copy's local gradient ``g`` (in place)."""
        self.grad, self.state = g, "launched"
        group = self.topo.dp_group
        if self.head:
            if self.slices is not None:  # only this rank's slice of the sum is stepped: a reduce-scatter
                self.dp_work = self.slices.scatter(g)
            elif self.dp > 1:
                self.dp_work = mean_all_reduce(g, self.dp, group, self.wire)
            return
        rows = self._union_rows(g.shape[0])
        if 2 * rows.numel() <= g.shape[0]:
            self.rows, self.packed, self.last_rows = rows, g.index_select(0, rows), rows.numel()
            payload = self.packed
        else:  # most rows touched: the dense gradient is no more bytes
            self.rows, self.packed, self.last_rows = None, None, None
            payload = g
        if self.dp > 1:
            self.dp_work = mean_all_reduce(payload, self.dp, group, self.wire)

    def progress(self) -> None:
        """Hand over as soon as this end's dp reduction landed (polled after every action; never blocks)."""
        if self.state == "launched" and (self.dp_work is None or self.dp_work.is_completed()):
            self.handoff()

    def handoff(self) -> None:
        """Once this end's dp reduction landed: post the exchange with the other end (idempotent)."""
        if self.state != "launched":
            return
        if self.dp_work is not None:
            self.wait_fn(self.dp_work, "data-parallel reduction of the tied embedding's gradient")
            self.dp_work = None
        group, g, peer = self.topo.tie_group, self.grad, self.other
        n_rows = g.shape[0]
        if self.sparse(n_rows):
            T = self.tokens_per_step
            idx = torch.full((T + 1,), -1, dtype=torch.int64, device=g.device)
            vals = torch.zeros((T, *g.shape[1:]), dtype=g.dtype, device=g.device)
        if self.head:  # send the dense copy (or slice), then receive the rows (or the dense copy or slice)
            sent = self.slices.take(g) if self.slices is not None else g
            self.works = [collectives.isend(sent, dst=peer, group=group)]
            recv = [idx, vals] if self.sparse(n_rows) else [torch.empty_like(sent)]
            self.works += [collectives.irecv(b, src=peer, group=group) for b in recv]
            self.bufs = recv + [sent]  # (the sent tensor alive until the send is done)
        else:  # receive the head's dense copy, then send the rows (or the dense copy)
            (work, dense), self.early_recv = self.early_recv, None  # posted by begin
            self.works = [work]
            if self.sparse(n_rows):
                if self.rows is None:
                    raise RuntimeError(f"{self.tokens_per_step} tokens touched more than half of {n_rows} rows")
                n = self.rows.numel()
                idx[0] = n
                idx[1 : n + 1] = self.rows
                vals[:n] = self.packed
                out = [idx, vals]
            else:
                if self.rows is not None:  # the rows went sparse over dp: back into the dense copy
                    g.index_copy_(0, self.rows, self.packed)
                    self.rows = self.packed = None
                # g itself gets the head's copy added before this send may be done: a copy goes
                out = [g.clone() if self.slices is None else self.slices.padded(g)]
            self.works += [collectives.isend(t, dst=peer, group=group) for t in out]
            self.bufs = [dense] + out
        self.state = "handed"

    def _covered(self, g: torch.Tensor) -> torch.Tensor:
        """What the other end's dense message covers: all of ``g``, or with ``share_slices`` this rank's slice."""
        return g if self.slices is None else self.slices.of(g)

    def _received(self, g: torch.Tensor) -> torch.Tensor:
        """The other end's dense message (the first buffer received), without a slice's padding."""
        return self.bufs[0] if self.slices is None else self.bufs[0][: self.slices.of(g).numel()]

    def wait(self) -> None:
        """Both ends end with the same sum (the other end's copy added to this one's)."""
        if self.state == "idle":
            return
        self.handoff()
        for w in self.works:
            self.wait_fn(w, "tied-embedding gradient exchange between pipeline ranks 0 and P-1", p2p=True)
        g = self.grad
        if self.head:
            if self.sparse(g.shape[0]):
                idx, vals = self.bufs[:2]
                n = int(idx[0].item())
                g.index_add_(0, idx[1 : n + 1], vals[:n])
            else:
                self._covered(g).add_(self._received(g))
        elif self.rows is None:
            self._covered(g).add_(self._received(g))
        else:
            self._covered(g).copy_(self._received(g))
            g.index_add_(0, self.rows, self.packed)
        self.grad = self.rows = self.packed = None
        self.works, self.bufs = [], []
        self.state = "idle"

    def reset(self) -> None:
        """Before loading a checkpoint: finish an exchange in flight (its messages must not be left
        for a later iteration to match), forget the rest."""
        if self.state != "idle":
            self.wait()
        self.tok_work = self.tokens = None


class LocalTie:
    """Both ends of the tie on one rank (the V placement of zbv: segments 0 and ``S - 1`` on pipeline rank 0).

    No exchange between pipeline ranks, and one data-parallel reduction instead of two: the head's copy is final
    first (the fused head computes it in the last segment's forward), so the embedding end adds it to its own copy
    when its gradient is final too and all-reduces the sum over dp, averaged; the head's copy takes the result, so
    the two stay equal. The dense sum is as many bytes as :class:`TieSide`'s head alone sends. :meth:`end` gives
    each chunk's reducer its side, with :class:`TieSide`'s methods."""

    def __init__(self, topo, wait, wire: torch.dtype | None = None):
        self.topo, self.dp_group, self.dp = topo, topo.dp_group, topo.dp
        self.wire = wire  # --dp.compression
        self.wait_fn = wait
        self.sides = {head: LocalTieSide(self, head) for head in (False, True)}
        self.slices: Slices | None = None  # --optim.shard_tied: the sum reduce-scattered, each copy takes the slice

    def end(self, head: bool) -> LocalTieSide:
        return self.sides[head]

    def reduce(self) -> None:
        """The embedding end's launch: its copy plus the head's, averaged over dp (async)."""
        emb, head = self.sides[False], self.sides[True]
        if head.state == "idle":
            raise RuntimeError("the tied weight's head end has not launched before the embedding end's reduction")
        emb.grad.add_(head.grad)
        if self.slices is not None:
            emb.dp_work = self.slices.scatter(emb.grad)
        elif self.dp > 1:
            emb.dp_work = mean_all_reduce(emb.grad, self.dp, self.dp_group, self.wire)

    def finish(self) -> None:
        """Once the embedding end launched: wait for the sum's reduction; the head's copy takes it."""
        emb, head = self.sides[False], self.sides[True]
        if emb.state == "idle":
            raise RuntimeError("the tied weight's embedding end has not launched its reduction before the head's wait")
        if emb.dp_work is not None:
            self.wait_fn(emb.dp_work, "data-parallel reduction of the tied embedding's gradient")
            emb.dp_work = None
        if self.slices is not None:  # the slice of the sum is all either copy's optimizer reads
            self.slices.take(emb.grad)
            self.slices.of(head.grad).copy_(self.slices.of(emb.grad))
        else:
            head.grad.copy_(emb.grad)
        for side in (emb, head):
            side.grad, side.state = None, "idle"


class LocalTieSide:
    """One end of a :class:`LocalTie`."""

    def __init__(self, tie: LocalTie, head: bool):
        self.tie, self.head = tie, head
        self.grad: torch.Tensor | None = None
        self.dp_work = None
        self.state = "idle"  # idle -> launched -> idle (at either end's wait)
        self.last_rows = None  # as TieSide's: the dp reduction sends the dense copy

    @property
    def slices(self) -> Slices | None:
        return self.tie.slices

    def share_slices(self, length: int) -> None:
        """``--optim.shard_tied``: the sum reduce-scattered, not all-reduced (both copies step the same slice)."""
        if self.tie.dp > 1:
            self.tie.slices = Slices(self.tie.topo, length)

    def set_tokens(self, tokens_per_step: int) -> None:
        """Nothing to size: no message crosses to another pipeline rank."""

    def begin(self, xs: list[torch.Tensor], every: torch.Tensor | None = None) -> None:
        """Nothing to gather: the whole dense sum is reduced."""

    def launch(self, g: torch.Tensor) -> None:
        self.grad, self.state = g, "launched"
        if not self.head:
            self.tie.reduce()

    def progress(self) -> None:
        """Nothing to hand over."""

    def handoff(self) -> None:
        """Nothing to hand over."""

    def wait(self) -> None:
        if self.state != "idle":
            self.tie.finish()

    def reset(self) -> None:
        """Before loading a checkpoint: finish a reduction in flight, forget the sum."""
        if self.dp_work is not None:
            self.tie.wait_fn(self.dp_work, "data-parallel reduction of the tied embedding's gradient")
        self.grad, self.dp_work, self.state = None, None, "idle"
