"""Percentiles of a sample, from its values or from exact counts of values on a grid (the same figures), and
the store of a level's ITLs that switches from one to the other (``ItlValues``).

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


ITL_EXACT_MAX = 2_000_000
"""ITL values per level kept as floats (16 MB); past it, counts per 1 µs value (exact order statistics)."""
BINCOUNT_US = 1 << 20
"""ITLs (µs) below this (~1 s) are counted with a table of at most 8 MB, the rest sorted (``_value_counts``)."""


class ItlValues:
    """The ITLs of a level's judged ok requests, for their percentiles: floats, then exact counts per value."""

    def __init__(self, exact_max: int = ITL_EXACT_MAX) -> None:
        self.exact_max = exact_max
        self.parts: list[np.ndarray] = []
        self.size = 0
        self.grid_us = np.zeros(0, np.int64)  # distinct 1 µs values (sorted) and their counts, past ITL_EXACT_MAX
        self.grid_counts = np.zeros(0, np.int64)
        self.grid_sum_us = 0
        self.off_grid = False

    def add(self, values: np.ndarray) -> None:
        """ITLs in ms (floats), or in µs as unsigned integers (a column file's, exact on the grid already)."""
        if values.size == 0:
            return
        self.parts.append(values)
        self.size += values.size
        if self.size > self.exact_max and not self.off_grid:
            self._count()

    def _floats(self) -> np.ndarray:
        return np.concatenate([p / 1e3 if p.dtype.kind == "u" else p for p in self.parts]) if self.parts \
            else np.zeros(0)

    def _count(self) -> None:
        if not self.parts:
            return
        us_parts = []
        for part in self.parts:
            if part.dtype.kind == "u":  # a column file's µs: counted as they are (no int64 copy when all are)
                us_parts.append(part)
                continue
            us = np.rint(part * 1e3).astype(np.int64)
            if not np.array_equal(us / 1e3, part):
                # not on the 1 µs grid: keep every float (exact, unbounded)
                flat = self._floats()
                if self.grid_us.size:
                    flat = np.concatenate((np.repeat(self.grid_us / 1e3, self.grid_counts), flat))
                    self.grid_us, self.grid_counts = np.zeros(0, np.int64), np.zeros(0, np.int64)
                    self.grid_sum_us = 0
                self.parts, self.off_grid = [flat], True
                return
            us_parts.append(us)
        self._add_counts(np.concatenate(us_parts))

    def _add_counts(self, us: np.ndarray) -> None:
        """µs values (integers) into the counts; the parts they came from are done."""
        self.parts, self.size = [], 0
        vals, counts = _value_counts(us)
        if self.grid_us.size:  # merged as arrays: a level has ~10⁵ distinct values, merged ~100 times
            vals, where = np.unique(np.concatenate((self.grid_us, vals)), return_inverse=True)
            merged = np.zeros(vals.size, np.int64)
            np.add.at(merged, where, np.concatenate((self.grid_counts, counts)))
            counts = merged
        self.grid_us, self.grid_counts = vals, counts
        self.grid_sum_us += int(us.sum())

    def percentiles(self) -> dict[str, float | None]:
        if not self.grid_us.size:
            return percentiles(self._floats())
        self._count()
        if self.off_grid:  # the last values were off the grid: every value is a float again
            return percentiles(self._floats())
        # the exact mean (an integer count of µs over n), where np.mean's pairwise float sum may differ by an ulp
        return counted_percentiles(self.grid_us / 1e3, self.grid_counts,
                                   self.grid_sum_us / (int(self.grid_counts.sum()) * 1000))


def _value_counts(us: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(us, return_counts=True)`` of µs values; those under ``BINCOUNT_US`` counted by ``bincount`` (no sort
    of millions of values)."""
    small = us < BINCOUNT_US if us.dtype.kind == "u" else (us >= 0) & (us < BINCOUNT_US)
    if small.all():
        counts = np.bincount(us)
        vals = np.flatnonzero(counts)
        return vals, counts[vals]
    a_vals, a_counts = _value_counts(us[small])
    b_vals, b_counts = np.unique(us[~small], return_counts=True)
    vals = np.concatenate((a_vals, b_vals))
    order = np.argsort(vals, kind="stable")
    return vals[order], np.concatenate((a_counts, b_counts))[order]
