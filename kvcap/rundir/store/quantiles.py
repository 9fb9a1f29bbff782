"""Percentiles of a sample, from its values or from exact counts of values on a grid (the same figures), and
the store of a level's ITLs that switches from one to the other (``ItlValues``).

A level of a long run can hold hundreds of millions of per-token ITLs; counting them per distinct value (both
writers round ITLs to 1 µs) keeps that in bounded memory, and the order statistics, hence the percentiles, are
still exactly ``np.percentile``'s.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

QUANTILES = {"p50": 50, "p90": 90, "p95": 95, "p99": 99}


def percentiles(values: np.ndarray | list[float]) -> dict[str, float | None]:
    arr = np.asarray([np.nan if v is None else v for v in values] if isinstance(values, list) else values, float)
    arr = arr[~np.isnan(arr)]
    if arr.size == 0:
        return {k: None for k in (*QUANTILES, "mean")}
    qs = np.percentile(arr, list(QUANTILES.values()))
    out: dict[str, float | None] = {k: round(float(q), 3) for k, q in zip(QUANTILES, qs)}
    out["mean"] = round(float(arr.mean()), 3)
    return out


def counted_percentiles(values: np.ndarray, counts: np.ndarray, mean: float) -> dict[str, float | None]:
    """``percentiles`` of the sample holding ``counts[i]`` copies of ``values[i]`` (sorted, distinct), without
    expanding it."""
    ends = np.cumsum(counts)
    return lerp_percentiles(int(counts.sum()), lambda ranks: values[np.searchsorted(ends, ranks, side="right")],
                            mean)


def lerp_percentiles(n: int, value_at: Callable[[np.ndarray], np.ndarray], mean: float) -> dict[str, float | None]:
    """``percentiles`` of a sample of ``n`` values given ``value_at``: its sorted sample's values at the ranks asked
    (0-based), with numpy's "linear" method (index (n − 1)·q, its two-sided lerp), so the result is bit-equal."""
    if n == 0:
        return {k: None for k in (*QUANTILES, "mean")}
    lo_index, hi_index, gamma = _lerp_ranks(n)
    a, b = value_at(lo_index), value_at(hi_index)
    diff = b - a
    qs = np.where(gamma >= 0.5, b - diff * (1 - gamma), a + diff * gamma)
    out: dict[str, float | None] = {k: round(float(q), 3) for k, q in zip(QUANTILES, qs)}
    out["mean"] = round(mean, 3)
    return out


