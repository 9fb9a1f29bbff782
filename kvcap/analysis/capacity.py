"""The article's three conditions per level, and the capacities that follow from them.

A level is a deliverable capacity only if (a) throughput still grows with load, (b) p95/p99 are within the SLO,
and (c) the system is stationary over the window: no upward trend of queueing or TTFT, errors and timeouts
under their limits, no preemptions. Otherwise it is at most a stress limit.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kvcap.analysis.telemetry import Points, Series, points
from kvcap.rundir.store.columns import LevelArrays
from kvcap.rundir.store.level_blocks import Level, as_level
from kvcap.rundir.store.quantiles import OrderStats

MIN_SCALING = 0.10
"""Condition (a): the throughput gain must be at least 10% of the proportional gain (concurrency ×2 → +10%)."""
DEFAULT_ERROR_LIMIT = 0.01
TREND_MIN_GROWTH = 0.10
"""Condition (c): a trend counts only if it is significant *and* grows TTFT by ≥ 10% of its median over the window."""


def trend(t: np.ndarray, y: np.ndarray) -> dict[str, float] | None:
    """Least-squares slope of y over t with a one-sided 95% lower bound (normal approximation)."""
    if t.size < 8 or np.ptp(t) <= 0:
        return None
    tc = t - t.mean()
    sxx = float(np.dot(tc, tc))
    slope = float(np.dot(tc, y - y.mean()) / sxx)
    resid = y - y.mean() - slope * tc
    se = float(np.sqrt(np.dot(resid, resid) / max(t.size - 2, 1) / sxx))
    return {"slope": slope, "lower95": slope - 1.645 * se, "span_s": float(np.ptp(t))}


class TrendSums:
    """``trend`` of (t, y) samples fed a part at a time (a slice of telemetry, a block of records): one part's is its
    own; more merge their means and centred sums (Chan et al.), the residual sum of squares then
    ``Syy − slope·Sty``."""

    def __init__(self) -> None:
        self.parts: list[tuple[int, float, float, float, float, float, float, float, dict[str, float] | None]] = []

    def add(self, t: np.ndarray, y: np.ndarray) -> None:
        if t.size:
            tc, yc = t - t.mean(), y - y.mean()
            self.parts.append((t.size, float(t.mean()), float(y.mean()), float(np.dot(tc, tc)), float(np.dot(tc, yc)),
                               float(np.dot(yc, yc)), float(t.min()), float(t.max()), trend(t, y)))

    @property
    def n(self) -> int:
        return sum(p[0] for p in self.parts)

    def result(self) -> dict[str, float] | None:
        if len(self.parts) == 1:
            return self.parts[0][-1]
        n = self.n
        span = max((p[7] for p in self.parts), default=0.0) - min((p[6] for p in self.parts), default=0.0)
        if n < 8 or span <= 0:
            return None
        t_mean = sum(p[0] * p[1] for p in self.parts) / n
        y_mean = sum(p[0] * p[2] for p in self.parts) / n
        stt = sum(p[3] + p[0] * (p[1] - t_mean) ** 2 for p in self.parts)
        sty = sum(p[4] + p[0] * (p[1] - t_mean) * (p[2] - y_mean) for p in self.parts)
        syy = sum(p[5] + p[0] * (p[2] - y_mean) ** 2 for p in self.parts)
        slope = sty / stt
        se = math.sqrt(max(syy - slope * sty, 0.0) / max(n - 2, 1) / stt)
        return {"slope": slope, "lower95": slope - 1.645 * se, "span_s": span}


def _sig(x: float) -> float:
    """A trend figure to 9 significant digits: what it means, not the last bits of how its sums were added (the
    same whether a long level's samples were summed whole or in slices)."""
    return float(f"{x:.9g}")


def _shown(tr: dict[str, float]) -> dict[str, float]:
    return {k: _sig(v) for k, v in tr.items()}


def stationarity(records: Level | LevelArrays | list[dict[str, Any]], window: tuple[float, float] | None,
                 waiting: Series | Points | TrendSums | None = None) -> dict[str, Any]:
    """Is latency (or the server's queue) growing within the measured window? ``waiting``: the server's queue
    over time, or its trend summed over slices of time (``telemetry_figures``)."""
    out: dict[str, Any] = {"source": None, "growing": False}
    if isinstance(waiting, TrendSums):
        tr = waiting.result() if waiting.n >= 8 else None
        if tr is not None:
            growth = tr["slope"] * tr["span_s"]
            out.update(source="telemetry:server.requests_waiting", **_shown(tr), growth=_sig(growth),
                       growing=tr["lower95"] > 0 and growth >= 1.0)
            return out
    elif waiting:
        t, v = points(waiting)
        if window is not None:
            inside = (t >= window[0]) & (t <= window[1])
            t, v = t[inside], v[inside]
        if t.size >= 8:
            tr = trend(t, v)
            if tr is not None:
                growth = tr["slope"] * tr["span_s"]
                out.update(source="telemetry:server.requests_waiting", **_shown(tr), growth=_sig(growth),
                           growing=tr["lower95"] > 0 and growth >= 1.0)
                return out
    level = as_level(records)
    ttft_trend = _ttft_trend(level)
    if ttft_trend is not None:
        tr, med = ttft_trend
        growth = tr["slope"] * tr["span_s"]
        out.update(source="client:ttft", **_shown(tr), growth_ms=_sig(growth),
                   growing=tr["lower95"] > 0 and growth >= max(TREND_MIN_GROWTH * med, 5.0))
    return out


def _ttft_trend(level: Level) -> tuple[dict[str, float], float] | None:
    """``trend`` of the measured requests' TTFT over their start (:class:`TrendSums` over the level's blocks: a
    level of one block gives ``trend``'s own floats), and the TTFT's median (a second pass)."""
    sums, median = TrendSums(), OrderStats()
    for a in level.blocks():
        meas = a.measured & ~np.isnan(a.ttft)
        sums.add(a.start[meas], a.ttft[meas])
        median.add(a.ttft[meas])
    tr = sums.result() if sums.n >= 8 else None
    if tr is None:
        return None
    median.ask(np.array([(median.n - 1) // 2, median.n // 2]))
    for a in level.blocks():
        median.collect(a.ttft[a.measured & ~np.isnan(a.ttft)])
    return tr, median.median()


def apply_conditions(levels: list[dict[str, Any]], slo: dict[str, float], extra: dict[float, dict[str, Any]],
                     min_scaling: float = MIN_SCALING) -> None:
    """Fill each level's ``failed_checks`` with the names of the conditions it fails (in place)."""
    error_limit = slo.get("error_rate", DEFAULT_ERROR_LIMIT)
    prev: dict[str, Any] | None = None
    for lv in sorted(levels, key=lambda x: x["level"]):
        failed = list(lv.get("failed_checks") or [])
        if prev is not None and prev["output_tok_s"] > 0 and lv["level"] > prev["level"]:
            gain = lv["output_tok_s"] / prev["output_tok_s"] - 1.0
            proportional = lv["level"] / prev["level"] - 1.0
            lv["scaling_efficiency"] = round(gain / proportional, 4) if proportional > 0 else None
            if lv["scaling_efficiency"] is not None and lv["scaling_efficiency"] < min_scaling:
                failed.append("throughput_growth")
        else:
            lv["scaling_efficiency"] = None
        if lv["error_rate"] > error_limit and "error_rate" not in failed:
            failed.append("error_rate")
        if lv.get("error_classes", {}).get("timeout"):
            failed.append("timeouts")
        info = extra.get(lv["level"], {})
        st = info.get("stationarity") or {}
        lv["stationarity"] = st
        if st.get("growing"):
            failed.append("queue_growth")
        if info.get("preemptions", 0) > 0:
            failed.append("preemptions")
        lv["preemptions"] = info.get("preemptions")
        lv["failed_checks"] = failed
        lv["slo_ok"] = not failed and lv["ok"] > 0
        if lv["ok"] > 0:
            prev = lv


def capacities(levels: list[dict[str, Any]], slo: dict[str, float],
               running: Series | Points, waiting: Series | Points) -> dict[str, Any]:
    """effective / stress_limit / resident, with where ``resident`` came from."""
    closed = [lv for lv in levels if lv["mode"] == "concurrency"] or levels
    ok_levels = [lv for lv in closed if lv["ok"] > 0]
    effective = None
    for lv in sorted(ok_levels, key=lambda x: x["level"]):  # the largest level of the passing run from below
        if lv["slo_ok"]:
            effective = lv["level"]
        else:
            break
    stress = max((lv["level"] for lv in ok_levels), default=None)
    above = [lv for lv in sorted(ok_levels, key=lambda x: x["level"]) if effective is None or lv["level"] > effective]
    limited_by = above[0]["failed_checks"][0] if above and above[0]["failed_checks"] else None
    resident, source, lower_bound = None, None, False
    if running:  # the most requests the server held at once; a lower bound unless something ever had to wait
        resident = int(np.max(points(running)[1]))
        source = "telemetry"
        lower_bound = not bool(np.any(points(waiting)[1] >= 0.5))
    elif ok_levels:
        resident, lower_bound = client_resident_estimate(ok_levels)
        source = "client_estimate"
    return {"slo": slo, "effective": effective, "stress_limit": stress, "resident": resident,
            "resident_source": source, "resident_lower_bound": lower_bound, "limited_by": limited_by,
            "scaling": [{"level": lv["level"], "efficiency": lv.get("scaling_efficiency")} for lv in ok_levels]}


def client_resident_estimate(levels: list[dict[str, Any]]) -> tuple[int | None, bool]:
    """The largest level without the queueing signature (TTFT far above its idle value plus a few TPOTs)."""
    lv = sorted(levels, key=lambda x: x["level"])
    base = (lv[0].get("ttft_ms") or {}).get("p50")
    if base is None:
        return None, True
    resident = None
    for x in lv:
        ttft, tpot = (x.get("ttft_ms") or {}).get("p50"), (x.get("tpot_ms") or {}).get("p50") or 0.0
        if ttft is None:
            continue
        if ttft <= 2.0 * base + 5.0 * tpot:
            resident = x["level"]
        else:
            return int(resident) if resident is not None else None, False
    return (int(resident) if resident is not None else None), True


def littles_law(level: dict[str, Any]) -> dict[str, Any] | None:
    """Little's law cross-check: λ·W (completion rate × mean response time) against the time-averaged number
    in flight measured from the records, and (closed loop) against the configured concurrency. A ratio well
    below 1 means the client did not keep the load it was asked for."""
    rate, e2e = level.get("request_s"), (level.get("e2e_ms") or {}).get("mean")
    measured = level.get("in_flight_mean")
    if measured is None and not (rate and e2e):
        return None
    out: dict[str, Any] = {"in_flight": measured,
                           "rate_x_response": round(rate * e2e / 1e3, 3) if rate and e2e else None}
    if level["mode"] == "concurrency" and measured is not None:
        ratio = measured / level["level"]
        out["ratio_to_concurrency"] = round(ratio, 3)
        out["mismatch"] = ratio < 0.85 or ratio > 1.1
    return out
