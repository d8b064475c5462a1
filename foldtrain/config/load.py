"""Building a config: defaults, then a TOML file, then ``--section.field value`` overrides (torchtitan's
convention; booleans may be bare flags), model fields filled from the preset or ``--model.init_from``;
and writing one back as TOML that ``--config`` reads."""

from __future__ import annotations

import dataclasses
import difflib
import keyword
import types
import typing
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser from PyPI (a dependency there, see pyproject.toml)
    import tomli as tomllib

from foldtrain.config.schema import Config, ModelConfig
from foldtrain.config.validate import validate
from foldtrain.errors import ConfigError
from foldtrain.model.hf_config import resolve_init_from
from foldtrain.model.presets import PRESETS


def _key(attr: str) -> str:
    """The public name of a field: ``async_`` is ``async`` (a field cannot be named after a Python keyword)."""
    return attr[:-1] if attr.endswith("_") and keyword.iskeyword(attr[:-1]) else attr


def _attr(name: str) -> str:
    return name + "_" if keyword.iskeyword(name) else name


def all_keys(cfg: Config | None = None) -> list[str]:
    cfg = cfg or Config()
    keys = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            keys += [f"{f.name}.{_key(g.name)}" for g in dataclasses.fields(value)]
        else:
            keys.append(f.name)
    return keys


def _field_type(obj: Any, name: str) -> Any:
    hints = typing.get_type_hints(type(obj))
    return hints[name]


def _convert(key: str, raw: Any, typ: Any) -> Any:
    """Convert a TOML or command-line value to the field's type, with a clear error."""
    origin = typing.get_origin(typ)
    try:
        if typ is bool:
            if isinstance(raw, bool):
                return raw
            s = str(raw).strip().lower()
            if s in ("1", "true", "yes", "on"):
                return True
            if s in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if typ is int:
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError
            return int(raw) if not isinstance(raw, str) else int(raw.strip(), 0)
        if typ is float:
            if isinstance(raw, bool):
                raise ValueError
            return float(raw)
        if typ is str:
            if not isinstance(raw, (str, int, float)) or isinstance(raw, bool):
                raise ValueError
            return str(raw)
        if origin is list:
            (inner,) = typing.get_args(typ)
            if isinstance(raw, str):
                raw = [p for p in raw.replace(" ", "").split(",") if p]
            if not isinstance(raw, list):
                raise ValueError
            return [_convert(key, r, inner) for r in raw]
        if origin in (typing.Union, types.UnionType):
            raise ValueError
    except (TypeError, ValueError):
        name = getattr(typ, "__name__", str(typ))
        raise ConfigError(f"--{key}: expected {name}, got {raw!r}; give a value of type {name}") from None
    return raw


def _unknown(key: str, candidates: list[str]) -> ConfigError:
    near = difflib.get_close_matches(key, candidates, n=1, cutoff=0.5)
    hint = f"did you mean --{near[0]}?" if near else "run `foldtrain config` to list the valid keys"
    return ConfigError(f"unknown config key '{key}'; {hint}")


def set_value(cfg: Config, key: str, raw: Any) -> None:
    """Set ``section.field`` (or a top-level ``field``) from a raw value."""
    parts = key.split(".")
    keys = all_keys(cfg)
    if key not in keys:
        raise _unknown(key, keys)
    obj = cfg
    for p in parts[:-1]:
        obj = getattr(obj, p)
    attr = _attr(parts[-1])
    setattr(obj, attr, _convert(key, raw, _field_type(obj, attr)))


def load_toml(cfg: Config, path: str | Path) -> None:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} not found; pass an existing TOML file to --config")
    try:
        data = tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {p} is not valid TOML ({e}); fix the syntax") from None
    for k, v in data.items():
        if isinstance(v, dict):
            for kk, vv in v.items():
                set_value(cfg, f"{k}.{kk}", vv)
        else:
            set_value(cfg, k, v)


def parse_overrides(args: list[str]) -> list[tuple[str, str | bool]]:
    """``--a.b v``, ``--a.b=v`` and bare boolean flags ``--resume`` into (key, value) pairs."""
    bool_keys = {k for k in all_keys() if _is_bool(k)}
    out: list[tuple[str, str | bool]] = []
    i = 0
    while i < len(args):
        a = args[i]
        if not a.startswith("--") or len(a) == 2:
            raise ConfigError(f"unexpected argument '{a}'; options look like --section.field value")
        a = a[2:]
        if "=" in a:
            k, v = a.split("=", 1)
            out.append((k, v))
            i += 1
            continue
        nxt = args[i + 1] if i + 1 < len(args) else None
        if a in bool_keys and (
            nxt is None
            or nxt.startswith("--")
            or nxt.lower() not in ("true", "false", "1", "0", "yes", "no", "on", "off")
        ):
            out.append((a, True))
            i += 1
            continue
        if nxt is None:
            if a not in all_keys():
                raise _unknown(a, all_keys())
            raise ConfigError(f"--{a} needs a value; write --{a} VALUE")
        out.append((a, nxt))
        i += 2
    return out


def _is_bool(key: str) -> bool:
    cfg = Config()
    parts = key.split(".")
    obj = cfg
    for p in parts[:-1]:
        obj = getattr(obj, p)
    return _field_type(obj, _attr(parts[-1])) is bool


def build_config(args: list[str] | None = None, config_file: str | None = None, validate_now: bool = True) -> Config:
    """Defaults, then the TOML file, then command-line overrides; presets resolved; validated."""
    cfg = Config()
    if config_file:
        load_toml(cfg, config_file)
    for k, v in parse_overrides(args or []):
        set_value(cfg, k, v)
    resolve(cfg)
    if validate_now:
        validate(cfg)
    return cfg


def resolve(cfg: Config) -> Config:
    """Fill model fields left at 0 from --model.init_from's checkpoint, else from the preset."""
    m = cfg.model
    if m.preset not in PRESETS:
        near = difflib.get_close_matches(m.preset, PRESETS, n=1)
        hint = f"did you mean '{near[0]}'? " if near else ""
        raise ConfigError(f"unknown model preset '{m.preset}'; {hint}valid presets: {', '.join(PRESETS)}")
    # the checkpoint's shape; a conflicting --model.* is an error
    src = resolve_init_from(m, PRESETS, ModelConfig.preset)
    if (
        src is not None
        and src.kind == "hf"
        and not cfg.data.tokenizer
        and not (Path(cfg.data.path).expanduser() / "meta.json").is_file()
    ):
        if src.tokenizer is None:
            raise ConfigError(
                f"--model.init_from {m.init_from} has no tokenizer.json, "
                "and a BPE trained on your data would give ids the weights do not know; "
                "put the model's tokenizer.json there or pass it with --data.tokenizer FILE"
            )
        cfg.data.tokenizer = str(src.tokenizer)  # fine-tuning a HF model: its own tokenizer encodes the new text
    for k, v in PRESETS[m.preset].items():
        if getattr(m, k) == 0:
            setattr(m, k, v)
    return cfg


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML that `--config` reads back."""

    def fmt(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, list):
            return "[" + ", ".join(fmt(x) for x in v) + "]"
        return repr(v)

    top, tables = [], []
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            tables.append(f"[{f.name}]")
            tables += [f"{_key(g.name)} = {fmt(getattr(v, g.name))}" for g in dataclasses.fields(v)]
            tables.append("")
        else:
            top.append(f"{f.name} = {fmt(v)}")
    return "\n".join(top + [""] + tables)
