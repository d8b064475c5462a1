"""Process-group setup from the launcher's environment; generic over CPU (gloo) and CUDA (NCCL).

torchrun describes the world with ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK``; ``horovodrun`` with
``HOROVOD_RANK`` / ``HOROVOD_SIZE`` / ``HOROVOD_LOCAL_RANK``. Under horovodrun, Horovod is
initialised first and rank, world and local rank come from it (``hvd.rank()``, ``hvd.size()``,
``hvd.local_rank()``); a torch.distributed group over the same processes is then formed (rank 0
hosts its store, its address and port reach the others through ``hvd.broadcast_object``), so that
checkpoints, barriers and every strategy work as under torchrun.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

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
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s), **kwargs)
    return DistEnv(rank, world, local_rank, device)


def _init_from_horovod(device_request: str, timeout_s: float) -> DistEnv:
    """Rank, world and local rank from Horovod; a torch.distributed group over the same processes."""
    try:
        import horovod.torch as hvd
    except ImportError as e:
        raise DistributedError(f"horovodrun started this process but this Python cannot import horovod.torch ({e}); install Horovod for it "
                               "(bash scripts/install-horovod.sh) or launch with torchrun") from None
    hvd.init()
    rank, world, local_rank = hvd.rank(), hvd.size(), hvd.local_rank()
    launched = int(os.environ["HOROVOD_SIZE"])
    if world != launched:
        raise DistributedError(f"Horovod formed a world of {world} process(es) but horovodrun launched {launched}; "
                               "check horovodrun's -np and -H slots")
    device = pick_device(device_request, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        if "HOROVOD_GLOO_IFACE" in os.environ:  # the interface horovodrun chose for Horovod's own gloo
            os.environ.setdefault("GLOO_SOCKET_IFNAME", os.environ["HOROVOD_GLOO_IFACE"])
        host = os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, 0, world, is_master=True, timeout=timeout, wait_for_workers=False) if rank == 0 else None
        host, port = hvd.broadcast_object((host, store.port) if rank == 0 else None, root_rank=0, name="foldtrain.store")
        if rank != 0:
            store = dist.TCPStore(host, port, world, is_master=False, timeout=timeout)
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, timeout=timeout, **kwargs)
    return DistEnv(rank, world, local_rank, device)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
