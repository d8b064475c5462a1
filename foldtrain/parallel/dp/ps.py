"""``--dp.strategy ps``: a centralised parameter server (the paper's "single parameter server").

Roles. ``--dp.ps_servers 0``: rank 0 is the server *and* a worker (colocated); every rank is a
worker. ``--dp.ps_servers K``: ranks ``0..K-1`` are dedicated servers that compute nothing
(their ``batch`` is empty) and ranks ``K..`` are the workers; ``dp_rank``/``dp_world`` number the
workers only, so the global batch is split among them. Whole parameter tensors are assigned to
the servers, largest first to the least-loaded one.

Only a server holds parameters of record: the fp32 master copy of the tensors it serves and
their AdamW state (workers keep a model replica to compute with, and no optimizer state).

One synchronous step, all point-to-point (``isend``/``irecv``), so the byte counters show the
server's link carrying N times a worker's traffic:

1. every worker sends each server the gradients of that server's tensors (in the model's
   gradient dtype: half in the master precisions);
2. each server sums the N workers' gradients in fp32 and divides by N;
3. the fp16 loss scaler's skip decision is all-reduced (MIN) over all ranks, so workers' scalers
   stay in step with the servers';
4. each server clips with the global norm (squared norms summed over the servers' own group
   when K > 1), steps AdamW, and sends every worker the new values (model dtype).

The training loss is the mean over workers; a dedicated server's model replica is never
updated, so it contributes nothing to the loss or the validation loss. With
``--dp.ps_staleness S > 0`` the bounded-staleness asynchronous variant runs
(:mod:`foldtrain.parallel.dp.ps_async`).

Checkpoint: each server saves the masters it serves under the single-process names (``model``)
and their moments (``optim``, keyed by parameter name), so the union over servers is an ordinary
full checkpoint; after loading, the servers send the workers their parameters.
"""

from __future__ import annotations

import copy
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

from foldtrain import collectives
from foldtrain.errors import ConfigError
from foldtrain.optim import adamw_state, load_adamw_state
from foldtrain.parallel.dp.base import DataParallelStrategy
from foldtrain.parallel.flat import flatten, unflatten_into

GRAD_TAG, PARAM_TAG, HEADER_TAG, EXPORT_TAG = 11, 12, 13, 14


