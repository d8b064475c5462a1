"""The 3D device mesh (data x pipeline x tensor) and the process groups the pipeline engine uses.

Placement (Megatron's): tensor-parallel ranks innermost (they exchange the most data, so they
should share a node), then pipeline, then data parallel::

    global rank = d * (P * T) + p * T + t        (d, p, t) = coords(rank)

:func:`get_topology` creates, once per process and layout, every group a 3D run uses, each with
``--dp.timeout_s`` as its timeout (so a stalled collective ends within it on NCCL too, not after
the backend's default of minutes): the ``dp``, ``pp`` and ``tp`` groups of this rank's
coordinates, the ``DeviceMesh`` es of DTensor (below), and what a pipeline needs beyond them:

* ``mesh``: a two-dimensional ``(dp, tp)`` ``DeviceMesh`` over the ranks that share this rank's pipeline
  coordinate, built on the ``dp`` and ``tp`` groups (no new group); ``tp_mesh`` and ``dp_mesh`` are its
  two dimensions. Tensor parallelism shards over ``tp_mesh``, FSDP (``--dp.strategy fsdp``) over
  ``dp_mesh``: FSDP2 composes with parameters that are already tensor-parallel DTensors only when both
  meshes are dimensions of one parent mesh, as torchtitan's 2D meshes are.

* ``p2p_up`` / ``p2p_down``: two groups over this rank's pipeline (same ranks as the ``pp`` group),
  one per direction. A message from pipeline rank ``a`` to ``b`` goes over ``p2p_up`` when
  ``a < b`` and ``p2p_down`` otherwise, so each (group, pair of ranks) carries one direction only.
  With NCCL (one stream per pair and communicator, operations in posting order) a send can then
  never sit in front of a later receive from the same peer, which the interleaved and fold
  schedules need (they deadlock when sends rendezvous with receives on one stream). With
  ``kind_channels`` (the V placement of zbv, whose pairs of ranks carry activations of one chain and
  gradients of the other in the same direction) gradients get two more such groups,
  ``p2p_up_grad`` / ``p2p_down_grad``, so each (group, pair) carries one kind in one direction.
* ``tie_group``: the two ranks of this rank's pipeline holding the first and the last model
  segment: ``{(d, 0, t), (d, P-1, t)}``. The token embedding and the output projection are one
  tied weight; with a pipeline they live on pipeline ranks 0 and P-1 as two copies. Each copy's
  gradient is first averaged over data parallel on its own (:mod:`foldtrain.parallel.pipeline.tie`),
  then the two are summed in this group before either optimizer steps; where the distributed
  optimizer splits the copy's state between the two ends, they all-gather the stepped halves in
  it. ``None`` when ``P == 1`` or this rank holds neither end.

Every group is created on every rank in the same order (``new_group`` is collective).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

__all__ = ["Topology", "coords", "get_topology", "global_rank"]


def global_rank(d: int, p: int, t: int, pp: int, tp: int) -> int:
    return d * pp * tp + p * tp + t


def coords(rank: int, pp: int, tp: int) -> tuple[int, int, int]:
    """``(dp, pp, tp)`` coordinates of a global rank."""
    return rank // (pp * tp), (rank // tp) % pp, rank % tp


@dataclass
class Topology:
    dp: int
    pp: int
    tp: int
    rank: int
    tp_mesh: Any  # the tensor-parallel dimension of ``mesh`` (DTensor's tensor parallelism)
    dp_group: Any
    pp_group: Any
    tp_group: Any
    p2p_up: Any
    p2p_down: Any
    tie_group: Any
    p2p_up_grad: Any = None  # kind_channels: the gradients' own direction groups
    p2p_down_grad: Any = None
    mesh: Any = None  # the 2D (dp, tp) DeviceMesh of this rank's pipeline coordinate
    dp_mesh: Any = None  # its data-parallel dimension (FSDP's)

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

    def pipeline_peer(self, p: int) -> int:
        """Global rank of pipeline rank ``p`` in this rank's pipeline (same dp and tp coordinates)."""
        d, _, t = self.coords
        return global_rank(d, p, t, self.pp, self.tp)

    def dp_peers(self) -> list[int]:
        """Global ranks of this rank's data-parallel group (same pp and tp coordinates), by dp rank."""
        _, p, t = self.coords
        return [global_rank(d, p, t, self.pp, self.tp) for d in range(self.dp)]

    def p2p_group(self, src_p: int, dst_p: int, grad: bool = False):
        """The group carrying messages (gradients if ``grad``) from pipeline rank ``src_p`` to ``dst_p``."""
        if grad and self.p2p_up_grad is not None:
            return self.p2p_up_grad if src_p < dst_p else self.p2p_down_grad
        return self.p2p_up if src_p < dst_p else self.p2p_down


_CACHE: dict[tuple, Topology] = {}


def get_topology(
    dp: int,
    pp: int,
    tp: int,
    device_type: str = "cpu",
    timeout_s: float | None = None,
    kind_channels: bool = False,
) -> Topology:
    """The process groups and tensor-parallel mesh of this layout (created once per process and layout).

    Groups are created on every rank in the same order (``new_group`` is collective); ``timeout_s``
    applies to all of them. ``kind_channels``: separate point-to-point groups for gradients (module docstring).
    """
    from datetime import timedelta

    from torch.distributed.device_mesh import DeviceMesh

    key = (dp, pp, tp, device_type, dist.get_world_size(), kind_channels)
    if key in _CACHE:
        return _CACHE[key]
    rank = dist.get_rank()
    d0, p0, t0 = coords(rank, pp, tp)
    kw = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}

    def groups(members: list[list[int]]):
        """One group per list (all created by every rank); the one holding this rank."""
        mine = None
        for ranks in members:
            g = dist.new_group(ranks, **kw)
            if rank in ranks:
                mine = g
        return mine

    dp_g = groups([[global_rank(d, p, t, pp, tp) for d in range(dp)] for p in range(pp) for t in range(tp)])
    pp_g = groups([[global_rank(d, p, t, pp, tp) for p in range(pp)] for d in range(dp) for t in range(tp)])
    tp_g = groups([[global_rank(d, p, t, pp, tp) for t in range(tp)] for d in range(dp) for p in range(pp)])
    mesh = DeviceMesh.from_group(
        [dp_g, tp_g],
        device_type,
        mesh=[[global_rank(d, p0, t, pp, tp) for t in range(tp)] for d in range(dp)],
        mesh_dim_names=("dp", "tp"),
    )
    up = down = tie = None
    directions = []  # (up, down) per kind: activations, then gradients with kind_channels
    if pp > 1:
        for _kind in range(2 if kind_channels else 1):
            for d in range(dp):
                for t in range(tp):
                    ranks = [global_rank(d, p, t, pp, tp) for p in range(pp)]
                    g_up = dist.new_group(ranks, **kw)
                    g_down = dist.new_group(ranks, **kw)
                    if (d, t) == (d0, t0):
                        directions.append((g_up, g_down))
        up, down = directions[0]
        for d in range(dp):
            for t in range(tp):
                g = dist.new_group([global_rank(d, 0, t, pp, tp), global_rank(d, pp - 1, t, pp, tp)], **kw)
                if (d, t) == (d0, t0) and p0 in (0, pp - 1):
                    tie = g
    topo = Topology(dp, pp, tp, rank, mesh["tp"], dp_g, pp_g, tp_g, up, down, tie, mesh=mesh, dp_mesh=mesh["dp"])
    if len(directions) > 1:
        topo.p2p_up_grad, topo.p2p_down_grad = directions[1]
    _CACHE[key] = topo
    return topo
