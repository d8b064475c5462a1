"""Initial weights that any part of the model can draw on its own.

Every parameter gets its initial value from a generator of its own, seeded by the run's seed and
the parameter's full-model name (``parts.3.attn.qkv.weight``). So a pipeline rank that builds only
its chunks (on the meta device, then materialised) gets exactly the values a single process gets
for those parameters, without drawing or holding the rest of the model; the order in which parts
are built does not matter either. GPT-2's scheme: N(0, 0.02) for linears and embeddings,
N(0, 0.02/sqrt(2·n_layer)) for the residual output projections, zero biases, unit LayerNorm gains.
The tied output projection takes the token embedding's value wherever it lives.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn as nn

TIED = {"lm_head.weight": "parts.0.wte.weight"}  # name suffix -> the name whose value it shares


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def initial_value(name: str, module: nn.Module, kind: str, shape: torch.Size, seed: int, n_layer: int) -> torch.Tensor:
    """The fp32 CPU initial value of parameter ``kind`` ("weight"/"bias") of ``module``, full name ``name``."""
    for suffix, source in TIED.items():
        if name.endswith(suffix):
            name = source
    if isinstance(module, nn.LayerNorm):
        return torch.ones(shape) if kind == "weight" else torch.zeros(shape)
    if kind == "bias":
        return torch.zeros(shape)
    if isinstance(module, (nn.Linear, nn.Embedding)):
        std = 0.02 / math.sqrt(2 * n_layer) if name.endswith(("attn.proj.weight", "mlp.proj.weight")) else 0.02
        # a padded vocabulary: the real rows are drawn as without padding, the padding rows are zero
        rows = min(getattr(module, "vocab_rows", shape[0]), shape[0])
        value = torch.empty((rows, *shape[1:])).normal_(0.0, std, generator=_generator(seed, name))
        return torch.cat([value, value.new_zeros((shape[0] - rows, *shape[1:]))]) if rows < shape[0] else value
    raise TypeError(f"no initialisation rule for {name} ({type(module).__name__})")


@torch.no_grad()
def init_weights(module: nn.Module, seed: int, n_layer: int) -> None:
    """Set every parameter of ``module`` (a GPT or a chunk of one, named like the full model) to its
    initial value, in place, on its own device and dtype; DTensor parameters get their local shard."""
    for mod_name, m in module.named_modules():
        for kind, p in m.named_parameters(recurse=False):
            name = f"{mod_name}.{kind}" if mod_name else kind
            value = initial_value(name, m, kind, p.shape, seed, n_layer)
            if hasattr(p, "device_mesh"):  # a DTensor: this rank's shard of the full value
                from torch.distributed.tensor import distribute_tensor

                value = distribute_tensor(value, p.device_mesh, p.placements, src_data_rank=None).to_local()
                p.to_local().copy_(value)
            else:
                p.copy_(value)
