"""The default corpus's content rule: leave out generated tables (charmaps, Unicode and escape tables).

The Python standard library holds ~75 files that are mostly generated data, e.g. the codec
charmaps in ``encodings/`` (``0x0080: 0x00c7,  # LATIN CAPITAL LETTER C WITH CEDILLA``), whose
near-identical tables a small model learns first and then samples. The rule is about content only
(no list of paths), deterministic, and cheap (one pass over the lines):

- a *code line* is a line with something left after removing a ``#`` comment and blanks;
- a code line is a *table line* when it holds at least one hex, escape or digit run
  (``0x1f``, ``\\x1f``, ``\\u00e9``, ``\\U0001f600``, ``\\017``, ``42``) and the characters in
  such runs are at least twice the remaining characters other than quotes, brackets, commas,
  colons, ``+``/``-`` and blanks;
- a file is a *generated table* when more than ``TABLE_LINE_FRACTION`` (40%) of its code lines
  are table lines.

Measured on CPython 3.11's standard library (1,790 files, 31.5 MB): the fraction has a gap
between 0.45 (``html/__init__.py``, a table of invalid character references) and 0.39
(``test/test_int_literal.py``); above 0.4 sit 74 files, 1.33 MB (71 codec charmaps,
``re/_casefix.py``, ``stringprep.py``, ``html/__init__.py``). ``RULE_VERSION`` is part of the
default corpus's cache key, so datasets prepared under another rule are never reused.
"""

from __future__ import annotations

import re

RULE_VERSION = 1
TABLE_LINE_FRACTION = 0.4
RULE = f"table-lines>{TABLE_LINE_FRACTION}-v{RULE_VERSION}"

_RUN = re.compile(r"0[xX][0-9a-fA-F]+|\\x[0-9a-fA-F]{2}|\\u[0-9a-fA-F]{4}|\\U[0-9a-fA-F]{8}|\\[0-7]{1,3}|\d+")
_NEUTRAL = frozenset("'\",:()[]{}+- \t")


def table_line_fraction(text: str) -> float:
    """Fraction of the code lines of ``text`` that are table lines (0.0 when it has no code line)."""
    code_lines = table_lines = 0
    for line in text.splitlines():
        code = line.split("#", 1)[0].strip()
        if not code:
            continue
        code_lines += 1
        runs = _RUN.findall(code)
        if not runs:
            continue
        in_runs = sum(map(len, runs))
        other = sum(1 for c in _RUN.sub("", code) if c not in _NEUTRAL and not c.isspace())
        if in_runs >= 2 * other:
            table_lines += 1
    return table_lines / code_lines if code_lines else 0.0


def is_generated_table(text: str) -> bool:
    """Whether the default corpus leaves ``text`` out (see the module's docstring for the rule)."""
    return table_line_fraction(text) > TABLE_LINE_FRACTION
