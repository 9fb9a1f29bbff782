"""A counter's increase over a level window (``counter_increase``): the value at each edge interpolated between
the samples either side, worked by hand on literal samples — including the real vLLM + LMCache run whose levels'
tier hits added up to a fifth less than the counter's rise — an edge with samples on one side only, a reset, and
the same figure fed in any slices, through ``TelemetryFigures`` as the summary feeds it."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kvcap.analysis.counter_increase import WindowIncrease, window_increases
from kvcap.analysis.telemetry import Telemetry
from kvcap.analysis.telemetry_figures import TelemetryFigures

# ``server.offload_prefix_hits_total`` sampled about once a second; 9.06 s, 10.06 s and 10.78 s are the real run's
# samples, the earlier ones made up on the same slope.
T = [0.06, 1.06, 2.06, 3.06, 4.06, 5.06, 6.06, 7.06, 8.06, 9.06, 10.06, 10.78]
V = [0.0, 0.0, 1000.0, 3000.0, 5000.0, 8000.0, 12000.0, 17000.0, 24000.0, 31872.0, 40320.0, 44416.0]
LEVEL_1, LEVEL_2 = (0.03, 7.477), (7.477, 10.741)

# Level 2 by hand. Start, 7.477 s: between 7.06 s (17000) and 8.06 s (24000), 0.417 of the way: 17000 + 0.417 ×
# 7000 = 19919. End, 10.741 s: between 10.06 s (40320) and 10.78 s (44416), 0.681 / 0.72 of the way: 40320 +
# 4096 × 681/720 = 44194.1333…
LEVEL_2_START = 17000 + 0.417 * 7000
LEVEL_2_END = 40320 + 4096 * 681 / 720
LEVEL_2_INCREASE = LEVEL_2_END - LEVEL_2_START  # 24275.1333…; the samples inside alone: 40320 − 24000 = 16320


def test_the_real_runs_level_2_by_hand() -> None:
    assert pytest.approx(19919.0) == LEVEL_2_START
    assert window_increases(np.array(T), np.array(V), [LEVEL_2]) == [pytest.approx(LEVEL_2_INCREASE, abs=1e-9)]
    assert pytest.approx(24275.1333, abs=1e-4) == LEVEL_2_INCREASE


def test_the_levels_add_up_to_the_counters_rise() -> None:
    """Windows that abut share their edge's value, so their increases add up to the rise over both; level 1 starts
    before the first sample, which it takes as its start (nothing is extrapolated)."""
    one, two = window_increases(np.array(T), np.array(V), [LEVEL_1, LEVEL_2])
    assert one == pytest.approx(LEVEL_2_START - 0.0)
    assert one + two == pytest.approx(LEVEL_2_END - V[0])


def test_an_edge_with_samples_on_one_side_takes_the_nearest() -> None:
    t, v = np.array([1.0, 2.0, 3.0]), np.array([10.0, 20.0, 40.0])
    assert window_increases(t, v, [(0.0, 2.5)]) == [pytest.approx(30.0 - 10.0)]  # start before the first sample
    assert window_increases(t, v, [(1.5, 9.0)]) == [pytest.approx(40.0 - 15.0)]  # end after the last
    assert window_increases(t, v, [(0.0, 9.0)]) == [30.0]  # both: last − first
    assert window_increases(t, v, [(2.2, 2.7)]) == [pytest.approx(10.0)]  # no sample inside: the line between
    # the counter does not cover the window: every sample on one side (or a single one in all)
    assert window_increases(t, v, [(3.5, 9.0), (-5.0, 0.5)]) == [None, None]
    assert window_increases(t[:1], v[:1], [(0.0, 9.0)]) == [None]
    assert window_increases(t[:0], v[:0], [(0.0, 9.0)]) == [None]


def test_a_reset_counts_as_no_increase() -> None:
    t, v = np.array([0.0, 1.0, 2.0, 3.0]), np.array([100.0, 200.0, 10.0, 50.0])
    # end 2.5 s: 10 + 0.5 × 40 = 30 < start 0.5 s: 150 — the reset only lowers the end, so nothing counts
    assert window_increases(t, v, [(0.5, 2.5)]) == [0.0]
    # start 1.5 s straddles the reset (200 → 10): not interpolated across it, the window's side (10) is taken
    assert window_increases(t, v, [(1.5, 3.0)]) == [pytest.approx(40.0)]
    # end 1.5 s straddles it: the window's side (200); start 0.5 s: 150
    assert window_increases(t, v, [(0.5, 1.5)]) == [pytest.approx(50.0)]


@pytest.mark.parametrize("cuts", [[], [7.477], [7.06, 8.06], [7.3, 10.5], [3.0, 7.477, 10.06, 10.741], [10.77]])
def test_any_slices_give_the_same_increase(cuts: list[float]) -> None:
    """Fed a slice at a time (each slice's samples only, in time order, some empty), the samples kept either side
    of each edge give the very float the whole series gives."""
    t, v = np.array(T), np.array(V)
    whole = window_increases(t, v, [LEVEL_1, LEVEL_2])
    bounds = [-np.inf, *cuts, 20.0, np.inf]
    windows = [WindowIncrease(*LEVEL_1), WindowIncrease(*LEVEL_2)]
    for lo, hi in itertools.pairwise(bounds):
        part = (t >= lo) & (t < hi)
        for w in windows:
            w.add(t[part], v[part])
    assert [w.value() for w in windows] == whole


def _rows(name: str, times: list[float], values: list[float], replica: str = "0") -> list[dict[str, object]]:
    return [{"t_s": t, "source": "metrics:http://x/metrics", "name": name, "labels": {"replica": replica},
             "value": v} for t, v in zip(times, values)]


@pytest.mark.parametrize("cut", [None, 7.5, 10.0])
def test_telemetry_figures_read_each_counter_this_way(cut: float | None) -> None:
    """Through ``TelemetryFigures`` as the summary feeds it (whole, or two slices cut at ``cut``): every counter's
    increase and the preemptions take the edges' interpolated values; a counter that does not cover a window is
    left out of it."""
    rows = (_rows("server.offload_prefix_hits_total", T, V)
            + _rows("server.preemptions_total", [7.0, 8.0], [0.0, 4.0])
            + _rows("server.prefix_cache_hits_total", [9.5, 10.5], [10.0, 20.0]))
    rows.sort(key=lambda r: r["t_s"])  # type: ignore[arg-type, return-value]
    figures = TelemetryFigures([LEVEL_1, LEVEL_2])
    if cut is None:
        figures.add(Telemetry(rows))
    else:
        figures.add(Telemetry([r for r in rows if r["t_s"] < cut]), -np.inf, cut)  # type: ignore[operator]
        figures.add(Telemetry([r for r in rows if r["t_s"] >= cut]), cut, np.inf)  # type: ignore[operator]
    level_2 = figures.increases(1)
    assert level_2["server.offload_prefix_hits_total"] == pytest.approx(LEVEL_2_INCREASE, abs=1e-9)
    assert level_2["server.prefix_cache_hits_total"] == pytest.approx(10.0)  # both samples inside
    assert "server.prefix_cache_hits_total" not in figures.increases(0)  # every sample after level 1
    # preemptions: 0 at 7.0 s, 4 at 8.0 s; at the edge 7.477 s the line reads 1.908: one whole preemption before
    # it, three after — each in one level, none split
    assert (figures.preemptions(0), figures.preemptions(1)) == (1.0, 3.0)
