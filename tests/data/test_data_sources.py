"""Document sources: files, directories, JSONL, HF datasets, the default corpus, bad inputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from foldtrain.data import sources
from foldtrain.errors import DataError


def docs(path, **kw) -> list[str]:
    return list(sources.iter_documents(path, **kw))


def test_text_file_is_one_document(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("line one\nline two\n")
    assert docs(f) == ["line one\nline two\n"]


def test_directory_walk(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.txt").write_text("nested")
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "latin.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "blob.bin").write_bytes(b"ab\x00\x01" * 100)
    (tmp_path / ".hidden").write_text("no")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "config").write_text("no")
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "m.txt").write_text("no")
    (tmp_path / "bom.txt").write_bytes("\ufeffbom".encode())
    assert docs(tmp_path) == ["first", "bom", "café", "nested"]


def test_directory_reads_jsonl_inside(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"text": "x"}\n{"text": "y"}\n')
    (tmp_path / "e.txt").write_text("z")
    assert docs(tmp_path) == ["x", "y", "z"]


def test_jsonl_field_and_blank_lines(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"body": "one", "id": 1}\n\n{"body": "two \\u00e9"}\n')
    assert docs(f, text_field="body") == ["one", "two é"]


@pytest.mark.parametrize(
    ("content", "pattern"),
    [
        ('{"text": "ok"}\n{"text": broken}\n', r"line 2 is not valid JSON"),
        ('{"text": "ok"}\n{"body": "x"}\n', r"line 2 has no field 'text'.*--data.text_field"),
        ("[1, 2]\n", r"line 1 is a JSON list"),
        ('{"text": null}\n', r"line 1: field 'text' is NoneType"),
    ],
)
def test_jsonl_errors_name_file_and_line(tmp_path, content, pattern):
    f = tmp_path / "bad.jsonl"
    f.write_text(content)
    with pytest.raises(DataError, match=pattern) as e:
        docs(f)
    assert str(f) in str(e.value) and "\n" not in str(e.value)


def test_missing_path(tmp_path):
    with pytest.raises(DataError, match="does not exist.*--data.path"):
        docs(tmp_path / "missing")


def test_empty_directory(tmp_path):
    (tmp_path / ".only_hidden").write_text("x")
    with pytest.raises(DataError, match="is empty"):
        docs(tmp_path)


def test_directory_of_binaries(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"\x00" * 10)
    with pytest.raises(DataError, match="no text files"):
        docs(tmp_path)


def test_binary_file_named_directly(tmp_path):
    f = tmp_path / "a.bin"
    f.write_bytes(b"\x00\x01")
    with pytest.raises(DataError, match="looks binary"):
        docs(f)


def test_hf_dataset_without_datasets(tmp_path, monkeypatch):
    (tmp_path / "dataset_info.json").write_text("{}")
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *a, **kw):
        if name == "datasets":
            raise ImportError(name)
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(DataError, match="pip install datasets"):
        docs(tmp_path)


def test_hf_dataset_on_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"content": ["alpha", "beta", None, "gamma"]})
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "dd"))
    ds.save_to_disk(str(tmp_path / "single"))
    assert docs(tmp_path / "dd", text_field="content") == ["alpha", "beta", "gamma"]
    assert docs(tmp_path / "single", text_field="content") == ["alpha", "beta", "gamma"]
    with pytest.raises(DataError, match="no column 'text'"):
        docs(tmp_path / "single")


def test_default_corpus_subset():
    root = sources.default_corpus_root()
    files = sources.default_corpus_files()
    assert root.is_dir() and len(files) > 500
    assert all(f.suffix == ".py" and "site-packages" not in f.parts and "__pycache__" not in f.parts for f in files)
    assert files[:20] == sources.default_corpus_files(limit=20)
    texts = list(sources.iter_default_corpus(limit=20))
    assert 0 < len(texts) <= 20 and all(isinstance(t, str) for t in texts)
    assert any("import" in t or "def " in t for t in texts)


def test_fingerprint_changes_with_content(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("one")
    before = sources.fingerprint(tmp_path)
    f.write_text("one two")
    assert sources.fingerprint(tmp_path) != before
    assert sources.fingerprint(Path(tmp_path)) == sources.fingerprint(str(tmp_path))


def test_decode_bytes_never_raises():
    assert sources.decode_bytes(bytes(range(256))) == bytes(range(256)).decode("latin-1")
    assert json.loads(json.dumps(sources.decode_bytes(b"\xff\xfe"))) == "ÿþ"
