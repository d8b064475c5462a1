"""--data.mix: weights, proportions, determinism across ranks and resumes, and bad mixes."""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest
import torch

from foldtrain.config import DataConfig
from foldtrain.data import Blend, MixedData, SequenceSampler, open_dataset, open_mix, parse_mix, prepare, val_batches
from foldtrain.data.sampler import BLEND_BLOCK, blend_counts
from foldtrain.errors import DataError

from .conftest import write_corpus

SEQ = 4


def marked(n_samples: int, mark: int) -> np.ndarray:
    """A token array whose every token is ``mark``: a row tells which dataset it came from."""
    return np.full(n_samples * SEQ + 1, mark, dtype=np.uint16)


def blend(weights, sizes=(50, 30, 20)):
    return Blend(
        [marked(n, i) for i, n in enumerate(sizes[: len(weights)])],
        list(weights),
        [f"d{i}" for i in range(len(weights))],
    )


def test_parse_mix():
    assert parse_mix("a=0.7, b=0.3") == [("a", 0.7), ("b", 0.3)]
    assert parse_mix("/x/y=z=2") == [("/x/y=z", 2.0)]  # the weight follows the last '='
    for spec, msg in [
        ("a=0,b=1", "not a positive number"),
        ("a=-1", "not a positive number"),
        ("a=nan", "not a positive number"),
        ("a=inf", "not a positive number"),
        ("a=x", "not a number"),
        ("a", "not DIR=WEIGHT"),
        ("", "empty"),
        ("a=1,a=2", "names a twice"),
    ]:
        with pytest.raises(DataError, match=msg):
            parse_mix(spec)


def test_block_counts_are_the_weights():
    c = blend_counts([0.7, 0.2, 0.1], ["a", "b", "c"])
    assert c.sum() == BLEND_BLOCK and np.abs(c / BLEND_BLOCK - [0.7, 0.2, 0.1]).max() <= 1 / BLEND_BLOCK
    with pytest.raises(DataError, match="below 1/4096"):
        blend_counts([1.0, 1e-6], ["a", "b"])


def test_proportions_within_statistical_tolerance():
    w = [0.6, 0.3, 0.1]
    s = SequenceSampler(blend(w), SEQ, seed=11)
    G, steps = 32, 100  # 3,200 sequences: most of one block of 4,096
    x = torch.cat([s.global_batch(step, G)[0][:, 0] for step in range(steps)])
    n = len(x)
    for i, wi in enumerate(w):
        # positions are a random draw without replacement from one block: within 4 binomial sigmas
        assert abs((x == i).sum().item() - wi * n) <= 4 * math.sqrt(n * wi * (1 - wi)), i
    # a whole number of blocks has the exact proportions
    ids = s.indices(0, 2 * BLEND_BLOCK)
    comp = np.searchsorted(s.offsets, ids, side="right") - 1
    assert np.bincount(comp).tolist() == (2 * blend_counts(w, ["a", "b", "c"])).tolist()


def test_each_dataset_runs_its_own_epochs():
    s = SequenceSampler(blend([0.5, 0.5], sizes=(10, 40)), SEQ, seed=2)
    ids = s.indices(0, BLEND_BLOCK)
    comp = np.searchsorted(s.offsets, ids, side="right") - 1
    small = ids[comp == 0]
    assert len(small) == BLEND_BLOCK // 2 and sorted(small[:10].tolist()) == list(
        range(10)
    )  # many epochs of the small one
    assert sorted(small[10:20].tolist()) == list(range(10)) and small[:10].tolist() != small[10:20].tolist()


def test_pure_function_of_step_across_ranks_and_resume():
    a = SequenceSampler(blend([0.5, 0.25, 0.25]), SEQ, seed=3)
    for step in (0, 5, 130):  # 130 * 32 crosses the first block boundary
        gx, gy = a.global_batch(step, 32)
        for world in (2, 4):
            parts = [a.rank_batch(step, 32, r, world) for r in range(world)]
            assert torch.equal(torch.cat([p[0] for p in parts]), gx) and torch.equal(
                torch.cat([p[1] for p in parts]), gy
            )
        fresh = SequenceSampler(blend([0.5, 0.25, 0.25]), SEQ, seed=3)  # a resumed run builds a new sampler
        assert torch.equal(fresh.global_batch(step, 32)[0], gx)
    other = SequenceSampler(blend([0.5, 0.25, 0.25]), SEQ, seed=4)
    assert not torch.equal(other.global_batch(0, 32)[0], a.global_batch(0, 32)[0])


def test_blend_val_batches():
    vb = val_batches(blend([0.75, 0.25]), SEQ, 16, 4)
    assert len(vb) == 4 and all(x.shape == (16, SEQ) for x, _ in vb)
    marks = torch.cat([x[:, 0] for x, _ in vb])
    assert abs((marks == 0).float().mean().item() - 0.75) < 0.15
    assert all(torch.equal(a[0], b[0]) for a, b in zip(vb, val_batches(blend([0.75, 0.25]), SEQ, 16, 4)))


@pytest.fixture(scope="module")
def two_datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    write_corpus(root / "raw_a", n_docs=10, seed=1)
    write_corpus(root / "raw_b", n_docs=10, seed=2)
    prepare(root / "raw_a", root / "a", vocab_size=300, val_fraction=0.2, seed=1, quiet=True)
    prepare(
        root / "raw_b",
        root / "b",
        tokenizer_path=root / "a" / "tokenizer.json",
        val_fraction=0.2,
        seed=1,
        quiet=True,
        shard_mb=0.003,
    )
    prepare(root / "raw_b", root / "c", vocab_size=280, val_fraction=0.2, seed=1, quiet=True)  # its own tokenizer
    return root


def test_open_mix(two_datasets):
    r = two_datasets
    data = open_dataset(DataConfig(mix=f"{r / 'a'}=3,{r / 'b'}=1"))
    assert isinstance(data, MixedData) and data.vocab_size == open_mix(f"{r / 'a'}=1").vocab_size
    s = SequenceSampler(data.split("train"), 16, seed=0)
    x, _ = s.rank_batch(2, 8, 1, 2)
    assert x.shape == (4, 16) and int(x.max()) < data.vocab_size
    assert len(s) == sum(c.n for c in s.components)
    assert val_batches(data.split("val"), 16, 4, 2)[1][0].shape == (4, 16)


def test_bad_mixes(two_datasets, tmp_path):
    r = two_datasets
    with pytest.raises(
        DataError, match=r"datasets .*a and .*c use different tokenizers; prepare them with the same --data.tokenizer"
    ):
        open_mix(f"{r / 'a'}=1,{r / 'c'}=1")
    with pytest.raises(DataError, match="is not a prepared dataset.*foldtrain prepare"):
        open_mix(f"{r / 'a'}=1,{r / 'raw_a'}=1")
    with pytest.raises(DataError, match="--data.mix and --data.path are both set"):
        open_dataset(DataConfig(mix=f"{r / 'a'}=1", path=str(r / "b")))
    broken = tmp_path / "b"
    shutil.copytree(r / "b", broken)
    (broken / "train-00001.bin").unlink()
    with pytest.raises(DataError, match="train-00001.bin is missing"):
        open_mix(f"{r / 'a'}=1,{broken}=1")