def _lerp_ranks(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    virtual = (n - 1) * (np.asarray(list(QUANTILES.values()), float) / 100)
    lo = np.floor(virtual)
    hi_index = np.where(virtual >= n - 1, n - 1, lo + 1).astype(np.int64)
    lo_index = np.where(virtual >= n - 1, n - 1, lo).astype(np.int64)
    return lo_index, hi_index, virtual - lo


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
        if self.grid_us.size:  # merged as arrays: many distinct values, merged once per part
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


_BUCKET_SHIFT = 40
"""A value's bucket keeps its float's sign, exponent and top 12 mantissa bits: 2⁻¹² wide relative to the value."""
_MAGNITUDE = np.int64(0x7FFF_FFFF_FFFF_FFFF)


def _buckets(v: np.ndarray) -> np.ndarray:
    """Each float's bucket, as an integer in the floats' order (a negative float's bits reversed below zero)."""
    bits = v.view(np.int64)
    return np.where(bits < 0, -(bits & _MAGNITUDE) - 1, bits) >> _BUCKET_SHIFT


def _merge_counts(keys: np.ndarray, counts: np.ndarray, new_keys: np.ndarray,
                  new_counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Two sorted (key, count) tables as one."""
    if not keys.size:
        return new_keys, new_counts
    merged_keys, where = np.unique(np.concatenate((keys, new_keys)), return_inverse=True)
    merged = np.zeros(merged_keys.size, np.int64)
    np.add.at(merged, where, np.concatenate((counts, new_counts)))
    return merged_keys, merged


class OrderStats:
    """Exact order statistics of a sample seen in blocks, twice, in memory bounded by the sample's buckets (at
    most a few thousand per power of two), not by its size.

    First pass (``add``): the count, sum and bucket counts, and the first ``keep`` values in order (for a
    bootstrap of a small sample). Then ``ask`` the ranks wanted; second pass (``collect``): the exact values of
    the buckets holding them, counted per distinct value. NaN is left out, as ``percentiles`` leaves it out."""

    def __init__(self, keep: int = 0) -> None:
        self.n, self.total, self.keep = 0, 0.0, keep
        self.keys, self.counts = np.zeros(0, np.int64), np.zeros(0, np.int64)
        self.head: list[np.ndarray] = []
        self.kept = 0
        self.wanted = np.zeros(0, np.int64)
        self.values, self.value_counts = np.zeros(0), np.zeros(0, np.int64)

    def add(self, v: np.ndarray) -> None:
        v = np.ascontiguousarray(v[~np.isnan(v)], float)
        if not v.size:
            return
        self.n += v.size
        self.total += float(np.sum(v))
        self.keys, self.counts = _merge_counts(self.keys, self.counts, *np.unique(_buckets(v), return_counts=True))
        if self.kept < self.keep:
            self.head.append(v[:self.keep - self.kept])
            self.kept += self.head[-1].size

    def first_values(self) -> np.ndarray:
        """The first ``keep`` values, in the order they came."""
        return np.concatenate(self.head) if self.head else np.zeros(0)

    def ask(self, ranks: np.ndarray) -> None:
        """The ranks (0-based, in the sorted sample) ``value_at`` will be asked for, before ``collect``."""
        ranks = np.asarray(ranks, np.int64)
        if self.n and ranks.size:
            idx = np.searchsorted(np.cumsum(self.counts), ranks, side="right")
            self.wanted = np.union1d(self.wanted, self.keys[idx])

    def collect(self, v: np.ndarray) -> None:
        if not self.wanted.size:
            return
        v = np.ascontiguousarray(v[~np.isnan(v)], float)
        inside = v[np.isin(_buckets(v), self.wanted)]
        if inside.size:
            self.values, self.value_counts = _merge_counts(self.values, self.value_counts,
                                                           *np.unique(inside, return_counts=True))

    def value_at(self, ranks: np.ndarray) -> np.ndarray:
        """The sorted sample's values at ``ranks`` (each asked for before ``collect``)."""
        ranks = np.asarray(ranks, np.int64)
        ends = np.cumsum(self.counts)
        idx = np.searchsorted(ends, ranks, side="right")
        wanted = np.isin(self.keys, self.wanted)
        if int(self.counts[wanted].sum()) != int(self.value_counts.sum()):
            raise ValueError("the records changed between the passes over them")
        before_in_wanted = np.cumsum(np.where(wanted, self.counts, 0)) - np.where(wanted, self.counts, 0)
        position = ranks - (ends[idx] - self.counts[idx]) + before_in_wanted[idx]
        values: np.ndarray = self.values[np.searchsorted(np.cumsum(self.value_counts), position, side="right")]
        return values

    def ask_percentiles(self) -> None:
        if self.n:
            self.ask(np.concatenate(_lerp_ranks(self.n)[:2]))

    def percentiles(self) -> dict[str, float | None]:
        """``percentiles`` of the sample (after ``ask_percentiles`` and the second pass)."""
        return lerp_percentiles(self.n, self.value_at, self.total / self.n if self.n else 0.0)

    def median(self) -> float:
        """``np.median`` of the sample (after asking for ranks (n − 1) // 2 and n // 2)."""
        lo, hi = self.value_at(np.array([(self.n - 1) // 2, self.n // 2]))
        return float(hi) if self.n % 2 else float(np.mean([lo, hi]))
