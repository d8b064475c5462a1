"""`foldtrain train` over many shards and over a mixture: a run stopped and resumed equals an uninterrupted one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from foldtrain.config import build_config
from foldtrain.data import TokenData, prepare
from foldtrain.train.trainer import train
from tests.conftest import tiny_run_args


def losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def run(data, out, *extra):
    return train(build_config(tiny_run_args(data, out, "--checkpoint.every", "5", *extra)))


@pytest.fixture(scope="module")
def sharded(small_corpus, tmp_path_factory):
    """The small real corpus in ~20 KB shards, and a second dataset with the same tokenizer."""
    root = tmp_path_factory.mktemp("train_shards")
    prepare(small_corpus, root / "many", vocab_size=512, val_fraction=0.1, seed=0, shard_mb=0.02, quiet=True)
    files = sorted(small_corpus.iterdir())
    (root / "half").mkdir()
    for f in files[::2]:
        (root / "half" / f.name).write_bytes(f.read_bytes())
    prepare(
        root / "half",
        root / "other",
        tokenizer_path=root / "many" / "tokenizer.json",
        val_fraction=0.1,
        seed=0,
        shard_mb=0.05,
        quiet=True,
    )
    return root


def test_resume_across_shards_is_exact(sharded, tmp_path):
    data = sharded / "many"
    n = len(TokenData.open(data).meta["shards"])
    assert n >= 8
    full, part = tmp_path / "full", tmp_path / "part"
    run(data, full, "--train.steps", "12")
    run(data, part, "--train.steps", "12", "--train.stop_at", "5")
    assert max(losses(part)) == 5
    run(data, part, "--train.steps", "12", "--resume")
    assert losses(part) == losses(full)  # bit for bit on CPU


def test_resume_of_a_mixture_is_exact(sharded, tmp_path):
    mix = f"{sharded / 'many'}=0.7,{sharded / 'other'}=0.3"
    full, part = tmp_path / "full", tmp_path / "part"
    run("", full, "--train.steps", "12", "--data.path=", "--data.mix", mix)
    run("", part, "--train.steps", "12", "--train.stop_at", "7", "--data.path=", "--data.mix", mix)
    run("", part, "--train.steps", "12", "--resume", "--data.path=", "--data.mix", mix)
    assert losses(part) == losses(full)
    other = tmp_path / "other"
    run(
        "", other, "--train.steps", "3", "--data.path=", "--data.mix", f"{sharded / 'many'}=0.1,{sharded / 'other'}=0.9"
    )
    assert [losses(other)[s] for s in (1, 2, 3)] != [losses(full)[s] for s in (1, 2, 3)]  # the weights matter
