"""TokenData validation and the deterministic, stateless samplers."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from foldtrain.data import SequenceSampler, TokenData, val_batches
from foldtrain.errors import DataError


@pytest.fixture(params=["v1", "v2"])
def fmt(request):
    return request.param


@pytest.fixture
def one_file(fmt, prepared, prepared_v1):
    """The one-shard dataset in the one-file format (v1) and in the sharded format (v2)."""
    return prepared_v1 if fmt == "v1" else prepared


@pytest.fixture
def copy(one_file, tmp_path):
    """A private copy of the prepared dataset that a test may damage."""
    dst = tmp_path / "data"
    shutil.copytree(one_file, dst)
    return dst


def bin_name(copy, split):
    return f"{split}.bin" if (copy / f"{split}.bin").exists() else f"{split}-00000.bin"


def test_open(one_file):
    prepared = one_file
    data = TokenData.open(prepared)
    meta = json.loads((prepared / "meta.json").read_text())
    assert data.meta == meta and data.vocab_size == meta["vocab_size"] and data.eot_id == meta["eot_id"]
    assert data.tokenizer_path == prepared / "tokenizer.json"
    train = data.split("train")
    assert isinstance(train, np.memmap) and train.dtype == np.uint16 and len(train) == meta["splits"]["train"]["tokens"]
    assert not train.flags.writeable
    assert int(train.max()) < data.vocab_size
    assert len(data.doc_offsets("val")) == meta["splits"]["val"]["documents"]
    assert data.load_tokenizer().get_vocab_size() == data.vocab_size
    with pytest.raises(KeyError):
        data.split("test")


def test_missing_or_bad_meta(tmp_path, copy):
    with pytest.raises(DataError, match="foldtrain prepare"):
        TokenData.open(tmp_path / "nowhere")
    (tmp_path / "raw").mkdir()
    with pytest.raises(DataError, match="no meta.json.*foldtrain prepare"):
        TokenData.open(tmp_path / "raw")
    (copy / "meta.json").write_text("{oops")
    with pytest.raises(DataError, match="unreadable.*foldtrain prepare"):
        TokenData.open(copy)
    (copy / "meta.json").write_text(json.dumps({"format": "foldtrain-tokens-v1", "dtype": "uint16"}))
    with pytest.raises(DataError, match="foldtrain prepare"):
        TokenData.open(copy)


def test_truncated(copy):
    f = copy / bin_name(copy, "train")
    size = f.stat().st_size
    with f.open("r+b") as fh:
        fh.truncate(size - 2)
    with pytest.raises(
        DataError,
        match=rf"token file .*{f.name} is truncated \({size - 2} bytes, expected {size}\); re-run foldtrain prepare",
    ):
        TokenData.open(copy)


def test_corrupted_byte(copy):
    f = copy / bin_name(copy, "val")
    data = bytearray(f.read_bytes())
    data[5] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(DataError, match="corrupt"):
        TokenData.open(copy)
    with pytest.raises(DataError, match="corrupt"):
        TokenData.open(copy, verify=True)
    TokenData.open(copy, verify=False)  # sizes still fine


def test_missing_tokenizer(copy):
    (copy / "tokenizer.json").unlink()
    with pytest.raises(DataError, match="tokenizer file .* is missing"):
        TokenData.open(copy)


# ---------------------------------------------------------------- sampler

SEQ = 4


def ramp(n_samples: int) -> np.ndarray:
    """Tokens 0..N so a row's first token tells which sample it is (start = index * SEQ)."""
    return np.arange(n_samples * SEQ + 1, dtype=np.uint16)


def sample_ids(x: torch.Tensor) -> list[int]:
    return (x[:, 0] // SEQ).tolist()


def test_sample_shape_and_shift():
    s = SequenceSampler(ramp(10), SEQ, seed=0)
    x, y = s.global_batch(0, 6)
    assert x.shape == y.shape == (6, SEQ) and x.dtype == y.dtype == torch.int64
    assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y[:, -1], x[:, -1] + 1)
    assert torch.equal(x - x[:, :1], torch.arange(SEQ).expand(6, SEQ))
    assert len(s) == 10


