"""Fault injection, FOR TESTS ONLY: kill a rank with SIGKILL at a chosen moment, deterministically.

Inactive (nothing installed, every hook a no-op) unless the environment variable
``FOLDTRAIN_FAULT`` is set. Its value is one or more ``;``-separated faults::

    ATTEMPT:RANK:STEP:POINT      e.g.  FOLDTRAIN_FAULT="0:1:5:forward;1:0:7:save"

On torchrun attempt ``ATTEMPT`` (``TORCHELASTIC_RESTART_COUNT``; 0 is the first attempt), global
rank ``RANK`` arms the fault when training step ``STEP`` (1-based) begins, and kills itself with
``SIGKILL`` — no cleanup, no exit handlers, exactly like an OOM kill or a lost node — at the next:

============  ==========================================================================
``step``      immediately (the start of the step)
``forward``   forward call of any module (a global forward pre-hook)
``backward``  backward pass: the first gradient computed for a module output of that step
``reduce``    collective of a reduction (``all_reduce``, reduce-scatter, all-gather, ``all_to_all_single``)
``p2p``       point-to-point transfer (``send``, ``recv``, ``isend``, ``irecv``)
``save``      checkpoint save, after this rank's files are written and before the checkpoint is complete
``export``    final export, after the weights are written to a temporary file and before the rename
============  ==========================================================================

The ``reduce`` and ``p2p`` points are the calls to :func:`point` at the top of every wrapper in
:mod:`foldtrain.collectives`, through which all of foldtrain's communication goes; ``save`` and
``export`` are calls in the checkpoint code; ``forward`` is a global module forward pre-hook, which
``install()`` registers only when a ``forward`` fault is configured; ``backward`` is a gradient hook
that a global module forward hook (registered only when a ``backward`` fault is configured) puts on
the module outputs of an armed step, so the kill comes from inside autograd's backward pass.
Nothing in ``torch.distributed`` is replaced, so ``install()`` may run at any time before training
starts (the CLI calls it first thing). Because the fault is tied to a restart attempt, a job under
``torchrun --max-restarts N`` is killed once per listed attempt and then runs to the end, which is
what the fault-injection tests check.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

ENV = "FOLDTRAIN_FAULT"
POINTS = ("step", "forward", "backward", "reduce", "p2p", "save", "export")


@dataclass(frozen=True)
class Fault:
    attempt: int
    rank: int
    step: int
    point: str


def parse(spec: str) -> list[Fault]:
    faults = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        fields = part.split(":")
        if len(fields) != 4 or fields[3] not in POINTS or not all(f.isdigit() for f in fields[:3]):
            raise ValueError(
                f"{ENV}: bad fault '{part}'; expected ATTEMPT:RANK:STEP:POINT with POINT one of {', '.join(POINTS)}"
            )
        faults.append(Fault(int(fields[0]), int(fields[1]), int(fields[2]), fields[3]))
    return faults


_mine: list[Fault] = []  # this process's faults (this attempt, this rank)
_armed: set[str] = set()
_installed = False


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def install() -> None:
    """Read ``FOLDTRAIN_FAULT`` and keep this process's faults (this attempt, this rank); a no-op when unset."""
    global _installed
    spec = os.environ.get(ENV)
    if not spec or _installed:
        return
    _installed = True
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = int(os.environ.get("RANK", "0"))
    _mine[:] = [f for f in parse(spec) if f.attempt == attempt and f.rank == rank]
    if any(f.point == "forward" for f in _mine):
        import torch.nn.modules.module as module

        module.register_module_forward_pre_hook(lambda *_: point("forward"))
    if any(f.point == "backward" for f in _mine):
        import torch.nn.modules.module as module

        module.register_module_forward_hook(_hook_backward)


def _hook_backward(_module, _inputs, output) -> None:
    """Forward hook: on an armed step, a gradient hook on the output that strikes when backward reaches it."""
    if "backward" in _armed and getattr(output, "requires_grad", False):
        output.register_hook(lambda _grad: point("backward"))


def step(n: int) -> None:
    """The training loop is starting step ``n`` (1-based): arm the faults of that step."""
    if not _mine:
        return
    for f in _mine:
        if f.step == n:
            _armed.add(f.point)
    point("step")


def point(name: str) -> None:
    """A place where a fault may strike; kills the process if a fault of this kind is armed.

    Every collective calls it, so it is one lookup in a set that stays empty unless a fault is armed."""
    if name in _armed:
        _kill()
