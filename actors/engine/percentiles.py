"""Percentiles of measured times: one definition for the launch summary and the benchmarks.

Pure and standard library only: numpy's default (linear) interpolation, without numpy.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between the closest ranks
    (numpy's default); ValueError on no values or ``q`` outside [0, 100]."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be within [0, 100], got {q}")
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of no values")
    position = (len(ordered) - 1) * q / 100
    lower = math.floor(position)
    upper = min(lower + 1, len(ordered) - 1)
    return ordered[lower] + (ordered[upper] - ordered[lower]) * (position - lower)


def stats(values: Sequence[float]) -> dict[str, float | None]:
    """p50, p99 and mean of ``values`` (all None when there are none)."""
    if not values:
        return {"p50": None, "p99": None, "mean": None}
    return {
        "p50": percentile(values, 50),
        "p99": percentile(values, 99),
        "mean": math.fsum(values) / len(values),
    }
