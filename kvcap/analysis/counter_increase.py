"""A counter's increase over a level's window, from samples taken about once a second and fed a slice at a time.

Why not last − first of the samples inside the window: each edge then loses what the counter gained between the
edge and the nearest sample inside — up to a sampling interval at each end, so the levels' increases added up fall
short of the run's. Instead the counter's value at each edge is read off the straight line between the last
sample at or before it and the first sample after it; an edge with samples on one side only takes the nearest
sample (nothing is extrapolated). A reset (the value drops) keeps the rule of the inside samples: it only lowers
the value at the end, so the increase is max(end − start, 0); and an edge whose two samples straddle a reset is
not interpolated across it — it takes the sample on the window's side.
"""

from __future__ import annotations

import math

import numpy as np

Sample = tuple[float, float]
"""(time, value)."""


def value_at(edge: float, before: Sample | None, after: Sample | None, start: bool) -> float:
    """The counter's value at ``edge``, between the last sample at or before it and the first after it (either may
    be missing, not both); ``start``: the window's start edge (its side is the later sample), else its end."""
    if after is None or before is None:
        nearest = before or after
        if nearest is None:
            raise ValueError(f"no sample on either side of {edge}")
        return nearest[1]
    (ta, va), (tb, vb) = before, after
    if vb < va:  # a reset in between: the value at the edge is unknown, take the window's own side
        return vb if start else va
    return va + (vb - va) * (edge - ta) / (tb - ta)


def increase(t0: float, t1: float, edges: tuple[Sample | None, Sample | None, Sample | None, Sample | None],
             whole: bool = False) -> float:
    """The increase over [t0, t1] given the samples around each edge: (last at or before t0, first after t0, last
    at or before t1, first after t1) — the one rule every per-level counter figure uses. ``whole``: a count of
    events (preemptions), each edge's value rounded down first, so an event between two samples falls in exactly
    one window, the one where the interpolated count passes it, and adjacent windows still add up."""
    before0, after0, before1, after1 = edges
    end, start = value_at(t1, before1, after1, False), value_at(t0, before0, after0, True)
    if whole:
        end, start = math.floor(end), math.floor(start)
    return max(end - start, 0.0)


class WindowIncrease:
    """A counter's increase over one window [t0, t1], fed its samples a slice at a time in time order: it keeps
    only the samples on either side of each edge and how many samples it needs lie in or around the window."""

    def __init__(self, t0: float, t1: float):
        self.t0, self.t1 = t0, t1
        self.before0: Sample | None = None
        self.after0: Sample | None = None
        self.before1: Sample | None = None
        self.after1: Sample | None = None
        self.inside = 0
        """Samples with t0 ≤ t ≤ t1."""

    def add(self, t: np.ndarray, v: np.ndarray) -> None:
        """The next samples (times ascending, after every one seen before); values that are not finite are none."""
        keep = np.isfinite(v)
        if not keep.all():
            t, v = t[keep], v[keep]
        if not t.size:
            return
        at0, at1 = int(np.searchsorted(t, self.t0, "right")), int(np.searchsorted(t, self.t1, "right"))
        if at0:
            self.before0 = (float(t[at0 - 1]), float(v[at0 - 1]))
        if self.after0 is None and at0 < t.size:
            self.after0 = (float(t[at0]), float(v[at0]))
        if at1:
            self.before1 = (float(t[at1 - 1]), float(v[at1 - 1]))
        if self.after1 is None and at1 < t.size:
            self.after1 = (float(t[at1]), float(v[at1]))
        self.inside += at1 - int(np.searchsorted(t, self.t0, "left"))

    @property
    def samples(self) -> int:
        """The samples the increase is read from: those in the window and the one each side just outside it."""
        outside_before = self.before0 is not None and self.before0[0] < self.t0
        return self.inside + int(outside_before) + int(self.after1 is not None)

    def value(self, whole: bool = False) -> float | None:
        """The increase (``whole``: see :func:`increase`); None with fewer than two samples in and around the window
        (the counter did not cover it)."""
        if self.samples < 2:
            return None
        return increase(self.t0, self.t1, (self.before0, self.after0, self.before1, self.after1), whole)


def window_increases(t: np.ndarray, v: np.ndarray, windows: list[tuple[float, float]]) -> list[float | None]:
    """Each window's increase over one whole series (the unsliced form, for tests and single reads)."""
    out = []
    for t0, t1 in windows:
        w = WindowIncrease(t0, t1)
        w.add(np.asarray(t, float), np.asarray(v, float))
        out.append(w.value())
    return out

