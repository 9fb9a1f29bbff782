"""When each output token of a request arrived, and how many arrived inside a window — from the request's first
token time and its per-token ITLs, vectorised over many requests at once.

Why a module of its own: throughput and goodput count the tokens received *inside* a level's measured window,
and both the column builders and the per-level arrays need the same count, made the same way (the same floats).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

Window = tuple[float, float]
EDGE_MARGIN_S = 1e-6
"""A record whose last token is this close to a window's edge is counted token by token (its last token time is
summed in another order than the running sums, and window bounds are rounded to the µs)."""


def segmented_cumsum(flat: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Each record's running sum of its own ITLs, exactly as ``np.cumsum`` of that record's list alone (rows of
    one length are stacked and summed along the row, so no sum carries over from the records before it)."""
    out = np.empty_like(flat)
    offsets = np.concatenate(([0], np.cumsum(lens)[:-1])).astype(np.int64)
    for length in np.unique(lens[lens > 0]).tolist():
        rows = np.flatnonzero(lens == length)
        idx = offsets[rows][:, None] + np.arange(length)
        out[idx] = np.cumsum(flat[idx], axis=1)
    return out


def count_tokens(first: np.ndarray, flat: np.ndarray, lens: np.ndarray, windows: Sequence[Window]) -> list[np.ndarray]:
    """Per window, per record: tokens at first and at first + each running ITL sum (ms) within [t0, t1); 0 for a
    record without ITLs (its tokens are spread by the closed form instead) or without a first token.

    Token times rise within a record (ITLs ≥ 0), so a record whose first and last tokens both lie inside a window
    (a margin of 1 µs on the last, which is summed in another order) has all of them inside, and one wholly before
    or after has none: only the few records across a window's edge need their token times. Negative ITLs (a
    damaged file) take every record's times."""
    has = (lens > 0) & ~np.isnan(first)
    if flat.size and flat.min() < 0:
        return count_each_token(first, flat, lens, windows, has)
    last = last_token_times(first, flat, lens)
    out = []
    edge = np.zeros(lens.size, bool)
    for t0, t1 in windows:
        inside = has & (first >= t0) & (last + EDGE_MARGIN_S < t1)
        outside = (first >= t1) | (last + EDGE_MARGIN_S < t0)
        out.append(np.where(inside, lens + 1, 0).astype(np.int64))
        edge |= has & ~inside & ~outside  # across an edge (or a sum that is not finite)
    if edge.any():
        rows = np.flatnonzero(edge)
        exact = count_each_token(first[rows], itls_of(flat, lens, rows), lens[rows], windows, has[rows])
        for count, part in zip(out, exact):
            count[rows] = part
    return out


def itls_of(flat: np.ndarray, lens: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The ITLs of records ``rows`` (in that order) out of their chunk's flat array (``lens`` per record)."""
    starts = np.cumsum(lens) - lens
    itls: np.ndarray = flat[np.repeat(starts[rows], lens[rows]) + ranks(lens[rows])]
    return itls


def last_token_times(first: np.ndarray, flat: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Each record's last token time: its first plus its ITLs (ms) summed (in another order than the running
    sums of :func:`count_each_token`: within ``EDGE_MARGIN_S`` of them)."""
    total = np.zeros(lens.size)
    some = lens > 0
    if flat.size:
        total[some] = np.add.reduceat(flat, (np.cumsum(lens) - lens)[some])
    return first + total / 1e3


def count_each_token(first: np.ndarray, flat: np.ndarray, lens: np.ndarray, windows: Sequence[Window],
                      has: np.ndarray) -> list[np.ndarray]:
    """``count_tokens`` from every token's time."""
    owner = np.repeat(np.arange(lens.size), lens)
    times = first[owner] + segmented_cumsum(flat, lens) / 1e3  # tokens 2..N (NaN first → never inside)
    out = []
    for t0, t1 in windows:
        count = (has & (first >= t0) & (first < t1)).astype(np.int64)
        inside = (times >= t0) & (times < t1)
        count += np.bincount(owner[inside], minlength=lens.size)
        out.append(count)
    return out


def ranks(lens: np.ndarray) -> np.ndarray:
    """0, 1, …, len−1 for each length in turn (the position of each value inside its record)."""
    total = int(lens.sum())
    starts = np.repeat(np.cumsum(lens) - lens, lens)
    within: np.ndarray = np.arange(total) - starts
    return within
