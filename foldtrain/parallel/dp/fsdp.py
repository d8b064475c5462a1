"""``--dp.strategy fsdp``: PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``), ZeRO-3.

As torchtitan applies it: ``fully_shard`` on every transformer block, then on the whole model (the root's
group: the positions and the final norm). Every rank keeps 1/W of each parameter, of its gradient and of its
AdamW state as a ``Shard(0)`` DTensor. A block's parameters are all-gathered just before its forward (and again
before its backward when ``--dp.reshard_after_forward true``, which frees them in between); its gradients are
reduce-scattered as its backward ends. AdamW steps the local shards.

The tied embedding and head: with ``--dp.shard_vocab true`` (the default) their one weight stays out of FSDP2,
split by vocabulary rows over the ranks and never gathered (:mod:`foldtrain.parallel.dp.vocab_shard`: the
activations travel instead, and every rank backpropagates the global batch's mean loss, so the units'
reduce-scatters sum). With ``false`` it is in the root's group, as torchtitan has it: gathered whole at the
forward's start and through the backward of the head and the embedding.

Precisions: the autocast modes (``bf16``, ``fp16``) run autocast over fp32 weights, as every other
strategy does; the master modes (``bf16-master``, ``fp16-master``) are FSDP's own mixed precision
(``MixedPrecisionPolicy``: half-precision weights gathered for compute, gradients reduced in fp32),
its sharded fp32 parameters being the masters. fp16 scales the loss; the loss scaler's verdict and
the gradient norm are computed over the local shards and made global with one all-reduce each.
``--dp.compression fp16|bf16`` is the policy's ``reduce_dtype``: the reduce-scatters in that dtype.

Checkpoints: ``get_model_state_dict`` / ``get_optimizer_state_dict`` hold the sharded DTensors under
the plain model's names, so ``torch.distributed.checkpoint`` reshards them from and to any other
layout. ``eval_model`` gathers the full model (a collective: every rank calls it).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from foldtrain.parallel.dp.base import DataParallelStrategy
from foldtrain.parallel.dp.vocab_shard import shard_vocab
from foldtrain.parallel.fsdp_gloo import fit_fsdp_to_gloo
from foldtrain.parallel.wire import fsdp_reduce_dtype


class FSDPStrategy(DataParallelStrategy):
    # the sharded fp32 parameters are the masters: TrainState keeps one fp32 model and no copy
    keeps_own_masters = True

    def __init__(self, state, cfg):
        super().__init__(state, cfg)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        self.mesh = init_device_mesh(self.device.type, (self.world,))
        param_dtype, reduce_dtype = self.precision.fsdp_dtypes
        reduce_dtype = fsdp_reduce_dtype(cfg.dp.compression, reduce_dtype)
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        opts = dict(mesh=self.mesh, reshard_after_forward=cfg.dp.reshard_after_forward, mp_policy=policy)
        ignored = {shard_vocab(self.model, self.mesh, param_dtype)} if cfg.dp.shard_vocab else None
        self.vocab_head = self.model.head.lm_head if ignored else None
        for block in self.model.blocks:
            fully_shard(block, **opts)
        fully_shard(self.model, **opts, ignored_params=ignored)
        units = [*self.model.blocks, self.model]
        fit_fsdp_to_gloo(units, self.mesh.get_group())
        if ignored:
            for unit in units:  # every rank backpropagates the global mean loss: its gradients are already 1/N
                unit.set_gradient_divide_factor(1.0)
                unit.set_force_sum_reduction_for_comms(True)  # a plain sum (gloo has no PREMUL_SUM)
        state.named_params = list(self.model.named_parameters())  # now DTensors
        state.set_optimizer(state.named_params)

    # ------------------------------------------------------------------ the step's hooks
    def no_sync(self) -> contextlib.AbstractContextManager:
        @contextlib.contextmanager
        def accumulate():
            self.model.set_requires_gradient_sync(False)  # keep unsharded gradients; reduce at the last
            try:
                yield
            finally:
                self.model.set_requires_gradient_sync(True)

        return accumulate()

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.vocab_head is None:
            return super().loss(logits, targets)
        return self.vocab_head.loss(logits, targets)

    def global_finite(self, finite: bool) -> bool:
        return self.all_true(finite, "loss-scaler all-reduce") if self.precision.scaler.enabled else finite

    def clip(self, params: list[torch.Tensor]) -> float:
        """The global norm from every rank's gradient shards (one all-reduce); clipped shard by shard."""
        return self.clip_by_global_norm(params)

    def eval_model(self) -> nn.Module:
        """The full fp32 model, on every rank, as the other strategies give it (a collective: every rank
        calls it)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        from foldtrain.model.gpt import GPT

        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
        with torch.device("meta"):
            model = GPT(self.model.shape, self.model.init_seed)
        model.to_empty(device=self.device)
        model.head.lm_head.weight = model.embedding.wte.weight  # tie again: to_empty may allocate the two apart
        model.load_state_dict(full, strict=True)
        return model
