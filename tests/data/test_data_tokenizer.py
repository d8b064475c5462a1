"""Tokenizer: exact round trips for any text, determinism, separators, loading."""

from __future__ import annotations

import random

import pytest

from foldtrain.data import tokenizer as T
from foldtrain.data.sources import decode_bytes
from foldtrain.errors import DataError

from .conftest import make_text

SAMPLES = [
    "",
    "hello world",
    "  leading and trailing spaces  \n\n\n",
    "tabs\tand\r\nwindows line endings\r\n",
    "unicode: café naïve Straße ﬁ ǅ Ω≈ç√ 数据集 日本語テキスト 한국어",
    "emoji: 🙂🚀👩‍👩‍👧‍👦 🇫🇷 and combining e\u0301 a\u0308",
    "control chars \x00\x01\x7f and a literal <|endoftext|> inside text",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n",
]


@pytest.fixture(scope="module")
def tok():
    rng = random.Random(1)
    return T.train_tokenizer([make_text(rng, 300) for _ in range(8)] + SAMPLES, 350)


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(tok, text):
    (ids,) = T.encode_batch(tok, [text])
    assert T.decode(tok, ids) == text


def test_round_trip_random_unicode(tok):
    rng = random.Random(0)
    alphabet = [chr(c) for c in range(32, 0x3000) if not 0xD800 <= c < 0xE000] + ["🙂", "\n", " ", "\t"]
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 300))) for _ in range(50)]
    for text, ids in zip(texts, T.encode_batch(tok, texts)):
        assert T.decode(tok, ids) == text


def test_latin1_bytes_round_trip(tok):
    text = decode_bytes("caf\xe9 na\xefve \xa9 1999\n".encode("latin-1"))  # not valid UTF-8
    assert text == "café naïve © 1999\n"
    assert T.decode(tok, T.encode_batch(tok, [text])[0]) == text


def test_literal_separator_is_text(tok):
    (ids,) = T.encode_batch(tok, ["a <|endoftext|> b"])
    assert T.eot_id(tok) not in ids
    assert T.decode(tok, ids + [T.eot_id(tok)]).endswith("<|endoftext|>")


def test_long_documents_split_into_pieces_encode_identically(tok, monkeypatch):
    monkeypatch.setattr(T, "PIECE_CHARS", 200)
    rng = random.Random(2)
    texts = [make_text(rng, 500), "x" * 1000, "\n \n  \n" * 100 + "end"]
    for text, ids in zip(texts, T.encode_batch(tok, texts, chunk_chars=700)):
        assert T.decode(tok, ids) == text
    # splitting before "\n" after non-space is exactly what the unsplit encoder does
    assert T.encode_batch(tok, texts[:1])[0] == tok.encode(texts[0], add_special_tokens=False).ids


def test_training_is_deterministic():
    rng = random.Random(5)
    docs = [make_text(rng, 200) for _ in range(10)]
    a, b = T.train_tokenizer(docs, 400), T.train_tokenizer(list(docs), 400)
    assert a.get_vocab() == b.get_vocab()
    assert a.to_str() == b.to_str()
    assert T.vocab_size(a) <= 400 and T.eot_id(a) == 0


def test_save_and_load(tok, tmp_path):
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    loaded = T.load_tokenizer(path)
    assert loaded.get_vocab() == tok.get_vocab()
    assert T.encode_batch(loaded, SAMPLES) == T.encode_batch(tok, SAMPLES)


def test_load_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        T.load_tokenizer(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(DataError, match="not a valid tokenizer.json"):
        T.load_tokenizer(bad)


def test_vocab_too_small():
    with pytest.raises(DataError, match="vocab_size"):
        T.train_tokenizer(["abc"], 100)
