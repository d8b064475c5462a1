"""This rank's model chunks: slices of a full GPT's ``parts`` that keep the full model's names.

A :class:`Chunk` holds the parts of one global segment in a ``ModuleDict`` keyed by their index in
``GPT.parts``, so its parameter names are the full model's (``parts.3.attn.qkv.weight``): the DCP
checkpoints of a pipeline run hold exactly the keys of a single-process one and load either way.

The trainer builds the full GPT on the meta device (no memory); each rank keeps its ``V``
segments and materialises only those (:func:`materialize`), with exactly the values a single
process draws for them (:mod:`foldtrain.model.init`: every parameter from its own generator).

Tied embedding: with a pipeline (``P > 1``) the token embedding (segment 0, pipeline rank 0) and
the output projection (segment ``S - 1``: pipeline rank ``P - 1``, or rank 0 in the V placement) live in
different chunks. The
last rank gets its own copy of the weight (same initial values); the executor sums the two
copies' gradients over the tie group before either optimizer steps, so both copies take the same
update and stay equal — exactly the single-process tied weight (Megatron's embedding group).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from foldtrain.model.gpt import GPT, Block, Head
from foldtrain.model.init import init_weights
from foldtrain.schedules import chunks_of_rank


class Chunk(nn.Module):
    """The parts of one global segment, in model order; ``body`` runs all but the head."""

    def __init__(self, segment: int, parts: list[tuple[int, nn.Module]]):
        super().__init__()
        self.segment = segment
        self.parts = nn.ModuleDict({str(i): m for i, m in parts})
        self.part_ids = [i for i, _ in parts]

    @property
    def head(self) -> Head | None:
        last = list(self.parts.values())[-1]
        return last if isinstance(last, Head) else None

    def body(self, x: torch.Tensor) -> torch.Tensor:
        """Every part except a trailing head (the executor fuses the head with the loss)."""
        mods = list(self.parts.values())
        if isinstance(mods[-1], Head):
            mods = mods[:-1]
        for m in mods:
            x = m(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.parts.values():
            x = m(x)
        return x


def part_ranges(n_layer: int, layers: list[list[int]] | tuple) -> list[list[int]]:
    """Indices into ``GPT.parts`` of every segment: blocks ``j`` are part ``1 + j``; the embedding
    (part 0) joins segment 0 and the head (part ``n_layer + 1``) the last segment."""
    out = [[1 + j for j in seg] for seg in layers]
    out[0].insert(0, 0)
    out[-1].append(n_layer + 1)
    return out


def build_chunks(model: GPT, layers, pp: int, pp_rank: int, placement: str = "loop") -> list[Chunk]:
    """This pipeline rank's chunks, in model order (the segments ``chunks_of_rank`` gives it: ``c * pp +
    pp_rank`` for the loop placement, ``pp_rank`` and ``2 pp - 1 - pp_rank`` for the V placement).

    Takes ownership of ``model``: the parts this rank does not hold are replaced by empty modules
    so their memory is freed, and with ``pp > 1`` the output projection becomes its own copy of the
    tied embedding weight (also where the V placement puts both ends on one rank: the tie's two copies
    behave the same whichever rank holds them).
    """
    n_layer = len(model.parts) - 2
    ranges = part_ranges(n_layer, layers)
    segments = len(ranges)
    mine = chunks_of_rank(pp_rank, pp, segments // pp, placement)
    keep = {i for s in mine for i in ranges[s]}
    head = model.parts[-1]
    if pp > 1 and (segments - 1) in mine:
        head.lm_head.weight = nn.Parameter(head.lm_head.weight.detach().clone())
    chunks = [Chunk(s, [(i, model.parts[i]) for i in ranges[s]]) for s in mine]
    for i in range(len(model.parts)):
        if i not in keep:
            model.parts[i] = nn.Module()
    return chunks


def materialize(chunk: Chunk, device: torch.device, seed: int, n_layer: int) -> None:
    """Give a chunk built on the meta device real storage on ``device`` and its initial values
    (a chunk that already has storage is left as it is)."""
    if not any(p.is_meta for p in chunk.parameters()):
        return
    tied = "0" in chunk.parts and chunk.head is not None and chunk.head.lm_head.weight is chunk.parts["0"].wte.weight
    chunk.to_empty(device=device)
    if tied:  # the whole model in one chunk: keep the embedding and the output projection one weight
        chunk.head.lm_head.weight = chunk.parts["0"].wte.weight
    init_weights(chunk, seed, n_layer)


def _checkpointed(forward, x):
    from torch.utils.checkpoint import checkpoint

    return checkpoint(forward, x, use_reentrant=False)


def apply_activation_checkpointing(module: nn.Module) -> int:
    """``--ac full``: recompute every transformer block's activations in the backward (non-reentrant
    ``torch.utils.checkpoint``), applied from outside by wrapping each Block's ``forward``. Returns the
    number of blocks wrapped. Parameter names are unchanged."""
    n = 0
    for m in module.modules():
        if isinstance(m, Block) and not getattr(m, "_foldtrain_ac", False):
            m.forward = functools.partial(_checkpointed, m.forward)
            m._foldtrain_ac = True
            n += 1
    return n
