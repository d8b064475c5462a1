"""``--data.mix DIR=WEIGHT,DIR=WEIGHT``: train on several prepared datasets blended by weight.

``open_dataset(cfg.data)`` is what training opens: the one dataset of ``--data.path`` (prepared
first if needed), or a ``MixedData`` when ``--data.mix`` is set. ``MixedData`` answers like
``TokenData`` (vocabulary, end-of-text id, tokenizer, ``split``); its splits are ``Blend``s,
which ``SequenceSampler`` and ``val_batches`` mix as described in ``sampler.py``. Every dataset
of a mix must use the same tokenizer (the same ``tokenizer.json`` content).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from foldtrain.data.dataset import TokenData
from foldtrain.data.tokens import Blend
from foldtrain.errors import DataError

if TYPE_CHECKING:
    from foldtrain.config import DataConfig


def parse_mix(spec: str) -> list[tuple[str, float]]:
    """``"a=0.7,b=0.3"`` -> ``[("a", 0.7), ("b", 0.3)]``; weights must be positive finite numbers."""
    out = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        path, sep, raw = item.rpartition("=")
        if not sep or not path.strip():
            raise DataError(
                f"--data.mix entry {item!r} is not DIR=WEIGHT; write e.g. --data.mix data/web=0.7,data/code=0.3"
            )
        try:
            weight = float(raw)
        except ValueError:
            raise DataError(
                f"--data.mix weight {raw!r} of {path} is not a number; give a positive number such as 0.5"
            ) from None
        if not math.isfinite(weight) or weight <= 0:
            raise DataError(
                f"--data.mix weight {raw!r} of {path} is not a positive number; give a positive number such as 0.5"
            )
        out.append((path.strip(), weight))
    if not out:
        raise DataError("--data.mix is empty; write DIR=WEIGHT,DIR=WEIGHT")
    paths = [p for p, _ in out]
    dup = next((p for p in paths if paths.count(p) > 1), None)
    if dup is not None:
        raise DataError(f"--data.mix names {dup} twice; give each dataset once, with its total weight")
    return out


def _tokenizer_sha(data: TokenData) -> str:
    return hashlib.sha256(data.tokenizer_path.read_bytes()).hexdigest()


@dataclass
class MixedData:
    """Several prepared datasets blended by weight; duck-types ``TokenData`` for training."""

    datasets: list[TokenData]
    weights: list[float]
    names: list[str]

    @property
    def path(self) -> Path:
        return self.datasets[0].path

    @property
    def fingerprint(self) -> str:
        """The blend's identity: every dataset's fingerprint and weight, in order."""
        key = json.dumps([[d.fingerprint, w] for d, w in zip(self.datasets, self.weights)])
        return hashlib.sha256(key.encode()).hexdigest()[:12]

    @property
    def meta(self) -> dict[str, Any]:
        return {
            "format": "mix",
            "mix": [{"path": str(d.path), "weight": w} for d, w in zip(self.datasets, self.weights)],
        }

    @property
    def vocab_size(self) -> int:
        return self.datasets[0].vocab_size

    @property
    def eot_id(self) -> int:
        return self.datasets[0].eot_id

    @property
    def tokenizer_path(self) -> Path:
        return self.datasets[0].tokenizer_path

    def split(self, name: str) -> Blend:
        return Blend([d.split(name) for d in self.datasets], self.weights, self.names)

    def load_tokenizer(self) -> Any:
        return self.datasets[0].load_tokenizer()


def open_mix(spec: str, verify: bool | None = None) -> MixedData:
    """Open and check every dataset of ``spec`` (see ``parse_mix``)."""
    entries = parse_mix(spec)
    datasets = []
    for path, _ in entries:
        p = Path(path).expanduser()
        if not (p / "meta.json").is_file():
            raise DataError(
                f"--data.mix dataset {p} is not a prepared dataset (no meta.json); "
                f"prepare it first with `foldtrain prepare --data.out {p}`"
            )
        datasets.append(TokenData.open(p, verify=verify))
    first = _tokenizer_sha(datasets[0])
    for (path, _), d in zip(entries[1:], datasets[1:]):
        if _tokenizer_sha(d) != first:
            raise DataError(
                f"--data.mix datasets {entries[0][0]} and {path} use different tokenizers; "
                f"prepare them with the same --data.tokenizer (e.g. {datasets[0].tokenizer_path})"
            )
    return MixedData(datasets, [w for _, w in entries], [p for p, _ in entries])


def open_dataset(data_cfg: DataConfig, quiet: bool = False) -> TokenData | MixedData:
    """The training data of ``[data]``: ``--data.mix`` if set, else ``--data.path`` (prepared if needed)."""
    verify = True if data_cfg.verify else None
    if data_cfg.mix.strip():
        if data_cfg.path.strip():
            raise DataError("--data.mix and --data.path are both set; give the datasets in --data.mix only")
        return open_mix(data_cfg.mix, verify)
    from foldtrain.data.resolve import resolve_data  # noqa: PLC0415 (resolve imports prepare, heavier)

    return TokenData.open(resolve_data(data_cfg, quiet=quiet), verify=verify)
