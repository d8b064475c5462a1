"""The ``reduce`` and ``p2p`` fault points: every communication call goes through ``foldtrain.collectives``.

``foldtrain/faults.py`` strikes at communication only where :mod:`foldtrain.collectives` calls
``faults.point``; it replaces nothing in ``torch.distributed``. So (a) no module of the
package may call a ``torch.distributed`` communication function directly (read from the source by
AST, lazy imports included; the plain-torch anchors of ``foldtrain/bench/anchors/`` are exempt), and
(b) an armed point fires in the wrappers of a real one-rank gloo group, an unarmed one does not, and
``faults.install()`` leaves ``torch.distributed`` as it was.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from foldtrain import collectives, faults

pytestmark = pytest.mark.faults

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "foldtrain"
EXEMPT = [PACKAGE / "collectives.py", PACKAGE / "bench" / "anchors"]
DIST_MODULES = {"torch.distributed", "torch.distributed.distributed_c10d"}
COMM = {
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "_all_gather_base",
    "all_to_all",
    "all_to_all_single",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "_reduce_scatter_base",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
}


def dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for a chain of attributes on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def direct_comm_uses(source: str) -> list[tuple[int, str]]:
    """(line, what) of every use of a torch.distributed communication function in ``source``.

    Names bound to ``torch.distributed`` anywhere in the file (``import torch.distributed as dist``,
    ``from torch import distributed``), ``torch.distributed.X`` spelled out, ``from torch.distributed
    import X`` and ``getattr(dist, "X")`` all count; a reference without a call does too, since binding
    the function to another name bypasses the wrappers just the same.
    """
    tree = ast.parse(source)
    aliases = set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name in DIST_MODULES and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            aliases |= {a.asname or a.name for a in node.names if a.name == "distributed"}
        elif isinstance(node, ast.ImportFrom) and node.module in DIST_MODULES:
            found += [(node.lineno, f"from {node.module} import {a.name}") for a in node.names if a.name in COMM]

    def is_dist(node: ast.AST) -> bool:
        name = dotted(node)
        return name in aliases or name in DIST_MODULES

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in COMM and is_dist(node.value):
            found.append((node.lineno, f"{dotted(node.value)}.{node.attr}"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr":
            args = node.args
            if len(args) >= 2 and is_dist(args[0]) and isinstance(args[1], ast.Constant) and args[1].value in COMM:
                found.append((node.lineno, f"getattr({dotted(args[0])}, {args[1].value!r})"))
    return sorted(found)


def test_the_detector_finds_every_spelling():
    source = """
import torch
import torch.distributed as dist
from torch import distributed as d2
from torch.distributed import isend, get_rank

def f(t):
    import torch.distributed.distributed_c10d as c10d
    dist.all_reduce(t)
    d2.send(t, 1)
    torch.distributed.recv(t, 0)
    c10d.all_gather_into_tensor(t, t)
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    dist.barrier(); dist.all_gather_object([None], 1); dist.get_rank(); collectives.all_reduce(t)
"""
    assert [what for _, what in direct_comm_uses(source)] == [
        "from torch.distributed import isend",
        "dist.all_reduce",
        "d2.send",
        "torch.distributed.recv",
        "c10d.all_gather_into_tensor",
        "dist.reduce_scatter_tensor",
        "getattr(dist, 'reduce_scatter_single')",
    ]


def test_no_module_calls_torch_distributed_communication_directly():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if any(path == e or e in path.parents for e in EXEMPT):
            continue
        rel = path.relative_to(ROOT)
        offenders += [f"{rel}:{line}: {what}" for line, what in direct_comm_uses(path.read_text(encoding="utf-8"))]
    assert not offenders, (
        "call foldtrain.collectives instead of torch.distributed (its wrappers are the faults' reduce and p2p "
        "points):\n" + "\n".join(offenders)
    )


class Killed(Exception):
    """What the test's ``_kill`` raises instead of sending SIGKILL."""


def raise_killed() -> None:
    raise Killed


