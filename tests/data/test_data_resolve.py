"""resolve_data(): prepared dirs, raw input, the default corpus cache, locking."""

from __future__ import annotations

import importlib
import threading
import time

import pytest

from foldtrain.config import DataConfig
from foldtrain.data import TokenData, resolve_data, sources
from foldtrain.errors import DataError

from .conftest import write_corpus

resolve_mod = importlib.import_module("foldtrain.data.resolve")


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FOLDTRAIN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def fake_stdlib(tmp_path, monkeypatch):
    """A tiny stand-in for the standard library, so the default corpus is cheap to prepare."""
    root = tmp_path / "stdlib"
    write_corpus(root, n_docs=6, words=200)
    for p in list(root.rglob("*.txt")):
        p.rename(p.with_suffix(".py"))
    (root / "site-packages").mkdir()
    (root / "site-packages" / "big.py").write_text("EXCLUDED = 1\n")
    monkeypatch.setattr(sources, "default_corpus_root", lambda: root)
    return root


def test_prepared_dir_is_used_as_is(prepared):
    assert resolve_data(DataConfig(path=str(prepared))) == prepared


def test_missing_path(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        resolve_data(DataConfig(path=str(tmp_path / "nope")))


def test_raw_input_is_prepared_once_into_cache(corpus, cache):
    cfg = DataConfig(path=str(corpus), vocab_size=300)
    out = resolve_data(cfg, quiet=True)
    assert out.parent == cache and out.name.startswith("corpus-") and out.name.endswith("-v300")
    stamp = (out / "meta.json").stat().st_mtime_ns
    assert resolve_data(cfg, quiet=True) == out and (out / "meta.json").stat().st_mtime_ns == stamp
    cfg.seed = 99  # different settings: rebuilt in place
    assert resolve_data(cfg, quiet=True) == out and TokenData.open(out).meta["seed"] == 99
    (corpus / "new.txt").write_text("a new document " * 20)  # changed input: rebuilt
    assert resolve_data(cfg, quiet=True) == out and TokenData.open(out).meta["n_documents"] == 13


def test_raw_input_into_data_out(corpus, tmp_path):
    out = resolve_data(DataConfig(path=str(corpus), out=str(tmp_path / "mine"), vocab_size=300), quiet=True)
    assert out == tmp_path / "mine" and TokenData.open(out).meta["n_documents"] == 12


def test_default_corpus_cached(fake_stdlib, cache):
    out = resolve_data(DataConfig(vocab_size=300), quiet=True)
    assert out.parent == cache and out.name.startswith("stdlib-py") and out.name.endswith("-v300")
    meta = TokenData.open(out).meta
    assert meta["n_documents"] == 6 and meta["source"] == f"stdlib:{fake_stdlib}"


def test_concurrent_resolves_prepare_once(fake_stdlib, monkeypatch):
    calls = []
    real = resolve_mod.prepare

    def slow_prepare(*args, **kwargs):
        calls.append(1)
        time.sleep(0.3)
        return real(*args, **kwargs)

    monkeypatch.setattr(resolve_mod, "prepare", slow_prepare)
    results, errors = [], []

    def worker():
        try:
            results.append(resolve_data(DataConfig(vocab_size=300), quiet=True))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1 and len(calls) == 1
    TokenData.open(results[0])


def test_empty_directory_fails_before_touching_the_cache(tmp_path, cache):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="is empty"):
        resolve_data(DataConfig(path=str(tmp_path / "empty")))
    assert not cache.exists()
