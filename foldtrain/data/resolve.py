"""Turn ``[data]`` settings into a prepared dataset directory, preparing (once) when needed.

- ``data.path`` names a prepared directory (it has ``meta.json``): used as is.
- ``data.path`` is empty: the default corpus (the interpreter's stdlib source, generated
  tables left out by ``corpus_filter``), prepared into ``data.out`` or
  ``$FOLDTRAIN_CACHE/stdlib-py{major}{minor}-f{filter rule version}-v{vocab}``
  (``FOLDTRAIN_CACHE`` defaults to ``~/.cache/foldtrain``).
- ``data.path`` is raw input: prepared into ``data.out`` or a cache directory
  keyed by a short hash of the absolute path, vocab size and tokenizer.

A cached preparation is reused only if it was made from the same request
(source, its file sizes and mtimes, the corpus filter rule, vocab size, tokenizer, text field,
val_fraction, seed, shard size, tokenizer sample); otherwise it is rebuilt (atomically; an
interrupted preparation of the same request is resumed, one of another is discarded). Preparation holds
an ``fcntl.flock`` lock on a file beside the output directory, so when several
ranks start at once one prepares and the others wait, then reuse the result.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from foldtrain.data import sources
from foldtrain.data.corpus_filter import RULE, RULE_VERSION
from foldtrain.data.prepare import is_prepared, log, prepare
from foldtrain.errors import DataError

if TYPE_CHECKING:
    from foldtrain.config import DataConfig


def cache_root() -> Path:
    """``$FOLDTRAIN_CACHE``, else ``~/.cache/foldtrain``."""
    return Path(os.environ.get("FOLDTRAIN_CACHE") or "~/.cache/foldtrain").expanduser()


def _short_hash(*parts: object) -> str:
    return hashlib.sha256("\0".join(map(str, parts)).encode("utf-8", "surrogateescape")).hexdigest()[:10]


def _abs(path: str) -> str:
    return str(Path(path).expanduser().absolute()) if path else ""


def default_cache_dir(vocab_size: int, tokenizer: str = "") -> Path:
    """Where the default corpus is cached for this interpreter and vocabulary size."""
    name = f"stdlib-py{sys.version_info.major}{sys.version_info.minor}-f{RULE_VERSION}-v{vocab_size}"
    if tokenizer:
        name += f"-tok{_short_hash(_abs(tokenizer))}"
    return cache_root() / name


def raw_cache_dir(path: str | Path, vocab_size: int, tokenizer: str = "") -> Path:
    """Where raw input ``path`` is cached once prepared."""
    p = Path(path).expanduser().absolute()
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in p.name)[:40] or "data"
    return cache_root() / f"{stem}-{_short_hash(p, vocab_size, _abs(tokenizer))}-v{vocab_size}"


def _request(source: Path | None, cfg: DataConfig) -> dict[str, Any]:
    """The meta.json fields that must match for a cached preparation to be reused."""
    return {
        "source": f"stdlib:{sources.default_corpus_root()}" if source is None else str(source.resolve()),
        "source_fingerprint": sources.fingerprint(source),
        "requested_vocab_size": cfg.vocab_size,
        "tokenizer_source": _abs(cfg.tokenizer),
        "text_field": cfg.text_field,
        "val_fraction": cfg.val_fraction,
        "seed": cfg.seed,
        "shard_mb": cfg.shard_mb,
        "tokenizer_sample_mb": cfg.tokenizer_sample_mb,
        "corpus_filter": {"rule": RULE} if source is None else None,
    }


def _matches(out: Path, want: dict[str, Any]) -> bool:
    if not is_prepared(out):
        return False
    try:
        meta = json.loads((out / "meta.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    if not isinstance(meta, dict):
        return False
    got = dict(meta)
    if isinstance(got.get("corpus_filter"), dict):  # the counts of what was left out are not part of the request
        got["corpus_filter"] = {"rule": got["corpus_filter"].get("rule")}
    return all(got.get(k) == v for k, v in want.items())


def _prepare_once(source: Path | None, out: Path, cfg: DataConfig, quiet: bool) -> Path:
    want = _request(source, cfg)
    if _matches(out, want):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    lock_path = out.with_name(f".{out.name}.lock")
    with lock_path.open("a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not quiet:
                log(f"waiting for another process to finish preparing {out}")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if _matches(out, want):  # another process prepared it while we waited
                return out
            if is_prepared(out) and not quiet:
                log(f"{out} was prepared from different data or settings; preparing it again")
            prepare(
                source,
                out,
                cfg.vocab_size,
                cfg.tokenizer,
                cfg.text_field,
                cfg.val_fraction,
                cfg.seed,
                quiet=quiet,
                workers=cfg.workers,
                shard_mb=cfg.shard_mb,
                tokenizer_sample_mb=cfg.tokenizer_sample_mb,
                discard_stale=cache_root().absolute() in out.parents,
            )
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return out


def resolve_data(data_cfg: DataConfig, quiet: bool = False) -> Path:
    """The prepared dataset directory for ``data_cfg``, preparing it first if needed."""
    if data_cfg.path.strip():
        p = Path(data_cfg.path).expanduser()
        if not p.exists():
            raise DataError(f"data path {p} does not exist; pass an existing file or directory to --data.path")
        if p.is_dir() and (p / "meta.json").is_file():  # prepared; TokenData.open validates it
            return p.absolute()
        out = (
            Path(data_cfg.out).expanduser()
            if data_cfg.out
            else raw_cache_dir(p, data_cfg.vocab_size, data_cfg.tokenizer)
        )
        return _prepare_once(p, out.absolute(), data_cfg, quiet)
    out = (
        Path(data_cfg.out).expanduser() if data_cfg.out else default_cache_dir(data_cfg.vocab_size, data_cfg.tokenizer)
    )
    return _prepare_once(None, out.absolute(), data_cfg, quiet)
