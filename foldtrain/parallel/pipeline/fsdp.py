"""``--dp.strategy fsdp`` in the 3D engine: every pipeline chunk fully sharded (FSDP2, ZeRO-3) over dp.

As torchtitan composes FSDP with pipeline and tensor parallelism: on each rank, ``fully_shard`` on every
transformer block of each local chunk, then on the chunk, over the data-parallel dimension of the rank's
``(dp, tp)`` mesh (:mod:`foldtrain.parallel.mesh`). With tensor parallelism the parameters are already
DTensors on that mesh's ``tp`` dimension, and FSDP shards them again over ``dp`` (2D DTensors). Each chunk
is an FSDP root of its own; its own group (the embedding, the head, the final norm) is not resharded after
the forward: the last chunk runs its head after its body, outside the chunk's forward (the fused head), and
needs that group gathered then (``body`` is registered as a forward method so that FSDP's hooks run).

Micro-batches, as torch pipelining drives FSDP (``torch/distributed/pipelining/stage.py``): from the start of
an iteration every backward of a chunk only accumulates the unsharded gradients (no reduce-scatter, no
reshard after the backward, not the last backward); the chunk's ``LR`` turns the three back on, runs every
group's post-backward (the reduce-scatters, averaged over dp) and the root's final callback, which leaves
the sharded gradients on the parameters. The engine's own data-parallel all-reduce
(:class:`~foldtrain.parallel.pipeline.reducer.ChunkReducer`) is not used: :class:`FSDPChunkReducer` stands in
for it. Where the pipeline splits the tied embedding, the two ends' copies are sharded alike (same mesh,
same placements), so their local gradient shards cover the same rows: one all-reduce of the shard over the
tie group sums them, or, where one rank holds both ends (zbv's V placement), one addition
(:class:`LocalShardTie`).

The zero-bubble schedules' split backward (:mod:`.split_backward`) takes a chunk's gathered weights at each
``I``: :func:`unshard` gathers them first (FSDP's pre-backward would, but only inside the autograd call, after
the ``I`` has read the parameters), and they stay gathered until the ``LR`` (no reshard after a backward), so
the ``W`` accumulates into the same gathered weights' gradients that the ``LR`` reduce-scatters.

The iteration's gradient norm is :func:`norm_sq` summed over every rank: each element of a sharded gradient
once, a part replicated over tensor-parallel ranks weighted by ``1/tp``.

The reduction calls FSDP2 internals (a group's ``post_backward``, the root's final callback, the states of
a root), as torch's own pipelining does in ``perform_reduce_grad``: checked on torch 2.11 and 2.13
(docs/testing.md); another torch may need this module to follow torch pipelining's.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from foldtrain import collectives
from foldtrain.model.gpt import Block
from foldtrain.parallel.fsdp_gloo import fit_fsdp_to_gloo
from foldtrain.parallel.pipeline.p2p import local_part
from foldtrain.parallel.wire import fsdp_reduce_dtype


def shard_chunk(chunk: nn.Module, dp_mesh, reshard_after_forward: bool, precision, compression: str = "none") -> None:
    """``fully_shard`` every block of ``chunk``, then ``chunk`` (its embedding, head and final norm), over
    ``dp_mesh``, in place; parameters become DTensors sharded over dp. ``compression``: ``--dp.compression``
    (the reduce-scatters' dtype, :func:`~foldtrain.parallel.wire.fsdp_reduce_dtype`)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    param_dtype, reduce_dtype = precision.fsdp_dtypes
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=fsdp_reduce_dtype(compression, reduce_dtype))
    blocks = [m for m in chunk.modules() if isinstance(m, Block)]
    for block in blocks:
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    # the chunk's own group stays gathered after its forward: the fused head reads it after ``body``
    fully_shard(chunk, mesh=dp_mesh, reshard_after_forward=False, mp_policy=policy)
    fit_fsdp_to_gloo([*blocks, chunk], dp_mesh.get_group())
    register_fsdp_forward_method(chunk, "body")


def unshard(chunk: nn.Module) -> None:
    """Gather every group of ``chunk`` that is sharded (a no-op for one already gathered): before a split
    backward's ``I`` reads the chunk's parameters."""
    from torch.distributed.fsdp import FSDPModule

    for m in chunk.modules():
        if isinstance(m, FSDPModule):
            m.unshard()


