"""`foldtrain prepare` against a plain tokenizing script: throughput (MB/s, per core) and peak memory.

Generates a corpus of text files under a scratch directory (default ``/tmp/foldtrain-databench``,
``--gb`` of input, deleted at the end unless ``--keep``), trains one tokenizer on a 20 MB sample
that both sides load, then measures two things in one invocation:

1. throughput, A/B: both sides on a subset of ``--subset_mb`` (hard links to the first files of
   the corpus), ``--rounds`` times, alternating which goes first, so machine noise hits both;
   wall-clock MB/s and MB per CPU-second (user + system time of the whole process tree, which
   a loaded machine distorts much less than wall time);
2. the whole corpus, ``foldtrain`` (and ``plain`` too with ``--full_plain``): peak memory and
   throughput at full size.

The two sides:

- **plain**: a script that reads the same files in sorted order, 256 at a time, tokenizes them with
  ``tokenizers``' ``encode_batch`` (the library's own parallelism, all cores) and appends the ids
  with ``numpy.tofile`` -- no split, no shards, no checksums, no resume;
- **foldtrain**: ``foldtrain prepare --data.tokenizer TOK --data.workers W`` (everything it does).

Each side runs as a subprocess; a poller samples every 0.2 s the process tree's summed PSS
(proportional set size: shared pages counted once) and the largest single-process RSS.

    foldtrain bench data --gb 2.1 --workers 2 [--rounds 2] [--subset_mb 100] [--full_plain] [--scratch DIR] [--keep]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

PLAIN = r"""
import os, sys, numpy as np
from tokenizers import Tokenizer
src, tok_path, out = sys.argv[1], sys.argv[2], sys.argv[3]
tok = Tokenizer.from_file(tok_path)
eot = tok.token_to_id("<|endoftext|>")
files = []
for d, dirs, names in os.walk(src):
    dirs.sort()
    files += [os.path.join(d, n) for n in sorted(names)]
with open(out, "wb") as fh:
    for i in range(0, len(files), 256):
        texts = [open(f, encoding="utf-8").read() for f in files[i:i + 256]]
        for enc in tok.encode_batch(texts, add_special_tokens=False):
            np.array(enc.ids + [eot], dtype=np.uint16).tofile(fh)
