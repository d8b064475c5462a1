"""Everything the docs name exists: relative links and their anchors, repository paths in backticks
(globs and ``path::test`` included), and every ``--section.key`` option (a config key or a flag of a
subcommand's parser). Pure: no subprocess, nothing launched."""

from __future__ import annotations

import functools
import re
import shlex
from pathlib import Path

import pytest

from tests.docs.cli_options import all_flags, config_keys
from tests.docs.markdown import ROOT, anchors, code_spans, doc_files, links, parse, rel

DOCS = doc_files()
IDS = [rel(p) for p in DOCS]
PATH_PREFIXES = ("foldtrain/", "scripts/", "examples/", "docs/", "tests/")
_PATH = re.compile(r"^(?:foldtrain|scripts|examples|docs|tests)/[\w.*?/\[\]-]*(?:::[\w\[\].,:-]+)?$")
_DOTTED = re.compile(r"(?<![\w-])--([a-z][a-z0-9_]*\.[a-z][a-z0-9_]*)")
_FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9_-]*)")
PLACEHOLDERS = {"section.field", "section.key"}  # how the docs write "any config key"


@functools.cache
def _anchors_of(path: Path) -> frozenset[str]:
    return frozenset(anchors(parse(path)))


def _check_target(doc_path: Path, target: str) -> str | None:
    """Why a link target does not resolve, or None."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
        return None
    file_part, _, anchor = target.partition("#")
    dest = (doc_path.parent / file_part).resolve() if file_part else doc_path
    if not dest.exists():
        return f"{target}: {rel(dest)} does not exist"
    if anchor and dest.suffix == ".md" and anchor not in _anchors_of(dest):
        return f"{target}: no heading with anchor #{anchor} in {rel(dest)}"
    return None


@pytest.mark.parametrize("path", DOCS, ids=IDS)
def test_links_and_anchors_resolve(path):
    doc = parse(path)
    bad = [f"{rel(path)}:{n}: {why}" for n, t in links(doc) if (why := _check_target(path, t))]
    assert not bad, "broken links:\n" + "\n".join(bad)


def _path_tokens(text: str) -> list[str]:
    """Words of ``text`` that name a repository path (trailing punctuation and #anchors dropped)."""
    out = []
    for word in text.split():
        word = word.strip("`\"'(),;:").rstrip(".")
        if word.startswith(PATH_PREFIXES):
            word = word.split("#")[0]
            if _PATH.match(word):
                out.append(word)
    return out


def _check_path(name: str) -> str | None:
    path, _, test = name.partition("::")
    hits = sorted(ROOT.glob(path)) if any(c in path for c in "*?[") else [ROOT / path]
    hits = [h for h in hits if h.exists()]
    if not hits:
        return f"{name}: no such file or directory"
    for part in filter(None, test.split("::")):
        func = part.split("[")[0]
        if not re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{re.escape(func)}\b", hits[0].read_text(), re.M):
            return f"{name}: {path} has no function or class {func}"
    return None


def _bash_blocks(doc):
    return [b for b in doc.blocks if b.lang in ("bash", "sh", "shell", "console")]


@pytest.mark.parametrize("path", DOCS, ids=IDS)
def test_repository_paths_exist(path):
    doc = parse(path)
    named = [(n, p) for n, span in code_spans(doc) for p in _path_tokens(span)]
    for b in _bash_blocks(doc):
        named += [(b.line + i + 1, p) for i, line in _logical_lines(b.text) for p in _path_tokens(line)]
    bad = [f"{rel(path)}:{n}: {why}" for n, p in named if (why := _check_path(p))]
    assert not bad, "paths named in the docs that do not exist:\n" + "\n".join(bad)


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """Shell lines with backslash continuations joined and comments dropped, each with the index of
    its first physical line."""
    out: list[tuple[int, str]] = []
    pending, start = "", 0
    for i, line in enumerate(text.splitlines()):
        if not pending:
            start = i
        line = re.sub(r"(^|\s)#.*$", "", line)
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append((start, pending + line))
        pending = ""
    if pending:
        out.append((start, pending))
    return out


def _foldtrain_flags(block_text: str) -> list[tuple[int, str]]:
    """Undotted ``--flags`` given to foldtrain in a command block: after ``foldtrain CMD`` (or
    ``-m foldtrain CMD``) up to the end of that command (a pipe, ``&&``, ``;``)."""
    out = []
    for i, line in _logical_lines(block_text):
        for m in re.finditer(r"(?:^|[\s;&|(])(?:-m\s+)?foldtrain\s+[a-z]+", line):
            tail = re.split(r"\|\||&&|[|;)]", line[m.end() :])[0]
            try:
                words = shlex.split(tail)
            except ValueError:
                words = tail.split()
            out += [(i, w.split("=")[0]) for w in words if _FLAG.fullmatch(w.split("=")[0])]
    return out


@pytest.mark.parametrize("path", DOCS, ids=IDS)
def test_options_exist(path):
    doc = parse(path)
    keys, flags = config_keys(), all_flags()
    texts = [(n, s) for n, s in code_spans(doc)] + [(b.line, b.text) for b in doc.blocks]
    bad = [
        f"{rel(path)}:{n}: --{k} is neither a config key (foldtrain config --keys) nor a subcommand's flag"
        for n, text in texts
        for k in _DOTTED.findall(text)
        if k not in keys and f"--{k}" not in flags and k not in PLACEHOLDERS
    ]
    for b in _bash_blocks(doc):
        bad += [
            f"{rel(path)}:{b.line + i + 1}: {f} is no option of foldtrain (config key or subcommand flag)"
            for i, f in _foldtrain_flags(b.text)
            if f[2:] not in keys and f not in flags
        ]
    assert not bad, "options named in the docs that foldtrain does not have:\n" + "\n".join(bad)


def test_doc_test_marks_precede_bash_blocks():
    """A ``<!-- doc-test -->`` line must sit right before a ```bash fence, or its block would not run."""
    bad = []
    for path in DOCS:
        lines = path.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            if line.strip() == "<!-- doc-test -->":
                nxt = lines[i + 1].strip() if i + 1 < len(lines) else ""
                if nxt != "```bash":
                    bad.append(f"{rel(path)}:{i + 1}: followed by {nxt!r}, not ```bash")
    assert not bad, "doc-test marks not followed by a bash block:\n" + "\n".join(bad)


def test_the_checks_can_fail(tmp_path):
    """The checkers catch what they are for (on a file written here, not on the docs)."""
    doc = tmp_path / "x.md"
    doc.write_text("# A `b` c\n\n[ok](#a-b-c) [bad](#nope) [gone](missing.md)\n")
    assert _check_target(doc, "#a-b-c") is None
    assert "no heading" in _check_target(doc, "#nope")
    assert "does not exist" in _check_target(doc, "missing.md")
    assert _check_path("foldtrain/config/schema.py") is None
    assert _check_path("foldtrain/sim/clusters/*.toml") is None
    assert _check_path("tests/docs/test_doc_links.py::test_the_checks_can_fail") is None
    assert "no function" in _check_path("tests/docs/test_doc_links.py::test_nothing_here")
    assert "no such file" in _check_path("foldtrain/nothing.py")
    assert _path_tokens("see `foldtrain/cli.py`, and examples/configs/*.toml.") == [
        "foldtrain/cli.py",
        "examples/configs/*.toml",
    ]
    assert _foldtrain_flags("torchrun --standalone -m foldtrain train --out x \\\n  --resume | tee log") == [
        (0, "--out"),
        (0, "--resume"),
    ]
    assert "train.steps" in config_keys() and "--gpus" in all_flags()
