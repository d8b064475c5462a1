"""The default corpus's content rule: generated tables are left out, code and prose stay, and the cache knows the
rule."""

from __future__ import annotations

import json
import sys

from foldtrain.config import DataConfig
from foldtrain.data import default_corpus_files, default_corpus_root, iter_default_corpus, resolve_data, sources
from foldtrain.data.corpus_filter import (
    RULE,
    RULE_VERSION,
    TABLE_LINE_FRACTION,
    is_generated_table,
    table_line_fraction,
)
from foldtrain.data.resolve import default_cache_dir

from .conftest import write_corpus

CHARMAP = "\n".join(
    ["### Decoding Table", "", "decoding_table = ("]
    + [f"    '\\x{i:02x}'     #  0x{i:02X} -> CONTROL CHARACTER" for i in range(64)]
    + [")", "", "encoding_map = {"]
    + [f"    0x{i:04x}: 0x{i:02x},     # LATIN LETTER {i}" for i in range(64)]
    + ["}"]
)
CODE = '''def shard_name(split: str, index: int) -> str:
    """Name of shard ``index`` of ``split``, e.g. train-00003."""
    return f"{split}-{index:05d}"


class Writer:
    def __init__(self, path, limit=1 << 20):
        self.path, self.limit = path, limit
        self.buf = [0, 1, 2]  # a few numbers are fine
'''


def test_rule_on_examples():
    assert table_line_fraction(CHARMAP) > 0.9 and is_generated_table(CHARMAP)
    assert table_line_fraction(CODE) == 0.0 and not is_generated_table(CODE)
    assert not is_generated_table("") and not is_generated_table("# only a comment\n\n")
    # the threshold: 2 table lines of 5 code lines (40%) stay, 3 of 5 go
    rows = ["x = compute()", "y = other(x)", "z = x + y"]
    assert not is_generated_table("\n".join(["0x1f, 0x20,", "0x21, 0x22,", *rows]))
    assert is_generated_table("\n".join(["0x1f, 0x20,", "0x21, 0x22,", "0x23,", *rows[:2]]))
    assert RULE == f"table-lines>{TABLE_LINE_FRACTION}-v{RULE_VERSION}"


def test_stdlib_charmaps_are_left_out_and_code_stays():
    root = default_corpus_root()
    files = {str(p.relative_to(root)): p for p in default_corpus_files()}
    for rel in ("encodings/cp437.py", "encodings/mac_roman.py", "stringprep.py"):  # in every CPython
        assert is_generated_table(files[rel].read_text(encoding="utf-8"))
    for rel in ("json/decoder.py", "os.py", "textwrap.py", "encodings/utf_8.py"):
        assert not is_generated_table(files[rel].read_text(encoding="utf-8"))


def test_default_corpus_skips_tables(tmp_path, monkeypatch):
    write_corpus(tmp_path, n_docs=3, words=50)
    for p in list(tmp_path.rglob("*.txt")):
        p.rename(p.with_suffix(".py"))
    (tmp_path / "cp_fake.py").write_text(CHARMAP)
    monkeypatch.setattr(sources, "default_corpus_root", lambda: tmp_path)
    docs = list(iter_default_corpus())
    assert len(docs) == 3 and CHARMAP not in docs


def test_cache_key_has_the_rule(tmp_path, monkeypatch):
    """A default corpus prepared under the old rule (or none) is not reused: the cache directory and the
    request both name the rule, and the meta reports what was left out."""
    monkeypatch.setenv("FOLDTRAIN_CACHE", str(tmp_path / "cache"))
    assert (
        default_cache_dir(8192).name
        == f"stdlib-py{sys.version_info.major}{sys.version_info.minor}-f{RULE_VERSION}-v8192"
    )
    root = tmp_path / "stdlib"
    write_corpus(root, n_docs=4, words=100)
    for p in list(root.rglob("*.txt")):
        p.rename(p.with_suffix(".py"))
    (root / "cp_fake.py").write_text(CHARMAP)
    monkeypatch.setattr(sources, "default_corpus_root", lambda: root)
    out = resolve_data(DataConfig(vocab_size=300), quiet=True)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["corpus_filter"] == {"rule": RULE, "files_left_out": 1, "bytes_left_out": len(CHARMAP)}
    assert meta["n_documents"] == 4
    # a cached dataset from another rule at the same place is prepared again, not reused
    meta["corpus_filter"]["rule"] = "table-lines>0.4-v0"
    (out / "meta.json").write_text(json.dumps(meta))
    mtime = (out / "meta.json").stat().st_mtime_ns
    assert resolve_data(DataConfig(vocab_size=300), quiet=True) == out
    assert (
        json.loads((out / "meta.json").read_text())["corpus_filter"]["rule"] == RULE
        and (out / "meta.json").stat().st_mtime_ns != mtime
    )
