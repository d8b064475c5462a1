"""Where documents come from: text files, directories, JSONL, Hugging Face datasets on disk.

Every source is reduced to an iterator of documents (``str``). Reading never
crashes on encodings: bytes are decoded as UTF-8 and, when that fails, as
latin-1 (which maps every byte to a character, so nothing is lost). Files that
look binary (a NUL byte in the first 8 KB) are skipped inside directories and
rejected when named directly. Every problem the user can fix is a ``DataError``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from foldtrain.data.corpus_filter import RULE, is_generated_table
from foldtrain.errors import DataError

BINARY_PROBE_BYTES = 8192
SKIP_DIRS = frozenset({"__pycache__"})
HF_MARKERS = ("dataset_info.json", "dataset_dict.json")


# ---------------------------------------------------------------- decoding


def one_line(e: BaseException) -> str:
    """An exception's message with newlines and runs of spaces collapsed (errors are one line)."""
    return " ".join(str(e).split())


def decode_bytes(data: bytes) -> str:
    """UTF-8 (a leading BOM dropped), falling back to latin-1; never raises."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("latin-1")
    return text[1:] if text.startswith("\ufeff") else text


def is_binary(data: bytes) -> bool:
    """A file is treated as binary when its first 8 KB contain a NUL byte."""
    return b"\x00" in data[:BINARY_PROBE_BYTES]


# ---------------------------------------------------------------- the default corpus


def default_corpus_root() -> Path:
    """The running interpreter's standard-library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def default_corpus_files(limit: int | None = None) -> list[Path]:
    """The standard library's ``*.py`` files (``site-packages`` excluded), in sorted walk order."""
    root = default_corpus_root()
    if not root.is_dir():
        raise DataError(f"the standard library directory {root} is missing; pass your own corpus to --data.path")
    files = [p for p in walk_files(root, skip_dirs=SKIP_DIRS | {"site-packages", "dist-packages"}) if p.suffix == ".py"]
    return files[:limit] if limit is not None else files


def read_default_file(path: Path) -> str | None:
    """The text of one default-corpus file, or ``None`` if it is unreadable, binary or a generated table."""
    data = _read_quietly(path)
    if data is None or is_binary(data):
        return None
    text = decode_bytes(data)
    return None if is_generated_table(text) else text


def iter_default_corpus(limit: int | None = None) -> Iterator[str]:
    """Documents of the default corpus (one per stdlib source file, generated tables left out,
    see ``corpus_filter``); ``limit`` caps the number of files looked at."""
    for path in default_corpus_files(limit):
        text = read_default_file(path)
        if text is not None:
            yield text


# ---------------------------------------------------------------- walking


def _is_prepared_dir(names: list[str]) -> bool:
    return ("meta.json" in names and ("train.bin" in names or "train-00000.bin" in names)) or (
        "options.json" in names and "plan.jsonl" in names
    )


def walk_files(root: Path, skip_dirs: frozenset[str] = SKIP_DIRS) -> list[Path]:
    """Regular files under ``root`` in a deterministic order (names sorted at every level).

    Hidden files and directories (leading dot), ``skip_dirs`` and prepared
    foldtrain datasets found inside the tree are skipped. Symbolic links to
    files are followed; links to directories are not.
    """
    return list(iter_files(root, skip_dirs))


def iter_files(root: Path, skip_dirs: frozenset[str] = SKIP_DIRS) -> Iterator[Path]:
    """``walk_files`` as a generator: memory for one directory's listing at a time."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in skip_dirs)
        if Path(dirpath) != root and _is_prepared_dir(filenames):
            dirnames[:] = []
            continue
        for name in sorted(filenames):
            if name.startswith("."):
                continue
            p = Path(dirpath, name)
            if p.is_file():
                yield p


def _read_quietly(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError as e:
        print(f"[data] skipping unreadable file {path}: {e.strerror or e}", file=sys.stderr)
        return None


# ---------------------------------------------------------------- formats


def iter_jsonl(path: Path, text_field: str = "text", start: int = 0, end: int | None = None) -> Iterator[str]:
    """One document per line: the string in ``text_field`` of each JSON object (blank lines skipped).

    ``start``/``end`` read only the lines that begin at a byte offset in ``[start, end)``, so
    consecutive byte ranges of one file together read every line exactly once.
    """
    try:
        fh = path.open("rb")
    except OSError as e:
        raise DataError(f"cannot read {path} ({e.strerror or e}); check the file's permissions") from None
    with fh:
        if start > 0:
            fh.seek(start - 1)
            fh.readline()  # the rest of the line that began before ``start`` (just "\n" if one ended there)
        lineno = 0
        while end is None or fh.tell() < end:
            where = fh.tell()
            raw = fh.readline()
            if not raw:
                break
            lineno += 1
            value = parse_jsonl_line(
                raw, text_field, f"{path} line {lineno}" if start == 0 else f"{path} line at byte {where}"
            )
            if value is not None:
                yield value


def parse_jsonl_line(raw: bytes, text_field: str, where: str) -> str | None:
    """The text of one JSONL line (``None`` for a blank line); ``where`` names the line in errors."""
    line = decode_bytes(raw).strip()
    if not line:
        return None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where} is not valid JSON ({e.msg}); fix or remove that line") from None
    if not isinstance(obj, dict):
        raise DataError(f"{where} is a JSON {type(obj).__name__}, not an object; write one JSON object per line")
    if text_field not in obj:
        found = ", ".join(sorted(map(str, obj))[:8]) or "none"
        raise DataError(
            f"{where} has no field '{text_field}' (fields: {found}); "
            "set --data.text_field to the field holding the text"
        )
    value = obj[text_field]
    if not isinstance(value, str):
        raise DataError(
            f"{where}: field '{text_field}' is {type(value).__name__}, not a string; "
            "fix the line or set --data.text_field to a text field"
        )
    return value


def is_hf_dataset(path: Path) -> bool:
    """A directory written by ``datasets``' ``save_to_disk``."""
    return path.is_dir() and any((path / m).is_file() for m in HF_MARKERS)


