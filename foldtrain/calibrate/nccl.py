"""Collective bandwidth and latency over message sizes, inside a node and between nodes, reported as nccl-tests
reports them (bus bandwidth); device-generic: NCCL among GPUs, gloo on a CPU (the tests' twin).

Inside a node: a group of the node's ranks, every node at once. Between nodes: a group of one rank per node,
as many such groups as a node has ranks, all at once, so the node's network interfaces carry what training
puts on them; the node's bandwidth is their sum. Every rank takes part; each group's time of a collective is
its slowest rank's.
"""

from __future__ import annotations

import math
import statistics
import time

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "send_recv")
CUDA_SIZES = tuple(8 * 1024 * 4**k for k in range(8))  # 8 KB .. 128 MB
CPU_SIZES = tuple(1024 * 4**k for k in range(5))  # 1 KB .. 256 KB
CUDA_BUDGET = 1 << 30  # bytes per size and kind: iterations = budget / size, 5 to 50
CPU_BUDGET = 1 << 20
PING_PONGS = 20
OVERLAP_PRODUCTS = 20  # matrix products timed alone, then beside the all-reduces: at least this many ...
OVERLAP_MIN_S = 0.1  # ... and as many more as take this long alone (one CPU time slice moved 10 ms by ±50%)
OVERLAP_TRIES = 4  # the all-reduces doubled until they outlast the products
OVERLAP_PAIRS = 5  # (beside, alone) timings alternated, their ratios' median kept


