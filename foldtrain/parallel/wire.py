"""``--dp.compression fp16|bf16``: gradients cross the data-parallel link in a half dtype (the ``allreduce`` and
``ddp`` strategies' buckets, the 3D engine's reductions; ``fsdp`` takes it as its policy's ``reduce_dtype``).

Every mean over data-parallel ranks goes the same way (:func:`outbound`): the buffer is cast to the wire
dtype, divided by the number of ranks, summed there and cast back, as torch DDP's ``fp16_compress_hook``
does: half the bytes, one rounding of each replica's gradient and of the sum per step, and no fp16
overflow in the sum. Only fp32 gradients are compressed; in the master precisions they are half already.
"""

from __future__ import annotations

import torch

from foldtrain import collectives

WIRE_DTYPES = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def wire_dtype(compression: str, grad_dtype: torch.dtype) -> torch.dtype | None:
    """The dtype fp32 gradients travel in under ``--dp.compression`` (None: their own)."""
    return WIRE_DTYPES[compression] if grad_dtype == torch.float32 else None


def fsdp_reduce_dtype(compression: str, precision_reduce: torch.dtype | None) -> torch.dtype | None:
    """FSDP2's ``MixedPrecisionPolicy.reduce_dtype``: the wire dtype under ``--dp.compression`` (in every precision:
    the master modes' fp32 reduce-scatters too), else the precision's own (``Precision.fsdp_dtypes``)."""
    return WIRE_DTYPES[compression] or precision_reduce


class CastBack:
    """An asynchronous all-reduce of a half copy of ``tensor``: the sum lands in ``tensor`` when waited on.

    It answers ``is_completed`` and ``wait`` as the collective's own work does, so every bounded wait and
    progress poll takes it unchanged."""

    def __init__(self, work, sent: torch.Tensor, tensor: torch.Tensor):
        self.work, self.sent, self.tensor = work, sent, tensor

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self, *timeout) -> bool:
        self.work.wait(*timeout)
        if self.sent is not None:
            self.tensor.copy_(self.sent)
            self.sent = None
        return True


def outbound(buf: torch.Tensor, dp: int, wire: torch.dtype | None) -> torch.Tensor:
    """What a mean over ``dp`` ranks sends of ``buf``: cast to ``wire`` first (a copy, unless ``buf`` is in it
    or ``wire`` is None), then divided by ``dp`` in place."""
    sent = buf if wire is None or buf.dtype == wire else buf.to(wire)
    return sent.div_(dp)


def mean_all_reduce(tensor: torch.Tensor, dp: int, group, wire: torch.dtype | None):
    """Start averaging ``tensor`` over the ``dp`` ranks of ``group`` in place (async); ``wire``: the dtype
    it travels in (None: its own). Returns the work to wait on, after which ``tensor`` holds the mean."""
    sent = outbound(tensor, dp, wire)
    work = collectives.all_reduce(sent, group=group, async_op=True)
    return work if sent is tensor else CastBack(work, sent, tensor)
