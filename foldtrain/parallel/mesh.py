"""The 3D device mesh (data x pipeline x tensor) and the process groups the pipeline engine uses.

Placement (Megatron's): tensor-parallel ranks innermost (they exchange the most data, so they
should share a node), then pipeline, then data parallel::

    global rank = d * (P * T) + p * T + t        (d, p, t) = coords(rank)

:func:`build_mesh` returns the ``DeviceMesh`` with dims ``("dp", "pp", "tp")``;
:func:`get_topology` adds what a pipeline needs beyond the mesh's own groups, cached per layout
so a process that builds several engines (tests) creates every group only once:

* ``p2p_up`` / ``p2p_down``: two groups over this rank's pipeline (same ranks as the ``pp`` group),
  one per direction. A message from pipeline rank ``a`` to ``b`` goes over ``p2p_up`` when
  ``a < b`` and ``p2p_down`` otherwise, so each (group, pair of ranks) carries one direction only.
  With NCCL (one stream per pair and communicator, operations in posting order) a send can then
  never sit in front of a later receive from the same peer, which the interleaved and fold
  schedules need (they deadlock when sends rendezvous with receives on one stream).
* ``tie_group``: the ranks holding the first and the last model segment, over every data-parallel
  replica, at this rank's tensor-parallel coordinate: ``{(d, 0, t), (d, P-1, t) for all d}``.
  The token embedding and the output projection are one tied weight; with a pipeline they live on
  pipeline ranks 0 and P-1 as two copies whose gradients are summed (and averaged over data
  parallel) in this group before the optimizer steps (Megatron's embedding group). ``None`` when
  ``P == 1`` or this rank holds neither end.

Every group is created on every rank in the same order (``new_group`` is collective).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

__all__ = ["Topology", "build_mesh", "coords", "get_topology", "global_rank"]


def global_rank(d: int, p: int, t: int, pp: int, tp: int) -> int:
    return d * pp * tp + p * tp + t


def coords(rank: int, pp: int, tp: int) -> tuple[int, int, int]:
    """``(dp, pp, tp)`` coordinates of a global rank."""
    return rank // (pp * tp), (rank // tp) % pp, rank % tp


def build_mesh(dp: int, pp: int, tp: int, device_type: str = "cpu"):
    """The ``(dp, pp, tp)`` DeviceMesh over the world (which must have ``dp * pp * tp`` ranks)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))


@dataclass
class Topology:
    dp: int
    pp: int
    tp: int
    rank: int
    mesh: Any  # DeviceMesh ("dp", "pp", "tp")
    dp_group: Any
    pp_group: Any
    tp_group: Any
    p2p_up: Any
    p2p_down: Any
    tie_group: Any

    @property
    def coords(self) -> tuple[int, int, int]:
        return coords(self.rank, self.pp, self.tp)

    @property
    def dp_rank(self) -> int:
        return self.coords[0]

    @property
    def pp_rank(self) -> int:
        return self.coords[1]

    @property
    def tp_rank(self) -> int:
        return self.coords[2]

    @property
    def tp_mesh(self):
        return self.mesh["tp"]

    def pipeline_peer(self, p: int) -> int:
        """Global rank of pipeline rank ``p`` in this rank's pipeline (same dp and tp coordinates)."""
        d, _, t = self.coords
        return global_rank(d, p, t, self.pp, self.tp)

    def p2p_group(self, src_p: int, dst_p: int):
        """The group carrying messages from pipeline rank ``src_p`` to ``dst_p``."""
        return self.p2p_up if src_p < dst_p else self.p2p_down


_CACHE: dict[tuple, Topology] = {}


def get_topology(dp: int, pp: int, tp: int, device_type: str = "cpu", timeout_s: float | None = None) -> Topology:
    """The mesh and pipeline groups of this layout (created once per process and layout).

    ``timeout_s`` applies to the pipeline's own groups (``p2p_up`` / ``p2p_down`` / ``tie_group``);
    the mesh's ``dp`` / ``pp`` / ``tp`` groups get PyTorch's default (``init_device_mesh`` takes none),
    so the engine bounds its own waits on them explicitly.
    """
    from datetime import timedelta

    key = (dp, pp, tp, device_type, dist.get_world_size())
    if key in _CACHE:
        return _CACHE[key]
    mesh = build_mesh(dp, pp, tp, device_type)
    rank = dist.get_rank()
    d0, p0, t0 = coords(rank, pp, tp)
    kw = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
    up = down = tie = None
    if pp > 1:
        for d in range(dp):
            for t in range(tp):
                ranks = [global_rank(d, p, t, pp, tp) for p in range(pp)]
                g_up = dist.new_group(ranks, **kw)
                g_down = dist.new_group(ranks, **kw)
                if (d, t) == (d0, t0):
                    up, down = g_up, g_down
        for t in range(tp):
            ranks = sorted({global_rank(d, p, t, pp, tp) for d in range(dp) for p in (0, pp - 1)})
            g = dist.new_group(ranks, **kw)
            if t == t0 and p0 in (0, pp - 1):
                tie = g
    topo = Topology(dp, pp, tp, rank, mesh, mesh.get_group("dp"), mesh.get_group("pp"), mesh.get_group("tp"), up, down, tie)
    _CACHE[key] = topo
    return topo