def bus_bw(kind: str, nbytes: float, seconds: float, n: int) -> float:
    """nccl-tests' bus bandwidth of a collective of ``nbytes`` (all-reduce's buffer, reduce-scatter's input,
    all-gather's output, the message of a send/recv) among ``n`` ranks taking ``seconds``: the algorithm
    bandwidth ``nbytes / seconds`` times ``2 (n-1) / n`` (all-reduce), ``(n-1) / n`` (reduce-scatter,
    all-gather) or 1 (send/recv)."""
    factor = {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_gather": (n - 1) / n}
    return nbytes / seconds * factor.get(kind, 1.0)


def node_groups(world: int, per_node: int) -> tuple[list[list[int]], list[list[int]]]:
    """The ranks of each node (torchrun numbers a node's ranks contiguously) and, for each local rank, the
    ranks with that local rank on every node."""
    nodes = world // per_node
    intra = [list(range(j * per_node, (j + 1) * per_node)) for j in range(nodes)]
    inter = [list(range(i, world, per_node)) for i in range(per_node)]
    return intra, inter


def message_bytes(nbytes: int, n: int) -> int:
    """The fp32 tensor of about ``nbytes`` a collective among ``n`` ranks moves (its elements a multiple of n)."""
    return 4 * n * max(1, nbytes // (4 * n))


def _collective(kind: str, nbytes: int, group, n: int, me: int, device):
    """One asynchronous call of ``kind`` on ``group`` (``me``: this rank's place in it); send/recv from its
    first rank to its second, the others idle."""
    import torch

    from foldtrain import collectives

    numel = message_bytes(nbytes, n) // 4
    full = torch.zeros(numel, device=device)
    if kind == "all_reduce":
        return lambda: collectives.all_reduce(full, group=group, async_op=True)
    if kind == "reduce_scatter":
        part = torch.zeros(numel // n, device=device)
        return lambda: collectives.reduce_scatter_single(part, full, group=group, async_op=True)
    if kind == "all_gather":
        part = torch.zeros(numel // n, device=device)
        return lambda: collectives.all_gather_single(full, part, group=group, async_op=True)
    if me == 0:
        return lambda: collectives.isend(full, group=group, group_dst=1)
    if me == 1:
        return lambda: collectives.irecv(full, group=group, group_src=0)
    return lambda: None


def _finish(works, device) -> None:
    from .gpu import sync

    for w in works:
        if w is not None:
            w.wait()
    sync(device)


def _align(group, device) -> None:
    """The group's ranks leave together: a one-element all-reduce, waited for."""
    import torch

    from foldtrain import collectives

    _finish([collectives.all_reduce(torch.zeros(1, device=device), group=group, async_op=True)], device)


def _time(fn, iters: int, group, device) -> float:
    """Seconds per call of ``fn`` over ``iters`` calls queued back to back (after two to warm up)."""
    _finish([fn(), fn()], device)
    _align(group, device)
    t0 = time.perf_counter()
    _finish([fn() for _ in range(iters)], device)
    return (time.perf_counter() - t0) / iters


def _ping_pong(group, me: int, device) -> float:
    """One way of a one-element send/recv between the group's first two ranks (half a round trip), median."""
    import torch

    from foldtrain import collectives

    x = torch.zeros(1, device=device)
    runs = []
    for _ in range(PING_PONGS + 2):
        t0 = time.perf_counter()
        if me == 0:
            collectives.send(x, group=group, group_dst=1)
            collectives.recv(x, group=group, group_src=1)
        elif me == 1:
            collectives.recv(x, group=group, group_src=0)
            collectives.send(x, group=group, group_dst=0)
        _finish([], device)
        runs.append((time.perf_counter() - t0) / 2)
    return statistics.median(runs[2:]) if me < 2 else 0.0


def sweep(group, n: int, device, sizes, budget: int) -> list[float]:
    """On ``group`` (``n`` ranks): seconds per call of each kind of :data:`KINDS` at each size, then the one-way
    latency of a small send/recv, then one step of the smallest all-reduce (its time over its ``2 (n-1)``
    steps); each the slowest rank's. Every rank of the group calls it."""
    import torch
    import torch.distributed as dist

    from foldtrain import collectives

    me = dist.get_rank(group)
    out = []
    for kind in KINDS:
        for nbytes in sizes:
            iters = max(5, min(50, budget // nbytes))
            out.append(_time(_collective(kind, nbytes, group, n, me, device), iters, group, device))
    out += [_ping_pong(group, me, device), out[0] / (2 * (n - 1))]
    t = torch.tensor(out, dtype=torch.float64, device=device)
    collectives.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def _curve(rows: list[list[float]], n: int, sizes, combine) -> dict:
    """A link from the sweeps of its groups: bus bandwidth per kind and size (``combine`` over the groups:
    ``sum`` for groups sharing a node's interfaces, a median for independent ones), latency and step."""
    busbw = {}
    for k, kind in enumerate(KINDS):
        busbw[kind] = [
            combine([bus_bw(kind, message_bytes(nb, n), row[k * len(sizes) + i], n) for row in rows])
            for i, nb in enumerate(sizes)
        ]
    return {
        "n": n,
        "groups": len(rows),
        "sizes": list(sizes),
        "busbw": busbw,
        "latency": statistics.median(row[-2] for row in rows),
        "hop": statistics.median(row[-1] for row in rows),
    }


def measure_links(device, per_node: int, sizes, budget: int) -> dict:
    """``{"intra": link or None, "inter": link or None}`` (see :func:`_curve`), on every rank; None where the
    launch has one rank per node (intra) or one node (inter), and both without a process group."""
    import torch
    import torch.distributed as dist

    from foldtrain import collectives

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return {"intra": None, "inter": None}
    world, rank = dist.get_world_size(), dist.get_rank()
    width = len(KINDS) * len(sizes) + 2
    row = []
    for lists, mine in zip(node_groups(world, per_node), divmod(rank, per_node)):
        n = len(lists[0])
        groups = [dist.new_group(ranks) for ranks in lists] if n > 1 else []  # every rank makes every group
        row += sweep(groups[mine], n, device, sizes, budget) if n > 1 else [0.0] * width
        dist.barrier()
    mine = torch.tensor(row, dtype=torch.float64, device=device)
    every = [torch.zeros_like(mine) for _ in range(world)]
    collectives.all_gather(every, mine)
    rows = [r.tolist() for r in every]
    nodes = world // per_node
    intra = [rows[j * per_node][:width] for j in range(nodes)]
    inter = [rows[i][width:] for i in range(per_node)]
    return {
        "intra": _curve(intra, per_node, sizes, statistics.median) if per_node > 1 else None,
        "inter": _curve(inter, nodes, sizes, sum) if nodes > 1 else None,
    }


def _compute_done(device) -> None:
    """Wait for the compute stream only (a device's collectives run on streams of their own)."""
    import torch

    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _beside(reduce, count: int, products, device) -> tuple[float, bool]:
    """The products' time with ``count`` all-reduces queued just before them; whether they outlasted it."""
    _align(None, device)
    works = [reduce() for _ in range(count)]
    beside = products()
    outlasted = not all(w.is_completed() for w in works)
    _finish(works, device)
    return beside, outlasted


def compute_beside_collectives(device, n: int, nbytes: int, dtype) -> float | None:
    """How much longer ``(n x n) @ (n x n)`` products (:data:`OVERLAP_PRODUCTS`, or :data:`OVERLAP_MIN_S`' worth)
    take on the slowest rank while all-reduces of ``nbytes`` over every rank run beside them than alone, less 1
    (``device.overlap_slowdown``), on every rank; None without a process group. The all-reduces are queued just
    before the products and must still be running when they end (else twice as many, up to
    :data:`OVERLAP_TRIES` times); the ratio is the median of :data:`OVERLAP_PAIRS` pairs, beside and alone
    alternated."""
    import torch
    import torch.distributed as dist

    from foldtrain import collectives

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    world, me = dist.get_world_size(), dist.get_rank()
    a = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty_like(a)

    reps = OVERLAP_PRODUCTS

    def products() -> float:
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, a, out=out)
        _compute_done(device)
        return time.perf_counter() - t0

    reps = max(reps, math.ceil(reps * OVERLAP_MIN_S / products()))
    agreed = torch.tensor([reps], dtype=torch.float64, device=device)
    collectives.all_reduce(agreed, op=dist.ReduceOp.MAX)  # the ranks time alike
    reps = int(agreed.item())
    _align(None, device)
    alone = min(products() for _ in range(3))
    reduce = _collective("all_reduce", nbytes, None, world, me, device)
    one = _time(reduce, 3, None, device)
    # every rank issues as many all-reduces: the most any rank needs
    need = torch.tensor([max(2, math.ceil(2 * alone / max(one, 1e-9)))], dtype=torch.float64, device=device)
    collectives.all_reduce(need, op=dist.ReduceOp.MAX)
    count = int(need.item())
    for _ in range(OVERLAP_TRIES):
        outlasted = torch.tensor([float(_beside(reduce, count, products, device)[1])], device=device)
        collectives.all_reduce(outlasted, op=dist.ReduceOp.MIN)
        if outlasted.item() or count > 1e5:
            break
        count *= 2
    # the slowest rank's times, alternated pairs, their ratios' median: a rank's own time moved by ±50% with the
    # other ranks' scheduling on 2 shared cores (read 0 once), the group's work as a whole much less
    pairs = []
    for _ in range(OVERLAP_PAIRS):
        beside = _beside(reduce, count, products, device)[0]
        _align(None, device)
        times = torch.tensor([beside, products()], dtype=torch.float64, device=device)
        collectives.all_reduce(times, op=dist.ReduceOp.MAX)
        pairs.append(times[0].item() / times[1].item() - 1.0)
    return max(0.0, statistics.median(pairs))
