"""Percentiles of a sample, from its values or from exact counts of values on a grid (the same figures).

A level of a long run can hold hundreds of millions of per-token ITLs; counting them per distinct value (both
writers round ITLs to 1 µs) keeps that in bounded memory, and the order statistics, hence the percentiles, are
still exactly ``np.percentile``'s.
"""

from __future__ import annotations

import numpy as np

QUANTILES = {"p50": 50, "p90": 90, "p95": 95, "p99": 99}


def percentiles(values: np.ndarray | list[float]) -> dict[str, float | None]:
    arr = np.asarray([np.nan if v is None else v for v in values] if isinstance(values, list) else values, float)
    arr = arr[~np.isnan(arr)]
    if arr.size == 0:
        return {k: None for k in QUANTILES} | {"mean": None}
    qs = np.percentile(arr, list(QUANTILES.values()))
    out: dict[str, float | None] = {k: round(float(q), 3) for k, q in zip(QUANTILES, qs)}
    out["mean"] = round(float(arr.mean()), 3)
    return out


def counted_percentiles(values: np.ndarray, counts: np.ndarray, mean: float) -> dict[str, float | None]:
    """``percentiles`` of the sample holding ``counts[i]`` copies of ``values[i]`` (sorted, distinct), without
    expanding it: numpy's "linear" method (index (n − 1)·q, its two-sided lerp), so the result is bit-equal."""
    n = int(counts.sum())
    if n == 0:
        return {k: None for k in QUANTILES} | {"mean": None}
    virtual = (n - 1) * (np.asarray(list(QUANTILES.values()), float) / 100)
    lo = np.floor(virtual)
    gamma = virtual - lo
    hi_index = np.where(virtual >= n - 1, n - 1, lo + 1).astype(np.int64)
    lo_index = np.where(virtual >= n - 1, n - 1, lo).astype(np.int64)
    ends = np.cumsum(counts)
    a, b = values[np.searchsorted(ends, lo_index, side="right")], values[np.searchsorted(ends, hi_index, side="right")]
    diff = b - a
    qs = np.where(gamma >= 0.5, b - diff * (1 - gamma), a + diff * gamma)
    out: dict[str, float | None] = {k: round(float(q), 3) for k, q in zip(QUANTILES, qs)}
    out["mean"] = round(mean, 3)
    return out
