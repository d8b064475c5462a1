"""The last step of a prepare: check every shard, settle the edge cases of the split, write
``meta.json`` and move the finished directory into place.

``meta.json`` of format ``foldtrain-tokens-v2`` holds, besides what v1 held, a ``shards`` list
with each shard's per-split token count, document count and sha256; ``splits`` holds the totals.

Split edge cases (the hash rule of ``shards.py`` can leave a side empty on a small corpus):

- one document in all: it is cut at the tail of its tokens, the last ``ceil(val_fraction * n)``
  (at least one) going to ``val``, as the one-file format did;
- no document in ``val``: the document with the smallest hash goes there (its shard is prepared
  again with a lower cut); no document in ``train``: the one with the largest hash goes there.

Installing is atomic: the finished directory is renamed into place, and a dataset already
there is removed only after that, so a failure never leaves a half-written dataset.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from foldtrain.data import shards
from foldtrain.data.tokenizer import eot_id
from foldtrain.data.tokenizer import vocab_size as tok_vocab_size
from foldtrain.errors import DataError

FORMAT = "foldtrain-tokens-v2"
WORK_FILES = ("options.json", "plan.jsonl")


def _install(tmp: Path, out: Path) -> None:
    """Move the finished ``tmp`` to ``out``; an existing dataset there is removed only afterwards."""
    if not out.exists():
        os.rename(tmp, out)
        return
    old = out.with_name(f".{out.name}.old-{os.getpid()}-{secrets.token_hex(4)}")
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _records(staging: Path, n: int, options_sha: str, itemsize: int) -> list[dict[str, Any]]:
    recs = []
    for i in range(n):
        path = shards.record_path(staging, i)
        if not path.is_file():
            raise DataError(
                f"shard {i} of {n} is not prepared in {staging}; "
                f"run the missing part (--data.shard {i} % --data.num_shards) "
                "or run without --data.shard to prepare it here"
            )
        rec = json.loads(path.read_text(encoding="utf-8"))
        if rec.get("options_sha256") != options_sha:
            raise DataError(
                f"shard {i} in {staging} was prepared with different options; "
                f"delete {path.name} and its .bin files and run again"
            )
        problem = shards.check_shard_files(staging, rec, itemsize)
        if problem is not None:
            raise DataError(
                f"shard {i} in {staging} is incomplete ({problem}); run the same command again to prepare it"
            )
        recs.append(rec)
    return recs


def _tail_split(staging: Path, rec: dict[str, Any], val_fraction: float, dtype: np.dtype, eot: int) -> dict[str, Any]:
    """The corpus's only document, cut at its tail into train and val (rewrites its shard)."""
    side = "train" if rec["train"]["documents"] else "val"
    f = staging / f"{shards.shard_name(side, rec['index'])}.bin"
    ids = np.fromfile(f, dtype=dtype)[:-1]  # without its EOT
    n = len(ids)
    k = min(max(1, math.ceil(val_fraction * n)), n - 1) if n >= 2 else 0
    for name, part in (("train", ids[: n - k]), ("val", ids[n - k :])):
        w = shards.SplitWriter(staging, shards.shard_name(name, rec["index"]), dtype, eot)
        w.add(part)
        rec[name] = w.close()
    shards.write_json(shards.record_path(staging, rec["index"]), rec)
    return rec


def _settle_split(
    staging: Path,
    recs: list[dict[str, Any]],
    val_fraction: float,
    dtype: np.dtype,
    eot: int,
    job: Callable[[int, int], Any],
    say: Any,
) -> dict[str, Any] | None:
    """Apply the split's edge cases; returns what was changed (for meta.json), or None."""
    n_train = sum(r["train"]["documents"] for r in recs)
    n_val = sum(r["val"]["documents"] for r in recs)
    if n_train + n_val == 1:
        i = next(r["index"] for r in recs if r["train"]["documents"] + r["val"]["documents"])
        recs[i] = _tail_split(staging, recs[i], val_fraction, dtype, eot)
        return {"single_document": True}
    if n_val and n_train:
        return None
    if not n_val:  # the document with the smallest hash goes to val
        i = min((r for r in recs if r["train"]["documents"]), key=lambda r: r["min_train_hash"])["index"]
        cut = recs[i]["min_train_hash"] + 1
    else:  # the document with the largest hash goes to train
        i = max((r for r in recs if r["val"]["documents"]), key=lambda r: r["max_val_hash"])["index"]
        cut = recs[i]["max_val_hash"]
    say(
        f"the hash split left {'val' if not n_val else 'train'} empty; "
        f"preparing shard {i} again with one document moved there"
    )
    recs[i] = shards.run_shard(job(i, cut))
    return {"shard": i, "cut": cut}


def finalize(
    staging: Path,
    out: Path,
    options: dict[str, Any],
    options_sha: str,
    info: dict[str, Any],
    tok: Any,
    dtype: np.dtype,
    job: Callable[[int, int], Any],
    say: Any,
) -> dict[str, Any]:
    """Check the shards in ``staging``, write meta.json and install the dataset at ``out``."""
    eot = eot_id(tok)
    recs = _records(staging, options["n_shards"], options_sha, dtype.itemsize)
    if not any(r["train"]["documents"] + r["val"]["documents"] for r in recs):
        shutil.rmtree(staging, ignore_errors=True)
        raise DataError(f"{info['source']} yielded no tokens (no non-empty documents); point --data.path at text files")
    # counted before a tail split makes 1 into 2
    n_documents = sum(r["train"]["documents"] + r["val"]["documents"] for r in recs)
    fixup = _settle_split(staging, recs, options["val_fraction"], dtype, eot, job, say)
    splits = {
        s: {"tokens": sum(r[s]["tokens"] for r in recs), "documents": sum(r[s]["documents"] for r in recs)}
        for s in shards.SPLITS
    }
    dropped_files, dropped_bytes = sum(r["dropped_files"] for r in recs), sum(r["dropped_bytes"] for r in recs)
    meta: dict[str, Any] = {
        "format": FORMAT,
        "dtype": dtype.name,
        "vocab_size": tok_vocab_size(tok),
        "eot_id": eot,
        "splits": splits,
        "shards": [{s: r[s] for s in shards.SPLITS} for r in recs],
        "n_documents": n_documents,
        "source": info["source"],
        "tokenizer": "tokenizer.json",
        "seed": options["seed"],
        "val_fraction": options["val_fraction"],
        "text_field": options["text_field"],
        "requested_vocab_size": options["requested_vocab_size"],
        "tokenizer_source": options["tokenizer_source"],
        "tokenizer_sample_mb": options["tokenizer_sample_mb"],
        "source_fingerprint": info["source_fingerprint"],
        "input_bytes": info["input_bytes"],
        "shard_mb": options["shard_mb"],
        "plan_sha256": options["plan_sha256"],
        "corpus_filter": {
            "rule": options["corpus_filter"],
            "files_left_out": dropped_files,
            "bytes_left_out": dropped_bytes,
        }
        if options["corpus_filter"]
        else None,
        "split_fixup": fixup,
    }
    if options["corpus_filter"]:
        say(
            f"corpus filter {options['corpus_filter']}: left out {dropped_files} generated-table files "
            f"({dropped_bytes / 1e6:.2f} MB)"
        )
    for name in WORK_FILES:
        (staging / name).unlink(missing_ok=True)
    for rec in staging.glob("shard-*.json"):
        rec.unlink()
    shards.write_json(staging / "meta.json", meta)
    _install(staging, out)
    return meta
