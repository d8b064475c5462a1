"""Predictions held against measurements: published GPU runs (``gpu_runs.toml``), the sources of the GPU presets'
constants (``microbenchmarks.toml``), ``python -m foldtrain.sim.validation.gpu`` writing docs/validation-gpu.md, and
the statistic both it and ``foldtrain bench simulator`` report."""

from __future__ import annotations


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation of ``a`` and ``b`` (ties ranked in order; NaN for fewer than 3 pairs)."""

    def ranks(x: list[float]) -> list[float]:
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        for k, i in enumerate(order):
            r[i] = float(k)
        return r

    ra, rb = ranks(a), ranks(b)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1)) if n > 2 else float("nan")
