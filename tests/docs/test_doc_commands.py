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

from tests.docs.markdown import ROOT, Block, doc_files, doc_test_blocks, parse, rel

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


def _run_blocks(path: Path, blocks: list[Block], scratch: Path) -> float:
    """Run ``blocks`` of ``path`` in order with ``$DOCTEST`` = ``scratch``; the seconds they took.
    Fails the calling test with the block and its output when one exits non-zero or runs too long."""
    env = _env(scratch)
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
    return time.perf_counter() - start


@pytest.mark.docs
@pytest.mark.parametrize("path,blocks", MARKED, ids=[rel(p) for p, _ in MARKED])
def test_doc_commands_run(path, blocks, tmp_path):
    DURATIONS[rel(path)] = (len(blocks), _run_blocks(path, blocks, tmp_path))


def test_the_runner_shares_doctest_and_fails_with_the_output(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text(
        "<!-- doc-test -->\n```bash\necho kept > $DOCTEST/f\n```\n\n"
        '<!-- doc-test -->\n```bash\ngrep -q kept $DOCTEST/f\ntest "$OMP_NUM_THREADS" = 1\n```\n\n'
        "<!-- doc-test -->\n```bash\necho about to fail\nfalse\necho never\n```\n"
    )
    blocks = doc_test_blocks(parse(doc))
    assert len(blocks) == 3
    _run_blocks(doc, blocks[:2], tmp_path)
    with pytest.raises(pytest.fail.Exception, match="(?s)exited 1.*about to fail") as failed:
        _run_blocks(doc, blocks, tmp_path)
    assert "never" not in str(failed.value).split("--- output ---")[1]
