"""The communication calls foldtrain makes, each through one fault-injection point.

Every collective and point-to-point transfer in ``foldtrain/`` goes through these functions instead
of calling :mod:`torch.distributed` directly, so :mod:`foldtrain.faults` can strike at the moment
communication starts (its ``reduce`` and ``p2p`` points) without patching ``torch.distributed``.
Each function takes exactly the arguments of its :mod:`torch.distributed` namesake and returns what
that returns. ``tests/faults/test_injection_points.py`` checks that nothing else in the package
(the plain-torch anchors of ``foldtrain/bench/anchors/`` aside) calls them directly.
"""

from __future__ import annotations

import torch.distributed as dist

from foldtrain import faults


def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    faults.point("reduce")
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def all_gather(tensor_list, tensor, group=None, async_op=False):
    faults.point("reduce")
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
    faults.point("reduce")
    return dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)


def reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
    faults.point("reduce")
    return dist.reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    faults.point("reduce")
    return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


# torch 2.12+ spells these two *_single and warns that the *_tensor names are deprecated; older torch
# has only the *_tensor names, which take the same arguments
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
    faults.point("reduce")
    return _reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)


def all_gather_single(output_tensor, input_tensor, group=None, async_op=False):
    faults.point("reduce")
    return _all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


def send(tensor, dst=None, group=None, tag=0, group_dst=None):
    faults.point("p2p")
    return dist.send(tensor, dst, group=group, tag=tag, group_dst=group_dst)


def recv(tensor, src=None, group=None, tag=0, group_src=None):
    faults.point("p2p")
    return dist.recv(tensor, src, group=group, tag=tag, group_src=group_src)


def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
    faults.point("p2p")
    return dist.isend(tensor, dst, group=group, tag=tag, group_dst=group_dst)


def irecv(tensor, src=None, group=None, tag=0, group_src=None):
    faults.point("p2p")
    return dist.irecv(tensor, src, group=group, tag=tag, group_src=group_src)
