"""The telemetry figures of ``summary.json`` — per level window: the server's running/waiting/parked, link, GPU,
KV and network figures, preemptions, the waiting trend and per-node figures; over the run: the most requests held
at once and whether any ever waited — added up a time slice at a time (``telemetry_slices``).

Why: each figure is a mean, maximum, minimum, first/last value or least-squares trend over the samples in a
window, and each of those adds up over slices of time: extremes, first/last values and the NIC peaks exactly; a
mean as the sum of its slices' sums (the last bits of a float sum depend on its order, so a mean rounded to 4
decimals over a window longer than a slice can, rarely, differ in that last digit from ``np.mean`` over the
whole); the trend's centred sums merged (``capacity.TrendSums``); a counter's increase from the samples either side
of each edge, kept as the slices pass (``counter_increase``). With one slice — any run shorter than
``SLICE_S`` — every figure is the same float the whole series gives.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kvcap.analysis.capacity import TrendSums
from kvcap.analysis.counter_increase import WindowIncrease
from kvcap.analysis.prefix_reuse import COUNTERS
from kvcap.analysis.telemetry import Series, Telemetry, read_telemetry, series_of
from kvcap.analysis.telemetry_nodes import NodeFigures, Stat, cut, nodes, servers
from kvcap.analysis.telemetry_slices import telemetry_slices
from kvcap.rundir import RunDir
from kvcap.rundir.store.column_file import Damaged

Window = tuple[float, float]
LEVEL_FIGURES = (("link_util_max", "link.util", "max"), ("gpu_util_mean", "gpu.util", "mean"),
                 ("kv_usage_mean", "server.kv_usage", "mean"), ("kv_usage_max", "server.kv_usage", "max"),
                 ("net_rx_bytes_s_mean", "net.rx_bytes_s", "mean"), ("net_tx_bytes_s_mean", "net.tx_bytes_s", "mean"))
"""(key, series, statistic) of a level's cluster-wide figures, in ``summary.json``'s order."""
HELD = (("running", "server.requests_running"), ("waiting", "server.requests_waiting"),
        ("parked", "server.requests_parked"))
PREEMPTIONS = "server.preemptions_total"
COUNTER_SERIES = tuple(dict.fromkeys((PREEMPTIONS, *COUNTERS)))
"""The counters whose increase over each level window the summary reads."""


def telemetry_figures(run: RunDir, windows: list[Window], write_copy: bool = False) -> TelemetryFigures:
    """The run's telemetry figures over ``windows``, a slice at a time where it can be; read whole if its copy
    changed while it was read in slices (then the JSONL, as ``read_telemetry`` falls back)."""
    figures = TelemetryFigures(windows)
    try:
        for tel, lo, hi in telemetry_slices(run, write_copy=write_copy):
            figures.add(tel, lo, hi)
    except Damaged:
        figures = TelemetryFigures(windows)
        figures.add(read_telemetry(run, write_copy=write_copy))
    return figures


class TelemetryFigures:
    """Every telemetry figure of a summary, over ``windows`` (one per level), fed slices in time order."""

    def __init__(self, windows: list[Window]):
        self.windows = windows
        self.stats: list[dict[str, Stat]] = [{} for _ in windows]
        self.counters: list[dict[str, WindowIncrease]] = [{} for _ in windows]
        self.waiting_trend = [TrendSums() for _ in windows]
        self.resident: list[tuple[float, float]] = []
        self.waiting: list[tuple[float, float]] = []
        self.parked = False
        self.nodes = NodeFigures(windows)
        self.node_names: list[str] = []
        self.n_servers = 1
        """``telemetry_nodes.nodes`` and ``servers``: the same from every slice, which lists every series of the run."""

    def add(self, tel: Telemetry, lo: float = -math.inf, hi: float = math.inf) -> None:
        held = {key: cut(series_of(tel, name), lo, hi) for key, name in HELD}
        parked = held["parked"]
        self.parked = self.parked or bool(parked)
        resident = held["running"].plus(parked) if parked else held["running"]
        for s, out in ((resident, self.resident), (held["waiting"], self.waiting)):
            if s:
                i = int(np.argmax(s.v))
                out.append((float(s.t[i]), float(s.v[i])))
        cluster = {name: cut(series_of(tel, name), lo, hi) for name in dict.fromkeys(n for _, n, _ in LEVEL_FIGURES)}
        counters = {name: cut(series_of(tel, name), lo, hi) for name in COUNTER_SERIES}
        for w, (t0, t1) in enumerate(self.windows):
            stats = self.stats[w]
            for key, s in held.items():
                stats.setdefault(key, Stat()).add(s.within(t0, t1).v)
            for name, s in cluster.items():
                stats.setdefault(name, Stat()).add(s.within(t0, t1).v)
            for name, s in counters.items():
                if s:  # every sample of the slice: those just outside the window set its edges' values
                    self.counters[w].setdefault(name, WindowIncrease(t0, t1)).add(s.t, s.v)
            inside = held["waiting"].within(t0, t1)
            self.waiting_trend[w].add(inside.t, inside.v)
        self.nodes.add(tel, lo, hi)
        self.node_names, self.n_servers = nodes(tel), servers(tel)

    def level(self, w: int) -> dict[str, Any]:
        """A level's figures, keyed and ordered as ``summary.json`` has them."""
        stats, out = self.stats[w], {}
        for key, _ in HELD:
            s = stats.get(key)
            if s is not None and s.n:
                figs = {"max": s.hi, "mean": round(s.of("mean"), 3)}
                for stat in ("mean", "max") if key == "waiting" else ("max", "mean"):
                    out[f"server_{key}_{stat}"] = figs[stat]
        for key, name, stat in LEVEL_FIGURES:
            s = stats.get(name)
            if s is not None and s.n:
                out[key] = round(s.of(stat), 4)
        return out

    def increase(self, w: int, name: str, whole: bool = False) -> float | None:
        """Counter ``name``'s increase over window ``w`` (``counter_increase``: its value at each edge interpolated
        between the samples either side; a reset counts as no increase); None where fewer than two samples lie in
        and just around the window."""
        c = self.counters[w].get(name)
        return c.value(whole) if c is not None else None

    def preemptions(self, w: int) -> float:
        """The server's preemptions over window ``w`` in whole preemptions (0 without the counter): one that fell
        between two samples at a level's edge belongs to one level, not a share to each."""
        n = self.increase(w, PREEMPTIONS, whole=True)
        return float(n) if n is not None else 0

    def increases(self, w: int) -> dict[str, float]:
        """The prefix and tier counters (``prefix_reuse.COUNTERS``) that cover window ``w``: each one's increase."""
        out = {}
        for name in COUNTERS:
            n = self.increase(w, name)
            if n is not None:
                out[name] = n
        return out

    def maxima(self, of: list[tuple[float, float]]) -> Series:
        """Each slice's maximum (and when): a series whose maximum, and whether any value reaches a bound, are the
        whole one's."""
        return Series(np.array([t for t, _ in of]), np.array([v for _, v in of]))
