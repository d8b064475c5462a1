"""Process-group setup from torchrun's environment; generic over CPU (gloo) and CUDA (NCCL)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from foldtrain.errors import ConfigError


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launch_world_size() -> int:
    """World size from torchrun's environment (1 without torchrun); needs no process group."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def pick_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--train.device cuda but no CUDA device is visible; use --train.device cpu or auto")
    if requested in ("auto", "cuda") and torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def init_distributed(device_request: str = "auto", timeout_s: float = 120.0) -> DistEnv:
    """Join the process group torchrun describes (if any). Call only after the config is validated."""
    world = launch_world_size()
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(device_request, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        kwargs.update(_attempt_store(rank, world, timedelta(seconds=timeout_s)))
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s), **kwargs)
    return DistEnv(rank, world, local_rank, device)


def _attempt_store(rank: int, world: int, timeout: timedelta) -> dict:
    """torchrun's c10d rendezvous shares its TCPStore with the workers and keeps it across restarts, so a
    restarted attempt could read the previous attempt's gloo/NCCL addresses and fail to connect
    (pytorch/pytorch#135712): give each attempt its own key prefix."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {"store": dist.PrefixStore(f"foldtrain/attempt_{attempt}", store), "rank": rank, "world_size": world}


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