def test_rank_slices_concatenate_to_global_batch():
    s = SequenceSampler(ramp(37), SEQ, seed=7)
    for world in (1, 2, 4):
        for step in (0, 3, 11):
            gx, gy = s.global_batch(step, 8)
            parts = [s.rank_batch(step, 8, r, world) for r in range(world)]
            assert torch.equal(torch.cat([p[0] for p in parts]), gx)
            assert torch.equal(torch.cat([p[1] for p in parts]), gy)


def test_one_epoch_world2_covers_every_sample_once():
    n, G = 48, 8
    s = SequenceSampler(ramp(n), SEQ, seed=1)
    seen = []
    for step in range(n // G):
        for rank in range(2):
            seen += sample_ids(s.rank_batch(step, G, rank, 2)[0])
    assert sorted(seen) == list(range(n))
    assert seen != list(range(n))  # shuffled


def test_deterministic_and_seeded():
    a, b, c = (SequenceSampler(ramp(20), SEQ, seed=k) for k in (5, 5, 6))
    assert torch.equal(a.global_batch(7, 4)[0], b.global_batch(7, 4)[0])
    # resume: a fresh sampler reproduces any step without replaying the previous ones
    assert torch.equal(SequenceSampler(ramp(20), SEQ, seed=5).global_batch(3, 4)[0], a.global_batch(3, 4)[0])
    assert not torch.equal(a.global_batch(0, 20)[0], c.global_batch(0, 20)[0])


def test_epoch_crossing():
    n = 10
    s = SequenceSampler(ramp(n), SEQ, seed=3)
    p0, p1 = s.permutation(0), s.permutation(1)
    assert not np.array_equal(p0, p1)
    assert sample_ids(s.global_batch(2, 4)[0]) == [*p0[8:10], *p1[0:2]]
    # a batch larger than an epoch spans several epochs
    assert sample_ids(s.global_batch(0, 25)[0]) == [*p0, *p1, *s.permutation(2)[:5]]
    assert np.array_equal(p0, np.random.default_rng(3).permutation(n))
    assert s.epoch(5, 4) == 2.0


def test_last_token_is_usable_and_tail_ignored():
    s = SequenceSampler(np.arange(2 * SEQ + 3, dtype=np.uint16), SEQ, seed=0)  # 2 samples + 2 spare tokens
    assert len(s) == 2
    with pytest.raises(DataError, match="seq_len"):
        SequenceSampler(np.arange(SEQ, dtype=np.uint16), SEQ, seed=0)


def test_rank_argument_errors():
    s = SequenceSampler(ramp(10), SEQ, seed=0)
    with pytest.raises(ValueError):
        s.rank_batch(0, 6, 0, 4)
    with pytest.raises(ValueError):
        s.rank_batch(0, 8, 2, 2)


def test_val_batches():
    tokens = ramp(10)
    batches = val_batches(tokens, SEQ, 3, 2)
    assert [sample_ids(x) for x, _ in batches] == [[0, 1, 2], [3, 4, 5]]
    assert len(val_batches(tokens, SEQ, 3, 100)) == 3  # only full batches
    ((x, y),) = val_batches(tokens, SEQ, 16, 4)  # fewer samples than one batch
    assert sample_ids(x) == list(range(10)) and torch.equal(y[:, :-1], x[:, 1:])
    with pytest.raises(DataError, match="validation split"):
        val_batches(np.arange(3, dtype=np.uint16), SEQ, 2, 2)


def test_sampler_on_prepared_data(prepared):
    data = TokenData.open(prepared)
    s = SequenceSampler(data.split("train"), 16, seed=0)
    x, y = s.rank_batch(1, 4, 1, 2)
    assert x.shape == (2, 16) and int(x.max()) < data.vocab_size
    assert val_batches(data.split("val"), 16, 2, 2)[0][0].shape == (2, 16)
