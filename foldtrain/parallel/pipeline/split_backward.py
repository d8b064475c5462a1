"""A segment's backward in two parts, ``I`` (the input's gradient) and ``W`` (the weights'), with torch autograd.

The zero-bubble schedules (:mod:`foldtrain.schedules.generators`) run a micro-batch's backward as an
``I``, whose result the previous stage is waiting for, and a ``W`` the rank may run later, when it
would otherwise idle. The activations and the graph live until the ``W``. Two ways, one result:

* :class:`LinearSplit` (a chunk whose weights compute as plain tensors): what the ZB paper's Megatron
  implementation defers, the linear layers' weight-gradient products. A forward hook keeps each
  ``nn.Linear``'s weight, input and the gradient edge of its output (the graph node, not the output
  tensor); the ``I`` is ONE autograd call for the segment input's gradient, every other parameter's
  (biases, norms: small) and those edges' gradients, each linear output's ``dy``, captured by the autograd
  engine itself. It skips the products only a linear weight's gradient needs; the ``W`` multiplies them
  out, ``dW = dy^T x``, accumulated into ``.grad`` by the product itself where the dtypes allow (one kernel,
  no temporary), else in the product's own dtype (autocast's bf16 / fp16) as autograd would.
* :class:`GraphSplit` (any chunk: DTensor weights under tensor parallelism, recomputed activations):
  torch pipelining's own ``stage_backward_input`` / ``stage_backward_weight``, which find, per group of
  weights, the graph nodes where their branches join the input's path, keep the gradients flowing into
  them in the ``I`` and run autograd from there in the ``W``: general, but one autograd call per group
  (6 a block), which costs a CPU as much as a third of a small block's backward.

Both take the weights the forward used, not the chunk's current ones: under FSDP (``--dp.strategy
fsdp``) a chunk's modules hold its sharded DTensors between passes and the gathered weights only while
gathered, so the ``I`` gathers them first (``prepare``), as FSDP's own pre-backward would, and the ``W``
uses the weights its ``I`` (or forward) saw (a forward between the two may have resharded them; the
gradients accumulate on the gathered ones, which FSDP reduce-scatters at the chunk's ``LR``). Without
tensor parallelism the gathered weights are plain tensors: :class:`LinearSplit`.

A segment whose input is token ids (segment 0) has no input gradient: its ``I`` does nothing and its
``W`` is the whole backward, as torch pipelining runs its first stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.autograd.graph import get_gradient_edge


@dataclass
class WeightWork:
    """What an ``I`` leaves for its ``W``."""

    linears: list = field(default_factory=list)  # LinearSplit: (weight, input, output's gradient)
    param_groups: list | None = None  # GraphSplit: torch pipelining's saved gradients per group of weights
    weights: list | None = None  # GraphSplit: the parameters those groups' gradients go to, as the I found them
    outputs: list | None = None  # segment 0: the outputs and their gradients for the whole backward
    grads: list | None = None


def accumulate(p: torch.Tensor, g: torch.Tensor | None) -> None:
    """``p.grad += g`` as autograd accumulates (the first gradient becomes ``.grad``)."""
    if g is None:
        return
    if p.grad is None:
        p.grad = g.detach()
    else:
        p.grad.add_(g)


class LinearSplit:
    """The split backward of a chunk of plain tensors, deferring its linear layers' weight products."""

    def __init__(self, chunk: nn.Module, prepare=None):
        """``prepare(chunk)``: run before an ``I`` reads the chunk's parameters (FSDP's gather; the small
        parameters are then looked up at each ``I``, the gathered ones being FSDP's while gathered)."""
        self.chunk = chunk
        self.prepare = prepare
        self.linears = [m for m in chunk.modules() if isinstance(m, nn.Linear)]
        self.others = self._others()
        self.recording: list | None = None
        for m in self.linears:
            m.register_forward_hook(self._note)

    def _others(self) -> list:
        """The chunk's parameters but its linear layers' weights, as its modules hold them now."""
        mine = {id(m.weight) for m in self.linears}
        return [p for p in self.chunk.parameters() if id(p) not in mine]

    def _note(self, module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        """Keep the linear layer's weight and input and its output's gradient edge, which the ``I`` asks autograd
        for (a Python hook on the output instead costs a call per linear layer and micro-batch)."""
        if self.recording is not None and out.requires_grad:
            self.recording.append((module.weight, args[0], get_gradient_edge(out)))

    def forward(self, run, *args):
        """``run(*args)`` with every linear layer's weight, input and output edge noted; returns (output, notes)."""
        self.recording = notes = []
        try:
            return run(*args), notes
        finally:
            self.recording = None

    def backward_input(self, outputs, grads, inp: torch.Tensor, notes: list) -> WeightWork:
        current = self.others
        if self.prepare is not None:  # the gathered parameters are on the modules only from now
            self.prepare(self.chunk)
            current = self._others()
        others = [p for p in current if p.requires_grad]
        wanted = [inp, *others, *(edge for _w, _x, edge in notes)]
        got = torch.autograd.grad(outputs, wanted, grads, allow_unused=True)
        inp.grad = got[0]
        for p, g in zip(others, got[1 : 1 + len(others)]):
            accumulate(p, g)
        dys = got[1 + len(others) :]
        return WeightWork(linears=[(w, x, dy) for (w, x, _edge), dy in zip(notes, dys)])

    @staticmethod
    def backward_weight(work: WeightWork) -> None:
        for w, x, dy in work.linears:
            if dy is None:  # the output did not reach the loss
                continue
            dy_t = dy.reshape(-1, dy.shape[-1]).t()
            x2 = x.reshape(-1, x.shape[-1])
            if w.grad is not None and dy_t.dtype == x2.dtype == w.grad.dtype:
                w.grad.addmm_(dy_t, x2)
            else:
                accumulate(w, (dy_t @ x2.to(dy_t.dtype)).to(w.dtype))


class GraphSplit:
    """The split backward of any chunk, with torch pipelining's graph analysis (module docstring)."""

    def __init__(self, chunk: nn.Module, prepare=None):
        """``prepare(chunk)``: run before an ``I`` reads the chunk's parameters (FSDP's gather)."""
        # torch pipelining's private helpers, imported where they are used: only this fallback needs them
        from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

        self.chunk = chunk
        self.prepare = prepare
        self._input, self._weight = stage_backward_input, stage_backward_weight

    def forward(self, run, *args):
        return run(*args), None

    def backward_input(self, outputs, grads, inp: torch.Tensor, notes) -> WeightWork:
        if self.prepare is not None:
            self.prepare(self.chunk)
        weights = list(self.chunk.parameters())
        _dinputs, groups = self._input(outputs, grads, [inp], weights)
        return WeightWork(param_groups=groups, weights=weights)

    def backward_weight(self, work: WeightWork) -> None:
        self._weight(work.weights, work.param_groups)


def split_for(
    chunk: nn.Module, recomputed: bool, prepare=None, tensor_parallel: bool = False
) -> LinearSplit | GraphSplit:
    """The split of ``chunk``: by its linear layers when its weights compute as plain tensors (not tensor-parallel
    DTensors; FSDP's gathered weights are plain without tensor parallelism) and its activations are kept
    (recomputation would note the recomputed products' tensors instead), else torch's. ``prepare``: a sharded
    chunk's gather before each ``I`` (module docstring)."""
    if prepare is not None:
        plain = not tensor_parallel
    else:
        plain = not any(hasattr(p, "placements") for p in chunk.parameters())
    return LinearSplit(chunk, prepare) if plain and not recomputed else GraphSplit(chunk, prepare)


def backward_input(split, outputs, grads, inp: torch.Tensor, notes) -> WeightWork:
    """``I``: ``inp.grad`` from the outputs' gradients (``notes``: what ``split.forward`` noted); returns what
    the ``W`` needs. An input without a gradient (token ids) leaves the whole backward to the ``W``."""
    if not inp.requires_grad:
        return WeightWork(outputs=outputs, grads=grads)
    return split.backward_input(outputs, grads, inp, notes)


def backward_weight(split, work: WeightWork) -> None:
    """``W``: the weights' gradients, accumulated into their ``.grad``."""
    if work.outputs is not None:
        torch.autograd.backward(work.outputs, work.grads)
    else:
        split.backward_weight(work)