def load_hf_dataset(path: Path, text_field: str = "text") -> Any:
    """The ``datasets.Dataset`` saved at ``path`` (its ``train`` split if a DatasetDict), holding ``text_field``."""
    try:
        import datasets  # noqa: PLC0415 (optional dependency)
    except ImportError:
        raise DataError(
            f"{path} is a Hugging Face dataset but `datasets` is not installed; run `pip install datasets`"
        ) from None
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001 (any loader failure is a data problem)
        raise DataError(
            f"cannot load the Hugging Face dataset at {path} ({type(e).__name__}: {one_line(e)}); "
            "re-save it with save_to_disk"
        ) from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError(
                f"the dataset at {path} has no 'train' split (splits: {', '.join(ds)}); "
                "save the train split or a single Dataset"
            )
        ds = ds["train"]
    if text_field not in ds.column_names:
        raise DataError(
            f"the dataset at {path} has no column '{text_field}' (columns: {', '.join(ds.column_names)}); "
            f"set --data.text_field to the column holding the text"
        )
    return ds


def iter_hf_dataset(path: Path, text_field: str = "text", start: int = 0, end: int | None = None) -> Iterator[str]:
    """Documents from a Hugging Face dataset saved with ``save_to_disk`` (rows ``[start, end)``)."""
    ds = load_hf_dataset(path, text_field)
    if start or end is not None:
        ds = ds.select(range(start, len(ds) if end is None else min(end, len(ds))))
    for batch in ds.select_columns([text_field]).iter(batch_size=1000):
        for value in batch[text_field]:
            if value is None:
                continue
            if not isinstance(value, str):
                raise DataError(
                    f"column '{text_field}' of {path} holds {type(value).__name__}, not text; "
                    "set --data.text_field to a text column"
                )
            yield value


def _iter_directory(root: Path, text_field: str) -> Iterator[str]:
    files = walk_files(root)
    if not files:
        raise DataError(
            f"directory {root} is empty (no non-hidden files); put text files in it or pass another --data.path"
        )
    text_files = 0
    for path in files:
        if path.suffix == ".jsonl":
            text_files += 1
            yield from iter_jsonl(path, text_field)
            continue
        data = _read_quietly(path)
        if data is None or is_binary(data):
            continue
        text_files += 1
        yield decode_bytes(data)
    if text_files == 0:
        raise DataError(
            f"directory {root} holds no text files (all {len(files)} are binary or unreadable); "
            "point --data.path at text files"
        )


def iter_documents(path: str | Path | None, text_field: str = "text") -> Iterator[str]:
    """Documents from ``path``; ``None`` or ``""`` means the default corpus.

    - a directory saved by ``datasets`` (``dataset_info.json``/``dataset_dict.json``): its rows;
    - any other directory: every regular non-hidden, non-binary file, recursively, in sorted
      order, one document per file (``*.jsonl`` files inside are read as JSONL);
    - a ``*.jsonl`` file: one document per line, from field ``text_field``;
    - any other file: the whole file is one document.
    """
    if path is None or str(path) == "":
        yield from iter_default_corpus()
        return
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"data path {p} does not exist; pass an existing file or directory to --data.path")
    if p.is_dir():
        if is_hf_dataset(p):
            yield from iter_hf_dataset(p, text_field)
        else:
            yield from _iter_directory(p, text_field)
        return
    if not p.is_file():
        raise DataError(
            f"data path {p} is not a regular file or directory; "
            "pass a text file, directory or .jsonl file to --data.path"
        )
    if p.suffix == ".jsonl":
        yield from iter_jsonl(p, text_field)
        return
    try:
        data = p.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read {p} ({e.strerror or e}); check the file's permissions") from None
    if is_binary(data):
        raise DataError(
            f"{p} looks binary (it contains NUL bytes); pass a text file, directory or .jsonl file to --data.path"
        )
    yield decode_bytes(data)


# ---------------------------------------------------------------- fingerprints


def fingerprint(path: str | Path | None) -> str:
    """A cheap identity of the input (file names, sizes, mtimes) to notice when a cached preparation is stale."""
    h = hashlib.sha256()
    if path is None or str(path) == "":
        root = default_corpus_root()
        files: Iterator[Path] | list[Path] = default_corpus_files()
        h.update(f"filter {RULE}\n".encode())
    else:
        root = Path(path).expanduser().resolve()
        if not root.exists():
            raise DataError(f"data path {root} does not exist; pass an existing file or directory to --data.path")
        files = [root] if root.is_file() else iter_files(root)
    n = 0
    for f in files:
        n += 1
        try:
            st = f.stat()
        except OSError:
            continue
        rel = f.relative_to(root) if f != root else Path(f.name)
        h.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode("utf-8", "surrogateescape"))
    if n == 0:
        raise DataError(
            f"directory {root} is empty (no non-hidden files); put text files in it or pass another --data.path"
        )
    return h.hexdigest()[:16]
