"""``foldtrain prepare``: raw text in, a sharded, tokenized dataset directory out, in bounded memory.

Steps (every one streams; memory does not grow with the corpus):

1. **plan** (``plan.py``): list the input as pieces (files, byte ranges of JSONL, row ranges of a
   Hugging Face dataset) and group them into shards of about ``--data.shard_mb`` of input;
2. **tokenizer**: train a byte-level BPE on a seeded sample of about ``--data.tokenizer_sample_mb``
   of the pieces (or load ``--data.tokenizer``);
3. **shards** (``shards.py``): each shard's documents are read, sent to ``train`` or ``val`` by a
   seeded hash of their text, batch-encoded and written, by ``--data.workers`` processes;
4. **finalize** (``merge.py``): check every shard, write ``meta.json``, move the directory into place.

Everything is built in ``<out>.partial/`` beside the output. An interrupted prepare, run again
with the same options, keeps the shards that are complete and does the rest; run with other
options it stops with one line and changes nothing. ``--data.shard K --data.num_shards N``
prepares only shards ``i`` with ``i % N == K`` (one part of the corpus per machine) and stops
before step 4; once every part's shards are in one ``<out>.partial/`` directory, the same command
without those flags finalizes. The dataset never depends on the number of workers or parts.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from foldtrain.data import merge, shards, sources
from foldtrain.data import plan as plan_mod
from foldtrain.data.corpus_filter import RULE
from foldtrain.data.tokenizer import load_tokenizer, train_tokenizer
from foldtrain.data.tokenizer import vocab_size as tok_vocab_size
from foldtrain.errors import DataError

FORMAT = merge.FORMAT
OPTIONS = "options.json"
PLAN = "plan.jsonl"


def log(msg: str) -> None:
    """One progress line on stderr."""
    print(f"[data] {msg}", file=sys.stderr, flush=True)


def token_dtype(vocab: int) -> np.dtype:
    """Little-endian uint16 when every id fits, else uint32."""
    return np.dtype("<u2") if vocab <= 65535 else np.dtype("<u4")


def is_prepared(path: str | Path) -> bool:
    """Whether ``path`` looks like a prepared dataset (``meta.json`` and ``train.bin`` or shards).

    Only the layout is checked; ``TokenData.open`` validates the contents.
    """
    p = Path(path)
    return (p / "meta.json").is_file() and ((p / "train.bin").is_file() or (p / "train-00000.bin").is_file())


def staging_dir(out: Path) -> Path:
    return out.with_name(out.name + ".partial")


def _check_source(source: str | Path | None) -> str:
    """A printable, absolute name of the source; rejects inputs that are already prepared."""
    if source is None or str(source) == "":
        return f"stdlib:{sources.default_corpus_root()}"
    p = Path(source).expanduser()
    if p.is_dir() and is_prepared(p):
        raise DataError(
            f"{p} is already a prepared dataset; pass it to --data.path to train on it instead of preparing it"
        )
    return str(p.resolve())


def _check_args(
    val_fraction: float, workers: int, shard_mb: float, sample_mb: float, shard: int, num_shards: int
) -> None:
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"--data.val_fraction must be in (0, 1), got {val_fraction}; pass e.g. 0.005")
    if workers < 1:
        raise DataError(f"--data.workers must be at least 1, got {workers}")
    if not shard_mb > 0 or not sample_mb > 0:
        raise DataError(f"--data.shard_mb and --data.tokenizer_sample_mb must be > 0, got {shard_mb} and {sample_mb}")
    if num_shards < 1 or not 0 <= shard < num_shards:
        raise DataError(
            f"--data.shard {shard} is not in [0, --data.num_shards {num_shards}); number the parts 0 .. num_shards-1"
        )


def _check_out_dir(out: Path, staging: Path) -> None:
    if out.exists() and not out.is_dir():
        raise DataError(f"output path {out} is a file; pass a directory to --data.out")
    if out.is_dir() and not is_prepared(out) and any(out.iterdir()):
        raise DataError(
            f"output directory {out} is not empty and holds no prepared dataset; choose a new or empty --data.out"
        )
    if staging.exists() and not (staging / OPTIONS).is_file() and (not staging.is_dir() or any(staging.iterdir())):
        raise DataError(
            f"{staging} exists and is not an interrupted prepare of foldtrain; "
            "move it away or choose another --data.out"
        )


def _differences(old: dict[str, Any], new: dict[str, Any]) -> str:
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    return ", ".join(f"{k} {old.get(k)!r} there, {new.get(k)!r} now" for k in keys[:3])


def _open_staging(staging: Path, options: dict[str, Any], discard_stale: bool, say: Any) -> None:
    """Create ``staging`` or check that the interrupted prepare in it used the same options."""
    if (staging / OPTIONS).is_file():
        try:
            old = json.loads((staging / OPTIONS).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            old = {"options": "unreadable"}
        if old == options:
            done = len(list(staging.glob("shard-*.json")))
            say(f"resuming the interrupted prepare in {staging} ({done} of {options['n_shards']} shards complete)")
            return
        if not discard_stale:
            raise DataError(
                f"{staging} holds an interrupted prepare with different options ({_differences(old, options)}); "
                f"re-run with the same options to resume it, or delete {staging} to start over"
            )
        say(f"discarding {staging}: an interrupted prepare of other data or options")
        shutil.rmtree(staging)
    staging.mkdir(parents=True, exist_ok=True)
    shards.write_json(staging / OPTIONS, options)


def _tokenizer(
    staging: Path,
    tokenizer_path: str | Path,
    vocab_size: int,
    plan: plan_mod.Plan,
    text_field: str,
    sample_mb: float,
    seed: int,
    say: Any,
) -> Any:
    dest = staging / "tokenizer.json"
    if dest.is_file():
        return load_tokenizer(dest)
    t0 = time.perf_counter()
    if tokenizer_path:
        tok = load_tokenizer(tokenizer_path)
        say(f"loaded tokenizer {tokenizer_path} (vocab {tok_vocab_size(tok):,})")
    else:
        sample = plan_mod.tokenizer_sample(plan, text_field, int(sample_mb * 1e6), seed)
        tok = train_tokenizer(sample, vocab_size)
        say(
            f"trained byte-level BPE tokenizer (vocab {tok_vocab_size(tok):,}) "
            f"on a sample of <= {sample_mb:g} MB in {time.perf_counter() - t0:.1f}s"
        )
    tmp = staging / "tokenizer.json.tmp"
    tok.save(str(tmp))
    tmp.replace(dest)
    return load_tokenizer(dest)


def _pending(staging: Path, n: int, shard: int, num_shards: int, itemsize: int, say: Any) -> list[int]:
    todo = []
    for i in range(shard, n, num_shards):
        rec = shards.record_path(staging, i)
        if rec.is_file():
            problem = shards.check_shard_files(staging, json.loads(rec.read_text(encoding="utf-8")), itemsize)
            if problem is None:
                continue
            say(f"shard {i} is incomplete ({problem}); preparing it again")
            rec.unlink()
        todo.append(i)
    return todo


def _run(jobs: list[shards.ShardJob], workers: int, total: int, say: Any) -> None:
    t0, done_bytes, done = time.perf_counter(), 0, 0

    def report(rec: dict[str, Any]) -> None:
        nonlocal done_bytes, done
        done_bytes += rec["input_bytes"]
        done += 1
        dt = max(time.perf_counter() - t0, 1e-9)
        say(
            f"shard {rec['index']} done ({done}/{len(jobs)} this run, {total} in all): "
            f"{rec['train']['tokens'] + rec['val']['tokens']:,} tokens; "
            f"{done_bytes / 1e6:.0f} MB at {done_bytes / 1e6 / dt:.1f} MB/s"
        )

    if workers == 1 or len(jobs) == 1:
        for job in jobs:
            report(shards.run_shard(job))
        return
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(min(workers, len(jobs)), initializer=shards.worker_init, maxtasksperchild=16) as pool:
        try:
            for rec in pool.imap_unordered(shards.run_shard_dict, [shards.job_dict(j) for j in jobs]):
                report(rec)
        except BaseException:
            pool.terminate()
            raise


def _plan_into_staging(
    source: str | Path | None,
    text_field: str,
    shard_mb: float,
    out: Path,
    staging: Path,
    options_of: Callable[[plan_mod.Plan], dict[str, Any]],
    discard_stale: bool,
    say: Callable[[str], None],
) -> tuple[plan_mod.Plan, dict[str, Any]]:
    """The plan of ``source``'s shards and the options of this prepare (``options_of(plan)``), with the
    staging directory opened for them and the plan moved into it."""
    plan_tmp = out.with_name(f".{out.name}.plan.tmp")
    try:
        plan = plan_mod.make_plan(source, text_field, max(1, int(shard_mb * 1e6)), plan_tmp)
        options = options_of(plan)
        _open_staging(staging, options, discard_stale, say)
    except BaseException:
        plan_tmp.unlink(missing_ok=True)
        raise
    plan_tmp.replace(staging / PLAN)
    plan.path = staging / PLAN
    return plan, options


def _job_maker(
    staging: Path, plan: plan_mod.Plan, text_field: str, seed: int, dtype: np.dtype, options_sha: str
) -> Callable[[int, int], shards.ShardJob]:
    """``job(i, cut)``: the work of tokenizing shard ``i`` of the plan (``cut``: where its validation split starts)."""

    def job(i: int, cut: int) -> shards.ShardJob:
        off, count, _ = plan.shards[i]
        return shards.ShardJob(
            str(staging),
            i,
            str(plan.path),
            off,
            count,
            plan.root,
            text_field,
            seed,
            cut,
            dtype.str,
            str(staging / "tokenizer.json"),
            options_sha,
        )

    return job


def prepare(
    source: str | Path | None,
    out_dir: str | Path,
    vocab_size: int = 8192,
    tokenizer_path: str | Path = "",
    text_field: str = "text",
    val_fraction: float = 0.005,
    seed: int = 1337,
    quiet: bool = False,
    *,
    workers: int = 1,
    shard_mb: float = 256.0,
    tokenizer_sample_mb: float = 100.0,
    shard: int = 0,
    num_shards: int = 1,
    discard_stale: bool = False,
) -> dict[str, Any]:
    """Tokenize ``source`` (``None``/``""``: the default corpus) into ``out_dir``; returns the meta.

    With ``num_shards > 1`` only part ``shard`` is prepared and ``{"part": ..., ...}`` is returned.
    ``discard_stale``: throw away an interrupted prepare of other options instead of refusing.
    """
    say = (lambda _msg: None) if quiet else log
    t0 = time.perf_counter()
    _check_args(val_fraction, workers, shard_mb, tokenizer_sample_mb, shard, num_shards)
    out = Path(out_dir).expanduser().absolute()
    staging = staging_dir(out)
    _check_out_dir(out, staging)
    label = _check_source(source)
    fingerprint = sources.fingerprint(source)
    out.parent.mkdir(parents=True, exist_ok=True)

    def options_of(plan: plan_mod.Plan) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "plan_sha256": plan.sha256,
            "n_shards": len(plan.shards),
            "requested_vocab_size": vocab_size,
            "tokenizer_source": str(Path(tokenizer_path).expanduser().absolute()) if tokenizer_path else "",
            "tokenizer_sample_mb": tokenizer_sample_mb,
            "text_field": text_field,
            "val_fraction": val_fraction,
            "seed": seed,
            "shard_mb": shard_mb,
            "corpus_filter": RULE if source is None or str(source) == "" else "",
        }

    plan, options = _plan_into_staging(source, text_field, shard_mb, out, staging, options_of, discard_stale, say)
    say(
        f"planned {len(plan.shards)} shard(s) of <= ~{shard_mb:g} MB from {plan.input_bytes / 1e6:.1f} MB of input "
        f"({label}) in {time.perf_counter() - t0:.1f}s"
    )
    options_sha = hashlib.sha256(json.dumps(options, sort_keys=True).encode()).hexdigest()

    tok = _tokenizer(staging, tokenizer_path, vocab_size, plan, text_field, tokenizer_sample_mb, seed, say)
    dtype = token_dtype(tok_vocab_size(tok))
    job = _job_maker(staging, plan, text_field, seed, dtype, options_sha)
    todo = _pending(staging, len(plan.shards), shard, num_shards, dtype.itemsize, say)
    _run([job(i, shards.default_cut(val_fraction)) for i in todo], workers, len(plan.shards), say)
    if num_shards > 1:
        mine = len(range(shard, len(plan.shards), num_shards))
        say(
            f"part {shard} of {num_shards} done ({mine} shard(s)) in {staging}; when every part's shards are in one "
            f"{staging.name}/ directory, run this command without --data.shard/--data.num_shards to finalize"
        )
        return {"part": shard, "num_shards": num_shards, "shards": mine, "staging": str(staging)}
    info = {"source": label, "source_fingerprint": fingerprint, "input_bytes": plan.input_bytes}
    meta = merge.finalize(staging, out, options, options_sha, info, tok, dtype, job, say)
    n_train, n_val = meta["splits"]["train"]["tokens"], meta["splits"]["val"]["tokens"]
    say(
        f"wrote {n_train:,} train + {n_val:,} val tokens ({dtype.name}) "
        f"of {meta['n_documents']:,} documents in {len(meta['shards'])} shard(s) to {out}; "
        f"total {time.perf_counter() - t0:.1f}s"
    )
    return meta
