"""The article's three conditions and the capacities, on hand-made level summaries.

A level is deliverable only if (a) throughput still grows (scaling efficiency ≥ 0.1), (b) the SLO holds and
(c) it is stationary (no queue growth, errors or timeouts under the limit, no preemptions). Effective
capacity is the largest level of the passing run counted from the lowest; resident is the most requests held
at once; the stress limit is the highest level that completed anything.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvcap.analysis.capacity import (
    apply_conditions,
    capacities,
    client_resident_estimate,
    littles_law,
    stationarity,
    trend,
)


def level(c: float, tok_s: float, *, ok: int = 100, error_rate: float = 0.0, failed: list[str] | None = None,
          mode: str = "concurrency", **extra) -> dict:
    return {"mode": mode, "level": c, "output_tok_s": tok_s, "ok": ok, "error_rate": error_rate,
            "failed_checks": list(failed or []), **extra}


def test_trend_of_an_exact_line():
    t = np.arange(10.0)
    tr = trend(t, 2 * t + 1)
    assert tr == {"slope": pytest.approx(2.0), "lower95": pytest.approx(2.0), "span_s": 9.0}  # no residual
    assert trend(t[:7], t[:7]) is None                     # fewer than 8 points
    assert trend(np.full(10, 3.0), t) is None              # no time span


def test_trend_lower_bound_falls_with_noise():
    t = np.arange(10.0)
    noise = np.array([1, -1] * 5, float)
    tr = trend(t, 2 * t + noise)
    assert tr["lower95"] < tr["slope"] < 2.0 + 0.2


def test_stationarity_from_the_server_queue():
    waiting = [(float(t), float(t)) for t in range(10)]    # one more request waiting every second
    st = stationarity([], (0.0, 9.0), waiting)
    assert st["source"] == "telemetry:server.requests_waiting" and st["growing"] is True
    assert st["growth"] == pytest.approx(9.0)
    flat = stationarity([], (0.0, 9.0), [(float(t), 2.0) for t in range(10)])
    assert flat["source"] == "telemetry:server.requests_waiting" and flat["growing"] is False
    # samples outside the window do not count: 7 left is too few, and without records there is no verdict
    assert stationarity([], (0.0, 6.0), waiting) == {"source": None, "growing": False}


def _ttft_records(ttfts: list[float]) -> list[dict]:
    return [{"start_s": float(i), "ttft_ms": v} for i, v in enumerate(ttfts)]


def test_stationarity_from_client_ttft():
    rising = stationarity(_ttft_records([100.0 + 10 * i for i in range(10)]), None)
    assert rising["source"] == "client:ttft" and rising["growing"] is True
    assert rising["growth_ms"] == pytest.approx(90.0)   # 10 ms/s over 9 s, ≥ 10% of the 145 ms median
    # significant but tiny: 0.9 ms over the window is below the 5 ms floor
    assert stationarity(_ttft_records([100.0 + 0.1 * i for i in range(10)]), None)["growing"] is False
    warm = _ttft_records([100.0 + 10 * i for i in range(10)])
    for r in warm:
        r["phase"] = "warmup"
    assert stationarity(warm, None) == {"source": None, "growing": False}


def test_apply_conditions_names_each_failed_condition():
    levels = [level(1, 100.0), level(2, 190.0), level(4, 200.0), level(8, 400.0, error_rate=0.05,
                                                                          error_classes={"timeout": 2}),
              level(16, 800.0, failed=["ttft_p95"])]
    extra = {8: {"stationarity": {"growing": True}, "preemptions": 3}}
    apply_conditions(levels, {}, extra)
    by = {lv["level"]: lv for lv in levels}
    assert by[1]["scaling_efficiency"] is None and by[1]["failed_checks"] == [] and by[1]["slo_ok"]
    assert by[2]["scaling_efficiency"] == pytest.approx(0.9)               # +90% for +100%
    assert by[4]["scaling_efficiency"] == 0.0526                           # 10/190 < 0.1 (4 decimals)
    assert by[4]["failed_checks"] == ["throughput_growth"] and not by[4]["slo_ok"]
    assert by[8]["failed_checks"] == ["error_rate", "timeouts", "queue_growth", "preemptions"]
    assert by[8]["preemptions"] == 3 and by[8]["stationarity"] == {"growing": True}
    assert by[16]["failed_checks"] == ["ttft_p95"]                         # the SLO check's result is kept


def test_apply_conditions_error_limit_and_skipped_levels():
    levels = [level(1, 100.0, error_rate=0.02), level(2, 0.0, ok=0), level(4, 150.0)]
    apply_conditions(levels, {"error_rate": 0.05}, {})
    assert levels[0]["failed_checks"] == []                                # 2% is within the SLO's 5%
    assert levels[1]["slo_ok"] is False                                    # nothing completed: no pass
    assert levels[2]["scaling_efficiency"] == 0.1667                       # (+50%)/(+300%) against c=1
    apply_conditions(levels, {}, {})
    assert levels[0]["failed_checks"] == ["error_rate"]                    # default limit 1%


def _judged(levels: list[dict], slo: dict | None = None, extra: dict | None = None) -> list[dict]:
    apply_conditions(levels, slo or {}, extra or {})
    return levels


def test_effective_is_the_top_of_the_passing_run_from_below():
    levels = _judged([level(8, 400.0), level(16, 780.0), level(24, 1100.0), level(32, 1120.0),
                      level(48, 1600.0)], extra={24: {"preemptions": 1}})
    cap = capacities(levels, {}, running=[], waiting=[])
    # 24 is preempting (c), so 48 does not count although it scales again from 32
    assert cap["effective"] == 16 and cap["limited_by"] == "preemptions"
    assert cap["stress_limit"] == 48
    assert cap["scaling"][1] == {"level": 16, "efficiency": pytest.approx(0.95)}


def test_effective_none_when_the_first_level_fails():
    levels = _judged([level(8, 400.0, failed=["tpot_p95"]), level(16, 780.0)])
    cap = capacities(levels, {"tpot_p95": 80.0}, running=[], waiting=[])
    assert cap["effective"] is None and cap["limited_by"] == "tpot_p95" and cap["stress_limit"] == 16


def test_levels_without_completions_are_not_a_stress_limit():
    levels = _judged([level(8, 400.0), level(16, 780.0), level(96, 0.0, ok=0)])
    cap = capacities(levels, {}, running=[], waiting=[])
    assert cap["effective"] == 16 and cap["stress_limit"] == 16 and cap["limited_by"] is None


def test_open_loop_levels_only_without_closed_loop_ones():
    mixed = _judged([level(8, 400.0), level(1.0, 50.0, mode="rate"), level(64.0, 3000.0, mode="rate")])
    assert capacities(mixed, {}, [], [])["stress_limit"] == 8
    rate_only = _judged([level(1.0, 50.0, mode="rate"), level(2.0, 100.0, mode="rate")])
    assert capacities(rate_only, {}, [], [])["effective"] == 2.0


def test_resident_is_the_most_requests_held_at_once():
    levels = _judged([level(8, 400.0), level(16, 780.0)])
    running = [(0.0, 3.0), (1.0, 15.0), (2.0, 12.0)]
    cap = capacities(levels, {}, running=running, waiting=[(1.0, 0.0), (2.0, 0.4)])
    assert cap["resident"] == 15 and cap["resident_source"] == "telemetry"
    assert cap["resident_lower_bound"] is True           # nothing ever waited: the server may hold more
    cap = capacities(levels, {}, running=running, waiting=[(2.0, 0.5)])
    assert cap["resident_lower_bound"] is False          # requests queued: 15 is the ceiling


def test_resident_from_client_latencies_without_telemetry():
    lv = [level(1, 50.0, ttft_ms={"p50": 100.0}, tpot_ms={"p50": 20.0}),
          level(2, 90.0, ttft_ms={"p50": 150.0}, tpot_ms={"p50": 20.0}),
          level(4, 160.0, ttft_ms={"p50": 300.0}, tpot_ms={"p50": 20.0}),   # ≤ 2·100 + 5·20 = 300
          level(8, 170.0, ttft_ms={"p50": 900.0}, tpot_ms={"p50": 20.0})]   # queueing
    assert client_resident_estimate(lv) == (4, False)
    assert client_resident_estimate(lv[:3]) == (4, True)            # never queued: only a lower bound
    assert client_resident_estimate([level(1, 50.0)]) == (None, True)
    cap = capacities(_judged(lv), {}, running=[], waiting=[])
    assert (cap["resident"], cap["resident_source"], cap["resident_lower_bound"]) == (4, "client_estimate", False)


def test_littles_law():
    lv = {"mode": "concurrency", "level": 8, "request_s": 2.0, "e2e_ms": {"mean": 3500.0}, "in_flight_mean": 7.0}
    assert littles_law(lv) == {"in_flight": 7.0, "rate_x_response": 7.0, "ratio_to_concurrency": 0.875,
                               "mismatch": False}
    assert littles_law(lv | {"in_flight_mean": 6.0})["mismatch"] is True     # 0.75 < 0.85: the client lagged
    assert littles_law(lv | {"in_flight_mean": 9.0})["mismatch"] is True     # 1.125 > 1.1
    assert littles_law(lv | {"mode": "rate"}) == {"in_flight": 7.0, "rate_x_response": 7.0}
    assert littles_law({"mode": "concurrency", "level": 8, "request_s": 0.0, "e2e_ms": {}}) is None