"""

WORDS_SEED = 1234


def generate(root: Path, gb: float, doc_kb: int = 16) -> int:
    """``gb`` GB of English-like text (Zipf-distributed words, sentences, paragraphs) in files of ~``doc_kb`` KB."""
    rng = random.Random(WORDS_SEED)
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    vocab = ["".join(rng.choices(letters, weights=range(26, 0, -1), k=rng.randint(1, 10))) for _ in range(30000)]
    cum = list(itertools.accumulate(1.0 / (i + 1) for i in range(len(vocab))))
    sentences = []
    for _ in range(20000):
        words = rng.choices(vocab, cum_weights=cum, k=rng.randint(5, 25))
        words[0] = words[0].capitalize()
        sentences.append(" ".join(words) + rng.choice([". ", ". ", ", and ", "? ", "! ", ".\n\n", ": 1998, 42% "]))
    target, written, i = int(gb * 1e9), 0, 0
    root.mkdir(parents=True, exist_ok=True)
    while written < target:
        d = root / f"{i // 1000:04d}"
        d.mkdir(exist_ok=True)
        n = max(1, int(rng.gauss(doc_kb * 1024 / 90, doc_kb * 4)))
        text = "".join(rng.choices(sentences, k=n))
        data = text.encode()
        (d / f"doc{i:07d}.txt").write_bytes(data)
        written += len(data)
        i += 1
    (root / "COMPLETE").write_text(str(written))
    return written


def subset(corpus: Path, dst: Path, mb: float) -> int:
    """Hard links to the first files of ``corpus`` (sorted walk order) totalling ``mb`` MB."""
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    total = 0
    for f in sorted(corpus.rglob("*.txt")):
        if total >= mb * 1e6:
            break
        target = dst / f.parent.name / f.name
        target.parent.mkdir(exist_ok=True)
        if not target.exists():
            os.link(f, target)
        total += f.stat().st_size
    return total


def _children(pid: int) -> list[int]:
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as fh:
                out += [int(c) for c in fh.read().split()]
    except OSError:
        pass
    return out


def _mem_kb(pid: int) -> tuple[int, int]:
    """(PSS, RSS) of one process in kB; (0, 0) if it is gone."""
    pss = rss = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            for line in fh:
                if line.startswith("Pss:"):
                    pss = int(line.split()[1])
                elif line.startswith("Rss:"):
                    rss = int(line.split()[1])
    except OSError:
        pass
    return pss, rss


def measure(cmd: list[str], env: dict[str, str], log: Path) -> dict[str, float]:
    """Run ``cmd`` (its stderr to ``log``); wall time, CPU time, peak summed PSS of its process tree
    and peak single-process RSS (MB). The peaks so far are printed every minute."""
    t0 = time.perf_counter()
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    errf = log.open("w")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=errf, text=True)
    peak = {"pss": 0, "rss": 0}
    done = threading.Event()

    def poll() -> None:
        last = time.perf_counter()
        while not done.is_set():
            if time.perf_counter() - last > 60:
                last = time.perf_counter()
                print(
                    f"  ... {last - t0:.0f}s: peak PSS {peak['pss'] / 1024:.0f} MB, "
                    f"peak RSS {peak['rss'] / 1024:.0f} MB so far",
                    file=sys.stderr,
                    flush=True,
                )
            tree, todo = [], [proc.pid]
            while todo:
                p = todo.pop()
                tree.append(p)
                todo += _children(p)
            mems = [_mem_kb(p) for p in tree]
            peak["pss"] = max(peak["pss"], sum(m[0] for m in mems))
            peak["rss"] = max(peak["rss"], max((m[1] for m in mems), default=0))
            done.wait(0.2)

    th = threading.Thread(target=poll, daemon=True)
    th.start()
    proc.wait()
    errf.close()
    wall = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)  # the whole tree: pool workers are waited for by their parent
    done.set()
    th.join()
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[:4]} failed ({proc.returncode}): {log.read_text()[-2000:]}")
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    return {"wall_s": wall, "cpu_s": cpu, "peak_pss_mb": peak["pss"] / 1024, "peak_rss_mb": peak["rss"] / 1024}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="foldtrain bench data", description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=2.1)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument(
        "--rounds", type=int, default=2, help="A/B repetitions on the subset (alternating which side goes first)"
    )
    ap.add_argument("--subset_mb", type=float, default=100.0)
    ap.add_argument("--full_plain", action="store_true", help="also run the plain script on the whole corpus")
    ap.add_argument("--shard_mb", type=float, default=256.0)
    ap.add_argument("--scratch", default="/tmp/foldtrain-databench")
    ap.add_argument("--keep", action="store_true", help="keep the generated corpus and outputs")
    return ap.parse_args(argv)


def ensure_inputs(a: argparse.Namespace, scratch: Path, corpus: Path, tok: Path) -> tuple[int, int, int]:
    """The corpus (generated unless a complete one is there), its subset and the shared tokenizer:
    ``(corpus bytes, corpus files, subset bytes)``."""
    if not (corpus / "COMPLETE").is_file():
        shutil.rmtree(corpus, ignore_errors=True)
        t = time.perf_counter()
        size = generate(corpus, a.gb)
        print(f"generated {size / 1e9:.2f} GB in {time.perf_counter() - t:.0f}s", file=sys.stderr, flush=True)
    size = sum(f.stat().st_size for f in corpus.rglob("*.txt"))
    n_files = sum(1 for _ in corpus.rglob("*.txt"))
    sub_size = subset(corpus, scratch / "subset", a.subset_mb)
    if not tok.is_file():
        from foldtrain.data.plan import make_plan, tokenizer_sample  # noqa: PLC0415
        from foldtrain.data.tokenizer import train_tokenizer  # noqa: PLC0415

        plan = make_plan(corpus, "text", 1 << 40, scratch / "plan.jsonl")
        train_tokenizer(tokenizer_sample(plan, "text", 20_000_000, 0), 8192).save(str(tok))
    return size, n_files, sub_size


def side_command(name: str, src: Path, a: argparse.Namespace, scratch: Path, tok: Path) -> list[str]:
    """The command line of one side (``plain`` or ``foldtrain``) tokenizing ``src``."""
    if name == "plain":
        return [sys.executable, "-c", PLAIN, str(src), str(tok), str(scratch / "plain.bin")]
    return [
        sys.executable,
        "-m",
        "foldtrain",
        "prepare",
        "--data.path",
        str(src),
        "--data.out",
        str(scratch / "ds"),
        "--data.tokenizer",
        str(tok),
        "--data.workers",
        str(a.workers),
        "--data.shard_mb",
        str(a.shard_mb),
    ]


def run_side(
    name: str, src: Path, nbytes: int, label: str, a: argparse.Namespace, scratch: Path, tok: Path
) -> dict[str, float]:
    """One side tokenizing ``src`` (``nbytes`` of input) from a clean output: its measurements and MB/s."""
    shutil.rmtree(scratch / "ds", ignore_errors=True)
    shutil.rmtree(scratch / "ds.partial", ignore_errors=True)
    (scratch / "plain.bin").unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log_path = scratch / f"{label.replace(' ', '_')}_{name}.log"
    res = measure(side_command(name, src, a, scratch, tok), env, log_path)
    res["mb_per_s"] = nbytes / 1e6 / res["wall_s"]
    res["mb_per_cpu_s"] = nbytes / 1e6 / res["cpu_s"]
    print(
        f"{label} {name}: {nbytes / 1e6:.0f} MB in {res['wall_s']:.0f}s: {res['mb_per_s']:.2f} MB/s, "
        f"{res['mb_per_cpu_s']:.2f} MB per CPU-second, "
        f"peak PSS {res['peak_pss_mb']:.0f} MB, peak RSS {res['peak_rss_mb']:.0f} MB",
        file=sys.stderr,
        flush=True,
    )
    return res


def summary_of(
    a: argparse.Namespace, size: int, n_files: int, sub_size: int, ab: dict[str, list[dict]], full: dict[str, dict]
) -> dict:
    """The printed result: the A/B rounds' throughput by side and their ratios, and the full-size runs."""

    def total(side: str, key: str) -> float:
        return sum(x[key] for x in ab[side])

    return {
        "input_gb": round(size / 1e9, 3),
        "files": n_files,
        "subset_mb": round(sub_size / 1e6, 1),
        "cores": os.cpu_count() or 1,
        "workers": a.workers,
        "rounds": a.rounds,
        "subset_mb_per_s": {k: round(sub_size * len(v) / 1e6 / total(k, "wall_s"), 3) for k, v in ab.items()},
        "subset_mb_per_cpu_s": {k: round(sub_size * len(v) / 1e6 / total(k, "cpu_s"), 3) for k, v in ab.items()},
        "ratio_wall": round(total("plain", "wall_s") / total("foldtrain", "wall_s"), 3),
        "ratio_per_cpu_s": round(total("plain", "cpu_s") / total("foldtrain", "cpu_s"), 3),
        "full": {k: {m: round(x, 2) for m, x in v.items()} for k, v in full.items()},
        "subset_runs": ab,
    }


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    scratch = Path(a.scratch)
    corpus, tok = scratch / "corpus", scratch / "tokenizer.json"
    try:
        size, n_files, sub_size = ensure_inputs(a, scratch, corpus, tok)
        ab: dict[str, list[dict[str, float]]] = {"plain": [], "foldtrain": []}
        for r in range(a.rounds):
            for name in ["plain", "foldtrain"] if r % 2 == 0 else ["foldtrain", "plain"]:
                ab[name].append(run_side(name, scratch / "subset", sub_size, f"subset round {r}", a, scratch, tok))
        full = {"foldtrain": run_side("foldtrain", corpus, size, "full", a, scratch, tok)}
        if (scratch / "ds" / "meta.json").is_file():
            meta = json.loads((scratch / "ds" / "meta.json").read_text())
            full["foldtrain"]["tokens"] = meta["splits"]["train"]["tokens"] + meta["splits"]["val"]["tokens"]
            full["foldtrain"]["shards"] = len(meta["shards"])
        if a.full_plain:
            full["plain"] = run_side("plain", corpus, size, "full", a, scratch, tok)
        print(json.dumps(summary_of(a, size, n_files, sub_size, ab, full), indent=2))
    finally:
        if not a.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    return 0
