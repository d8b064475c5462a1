"""Python 3.10 is declared supported: the code parses as 3.10 and the TOML loader falls back to tomli."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_declared_version_and_dependency():
    from foldtrain.config.load import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == ">=3.10"
    assert "tomli>=1.1; python_version < '3.11'" in project["dependencies"]


def test_every_module_parses_as_python_310():
    files = sorted((ROOT / "foldtrain").rglob("*.py")) + sorted((ROOT / "tests").rglob("*.py"))
    for f in files:
        ast.parse(f.read_text(encoding="utf-8"), filename=str(f), feature_version=(3, 10))


def test_config_loads_toml_without_tomllib(tmp_path):
    """As on Python 3.10, where the standard library has no tomllib: the config reads TOML through tomli."""
    toml = tmp_path / "c.toml"
    toml.write_text('precision = "bf16"\n[train]\nsteps = 7\n')
    code = (
        "import sys; sys.modules['tomllib'] = None\n"  # makes `import tomllib` raise ModuleNotFoundError
        "from foldtrain import config\nfrom foldtrain.config import load\n"
        "assert load.tomllib.__name__ == 'tomli', load.tomllib\n"
        f"cfg = config.build_config([], {str(toml)!r})\n"
        "assert (cfg.precision, cfg.train.steps) == ('bf16', 7)\n"
        "try:\n"
        "    config.load_toml(config.Config(), __import__('pathlib').Path(sys.argv[1]))\n"
        "except __import__('foldtrain.errors').errors.ConfigError as e:\n"
        "    print('error:', e)\n"
    )
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\n")
    r = subprocess.run(
        [sys.executable, "-c", code, str(bad)],
        capture_output=True,
        text=True,
        cwd=str(ROOT),
        timeout=120,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 0, r.stderr
    assert f"error: config file {bad} is not valid TOML" in r.stdout
