"""prepare(): outputs, meta, splits, determinism, atomicity and bad inputs."""

from __future__ import annotations

import hashlib
import importlib
import json
import math
from pathlib import Path

import numpy as np
import pytest

from foldtrain.data import TokenData, decode, load_tokenizer, prepare
from foldtrain.data.prepare import token_dtype
from foldtrain.data.shards import default_cut, doc_hash
from foldtrain.errors import DataError

shards_mod = importlib.import_module("foldtrain.data.shards")


def read_docs(out, split):
    """The decoded documents of a split (all shards, in order), using the offsets files."""
    data = TokenData.open(out)
    tok = load_tokenizer(out / "tokenizer.json")
    ids = np.asarray(data.split(split)[:])
    offsets = data.doc_offsets(split)
    assert offsets.dtype == np.int64 and (len(offsets) == 0 or offsets[0] == 0)
    bounds = [*offsets.tolist(), len(ids)]
    docs = []
    for a, b in zip(bounds, bounds[1:]):
        assert ids[b - 1] == data.eot_id and data.eot_id not in ids[a : b - 1]
        docs.append(decode(tok, ids[a : b - 1]))
    return docs


def expected_val(texts, seed, val_fraction):
    """The documents the stated rule sends to val: seeded hash below val_fraction * 2**64."""
    return sorted(t for t in texts if doc_hash(seed, t) < default_cut(val_fraction))


def test_meta_and_files(prepared):
    meta = json.loads((prepared / "meta.json").read_text())
    assert meta["format"] == "foldtrain-tokens-v2" and meta["dtype"] == "uint16"
    assert meta["n_documents"] == 12 and meta["seed"] == 3 and meta["tokenizer"] == "tokenizer.json"
    tok = load_tokenizer(prepared / "tokenizer.json")
    assert meta["vocab_size"] == tok.get_vocab_size() <= 400
    assert meta["eot_id"] == tok.token_to_id("<|endoftext|>")
    assert len(meta["shards"]) == 1
    for split in ("train", "val"):
        data = (prepared / f"{split}-00000.bin").read_bytes()
        info = meta["shards"][0][split]
        assert (
            len(data) == 2 * info["tokens"] and info["tokens"] > 0 and meta["splits"][split]["tokens"] == info["tokens"]
        )
        assert hashlib.sha256(data).hexdigest() == info["sha256"]
    texts = [p.read_text() for p in (prepared.parent / "raw").rglob("*.txt")]
    assert meta["splits"]["val"]["documents"] == len(expected_val(texts, 3, 0.2)) > 0
    assert not list(prepared.parent.glob(".out.*")) and not list(prepared.parent.glob("out.partial")), (
        "work directories left behind"
    )
    assert sorted(p.name for p in prepared.iterdir()) == [
        "meta.json",
        "tokenizer.json",
        "train-00000.bin",
        "train-00000_docs.npy",
        "val-00000.bin",
        "val-00000_docs.npy",
    ]


def test_documents_survive_intact(prepared):
    originals = [p.read_text() for p in (prepared.parent / "raw").rglob("*.txt")]
    train, val = read_docs(prepared, "train"), read_docs(prepared, "val")
    assert sorted(val) == expected_val(originals, 3, 0.2) and sorted(train + val) == sorted(originals)


def test_sharded_equals_one_file(prepared, prepared_sharded):
    """Shards hold the same documents in the same order as one file: the token streams are equal."""
    one, many = TokenData.open(prepared), TokenData.open(prepared_sharded)
    assert len(many.meta["shards"]) >= 4 and many.meta["splits"] == one.meta["splits"]
    for split in ("train", "val"):
        assert np.array_equal(np.asarray(one.split(split)[:]), np.asarray(many.split(split)[:]))
        assert np.array_equal(one.doc_offsets(split), many.doc_offsets(split))


def test_deterministic_and_seeded(tmp_path, corpus):
    a = prepare(corpus, tmp_path / "a", vocab_size=300, seed=1, quiet=True)
    b = prepare(corpus, tmp_path / "b", vocab_size=300, seed=1, quiet=True, workers=2, shard_mb=0.003)
    c = prepare(corpus, tmp_path / "c", vocab_size=300, seed=2, val_fraction=0.3, quiet=True)
    assert a["splits"] == b["splits"] and len(b["shards"]) > 1
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()
    texts = [p.read_text() for p in sorted(corpus.rglob("*.txt"))]
    assert c["splits"]["val"]["documents"] == len(expected_val(texts, 2, 0.3))
    assert (
        c["splits"]["train"]["tokens"] != a["splits"]["train"]["tokens"]
        or c["shards"][0]["train"]["sha256"] != a["shards"][0]["train"]["sha256"]
    )


def test_empty_val_gets_one_document(tmp_path, corpus):
    """A val_fraction so small that no hash falls below it: the smallest-hash document goes to val."""
    texts = [p.read_text() for p in sorted(corpus.rglob("*.txt"))]
    meta = prepare(corpus, tmp_path / "out", vocab_size=300, seed=1, val_fraction=1e-9, quiet=True, shard_mb=0.003)
    assert read_docs(tmp_path / "out", "val") == [min(texts, key=lambda t: doc_hash(1, t))]
    assert meta["splits"]["train"]["documents"] == len(texts) - 1 and meta["split_fixup"]["cut"] > 0


