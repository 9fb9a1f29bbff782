"""A run's telemetry a time slice at a time, so the summary's memory does not grow with the run's length.

Why: a long simulated level has a telemetry row per series per second that moved, and holding them all, then
their series on the grid, made the analysis's memory grow with the run. Every figure the summary takes
from telemetry is a mean, maximum, first/last value or trend over a window, which adds up over time slices
(``telemetry_figures``). So the column copy (``telemetry.columns``) is read a slice of ``SLICE_S`` simulated
seconds at a time, each slice a :class:`~kvcap.analysis.telemetry.Telemetry` of its own whose sample times are
exactly the whole run's in that slice: a value held from before the slice (``hold_s``) is put on the grid from
the row it was written in (the same floats), and a value held past its end is cut there. The slicing is used only
where it is exact — rows in time order, one source kind per metric, no series whose last row is held — and a run
shorter than a slice is read whole.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from kvcap.analysis.telemetry import Telemetry, read_telemetry, round_us
from kvcap.rundir import TELEMETRY, RunDir
from kvcap.rundir.store.column_file import Damaged, Series, stored_telemetry, telemetry_span

SLICE_S = 8192.0
"""Simulated seconds per slice: ~10 MB of rows and grids for the sim's 45 series at 1 s."""
Slice = tuple[Telemetry, float, float]
"""A slice's telemetry and the times [lo, hi) it holds the samples of."""


def telemetry_slices(run: RunDir, write_copy: bool = False, slice_s: float | None = None) -> Iterator[Slice]:
    """The run's telemetry as slices covering every sample time once; one slice (-inf, inf) — ``read_telemetry``,
    deduplicated by source kind — where it cannot be sliced exactly or is shorter than ``slice_s`` (default
    ``SLICE_S``)."""
    slice_s = slice_s or SLICE_S
    path = run.dir / TELEMETRY
    plan = _plan(path, slice_s)
    if plan is None:
        yield read_telemetry(run, write_copy=write_copy), -math.inf, math.inf
        return
    yield from _slices(path, *plan, slice_s)


def _plan(path: Path, slice_s: float) -> tuple[list[Series], np.ndarray, float] | None:
    """A first read of the copy: its series in order of first appearance (by copy id: their rank), and the first
    sample time — or None where slices would not be exact: no copy, times out of order or not finite, a series'
    last row held, a metric from two source kinds (deduplication chooses per run), or one slice's length."""
    span = telemetry_span(path)
    if span is not None and (span[1] - span[0] <= slice_s or not span[2]):
        return None  # as its index says: one slice, or not in time order
    stored = stored_telemetry(path)
    if stored is None:
        return None
    series, chunks = stored
    keys = {(src, name, *sorted(labels.items())) for src, name, labels in series}
    kinds: dict[str, set[str]] = {}
    for src, name, _ in series:
        kinds.setdefault(name, set()).add(src.split(":", 1)[0])
    if len(keys) != len(series) or any(len(k) > 1 for k in kinds.values()):
        return None
    first_row = np.full(len(series), -1, np.int64)
    last_hold = np.full(len(series), np.nan)
    t_first, t_prev, rows = math.nan, -math.inf, 0
    try:
        for c in chunks:
            sid, t, hold = c["series"].astype(np.int64), c["t"], c["hold"]
            if not t.size:
                continue
            if not np.isfinite(t).all() or t[0] < t_prev or np.any(np.diff(t) < 0) or sid.min() < 0 \
                    or sid.max() >= len(series):
                return None
            if math.isnan(t_first):
                t_first = float(t[0])
            t_prev = float(t[-1])
            ids, at = np.unique(sid, return_index=True)
            new = first_row[ids] < 0
            first_row[ids[new]] = rows + at[new]
            last = sid.size - 1 - np.unique(sid[::-1], return_index=True)[1]
            last_hold[ids] = hold[last]
            rows += sid.size
    except Damaged:
        return None
    if math.isnan(t_first) or t_prev - t_first <= slice_s or np.any(np.isfinite(last_hold) & (last_hold > 0)):
        return None
    seen = np.flatnonzero(first_row >= 0)
    return series, seen[np.argsort(first_row[seen])], t_first


def _slices(path: Path, series: list[Series], order: np.ndarray, t_first: float, slice_s: float) -> Iterator[Slice]:
    """The second read, cut into slices [lo, lo + slice_s); the last one takes every row left."""
    stored = stored_telemetry(path)
    if stored is None:
        raise Damaged(f"{path}: the column copy changed while it was read")
    carry: dict[int, tuple[float, float, float]] = {}  # series → its latest held row before the slice
    lo, hi = t_first, t_first + slice_s
    parts: list[tuple[np.ndarray, ...]] = []
    for c in stored[1]:
        arrays: tuple[np.ndarray, ...] = (c["series"].astype(np.int64), c["t"], c["value"], c["hold"])
        while arrays[1].size and arrays[1][-1] >= hi:
            cut = int(np.searchsorted(arrays[1], hi, "left"))
            parts.append(tuple(a[:cut] for a in arrays))
            yield _slice(series, order, parts, carry, lo, hi)
            parts, arrays = [], tuple(a[cut:] for a in arrays)
            lo, hi = hi, hi + slice_s
        parts.append(arrays)
    yield _slice(series, order, parts, carry, lo, math.inf)


def _slice(series: list[Series], order: np.ndarray, parts: list[tuple[np.ndarray, ...]],
           carry: dict[int, tuple[float, float, float]], lo: float, hi: float) -> Slice:
    """One slice's telemetry (every series of the run, in the run's order, most of them with rows here); updates
    ``carry`` for the next slice."""
    sid, t, v, h = (np.concatenate([p[k] for p in parts]) for k in range(4)) if parts else (
        np.zeros(0, np.int64), np.zeros(0), np.zeros(0), np.zeros(0))
    by_series = np.argsort(sid, kind="stable")
    bounds = np.searchsorted(sid[by_series], order)
    ends = np.searchsorted(sid[by_series], order, "right")
    raw = []
    for g, a, b in zip(order.tolist(), bounds.tolist(), ends.tolist()):
        rows = by_series[a:b]
        st, sv, sh = t[rows], v[rows], h[rows]
        if g in carry:  # the grid points of a value held from before the slice, up to this series' next row
            ct, cv, ch = carry.pop(g)
            end = min(float(st[0]) if st.size else math.inf, hi)
            grid = np.zeros(0)
            if math.isfinite(end):
                k = np.arange(max(1, math.floor((lo - ct) / ch) - 1), math.ceil((end - ct) / ch) + 2)
                grid = round_us(ct + k * ch)
                grid = grid[(grid >= lo) & (grid < end)]
            st, sv, sh = (np.concatenate((grid, st)), np.concatenate((np.full(grid.size, cv), sv)),
                          np.concatenate((np.full(grid.size, np.nan), sh)))
            if not rows.size:
                carry[g] = (ct, cv, ch)  # still held: its next row is in a later slice
        if rows.size and np.isfinite(h[rows[-1]]) and h[rows[-1]] > 0 and math.isfinite(hi):
            carry[g] = (float(t[rows[-1]]), float(v[rows[-1]]), float(h[rows[-1]]))
            # held past the slice: on the grid up to its end (a row there without a value, left out of every figure)
            st, sv, sh = np.append(st, hi), np.append(sv, np.nan), np.append(sh, np.nan)
        raw.append((st, sv, sh))
    return Telemetry.from_series([series[g] for g in order.tolist()], raw), lo, hi
