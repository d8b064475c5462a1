"""``--dp.shard_vocab`` (``foldtrain/parallel/dp/vocab_shard.py``) in one process, on a one-rank gloo group: the
split, the same loss and gradients as the plain tied model, padding rows that take no probability, and the tied
gradient allocated once. Several ranks against one process: ``tests/parallel/dp/test_dp_strategies.py``."""

from __future__ import annotations

import copy

import pytest
import torch

from foldtrain.config import build_config
from foldtrain.model.gpt import lm_loss
from foldtrain.model.presets import vocab_slice
from foldtrain.parallel.dp.vocab_shard import shard_vocab
from foldtrain.train.trainer import build_model
from tests.conftest import TINY_ARGS


@pytest.fixture
def mesh(gloo_group):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (1,))


def test_rows_split_as_shard_0_splits():
    assert [vocab_slice(125, 4, r) for r in range(4)] == [(0, 32), (32, 32), (64, 32), (96, 29)]
    assert [vocab_slice(6, 4, r) for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 0)]
    assert [len(c) for c in torch.arange(125).chunk(4)] == [n for _, n in (vocab_slice(125, 4, r) for r in range(4))]


def tiny_model(*args: str):
    return build_model(build_config([*TINY_ARGS, "--model.vocab_size", "60", "--train.seq_len", "8", *args]))


def test_the_same_loss_and_gradients_as_the_tied_model(mesh):
    """Padded to 64 rows, the last 4 take no probability: the sharded head gives them -inf and no gradient."""
    plain = tiny_model("--model.vocab_multiple", "64")
    sharded = copy.deepcopy(plain)
    weight = shard_vocab(sharded, mesh, None)
    assert sharded.embedding.wte.weight is weight and sharded.head.lm_head.weight is weight  # still one parameter
    idx = torch.randint(0, 60, (2, 8))
    logits = sharded(idx)
    assert logits.shape == (2, 8, 64) and torch.isinf(logits[..., 60:]).all()
    loss = sharded.head.lm_head.loss(logits, idx)
    ref = lm_loss(plain(idx), idx)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=0)
    loss.backward()
    ref.backward()
    got = dict(sharded.named_parameters())
    for name, p in plain.named_parameters():
        g = got[name].grad
        g = g.to_local() if hasattr(g, "to_local") else g
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert got["parts.0.wte.weight"].grad.to_local()[60:].abs().max() == 0


def slice_sized_allocations(model, idx, loss_fn, rows: int, d: int) -> int:
    """How many (rows, d) fp32 tensors the forward and backward allocate (the profiler's allocator events)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss_fn(model(idx), idx).backward()
    todo, sizes = list(prof.profiler.kineto_results.experimental_event_tree()), []
    while todo:
        node = todo.pop()
        todo += node.children
        if node.tag == _EventType.Allocation:
            sizes.append(node.extra_fields.alloc_size)
    return sizes.count(rows * d * 4)


def test_the_tied_gradient_is_allocated_once(mesh):
    """Autograd adds the embedding's dense gradient of a tied weight to the head's out of place: three slice-sized
    tensors in the plain model (the head's, the embedding's, their sum); the sharded one allocates one and adds
    the embedding's rows into it."""
    plain = tiny_model("--model.d_model", "48")
    sharded = copy.deepcopy(plain)
    shard_vocab(sharded, mesh, None)
    idx = torch.randint(0, 60, (2, 8))
    assert slice_sized_allocations(plain, idx, lm_loss, 60, 48) == 3
    assert slice_sized_allocations(sharded, idx, sharded.head.lm_head.loss, 60, 48) == 1
