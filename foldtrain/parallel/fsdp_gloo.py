"""FSDP2 on gloo: what changes where the collectives run on the training thread.

On a CPU, FSDP2's all-gathers and reduce-scatters are synchronous (``unshard_async_op`` is false and there are
no streams), so what it does on a GPU to overlap them with compute overlaps nothing here and only holds memory:

* its implicit backward prefetch all-gathers the next unit as a unit's backward starts; on a GPU that
  all-gather runs beside the backward, here it blocks the thread just as it would a moment later, and the rank
  holds two gathered units instead of one. Every unit prefetches only itself (already gathered: a no-op),
  which turns the implicit prefetch off through the public API;
* gloo's ``reduce_scatter_single`` all-reduces a copy of its whole input: :class:`InPlaceReduceScatter`;
* gloo's worker thread lets go of a collective's tensors only after the caller has been told it is done, and on
  busy cores that can be several units later: :class:`ReleasedAllGather` waits for it.

NCCL and the other backends keep FSDP2's own behaviour.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from foldtrain import collectives


class _Allocates:
    """FSDP2's comm hooks allocate their buffers through the hook (``allocate``): plain empty tensors here."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class InPlaceReduceScatter(_Allocates):
    """FSDP2's reduce-scatter on gloo (``FSDPModule.set_custom_reduce_scatter``). gloo's ``reduce_scatter_single``
    all-reduces a copy of its whole input and keeps this rank's slice; FSDP2 allocates that input for the
    collective alone and never reads it after, so this all-reduces it in place, copies the slice out and frees
    the input's memory: the same sums, bit for bit, without the copy. That copy was more than a unit's gradients
    at the worst moment: gloo's worker thread frees it only once it runs again, and with more threads than cores
    (4 ranks on 2 here) it held up to five of them while the backward went on (``foldtrain bench
    fsdp-memory``). Freeing the input at once matters too: FSDP2 keeps a reference to the last one
    (``reduce_scatter_max_input_buffers``, for a GPU stream still reading it) until the next unit's
    reduce-scatter, beside that unit's gradients."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False) -> None:
        if async_op:  # FSDP2 calls it synchronously; an asynchronous caller would read the slice too early
            raise NotImplementedError("InPlaceReduceScatter is synchronous")
        collectives.all_reduce(input_tensor, op=op, group=group)
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        output_tensor.copy_(input_tensor.view(world, -1)[rank].view_as(output_tensor))
        input_tensor.untyped_storage().resize_(0)  # a later read would fail loudly, not see stale sums


class ReleasedAllGather(_Allocates):
    """FSDP2's all-gather on gloo (``FSDPModule.set_custom_all_gather``), returning once gloo's worker thread has let
    go of the output. gloo runs a collective on a worker thread, which marks it done and only then, at the end of
    its loop, drops its references to the tensors (``_allgather_base`` holds views of the output). With more
    threads than cores the caller often runs on first: FSDP2 copies the parameters out and drops the output, but
    the storage lives until the worker runs again. Measured (``foldtrain bench fsdp-memory``, 4 ranks on 2 cores):
    20 to 30 of a step's 26 all-gathers returned before the worker let go, and on one rank in four a block's output
    outlived the next 8 blocks' backward, 27 MB beside the peak. The storage's use count says when the worker has
    let go; the wait yields the core to it, for at most ``patience_s`` (then the memory is merely held longer)."""

    def __init__(self, patience_s: float = 0.1):
        self.patience_s = patience_s

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False) -> None:
        if async_op:  # FSDP2 calls it synchronously on a CPU (unshard_async_op is false there)
            raise NotImplementedError("ReleasedAllGather is synchronous")
        storage = output_tensor.untyped_storage()
        held = torch._C._storage_Use_Count(storage._cdata)  # this function's references, before gloo's
        collectives.all_gather_single(output_tensor, input_tensor, group=group)
        deadline = time.monotonic() + self.patience_s
        while torch._C._storage_Use_Count(storage._cdata) > held and time.monotonic() < deadline:
            os.sched_yield()


def fit_fsdp_to_gloo(modules, group) -> None:
    """On gloo (``group``'s backend), give every FSDP2 module of ``modules`` the :class:`InPlaceReduceScatter`,
    the :class:`ReleasedAllGather` and no backward prefetch (the module docstring says why); a torch whose FSDP2
    lacks a hook keeps gloo's collective. Other backends: nothing changes."""
    if dist.get_backend(group) != "gloo":
        return
    for m in modules:
        if hasattr(m, "set_custom_reduce_scatter"):
            m.set_custom_reduce_scatter(InPlaceReduceScatter())
        m.set_modules_to_backward_prefetch([m])
        if hasattr(m, "set_custom_all_gather") and hasattr(torch._C, "_storage_Use_Count"):
            m.set_custom_all_gather(ReleasedAllGather())