class ParameterServerStrategy(DataParallelStrategy):
    def __init__(self, state, cfg):
        super().__init__(state, cfg)
        k = cfg.dp.ps_servers
        self.servers = list(range(k)) if k else [0]
        self.workers = list(range(k, self.world))
        self.is_server, self.is_worker = self.rank in self.servers, self.rank in self.workers
        self.dp_rank, self.dp_world = (self.workers.index(self.rank) if self.is_worker else 0), len(self.workers)
        self.params = [p for _, p in self.named_params]
        self.served = assign_to_servers([p.numel() for p in self.params], self.servers)
        if any(not served for served in self.served.values()):
            raise ConfigError(
                f"--dp.ps_servers {k} is more than the model's {len(self.params)} parameter tensors; use fewer servers"
            )
        if self.is_server:  # fp32 masters of the served tensors own the optimizer
            self.masters = {i: nn.Parameter(self.params[i].detach().float().clone()) for i in self.served[self.rank]}
            named = [(self.named_params[i][0], m) for i, m in self.masters.items()]
        else:  # a worker's optimizer never steps: it only keeps the LR schedule and zero_grad uniform
            self.masters, named = {}, self.named_params
        state.set_optimizer(named, self.server_optim_config(cfg), masters=False)
        self.server_group = dist.new_group(self.servers) if len(self.servers) > 1 else None

    def server_optim_config(self, cfg):
        return cfg.optim

    def size_of(self, server: int) -> int:
        return sum(self.params[i].numel() for i in self.served[server])

    def batch(self, sampler, step):
        if self.is_worker:
            return super().batch(sampler, step)
        empty = torch.zeros((0, self.cfg.train.seq_len), dtype=torch.long)  # a dedicated server computes nothing
        return empty, empty

    def grads_for(self, server: int, dtype: torch.dtype) -> torch.Tensor:
        """This worker's gradients of ``server``'s tensors, packed into one buffer."""
        return flatten(
            [
                self.params[i].grad if self.params[i].grad is not None else torch.zeros_like(self.params[i])
                for i in self.served[server]
            ],
            dtype,
        )

    def set_master_grads(self, flat: torch.Tensor) -> None:
        offset = 0
        for m in self.masters.values():
            m.grad = flat[offset : offset + m.numel()].view_as(m)
            offset += m.numel()

    # ------------------------------------------------------------------ the step's hooks
    def sync_grads(self) -> None:
        """Workers push gradients; each server averages its tensors' gradients over the workers (fp32)."""
        dtype = self.precision.param_dtype
        sends = []
        if self.is_worker:
            sends = [
                (s, self.comm.isend(self.grads_for(s, dtype), s, GRAD_TAG)) for s in self.servers if s != self.rank
            ]
        if self.is_server:
            size = self.size_of(self.rank)
            bufs = {w: torch.empty(size, dtype=dtype, device=self.device) for w in self.workers if w != self.rank}
            recvs = {w: self.comm.irecv(b, w, GRAD_TAG) for w, b in bufs.items()}
            total = (
                self.grads_for(self.rank, torch.float32) if self.is_worker else torch.zeros(size, device=self.device)
            )
            for w, work in recvs.items():
                self.comm.wait(work, "gradient push", peer=w)
                total += bufs[w].float()
            self.set_master_grads(total.div_(len(self.workers)))
        for s, work in sends:
            self.comm.wait(work, "gradient push", peer=s)

    def optimizer_params(self) -> list[torch.Tensor]:
        return list(self.masters.values())

    def global_finite(self, finite: bool) -> bool:
        return self.all_true(finite, "loss-scaler all-reduce") if self.precision.scaler.enabled else finite

    def clip(self, params: list[torch.Tensor]) -> float:
        return self.clip_by_global_norm(params, self.server_group, len(self.servers))

    def apply_update(self, grads_finite: bool) -> None:
        if grads_finite:
            if self.is_server:
                self.last_grad_norm = self.clip(self.optimizer_params())
                self.optimizer.step()
            self.distribute_params()
        self.step_schedule()

    def step_schedule(self) -> None:
        if self.is_server:
            self.lr_scheduler.step()
            return
        with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": a worker's never steps
            warnings.simplefilter("ignore", UserWarning)
            self.lr_scheduler.step()

    def distribute_params(self) -> None:
        """Servers send every worker the current values of their tensors (model dtype)."""
        dtype = self.precision.param_dtype
        sends, recvs = [], []
        if self.is_server:
            mine = flatten(list(self.masters.values()), dtype)
            sends = [(w, self.comm.isend(mine, w, PARAM_TAG)) for w in self.workers if w != self.rank]
            if self.is_worker:
                unflatten_into(mine, [self.params[i] for i in self.served[self.rank]])
        if self.is_worker:
            for s in self.servers:
                if s != self.rank:
                    buf = torch.empty(self.size_of(s), dtype=dtype, device=self.device)
                    recvs.append((s, buf, self.comm.irecv(buf, s, PARAM_TAG)))
        for s, buf, work in recvs:
            self.comm.wait(work, "parameter pull", peer=s)
            unflatten_into(buf, [self.params[i] for i in self.served[s]])
        for w, work in sends:
            self.comm.wait(work, "parameter pull", peer=w)

    def reduce_scalar(self, value: torch.Tensor) -> torch.Tensor:
        return self.mean_over(value, len(self.workers), self.is_worker)

    def zero_grad(self) -> None:
        super().zero_grad()
        self.model.zero_grad(set_to_none=True)

    def eval_loss(self, local_loss) -> float:
        """Mean over the workers' replicas (a dedicated server's replica is not current)."""
        with self.failures_named():
            local = local_loss() if self.is_worker else torch.zeros((), device=self.device)
            return float(self.mean_over(local, len(self.workers), self.is_worker))

    # ------------------------------------------------------------------ checkpoint and export
    def model_optim_state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        index = {p.data_ptr(): i for i, p in enumerate(self.params)}
        model = {
            k: self.masters[index[v.data_ptr()]]
            for k, v in get_model_state_dict(self.model).items()
            if index.get(v.data_ptr()) in self.masters
        }
        optim = {self.named_params[i][0]: adamw_state(self.optimizer, m) for i, m in self.masters.items()}
        return {"model": model, "optim": optim}

    @torch.no_grad()
    def load_model_optim_state(self, sd: dict) -> None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        index = {p.data_ptr(): i for i, p in enumerate(self.params)}
        for k, v in get_model_state_dict(self.model).items():
            i = index.get(v.data_ptr())
            if i in self.masters and sd["model"][k] is not self.masters[i]:
                self.masters[i].copy_(sd["model"][k])
        for i, m in self.masters.items():
            load_adamw_state(self.optimizer, m, sd["optim"][self.named_params[i][0]])
        self.distribute_params()

    def eval_model(self) -> nn.Module:
        """Rank 0 assembles the full fp32 model from every server's masters (the others return theirs)."""
        if self.rank != 0:
            if self.is_server:
                collectives.send(flatten(list(self.masters.values()), torch.float32), 0, tag=EXPORT_TAG)
            return self.model
        model = copy.deepcopy(self.model).float()
        params = list(model.parameters())  # same order as self.params
        for s in self.servers:
            if s == 0:
                buf = flatten(list(self.masters.values()), torch.float32)
            else:
                buf = torch.empty(self.size_of(s), device=self.device)
                collectives.recv(buf, s, tag=EXPORT_TAG)
            unflatten_into(buf, [params[i] for i in self.served[s]])
        return model


def assign_to_servers(sizes: list[int], servers: list[int]) -> dict[int, list[int]]:
    """Whole tensors to servers: largest first, each to the least-loaded server; lists in model order."""
    load = {s: 0 for s in servers}
    owner = {}
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        s = min(servers, key=lambda s: (load[s], s))
        owner[i] = s
        load[s] += sizes[i]
    return {s: [i for i in range(len(sizes)) if owner[i] == s] for s in servers}
