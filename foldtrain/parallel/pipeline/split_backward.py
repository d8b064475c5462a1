"""A segment's backward in two parts, ``I`` (the input's gradient) and ``W`` (the weights'), with torch autograd.

The zero-bubble schedules (:mod:`foldtrain.schedules.generators`) run a micro-batch's backward as an
``I``, whose result the previous stage is waiting for, and a ``W`` the rank may run later, when it
would otherwise idle. Both use torch pipelining's own implementation
(``torch.distributed.pipelining._backward``): ``stage_backward_input`` computes only the input's
gradient (autograd skips every product a weight's gradient alone needs) and keeps, for each group of
weights, the gradients flowing into the graph nodes where the weights' branches join the input's path;
``stage_backward_weight`` then runs autograd from those nodes to the weights alone. The graph (and the
activations it saves) lives until the ``W``.

A segment whose input is token ids (segment 0) has no input gradient: its ``I`` does nothing and its
``W`` is the whole backward, as torch pipelining runs its first stage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight


@dataclass
class WeightWork:
    """What an ``I`` leaves for its ``W``: the saved gradients of the weights' groups, or (segment 0) the
    outputs and their gradients for the whole backward."""

    param_groups: list | None = None
    outputs: list | None = None
    grads: list | None = None


def backward_input(outputs: list[torch.Tensor], grads: list[torch.Tensor], inp: torch.Tensor, params) -> WeightWork:
    """``I``: ``inp.grad`` from the outputs' gradients; returns what the ``W`` needs."""
    if not inp.requires_grad:
        return WeightWork(outputs=outputs, grads=grads)
    _dinputs, groups = stage_backward_input(outputs, grads, [inp], params)
    return WeightWork(param_groups=groups)


def backward_weight(work: WeightWork, params) -> None:
    """``W``: the weights' gradients, accumulated into their ``.grad``."""
    if work.param_groups is None:
        torch.autograd.backward(work.outputs, work.grads)
    else:
        stage_backward_weight(params, work.param_groups)
