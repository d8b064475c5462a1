"""The tree's style: ruff's lint rules and layout (configured in pyproject.toml), and functions short enough to read.

ruff comes from the ``test`` extra; without it the two ruff tests skip and say so. The length check needs
nothing but the standard library.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECKED = ["foldtrain", "tests", "scripts", "examples"]
PACKAGE = ROOT / "foldtrain"
MAX_FUNCTION_LINES = 80


def find_ruff() -> str | None:
    """The ruff installed next to this interpreter (the venv's), else the one on PATH, else None."""
    beside = Path(sys.executable).parent / ("ruff.exe" if sys.platform == "win32" else "ruff")
    if beside.is_file():
        return str(beside)
    return shutil.which("ruff")


def run_ruff(*args: str) -> subprocess.CompletedProcess:
    ruff = find_ruff()
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]' brings it)")
    paths = [p for p in CHECKED if (ROOT / p).exists()]
    return subprocess.run([ruff, *args, *paths], cwd=ROOT, capture_output=True, text=True)


def test_ruff_check_passes():
    r = run_ruff("check", "--no-cache", "--output-format", "concise")
    assert r.returncode == 0, f"ruff check found problems:\n{r.stdout}{r.stderr}"


def test_ruff_format_check_passes():
    r = run_ruff("format", "--check", "--no-cache")
    assert r.returncode == 0, f"files ruff format would change (run `ruff format` on them):\n{r.stdout}{r.stderr}"


def function_lengths(path: Path) -> list[tuple[int, str, int]]:
    """(first line, qualified name, length in lines) of every function and method in one file.

    The length runs from the ``def`` line to the last line of the body; decorators are not counted.
    """
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: list[tuple[int, str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                found.append((child.lineno, name, child.end_lineno - child.lineno + 1))
                visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def test_no_function_longer_than_limit():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for lineno, name, length in function_lengths(path):
            if length > MAX_FUNCTION_LINES:
                offenders.append(f"{rel}:{lineno} {name} is {length} lines")
    assert not offenders, f"functions in foldtrain/ longer than {MAX_FUNCTION_LINES} lines:\n" + "\n".join(offenders)
