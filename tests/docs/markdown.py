"""Reading the docs as a test needs them: files, headings and their GitHub anchors, links, inline code,
fenced blocks and the ``<!-- doc-test -->`` blocks. Pure Python, no Markdown library."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC_TEST_MARK = "<!-- doc-test -->"


def doc_files() -> list[Path]:
    """README.md and every Markdown file under docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


@dataclass
class Block:
    """A fenced code block: its info string (``bash``, ``toml``, ...), text, first line (1-based) and
    whether the line right before its opening fence is the doc-test mark."""

    lang: str
    text: str
    line: int
    doc_test: bool


@dataclass
class Doc:
    path: Path
    prose: list[tuple[int, str]]  # (line number, text) of the lines outside fenced blocks
    blocks: list[Block]


_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})(.*)$")


def parse(path: Path) -> Doc:
    """Split a Markdown file into prose lines and fenced blocks."""
    lines = path.read_text(encoding="utf-8").splitlines()
    prose: list[tuple[int, str]] = []
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            prose.append((i + 1, lines[i]))
            i += 1
            continue
        fence, start = m.group(2), i
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        marked = start > 0 and lines[start - 1].strip() == DOC_TEST_MARK
        blocks.append(Block(m.group(3).strip().lower(), "\n".join(body), start + 1, marked))
        i += 1  # the closing fence
    return Doc(path, prose, blocks)


_CODE_SPAN = re.compile(r"(`+)(.+?)\1")


def code_spans(doc: Doc) -> list[tuple[int, str]]:
    """Inline code of the prose lines (a span does not cross lines here)."""
    return [(n, m.group(2).strip()) for n, line in doc.prose for m in _CODE_SPAN.finditer(line)]


def _without_code(line: str) -> str:
    return _CODE_SPAN.sub("", line)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: rendered text, lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links keep their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("`", "").replace("*", "")
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(doc: Doc) -> set[str]:
    """Every anchor of the file: heading slugs (duplicates numbered -1, -2, ... as GitHub does) and
    explicit ``<a name=..>`` / ``id=".."`` targets."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for _, line in doc.prose:
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            k = seen.get(base, 0)
            seen[base] = k + 1
            out.add(base if k == 0 else f"{base}-{k}")
        out.update(re.findall(r"""<a\s+(?:name|id)=["']([^"']+)["']""", line))
    return out


_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_DEF = re.compile(r"^\s*\[[^\]]+\]:\s*(\S+)")


def links(doc: Doc) -> list[tuple[int, str]]:
    """Link and image targets of the prose (inline and reference definitions), code spans excluded."""
    out = []
    for n, line in doc.prose:
        bare = _without_code(line)
        out += [(n, m.group(1)) for m in _LINK.finditer(bare)]
        m = _REF_DEF.match(bare)
        if m:
            out.append((n, m.group(1)))
    return out


def doc_test_blocks(doc: Doc) -> list[Block]:
    return [b for b in doc.blocks if b.doc_test]
