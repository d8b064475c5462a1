"""The package's layering (README, "Layout of the code"): import-linter's contracts from
pyproject.toml hold, and no modules import each other in a cycle — lazy imports included."""

from __future__ import annotations

import subprocess
import sys

import grimp

from tests.support import ROOT


def test_import_linter_contracts_hold():
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout


def cycles(graph) -> list[list[str]]:
    """Every import cycle among modules, as a path (Tarjan's strongly connected components)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(m: str) -> None:
        index[m] = low[m] = counter[0]
        counter[0] += 1
        stack.append(m)
        on_stack.add(m)
        for n in graph.find_modules_directly_imported_by(m):
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in on_stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            comp = []
            while True:
                n = stack.pop()
                on_stack.discard(n)
                comp.append(n)
                if n == m:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for m in sorted(graph.modules):
        if m not in index:
            visit(m)
    return out


def test_no_import_cycles():
    graph = grimp.build_graph("foldtrain")
    # a package's __init__ re-exporting its own submodules is a facade, not a cycle of meaning
    for m in list(graph.modules):
        for n in list(graph.find_modules_directly_imported_by(m)):
            if n.startswith(m + "."):
                graph.remove_import(importer=m, imported=n)
    assert cycles(graph) == []


def test_the_cycle_finder_finds_cycles():
    class G:
        modules = {"a", "b", "c", "d"}

        @staticmethod
        def find_modules_directly_imported_by(m):
            return {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}[m]

    assert cycles(G) == [["a", "b", "c"]]
