"""Process-group setup from torchrun's environment; generic over CPU (gloo) and CUDA (NCCL)."""

from __future__ import annotations

import hashlib
import json
import os
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
        kwargs.update(_attempt_store(rank, world, timedelta(seconds=timeout_s)))
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s), **kwargs)
    return DistEnv(rank, world, local_rank, device)


def gather_floats(value: float) -> list[float]:
    """``value`` of every rank, in rank order, on every rank (one tiny all-gather; ``[value]`` alone)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [float(value)]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    out = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(out, torch.tensor([float(value)], dtype=torch.float64, device=device))
    return [float(x) for x in out]


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


def dataset_identity(meta: dict) -> str:
    """A short fingerprint of a prepared dataset: its ``meta.json`` checksums, token counts and vocabulary."""
    s = meta["splits"]
    key = json.dumps([meta.get("dtype"), meta.get("vocab_size"), meta.get("eot_id"), s["train"]["tokens"], s["train"]["sha256"], s["val"]["tokens"], s["val"]["sha256"]])
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def check_same_data(meta: dict) -> None:
    """Every rank must train on the same prepared dataset; a mismatch raises on every rank (none hangs).

    One ``all_gather_object`` of the dataset fingerprint, right after the process group starts. Nodes
    prepare their own copy (the default corpus is each node's own standard library), so they can differ.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    ids: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(ids, dataset_identity(meta))
    if len(set(ids)) > 1:
        groups: dict[str, list[int]] = {}
        for r, i in enumerate(ids):
            groups.setdefault(str(i), []).append(r)
        desc = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {_ranges(rs)}: {i}" for i, rs in groups.items())
        raise DistributedError(
            f"the ranks train on different data (dataset fingerprints from meta.json checksums: {desc}); "
            "prepare identical data on every node (same --data.path contents, tokenizer, vocab size, seed) or give every node one prepared directory"
        )


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out, start = [], ranks[0]
    for a, b in zip(ranks, ranks[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}-{a}" if a > start else f"{a}")
            start = b
    return ",".join(out)
