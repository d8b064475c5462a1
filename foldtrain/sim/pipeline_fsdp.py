"""``--dp.strategy fsdp`` in the 3D engine, simulated: every pipeline chunk fully sharded over dp.

What ``foldtrain/parallel/pipeline/fsdp.py`` does, in FSDP2's terms (torch pipelining drives FSDP the same way):
every block of a chunk is one FSDP unit, the chunk's own parameters (the embedding, the final norm, the head's
tied copy) another, its *root*. Every rank keeps 1/dp of each parameter, gradient and AdamW moment in fp32.

* **All-gathers** (``weight_bytes`` per parameter: half precision under ``*-master``, whose policy gathers
  half weights; fp32 otherwise): a unit is gathered when a forward or backward of its chunk needs it and it is
  sharded. The root stays gathered from the chunk's first forward of the iteration to its ``LR``
  (``reshard_after_forward=False``). A block is resharded after each forward (``--dp.reshard_after_forward``)
  but never after a backward before the ``LR`` (``set_reshard_after_backward(False)``): so a backward after a
  forward gathers the blocks again, a forward after a backward finds them gathered
  (:func:`gathering_actions`). On shared cores (gloo) the all-gathers run on the training thread before the
  compute; on a GPU FSDP2 prefetches the next unit while one computes, so only the first unit's all-gather
  waits and the pass takes the longer of its compute and the other units' all-gathers. A split backward
  (the zero-bubble schedules) gathers at its ``I`` (segment 0, without an input gradient, at its ``W``, which is
  its whole backward: ``runs_backward``), every block at once before the compute (the engine gathers them
  itself, so that the ``I`` reads the gathered weights: :func:`prefetched`); its other ``W`` gather nothing.
* **Reduce-scatters**: the backwards only accumulate unsharded fp32 gradients (``reduce_dtype``); the chunk's
  ``LR`` reduce-scatters every unit's and waits for them (the root's final callback): the rank blocks there.
  Then the tied copy's shard is summed with the other end of the pipeline (one all-reduce of ``1/dp`` of the
  embedding over the two ranks, asynchronous, waited at the ``WR``).
* **The step**: AdamW on the rank's 1/dp (28 bytes per parameter: the fp32 shards are the masters).

Memory per rank: the fp32 shards (16 bytes per parameter / dp) and, walking the rank's action list, the most
the unsharded units and the accumulated fp32 gradients hold together with the activations
(:func:`peak_buffers`): a chunk's root from its first forward to its ``LR``, its blocks from its first
backward (with ``reshard_after_forward false`` from its first forward), its gradients (4 bytes per parameter)
from its first backward; in a pass while the chunk's blocks are not held, two blocks gathered at once on a GPU
(the one computing, the one prefetched), one on shared cores (:func:`on_thread`); at the ``LR``, where each
unit in turn is resharded and its gradients copied into an fp32 reduce-scatter input, the largest unit's input
less its weights.
"""

from __future__ import annotations

from foldtrain.schedules import WEIGHT_OPS, Op, Schedule, runs_backward

from .cluster import Cluster
from .costs import block_params, segment_params
from .setup import Setup

REDUCE_BYTES = 4  # fp32 gradients: accumulated, reduce-scattered, sharded


def on_thread(c: Cluster) -> bool:
    """Whether FSDP2's collectives run on the training thread: on shared cores (gloo on CPUs). There they
    overlap no compute, so a prefetch would only hold memory: foldtrain turns it off, and frees each
    reduce-scatter's input as it returns (``foldtrain/parallel/fsdp_gloo.py``): a rank holds one gathered block
    in a pass, not two, and no reduce-scatter input beyond the one being filled."""
    return c.shared_cores > 0


def units(s: Setup, seg: int) -> tuple[float, float]:
    """``(blocks, root)``: the parameters of segment ``seg``'s blocks (one unit each) and of its own unit."""
    blocks = s.layers[seg] * block_params(s)
    return blocks, segment_params(s, seg) - blocks


def prefetched(a) -> bool:
    """Whether FSDP's own hooks gather action ``a``'s blocks, prefetching the next while one computes on a GPU: a
    forward or a whole backward; an ``I`` gathers every block first (``foldtrain/parallel/pipeline/fsdp.py``)."""
    return a.op is not Op.BACKWARD_INPUT


def unit_host(c: Cluster, gathers: bool) -> float:
    """FSDP2's host work on one unit with parameters in one pass: its hooks (``fsdp_unit``) and, where the pass
    ``gathers`` it, its copies in and out and its reshard (``fsdp_gather``). A root runs ``fsdp_root`` more, its
    own hooks that begin and end the pass (:func:`root_host`). The one rule both simulators of FSDP price its
    host work by."""
    return c.fsdp_unit + (c.fsdp_gather if gathers else 0.0)


