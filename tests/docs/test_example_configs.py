"""Every examples/configs/*.toml loads and validates through foldtrain's config loader, as
``foldtrain train --config FILE`` would read it (a 3D layout also against its own world size)."""

from __future__ import annotations

import pytest

from tests.docs.markdown import ROOT, rel

CONFIGS = sorted((ROOT / "examples" / "configs").glob("*.toml"))


def test_example_configs_exist():
    assert CONFIGS, "no examples/configs/*.toml found (the example configurations the docs point to)"


@pytest.mark.parametrize("path", CONFIGS, ids=[rel(p) for p in CONFIGS])
def test_example_config_validates(path):
    from foldtrain.config import build_config, validate_world
    from foldtrain.schedules.layout import uses_3d_engine

    cfg = build_config([], str(path))  # parses, resolves the preset, validates; ConfigError on a bad key or value
    if uses_3d_engine(cfg):
        p = cfg.parallel
        validate_world(cfg, p.dp * p.pp * p.tp)