@pytest.fixture
def fault_state(monkeypatch):
    """Fresh fault state for one test (restored after it); ``arm(spec)`` installs ``spec`` for rank 0 of
    attempt 0 and begins step 1, which arms the faults of that step."""
    monkeypatch.setattr(faults, "_mine", [])
    monkeypatch.setattr(faults, "_armed", set())
    monkeypatch.setattr(faults, "_installed", False)
    monkeypatch.setattr(faults, "_kill", raise_killed)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.delenv(faults.ENV, raising=False)

    def arm(spec: str) -> None:
        monkeypatch.setenv(faults.ENV, spec)
        faults.install()
        faults.step(1)

    return arm


def test_install_leaves_torch_distributed_alone(fault_state):
    before = {name: getattr(dist, name) for name in COMM if hasattr(dist, name)}
    fault_state("0:0:1:reduce;0:0:1:p2p")
    assert faults._armed == {"reduce", "p2p"}
    after = {name: getattr(dist, name) for name in COMM if hasattr(dist, name)}
    assert all(after[name] is fn for name, fn in before.items()), [n for n in before if after[n] is not before[n]]


REDUCE_CALLS = {
    "all_reduce": lambda t: collectives.all_reduce(t),
    "all_gather": lambda t: collectives.all_gather([torch.zeros_like(t)], t),
    "all_to_all_single": lambda t: collectives.all_to_all_single(torch.zeros_like(t), t),
    "reduce_scatter_tensor": lambda t: collectives.reduce_scatter_tensor(torch.zeros_like(t), t),
    "all_gather_into_tensor": lambda t: collectives.all_gather_into_tensor(torch.zeros_like(t), t),
}
P2P_CALLS = {
    "send": lambda t: collectives.send(t, 0),
    "recv": lambda t: collectives.recv(t, 0),
    "isend": lambda t: collectives.isend(t, 0),
    "irecv": lambda t: collectives.irecv(t, 0),
}


@pytest.mark.parametrize("name", sorted(REDUCE_CALLS) + sorted(P2P_CALLS))
def test_an_armed_point_fires_in_its_wrappers(fault_state, gloo_group, name):
    point = "reduce" if name in REDUCE_CALLS else "p2p"
    fault_state(f"0:0:1:{point}")
    with pytest.raises(Killed):
        {**REDUCE_CALLS, **P2P_CALLS}[name](torch.ones(4))


def test_nothing_fires_unarmed_or_at_another_point(fault_state, gloo_group):
    t = torch.ones(4)
    collectives.all_reduce(t)  # nothing configured: the collective runs (a sum over one rank)
    out = [torch.zeros(4)]
    collectives.all_gather(out, t)
    assert torch.equal(t, torch.ones(4)) and torch.equal(out[0], t)
    fault_state("0:0:2:reduce;0:1:1:reduce;1:0:1:reduce;0:0:1:p2p")  # another step, rank, attempt, point
    assert faults._armed == {"p2p"}
    collectives.all_reduce(t)
    with pytest.raises(Killed):
        collectives.isend(t, 0)


def test_backward_fires_inside_backward_of_an_armed_step_only(fault_state, monkeypatch):
    """The ``backward`` point: nothing strikes in the forward; the kill comes from autograd's backward pass,
    and an output computed before the step was armed carries no hook."""
    from collections import OrderedDict

    import torch.nn.modules.module as module

    hooks = OrderedDict()  # the global forward hooks install() registers, removed after the test
    monkeypatch.setattr(module, "_global_forward_hooks", hooks)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    monkeypatch.setenv(faults.ENV, "0:0:2:backward")
    faults.install()
    assert len(hooks) == 1
    faults.step(1)  # not the armed step: forward and backward run
    model(torch.ones(2, 4)).sum().backward()
    early = model(torch.ones(2, 4)).sum()  # before step 2 arms the fault
    faults.step(2)
    early.backward()
    loss = model(torch.ones(2, 4)).sum()  # the armed step's forward runs to the end
    with pytest.raises(Killed):
        loss.backward()
