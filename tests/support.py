"""What the multi-rank tests share: one torchrun launcher and a synthetic sampler for the trainer's engines.

What the equivalence tests compare with (error measures, the attention key biases they leave out, token
batches, the single-process reference run) is in ``tests.equivalence``."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import torch

from tests import launch
from tests.launch import launch_env

ROOT = Path(__file__).resolve().parents[1]


def torchrun(
    n: int,
    *args: str,
    timeout: float,
    monitor_s: float | None = None,
    env: dict[str, str] | None = None,
    fork: bool = True,
) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node n ARGS`` from the repository root in :func:`launch_env` with
    ``env`` added; output captured. With ``fork`` (the default) the agent and its ranks are forked from an
    interpreter that has imported torch already (:mod:`tests.launch`: torchrun's own agent, about half the CPU
    time of a short run); ``fork=False`` runs torchrun itself."""
    argv = ["--standalone", "--nproc-per-node", str(n)]
    if monitor_s is not None:
        argv += ["--monitor-interval", str(monitor_s)]
    if fork:
        return launch.run([*argv, *args], launch_env(env), ROOT, timeout)
    cmd = [sys.executable, "-m", "torch.distributed.run", *argv, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=launch_env(env), cwd=ROOT)


def failed(proc: subprocess.CompletedProcess) -> str:
    """The tail of a failed launch's output, for an assertion message."""
    return f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


class SyntheticSampler:
    """Deterministic batches seeded by the step; rank r gets rows [r*G/W, (r+1)*G/W) like SequenceSampler.

    ``toy``: learnable sequences (each token is the previous one plus 1), for convergence checks.
    """

    def __init__(self, vocab: int, seq_len: int, toy: bool = False):
        self.vocab, self.seq_len, self.toy = vocab, seq_len, toy

    def global_batch(self, step: int, rows: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 + step)
        if self.toy:
            start = torch.randint(0, self.vocab, (rows, 1), generator=g)
            return (start + torch.arange(self.seq_len + 1)) % self.vocab
        return torch.randint(0, self.vocab, (rows, self.seq_len + 1), generator=g)

    def rank_batch(self, step: int, global_batch: int, rank: int, world: int):
        per = global_batch // world
        seq = self.global_batch(step, global_batch)[rank * per : (rank + 1) * per]
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


@contextlib.contextmanager
def all_reduced_dtypes(small: list[int] | None = None):
    """The elements foldtrain's all-reduces carried, by dtype, leaving out tensors of under 64 elements (the
    step's loss, norms and agreements): what ``--dp.compression`` must have cast. ``small``: a one-element list
    that counts those left out (each is a step's latency on a slow link)."""
    from foldtrain import collectives

    seen: dict[str, int] = {}
    real = collectives.all_reduce

    def counted(tensor, *args, **kwargs):
        if tensor.numel() >= 64:
            seen[str(tensor.dtype)] = seen.get(str(tensor.dtype), 0) + tensor.numel()
        elif small is not None:
            small[0] += 1
        return real(tensor, *args, **kwargs)

    collectives.all_reduce = counted
    try:
        yield seen
    finally:
        collectives.all_reduce = real
