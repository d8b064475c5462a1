"""Checksums of a checkpoint's files, recorded in its ``meta.json`` and verified before any load.

``meta.json`` is written last, after every rank has finished writing; it lists every other file of
the checkpoint with its size and checksum (xxh3-128: non-cryptographic and ~8x faster than sha256
here, so hashing stays a few percent of the save; docs/benchmarks.md). A checkpoint is *intact* when
that list matches the directory exactly: every listed file present with the recorded size and digest,
and no other file.
Nothing of a checkpoint is unpickled or read into a model before it has been verified.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import xxhash

HASH = "xxh3_128"  # what a save records; measured against sha256, crc32 and blake2b in docs/benchmarks.md
_HASHERS = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}  # what a load can verify
META = "meta.json"
_CHUNK = 8 << 20


def file_digest(path: Path, algorithm: str = HASH) -> str:
    """Checksum of a file, read in 8 MiB blocks into one reused buffer."""
    h = _HASHERS[algorithm]()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def describe(directory: Path, names) -> dict[str, dict]:
    """``{name: {"bytes": size, HASH: digest}}`` for the given files of ``directory``."""
    return {n: {"bytes": (directory / n).stat().st_size, HASH: file_digest(directory / n)} for n in sorted(names)}


def read_meta(path: Path) -> dict:
    """The checkpoint's ``meta.json`` (a plain JSON object); raises ``ValueError`` with a reason."""
    f = path / META
    if not f.is_file():
        raise ValueError(f"it has no {META} (an interrupted or foreign save)")
    try:
        meta = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"its {META} is unreadable ({type(e).__name__})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("files"), dict) or not isinstance(meta.get("step"), int):
        raise ValueError(
            f"its {META} records no file checksums (written by an older foldtrain, or not a foldtrain checkpoint)"
        )
    return meta


def damage(path: Path) -> str | None:
    """Why the checkpoint at ``path`` is not intact (one phrase naming the file), or None if it is."""
    try:
        meta = read_meta(path)
        listed: dict = meta["files"]
        algorithm = meta.get("hash", "sha256")
        present = {p.name for p in path.iterdir()} - {META}
    except ValueError as e:
        return str(e)
    except OSError as e:
        return f"it cannot be read ({e.strerror})"
    if algorithm not in _HASHERS:
        return f"its {META} names an unknown checksum {algorithm!r}"
    for name in sorted(present - listed.keys()):
        return f"{name} is not part of the checkpoint as saved"
    for name, rec in sorted(listed.items()):  # sizes first: a truncated file is found without hashing anything
        if name not in present:
            return f"{name} is missing"
        if (
            not isinstance(rec, dict)
            or not isinstance(rec.get("bytes"), int)
            or not isinstance(rec.get(algorithm), str)
        ):
            return f"{META} has a malformed entry for {name}"
        size = (path / name).stat().st_size
        if size != rec["bytes"]:
            return f"{name} has {size} bytes, {rec['bytes']} were saved"
    for name, rec in sorted(listed.items()):
        if file_digest(path / name, algorithm) != rec[algorithm]:
            return f"{name} does not match its checksum"
    return None