def test_single_text_file_split_at_tail(tmp_path):
    f = tmp_path / "book.txt"
    text = "All work and no play makes Jack a dull boy. " * 200
    f.write_text(text)
    meta = prepare(f, tmp_path / "out", vocab_size=300, val_fraction=0.1, quiet=True)
    train, val = read_docs(tmp_path / "out", "train"), read_docs(tmp_path / "out", "val")
    assert len(train) == len(val) == 1 and train[0] + val[0] == text
    n = meta["splits"]["train"]["tokens"] + meta["splits"]["val"]["tokens"] - 2
    assert meta["splits"]["val"]["tokens"] - 1 == math.ceil(0.1 * n)
    assert meta["n_documents"] == 1 and meta["source"] == str(f.resolve())


def test_directory_with_non_utf8_and_binary(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("plain ascii text\n" * 20)
    (src / "b.txt").write_bytes("caf\xe9 cr\xe8me br\xfbl\xe9e\n".encode("latin-1") * 20)
    (src / "c.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00" + bytes(range(256)))
    (src / "d.txt").write_text("emoji 🙂 and 数据\n" * 20)
    meta = prepare(src, tmp_path / "out", vocab_size=300, quiet=True)
    assert meta["n_documents"] == 3
    docs = read_docs(tmp_path / "out", "train") + read_docs(tmp_path / "out", "val")
    assert sorted(docs) == sorted(["plain ascii text\n" * 20, "café crème brûlée\n" * 20, "emoji 🙂 and 数据\n" * 20])


def test_jsonl_with_field(tmp_path):
    f = tmp_path / "d.jsonl"
    rows = [{"content": f"document number {i} " * 10, "id": i} for i in range(10)]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    meta = prepare(f, tmp_path / "out", vocab_size=300, text_field="content", quiet=True)
    assert meta["n_documents"] == 10 and meta["text_field"] == "content"
    with pytest.raises(DataError, match="no field 'text'"):
        prepare(f, tmp_path / "out2", vocab_size=300, quiet=True)
    assert not (tmp_path / "out2").exists()


def test_existing_tokenizer(tmp_path, prepared, corpus):
    meta = prepare(corpus, tmp_path / "out", tokenizer_path=prepared / "tokenizer.json", quiet=True)
    assert (tmp_path / "out" / "tokenizer.json").read_text() == (prepared / "tokenizer.json").read_text()
    assert meta["vocab_size"] == json.loads((prepared / "meta.json").read_text())["vocab_size"]


def test_no_tokens(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("")
    (src / "b.txt").write_text("")
    with pytest.raises(DataError, match="yielded no tokens.*--data.path"):
        prepare(src, tmp_path / "out", vocab_size=300, quiet=True)
    assert not (tmp_path / "out").exists()


def test_bad_inputs(tmp_path, prepared):
    with pytest.raises(DataError, match="does not exist"):
        prepare(tmp_path / "missing", tmp_path / "out", quiet=True)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="is empty"):
        prepare(tmp_path / "empty", tmp_path / "out", quiet=True)
    with pytest.raises(DataError, match="already a prepared dataset"):
        prepare(prepared, tmp_path / "out", quiet=True)
    with pytest.raises(DataError, match="val_fraction"):
        prepare(tmp_path, tmp_path / "out", val_fraction=1.0, quiet=True)
    assert not (tmp_path / "out").exists()


def test_refuses_to_overwrite_foreign_directory(tmp_path, corpus):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("precious")
    with pytest.raises(DataError, match="not empty"):
        prepare(corpus, out, vocab_size=300, quiet=True)
    assert (out / "notes.txt").read_text() == "precious"


def test_failed_reprepare_keeps_existing_dataset(tmp_path, corpus, monkeypatch):
    out = tmp_path / "out"
    prepare(corpus, out, vocab_size=300, quiet=True)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "e.txt").write_text("")
    with pytest.raises(DataError, match="no tokens"):
        prepare(tmp_path / "empty", out, vocab_size=300, quiet=True)

    real = shards_mod.run_shard

    def crash(job):  # a failure in the middle of writing a shard
        (Path(job.staging) / "train-00000.bin.tmp").write_bytes(b"partial")
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(shards_mod, "run_shard", crash)
    with pytest.raises(RuntimeError):
        prepare(corpus, out, vocab_size=300, seed=9, quiet=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "empty", "out", "out.partial"]
    TokenData.open(out)
    monkeypatch.setattr(shards_mod, "run_shard", real)
    meta = prepare(corpus, out, vocab_size=300, seed=9, quiet=True)  # the same command resumes and replaces it
    assert meta["seed"] == 9 and TokenData.open(out).meta == meta
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "empty", "out"]


def test_reprepare_replaces_dataset(tmp_path, corpus):
    out = tmp_path / "out"
    prepare(corpus, out, vocab_size=300, seed=1, quiet=True)
    meta = prepare(corpus, out, vocab_size=300, seed=2, quiet=True)
    assert TokenData.open(out).meta == meta
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "out"]


def test_progress_lines(tmp_path, corpus, capsys):
    prepare(corpus, tmp_path / "out", vocab_size=300)
    err = capsys.readouterr().err
    assert "planned 1 shard" in err and "tokenizer" in err and "12 documents" in err and "train" in err


def test_token_dtype():
    assert token_dtype(8192) == np.dtype("<u2") and token_dtype(65535) == np.dtype("<u2")
    assert token_dtype(70000) == np.dtype("<u4")


def test_directory_with_unrelated_meta_json_is_not_overwritten(tmp_path, corpus):
    out = tmp_path / "project"
    out.mkdir()
    (out / "meta.json").write_text('{"name": "my project"}')
    with pytest.raises(DataError, match="not empty"):
        prepare(corpus, out, vocab_size=300, quiet=True)
    assert (out / "meta.json").read_text() == '{"name": "my project"}'