def root_host(c: Cluster, has_params: bool, gathers: bool) -> float:
    """The root's host work in one pass: its own hooks, and :func:`unit_host` where it holds parameters."""
    return c.fsdp_root + (unit_host(c, gathers) if has_params else 0.0)


def fsdp_host(
    c: Cluster, blocks: int, op: Op, segment: int, gathers: bool, root_params: bool = False, root_gathers: bool = False
) -> float:
    """FSDP2's host work in a compute action of a chunk of ``blocks`` blocks: :func:`unit_host` of every block
    and :func:`root_host` of the chunk's root (``root_params``: it holds parameters) in a pass that runs through
    their hooks (a forward, a backward: ``runs_backward``), the blocks gathered where the pass ``gathers``, the
    root where ``root_gathers`` (its first forward: :func:`roots_gathered`). A weight-gradient ``W`` past
    segment 0 multiplies saved tensors, outside FSDP's hooks: none."""
    if op is not Op.FORWARD and not runs_backward(op, segment):
        return 0.0
    return blocks * unit_host(c, gathers) + root_host(c, root_params, root_gathers)


def gathering_actions(sched: Schedule, p: int, reshard_after_forward: bool) -> set[tuple[Op, int, int]]:
    """``(op, chunk, micro-batch)`` of the forwards and backward passes (``runs_backward``) of rank ``p`` that
    find their chunk's blocks sharded, so FSDP all-gathers them first (the module docstring's rule); every ``LR``
    reshards its chunk."""
    gathered: dict[int, bool] = {}
    out = set()
    for a in sched.ranks[p]:
        if a.op is Op.FORWARD or runs_backward(a.op, a.chunk):
            if not gathered.get(a.chunk):
                out.add((a.op, a.chunk, a.mb))
            gathered[a.chunk] = a.op is not Op.FORWARD or not reshard_after_forward
        elif a.op is Op.LAUNCH_REDUCE:
            gathered[a.chunk] = False
    return out


def roots_gathered(sched: Schedule, p: int) -> set[tuple[int, int]]:
    """``(chunk, micro-batch)`` of each chunk's first forward on rank ``p``: where its root is gathered."""
    seen: set[int] = set()
    out = set()
    for a in sched.ranks[p]:
        if a.op is Op.FORWARD and a.chunk not in seen:
            seen.add(a.chunk)
            out.add((a.chunk, a.mb))
    return out


def peak_buffers(
    s: Setup,
    sched: Schedule,
    p: int,
    act: dict[int, float],
    blocks: dict[int, float],
    roots: dict[int, float],
    thread: bool = False,
) -> tuple[float, float]:
    """``(activations, unsharded buffers)`` at the moment rank ``p`` holds most of both together; ``act``: a
    segment's activation bytes per micro-batch; ``blocks`` / ``roots``: its blocks' and root's parameters;
    ``thread``: :func:`on_thread`."""
    wb = s.weight_bytes
    passing = 1 if thread else 2  # blocks gathered during a pass: the one computing (and the one prefetched)
    first_f: set[int] = set()
    first_b: set[int] = set()
    live = 0.0
    best = (0.0, 0.0)

    def blocks_held(c: int) -> bool:
        return c in first_f and (c in first_b or not s.reshard_after_forward)

    def held() -> float:
        out = 0.0
        for c in first_f:
            out += roots[c] * wb + (blocks[c] * wb if blocks_held(c) else 0.0)
            if c in first_b:
                out += (blocks[c] + roots[c]) * REDUCE_BYTES
        return out

    def moment(transient: float) -> None:
        nonlocal best
        if live + held() + transient > sum(best):
            best = (live, held() + transient)

    for a in sched.ranks[p]:
        c = a.chunk
        if a.op is Op.FORWARD:
            first_f.add(c)
            live += act[c]
        if (a.op is Op.FORWARD or runs_backward(a.op, a.chunk)) and s.layers[c]:
            # the unit computing (and the one prefetched), where the chunk's blocks are not all held already; an
            # I holds them all from its start
            unit = blocks[c] if not prefetched(a) else passing * blocks[c] / s.layers[c]
            moment(0.0 if blocks_held(c) else unit * wb)  # a forward; a backward's start
        if runs_backward(a.op, a.chunk) or a.op in WEIGHT_OPS:
            first_b.add(c)  # the blocks stay gathered, the chunk's gradients accumulate
        if a.op in WEIGHT_OPS:  # this micro-batch's activations freed
            live -= act[c]
            if a.op is Op.BACKWARD:
                moment(0.0)
        elif a.op is Op.LAUNCH_REDUCE:
            # each unit in turn: its weights resharded, its gradients copied into an fp32 reduce-scatter input
            unit = max(roots[c], blocks[c] / max(s.layers[c], 1))
            moment(unit * (REDUCE_BYTES - wb))
            first_f.discard(c)
            first_b.discard(c)
    return best
