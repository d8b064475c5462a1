"""docs/configuration.md is the reference of every config key: each one appears there as ``--section.key``."""

from __future__ import annotations

import re

from tests.docs.cli_options import config_keys
from tests.docs.markdown import ROOT

REFERENCE = ROOT / "docs" / "configuration.md"


def test_every_config_key_is_documented():
    assert REFERENCE.is_file(), "docs/configuration.md (the configuration reference) does not exist"
    text = REFERENCE.read_text(encoding="utf-8")
    missing = sorted(k for k in config_keys() if not re.search(rf"--{re.escape(k)}(?![\w.])", text))
    assert not missing, "config keys missing from docs/configuration.md: " + ", ".join(f"--{k}" for k in missing)
