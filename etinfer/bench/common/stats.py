"""Percentiles and summaries of the benchmarks' figures, computed one way everywhere.

Percentiles interpolate linearly between order statistics (NumPy's default, ``np.percentile``),
as vLLM's serving benchmark computes its p99s. An empty list has no figure: None.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import numpy as np


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0 to 100) of ``values``."""
    return float(np.percentile(values, q)) if len(values) else None


def mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if len(values) else None


def summary(values: Sequence[float], scale: float = 1.0) -> dict[str, float | None]:
    """Mean, median and 99th percentile, times ``scale`` (1000: seconds to milliseconds)."""
    scaled = [scale * v for v in values]
    return {"mean": mean(scaled), "median": percentile(scaled, 50), "p99": percentile(scaled, 99)}
