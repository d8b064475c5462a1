"""Fixtures for the data-pipeline tests: small synthetic corpora and one prepared dataset."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest

WORDS = (
    "the of and to in is was for on that with as by at from it an be this which or are def return class import "
    "self value data token model batch layer train loss step print if else while None True False café naïve 数据 🙂"
).split()


def make_text(rng: random.Random, n_words: int) -> str:
    """Pseudo-text with words, punctuation, indentation and newlines."""
    out = []
    for i in range(n_words):
        out.append(rng.choice(WORDS))
        if i % 11 == 10:
            out.append(rng.choice([".\n", ":\n    ", ",", "()\n", " = 1\n"]))
    return " ".join(out)


def write_corpus(root: Path, n_docs: int = 12, words: int = 400, seed: int = 0) -> list[str]:
    """``n_docs`` text files under ``root`` (some in a subdirectory); returns their texts."""
    rng = random.Random(seed)
    texts = []
    for i in range(n_docs):
        sub = root / ("sub" if i % 3 == 0 else "")
        sub.mkdir(parents=True, exist_ok=True)
        text = make_text(rng, words)
        (sub / f"doc{i:02d}.txt").write_text(text, encoding="utf-8")
        texts.append(text)
    return texts


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    root = tmp_path / "corpus"
    write_corpus(root)
    return root


@pytest.fixture(scope="session")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A prepared dataset (vocab 400) of 12 synthetic documents; treat it as read-only."""
    from foldtrain.data import prepare

    root = tmp_path_factory.mktemp("synthetic")
    write_corpus(root / "raw")
    prepare(root / "raw", root / "out", vocab_size=400, val_fraction=0.2, seed=3, quiet=True)
    return root / "out"


def to_v1(v2: Path, dst: Path) -> Path:
    """The one-file format (``foldtrain-tokens-v1``) of a one-shard v2 dataset, as older foldtrain wrote it."""
    import json

    meta = json.loads((v2 / "meta.json").read_text())
    assert len(meta["shards"]) == 1
    dst.mkdir(parents=True)
    for split in ("train", "val"):
        shutil.copy(v2 / f"{split}-00000.bin", dst / f"{split}.bin")
        shutil.copy(v2 / f"{split}-00000_docs.npy", dst / f"{split}_docs.npy")
    shutil.copy(v2 / "tokenizer.json", dst / "tokenizer.json")
    v1 = {
        k: meta[k]
        for k in (
            "dtype",
            "vocab_size",
            "eot_id",
            "n_documents",
            "source",
            "tokenizer",
            "seed",
            "val_fraction",
            "text_field",
        )
    }
    v1 = {"format": "foldtrain-tokens-v1", **v1, "splits": meta["shards"][0]}
    (dst / "meta.json").write_text(json.dumps(v1, indent=2))
    return dst


@pytest.fixture(scope="session")
def prepared_v1(prepared: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``prepared`` in the one-file format of foldtrain-tokens-v1; read-only."""
    return to_v1(prepared, tmp_path_factory.mktemp("v1") / "out")


@pytest.fixture(scope="session")
def prepared_sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The corpus of ``prepared`` in shards of ~2 KB of input (several shards); read-only."""
    from foldtrain.data import prepare

    root = tmp_path_factory.mktemp("sharded")
    write_corpus(root / "raw")
    prepare(root / "raw", root / "out", vocab_size=400, val_fraction=0.2, seed=3, quiet=True, shard_mb=0.002)
    return root / "out"
