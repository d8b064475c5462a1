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
        if backend == "nccl":
            # waits block the CPU and raise once the group's timeout (--dp.timeout_s) passes, so a stalled
            # peer becomes the same one-line DistributedError as on gloo instead of a watchdog abort
            os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s), **kwargs)
    return DistEnv(rank, world, local_rank, device)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
