"""What the anchor scripts share, so that each keeps only its own training loop: the device, the data
and model every run starts from, foldtrain's AdamW and LR schedule, autocast, and rank 0's
``metrics.jsonl``.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from foldtrain.data import TokenData, resolve_data
from foldtrain.hostmem import keep_freed_host_memory
from foldtrain.model import GPT, GPTShape
from foldtrain.train.metrics import peak_memory_mb  # measured exactly as foldtrain's runs are

# --precision -> autocast dtype; the ``*-master`` precisions map to autocast too (which keeps fp32
# weights: the AMP-O1 way a plain PyTorch user gets mixed precision)
HALF = {"bf16": torch.bfloat16, "bf16-master": torch.bfloat16, "fp16": torch.float16, "fp16-master": torch.float16}


def setup_device(t, local_rank: int) -> torch.device:
    """The process's device: GPU ``local_rank`` (modulo the GPUs there are) unless ``--train.device cpu``
    or no CUDA; made the current device."""
    use_cuda = torch.cuda.is_available() and t.device != "cpu"
    device = torch.device("cuda", local_rank % torch.cuda.device_count()) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    return device


def data_and_model(cfg) -> tuple[TokenData, GPT]:
    """The prepared data and the GPT (on the CPU) built with ``--train.seed``, as foldtrain builds it;
    the host allocator set up as foldtrain's runs set it (``--train.malloc_cache``), so that a comparison
    measures the parallel strategy, not malloc."""
    on_gpu = torch.cuda.is_available() and cfg.train.device != "cpu"  # as setup_device decides
    if cfg.train.malloc_cache and not on_gpu:
        keep_freed_host_memory()
    data = TokenData.open(resolve_data(cfg.data))
    torch.manual_seed(cfg.train.seed)
    return data, GPT(GPTShape.from_config(cfg.model, cfg.parallel.tp), cfg.train.seed)


def untie_head(head: torch.nn.Module) -> None:
    """Give the output projection its own copy of the (tied) embedding weight."""
    head.lm_head.weight = torch.nn.Parameter(head.lm_head.weight.detach().clone())


def adamw(params, o, foreach: bool | None = True) -> torch.optim.AdamW:
    """foldtrain's AdamW: weight decay on matrices only."""
    params = list(params)
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=o.lr,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
        foreach=foreach,
    )


def lr_at(step: int, o, total: int) -> float:
    """Linear warm-up, then cosine decay to min_lr (the schedule foldtrain uses)."""
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    t = min(1.0, (step - o.warmup_steps) / max(1, total - o.warmup_steps))
    return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1 + math.cos(math.pi * t))


def set_lr(opt: torch.optim.Optimizer, lr: float) -> float:
    for g in opt.param_groups:
        g["lr"] = lr
    return lr


def autocast_for(device: torch.device, half: torch.dtype | None):
    """A factory of the forward's context: ``torch.autocast`` to ``half``, or nothing for None."""
    return (lambda: torch.autocast(device.type, dtype=half)) if half is not None else contextlib.nullcontext


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def micro_batches(x: torch.Tensor, y: torch.Tensor, n: int, rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first ``n`` consecutive slices of ``rows`` rows of a batch."""
    return [(x[i * rows : (i + 1) * rows], y[i * rows : (i + 1) * rows]) for i in range(n)]


class Metrics:
    """Rank 0's ``metrics.jsonl`` in ``--out``, one line per step with the fields the benchmark reads
    (``step``, ``loss``, ``lr``, ``tokens_per_s``, ``step_time_s``, ``time_s``, ``grad_norm``, ``peak_mem_mb``);
    on the other ranks it writes nothing and reads no values (no device synchronisation). ``time_s`` is the
    wall clock since the object was made, as foldtrain's loop writes it: the benchmark's step time is the
    period between two of them."""

    def __init__(self, cfg, rank: int, device: torch.device):
        self.tokens_per_step = cfg.train.global_batch * cfg.train.seq_len
        self.device = device
        self.t0 = time.perf_counter()
        self.f = None
        if rank == 0:
            out = Path(cfg.out)
            out.mkdir(parents=True, exist_ok=True)
            self.f = open(out / "metrics.jsonl", "w")

    def write(self, step: int, dt: float, loss, lr: float | None = None, grad_norm=None) -> None:
        """Step ``step`` (0-based) took ``dt`` seconds; ``loss`` and ``grad_norm`` may be one-element tensors."""
        if self.f is None:
            return
        rec = {"step": step + 1, "loss": float(loss)}
        if lr is not None:
            rec["lr"] = lr
        rec.update(tokens_per_s=self.tokens_per_step / dt, step_time_s=dt, time_s=time.perf_counter() - self.t0)
        if grad_norm is not None:
            rec["grad_norm"] = float(grad_norm)
        rec["peak_mem_mb"] = peak_memory_mb(self.device)
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()

    def close(self) -> None:
        if self.f is not None:
            self.f.close()
