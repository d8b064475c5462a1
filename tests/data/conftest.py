"""Fixtures for the data-pipeline tests: small synthetic corpora and one prepared dataset."""

from __future__ import annotations

import random
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
