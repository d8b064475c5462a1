"""The docs' runnable commands: every ```bash block right after a ``<!-- doc-test -->`` line in README.md
and docs/**/*.md runs with ``bash -e`` from the repository root, the venv's bin first on PATH and
OMP_NUM_THREADS=1. A file's blocks run in order, one test per file, sharing one scratch directory
exported as ``$DOCTEST``; a block that exits non-zero fails the test with its output."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.docs.markdown import ROOT, doc_files, doc_test_blocks, parse, rel

# Marked blocks that must exist, at least the three tutorials' CPU runs (docs/tutorials: 5 + 4 + 4):
# a test that finds fewer fails instead of passing on nothing.
MIN_BLOCKS = 13
BLOCK_TIMEOUT_S = 300
DURATIONS: dict[str, tuple[int, float]] = {}  # file -> (blocks, seconds), printed at the end of the run


def _marked() -> list[tuple[Path, list]]:
    out = []
    for path in doc_files():
        blocks = doc_test_blocks(parse(path))
        if blocks:
            out.append((path, blocks))
    return out


MARKED = _marked()


def _env(scratch: Path) -> dict[str, str]:
    venv_bin = ROOT / ".venv" / "bin"
    bin_dir = venv_bin if venv_bin.is_dir() else Path(sys.executable).parent
    env = dict(os.environ)
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", OMP_NUM_THREADS="1", DOCTEST=str(scratch))
    env.pop("FOLDTRAIN_FAULT", None)
    return env


def test_marked_blocks_exist():
    n = sum(len(blocks) for _, blocks in MARKED)
    assert n >= MIN_BLOCKS, f"found {n} <!-- doc-test --> bash blocks in README.md and docs/, expected >= {MIN_BLOCKS}"


@pytest.mark.docs
@pytest.mark.parametrize("path,blocks", MARKED, ids=[rel(p) for p, _ in MARKED])
def test_doc_commands_run(path, blocks, tmp_path):
    env = _env(tmp_path)
    start = time.perf_counter()
    for b in blocks:
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(
                ["bash", "-e", "-c", b.text],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=BLOCK_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            pytest.fail(f"{rel(path)}:{b.line}: block ran past {BLOCK_TIMEOUT_S} s\n{b.text}\n--- output ---\n{out}")
        if proc.returncode != 0:
            pytest.fail(
                f"{rel(path)}:{b.line}: block exited {proc.returncode} after {time.perf_counter() - t0:.1f} s\n"
                f"{b.text}\n--- output ---\n{proc.stdout[-6000:]}"
            )
    DURATIONS[rel(path)] = (len(blocks), time.perf_counter() - start)
