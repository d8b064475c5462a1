"""The split backward (``I`` then ``W``) of one chunk against autograd's whole backward, in one process.

The multi-rank equivalence cases check the zero-bubble schedules end to end at 1e-5; these pin the split
itself: the same gradients bit for bit in fp32 over accumulated micro-batches, what the ``I`` leaves to
the ``W``, autocast's bf16 products, and torch's graph-based split for chunks the linear split cannot take.
"""

import copy

import torch
import torch.nn as nn

from foldtrain.model.gpt import Block, GPTShape
from foldtrain.parallel.pipeline.split_backward import (
    GraphSplit,
    LinearSplit,
    backward_input,
    backward_weight,
    split_for,
)

SHAPE = GPTShape(n_layer=2, n_head=4, d_model=32, context=16, vocab_size=64)


def _chunks(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    whole = nn.Sequential(Block(SHAPE), Block(SHAPE))
    return whole, copy.deepcopy(whole)


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(2, 16, 32, generator=g), torch.randn(2, 16, 32, generator=g)) for _ in range(n)]


def _whole(chunk: nn.Module, x: torch.Tensor, dy: torch.Tensor, autocast: bool = False) -> torch.Tensor:
    x = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = chunk(x)
    torch.autograd.backward([out], [dy.to(out.dtype)])
    return x.grad


def _split(split, chunk: nn.Module, x: torch.Tensor, dy: torch.Tensor, autocast: bool = False):
    x = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out, notes = split.forward(chunk, x)
    work = backward_input(split, [out], [dy.to(out.dtype)], x, notes)
    return x.grad, work


def test_linear_split_matches_the_whole_backward_bit_for_bit_over_accumulated_micro_batches():
    """Three micro-batches, every I before any W (as fold-zb runs them): the input gradients come from the I
    alone, the linear weights have no gradient until their W, and every gradient then equals autograd's."""
    whole, chunk = _chunks()
    split = split_for(chunk, recomputed=False)
    assert isinstance(split, LinearSplit)
    linears = [m.weight for m in chunk.modules() if isinstance(m, nn.Linear)]
    works = []
    for x, dy in _batches(3):
        want = _whole(whole, x, dy)
        got, work = _split(split, chunk, x, dy)
        assert torch.equal(got, want)
        works.append(work)
    assert all(w.grad is None for w in linears)  # the I skipped every linear weight's product
    assert chunk[0].ln1.weight.grad is not None  # ... but not the small parameters'
    for work in works:
        backward_weight(split, work)
    for (name, p), q in zip(chunk.named_parameters(), whole.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_linear_split_under_bf16_autocast_matches_autograd():
    """Autocast's bf16 products: the W multiplies in the product's dtype and accumulates in the weight's."""
    whole, chunk = _chunks(seed=2)
    split = LinearSplit(chunk)
    for x, dy in _batches(2):
        want = _whole(whole, x, dy, autocast=True)
        got, work = _split(split, chunk, x, dy, autocast=True)
        backward_weight(split, work)
        assert torch.equal(got, want)
    for (name, p), q in zip(chunk.named_parameters(), whole.parameters()):
        assert p.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-6, msg=name)


def test_graph_split_matches_autograd():
    """torch pipelining's split, which recomputed chunks and DTensor weights take."""
    whole, chunk = _chunks(seed=3)
    split = split_for(chunk, recomputed=True)
    assert isinstance(split, GraphSplit)
    for x, dy in _batches(2):
        want = _whole(whole, x, dy)
        got, work = _split(split, chunk, x, dy)
        backward_weight(split, work)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    for (name, p), q in zip(chunk.named_parameters(), whole.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6, msg=name)


def test_segment_zero_leaves_the_whole_backward_to_its_w():
    """Token ids have no gradient: the I does nothing and the W runs the whole backward."""
    whole, chunk = _chunks(seed=4)
    split = LinearSplit(chunk)
    x, dy = _batches(1)[0]
    out, notes = split.forward(chunk, x)  # x does not require grad, as token ids' embedding output would not
    work = backward_input(split, [out], [dy], x, notes)
    assert all(p.grad is None for p in chunk.parameters())
    backward_weight(split, work)
    whole(x).backward(dy)
    for (name, p), q in zip(chunk.named_parameters(), whole.parameters()):
        assert torch.equal(p.grad, q.grad), name