def reshard(chunk: nn.Module) -> None:
    """Free every gathered group of ``chunk`` (after an evaluation's forwards, which no backward reshards)."""
    from torch.distributed.fsdp import FSDPModule

    for m in chunk.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def param_groups(chunk: nn.Module) -> list:
    """Every FSDP parameter group of a sharded chunk (each all-gathers and reduce-scatters as one). FSDP2
    internals, read as torch pipelining reads them (an older FSDP2 state holds one ``_fsdp_param_group``)."""
    from torch.distributed.fsdp import fully_shard

    groups = []
    for state in fully_shard.state(chunk)._state_ctx.all_states:
        many = getattr(state, "_fsdp_param_groups", None)
        one = getattr(state, "_fsdp_param_group", None)
        groups += list(many) if many is not None else ([one] if one is not None else [])
    return groups


def _replicas(t) -> int:
    """On how many ranks of its mesh a DTensor's local part is repeated (1 for a plain tensor)."""
    if not hasattr(t, "placements"):
        return 1
    n = 1
    for dim, placement in enumerate(t.placements):
        if placement.is_replicate():
            n *= t.device_mesh.size(dim)
    return n


def norm_sq(grads: list, device: torch.device) -> torch.Tensor:
    """This rank's share of the squared gradient norm, in fp32: the local shards' squares, each repeated part
    (a parameter replicated over tp) divided by its copies, so a sum over every rank counts each element once."""
    total = torch.zeros((), device=device)
    for g in grads:
        total = total + torch.linalg.vector_norm(local_part(g).detach().float()) ** 2 / _replicas(g)
    return total


class FSDPChunkReducer:
    """A fully sharded chunk's data-parallel reduction, driven as a
    :class:`~foldtrain.parallel.pipeline.reducer.ChunkReducer` is (``LR`` launches, ``WR`` waits)."""

    tie = None  # no row exchange (tie.py): the tied copy's shard is summed whole

    def __init__(self, segment: int, chunk: nn.Module, tied, topo, wait, local_tie: LocalShardTie | None = None):
        """``tied``: the tied embedding's copy this chunk holds where the pipeline splits the tie, or None;
        ``wait(work, what)``: a wait bounded by ``--dp.timeout_s``; ``local_tie``: where this rank holds both
        copies (zbv), what sums them."""
        self.segment = segment
        self.chunk = chunk
        self.tied = tied
        self.topo = topo
        self.wait_fn = wait
        self.local_tie = local_tie
        self.tie_work = None
        self.pending = False

    def _sync_on_this_backward(self, last: bool) -> None:
        self.chunk.set_is_last_backward(last)
        self.chunk.set_reshard_after_backward(last)
        self.chunk.set_requires_gradient_sync(last)

    def begin(self, xs: list[torch.Tensor], every: torch.Tensor | None = None) -> None:
        """Start of an iteration: the chunk's backwards accumulate unsharded gradients until its ``LR``."""
        self._sync_on_this_backward(False)

    def launch(self, deadline: int = 0, deferred: bool = False) -> None:
        """After the chunk's last backward: reduce-scatter its gradients (FSDP's post-backward of every group,
        then the root's final callback, as torch pipelining's ``perform_reduce_grad``), then start the tied
        copy's sum with the other end."""
        from torch.distributed.fsdp import fully_shard

        self._sync_on_this_backward(True)
        state = fully_shard.state(self.chunk)
        for group in param_groups(self.chunk):
            group.post_backward()
        state._root_post_backward_final_callback()
        if self.tied is not None:  # both ends issue it: a copy without a gradient sums zeros
            if self.tied.grad is None:
                self.tied.grad = torch.zeros_like(self.tied)
            shard = local_part(self.tied.grad)
            if self.local_tie is not None:
                self.local_tie.add(shard)
            else:
                self.tie_work = collectives.all_reduce(shard, group=self.topo.tie_group, async_op=True)
        self.pending = True

    def wait(self) -> None:
        if self.tie_work is not None:
            self.wait_fn(self.tie_work, "sum of the tied embedding's gradient shards over pipeline ranks 0 and P-1")
            self.tie_work = None
        self.pending = False

    # the ChunkReducer calls the executor makes that have nothing to do here
    def launch_tie(self, deadline: int = 0) -> None:
        pass

    def progress(self) -> None:
        pass

    def handoff(self) -> None:
        pass

    def reset(self) -> None:
        self.wait()


class LocalShardTie:
    """Both copies of the tied embedding on one rank (zbv's V placement): each chunk's ``LR`` hands over its
    copy's reduced local shard; the second sums the two into both, as the tie group's all-reduce does where
    the copies are on two ranks. Both ``LR`` come before either chunk's ``WR`` (no fsdp chunk is deferred)."""

    def __init__(self):
        self.first: torch.Tensor | None = None

    def add(self, shard: torch.Tensor) -> None:
        if self.first is None:
            self.first = shard
            return
        shard.add_(self.first)
        self.first.copy_(shard)
        self.first = None
