"""Process-group setup from the launcher's environment; generic over CPU (gloo) and CUDA (NCCL).

torchrun describes the world with ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK``; ``horovodrun`` with
``HOROVOD_RANK`` / ``HOROVOD_SIZE`` / ``HOROVOD_LOCAL_RANK``. Under horovodrun, Horovod is
initialised first and rank, world and local rank come from it (``hvd.rank()``, ``hvd.size()``,
``hvd.local_rank()``); a torch.distributed group over the same processes is then formed (rank 0
hosts its store, its address and port reach the others through ``hvd.broadcast_object``), so that
checkpoints, barriers and every strategy work as under torchrun.
"""

from __future__ import annotations

import gc
import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from foldtrain import collectives
from foldtrain.errors import ConfigError, DistributedError


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched_by_horovodrun() -> bool:
    """Whether horovodrun (not torchrun) started this process."""
    return "WORLD_SIZE" not in os.environ and "HOROVOD_RANK" in os.environ and "HOROVOD_SIZE" in os.environ


def launch_world_size() -> int:
    """World size from the launcher's environment (torchrun or horovodrun; 1 without either); needs no process group."""
    if launched_by_horovodrun():
        return int(os.environ["HOROVOD_SIZE"])
    return int(os.environ.get("WORLD_SIZE", "1"))


def pick_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--train.device cuda but no CUDA device is visible; use --train.device cpu or auto")
    if requested in ("auto", "cuda") and torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def init_distributed(device_request: str = "auto", timeout_s: float = 120.0) -> DistEnv:
    """Join the process group torchrun or horovodrun describes (if any). Call only after the config is validated."""
    if launched_by_horovodrun():
        return _init_from_horovod(device_request, timeout_s)
    world = launch_world_size()
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(device_request, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        backend = _backend(device)
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        kwargs.update(_attempt_store(rank, world, timedelta(seconds=timeout_s)))
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s), **kwargs)
    return DistEnv(rank, world, local_rank, device)


def _backend(device: torch.device) -> str:
    """The process group's backend for ``device``: NCCL on GPUs, whose waits then block the CPU and raise once the
    group's timeout (--dp.timeout_s) passes, so that a stalled peer becomes the same one-line DistributedError as on
    gloo instead of a watchdog abort (under torchrun and horovodrun alike); gloo elsewhere."""
    if device.type != "cuda":
        return "gloo"
    os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
    return "nccl"


def gather_floats(value: float) -> list[float]:
    """``value`` of every rank, in rank order, on every rank (one tiny all-gather; ``[value]`` alone)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [float(value)]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    out = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(dist.get_world_size())]
    collectives.all_gather(out, torch.tensor([float(value)], dtype=torch.float64, device=device))
    return [float(x) for x in out]


def _attempt_store(rank: int, world: int, timeout: timedelta) -> dict:
    """torchrun's c10d rendezvous shares its TCPStore with the workers and keeps it across restarts, so a
    restarted attempt could read the previous attempt's gloo/NCCL addresses and fail to connect
    (pytorch/pytorch#135712): give each attempt its own key prefix."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False, timeout=timeout
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {"store": dist.PrefixStore(f"foldtrain/attempt_{attempt}", store), "rank": rank, "world_size": world}


def _init_from_horovod(device_request: str, timeout_s: float) -> DistEnv:
    """Rank, world and local rank from Horovod; a torch.distributed group over the same processes."""
    try:
        import horovod.torch as hvd
    except ImportError as e:
        raise DistributedError(
            f"horovodrun started this process but this Python cannot import horovod.torch ({e}); "
            "install Horovod for it (bash scripts/install-horovod.sh) or launch with torchrun"
        ) from None
    hvd.init()
    rank, world, local_rank = hvd.rank(), hvd.size(), hvd.local_rank()
    launched = int(os.environ["HOROVOD_SIZE"])
    if world != launched:
        raise DistributedError(
            f"Horovod formed a world of {world} process(es) but horovodrun launched {launched}; "
            "check horovodrun's -np and -H slots"
        )
    device = pick_device(device_request, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        if "HOROVOD_GLOO_IFACE" in os.environ:  # the interface horovodrun chose for Horovod's own gloo
            os.environ.setdefault("GLOO_SOCKET_IFNAME", os.environ["HOROVOD_GLOO_IFACE"])
        host = os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()
        timeout = timedelta(seconds=timeout_s)
        store = (
            dist.TCPStore(host, 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
            if rank == 0
            else None
        )
        host, port = hvd.broadcast_object(
            (host, store.port) if rank == 0 else None, root_rank=0, name="foldtrain.store"
        )
        if rank != 0:
            store = dist.TCPStore(host, port, world, is_master=False, timeout=timeout)
        backend = _backend(device)
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, timeout=timeout, **kwargs)
    return DistEnv(rank, world, local_rank, device)


def shutdown() -> None:
    """Tear the process group down, after the engines that used it are collected: an engine left in a reference
    cycle (DDP's reducer holds the group's work objects) would outlive the group, and a process whose gloo threads
    outlive it can die in their destructors at exit ("terminate called without an active exception", SIGABRT; seen
    once in a 2-node doc-test run, not reproduced since)."""
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def check_same_data(fingerprint: str) -> None:
    """Every rank must train on the same prepared dataset; a mismatch raises on every rank (none hangs).

    One ``all_gather_object`` of the dataset fingerprint, right after the process group starts. Nodes
    prepare their own copy (the default corpus is each node's own standard library), so they can differ.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    ids: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(ids, fingerprint)
    if len(set(ids)) > 1:
        groups: dict[str, list[int]] = {}
        for r, i in enumerate(ids):
            groups.setdefault(str(i), []).append(r)
        desc = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {_ranges(rs)}: {i}" for i, rs in groups.items())
        raise DistributedError(
            f"the ranks train on different data (dataset fingerprints from meta.json checksums: {desc}); "
            "prepare identical data on every node (same --data.path contents, tokenizer, vocab size, seed) "
            "or give every node one prepared directory"
        )


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out, start = [], ranks[0]
    for a, b in zip(ranks, ranks[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}-{a}" if a > start else f"{a}")
            start = b
    return ",".join(out)
