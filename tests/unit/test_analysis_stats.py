"""Per-level statistics on hand-made records: percentiles, tokens in the window, goodput, intervals, the SLO.

Every expected value is worked out by hand in the comment next to it; percentiles interpolate linearly
between order statistics (numpy's default): position (n − 1)·q/100 in the sorted values.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvcap.analysis.stats import (
    LevelArrays,
    bootstrap_ci,
    check_slo,
    level_key,
    meets_request_slo,
    percentiles,
    repeats_ci,
    summarize_level,
    tokens_in_window,
)


def test_percentiles_interpolate_linearly():
    # 1…10: p50 at position 4.5 → 5.5; p90 at 8.1 → 9 + 0.1·1; p95 at 8.55; p99 at 8.91
    assert percentiles(list(range(1, 11))) == {"p50": 5.5, "p90": 9.1, "p95": 9.55, "p99": 9.91, "mean": 5.5}
    # sorted [1000, 1000, 3000]: p90 at 1.8 → 1000 + 0.8·2000 = 2600; mean 5000/3 rounded to 3 decimals
    assert percentiles(np.array([1000.0, 3000.0, 1000.0])) == {"p50": 1000.0, "p90": 2600.0, "p95": 2800.0,
                                                               "p99": 2960.0, "mean": 1666.667}


def test_percentiles_skip_missing_values():
    assert percentiles([None, 4.0, float("nan"), 2.0]) == {"p50": 3.0, "p90": 3.8, "p95": 3.9, "p99": 3.98,
                                                           "mean": 3.0}
    assert percentiles([]) == {"p50": None, "p90": None, "p95": None, "p99": None, "mean": None}
    assert percentiles([None]) == percentiles(np.zeros(0))


def test_tokens_in_window_from_itls():
    rec = {"start_s": 10.0, "ttft_ms": 500.0, "itl_ms": [100.0, 100.0, 100.0]}  # tokens at 10.5 10.6 10.7 10.8
    assert tokens_in_window(rec, 10.55, 10.75) == 2
    assert tokens_in_window(rec, 0.0, 10.5) == 0    # the window is half-open: [t0, t1)
    assert tokens_in_window(rec, 10.5, 20.0) == 4
    assert tokens_in_window({"start_s": 1.0, "ttft_ms": None, "output_tokens": 9}, 0.0, 99.0) == 0


def test_tokens_in_window_spread_evenly_without_itls():
    # 5 tokens from the first (10.5 s) to the end (11.5 s): 10.5, 10.75, 11.0, 11.25, 11.5
    rec = {"start_s": 10.0, "ttft_ms": 500.0, "e2e_ms": 1500.0, "output_tokens": 5}
    assert tokens_in_window(rec, 10.7, 11.2) == 2
    assert tokens_in_window(rec, 11.3, 12.0) == 1
    one = {"start_s": 10.0, "ttft_ms": 500.0, "e2e_ms": 500.0, "output_tokens": 1}
    assert tokens_in_window(one, 10.0, 11.0) == 1 and tokens_in_window(one, 11.0, 12.0) == 0
    no_end = {"start_s": 10.0, "ttft_ms": 500.0, "output_tokens": 3}   # no E2E: all counted at the first token
    assert tokens_in_window(no_end, 10.0, 10.6) == 3


def test_vectorised_tokens_agree_with_the_per_record_count():
    records = [{"start_s": 10.0, "ttft_ms": 500.0, "itl_ms": [100.0, 100.0, 100.0], "ok": True},
               {"start_s": 10.0, "ttft_ms": 500.0, "e2e_ms": 1500.0, "output_tokens": 5, "ok": True},
               {"start_s": 10.0, "ttft_ms": 500.0, "e2e_ms": 500.0, "output_tokens": 1, "ok": True},
               {"start_s": 12.0, "ttft_ms": None, "ok": False}]
    a = LevelArrays(records)
    everyone = np.ones(len(records), bool)
    for t0, t1 in ((10.0, 10.75), (10.0, 11.2), (0.0, 99.0), (9.0, 10.0)):
        assert a.tokens_in_window(t0, t1, everyone) == sum(tokens_in_window(r, t0, t1) for r in records)
    assert a.tokens_in_window(10.0, 10.75, everyone) == 3 + 1 + 1   # 10.5 10.6 10.7 | 10.5 | 10.5
    assert a.tokens_in_window(0.0, 99.0, everyone) == 4 + 5 + 1
    assert a.tokens_in_window(0.0, 99.0, np.array([False, True, False, False])) == 5


def test_vectorised_tokens_of_a_request_that_ended_before_the_window():
    """Regression: the first-token index of a request without ITLs was clipped to its last token, so a request
    that ended before the window counted one token inside it (and in summarize_level's output_tok_s)."""
    spread = {"start_s": 10.0, "ttft_ms": 500.0, "e2e_ms": 1500.0, "output_tokens": 5, "ok": True}  # 10.5 … 11.5
    single = {"start_s": 10.0, "ttft_ms": 500.0, "e2e_ms": 500.0, "output_tokens": 1, "ok": True}   # 10.5
    for rec in (spread, single):
        assert tokens_in_window(rec, 20.0, 30.0) == 0
        assert LevelArrays([rec]).tokens_in_window(20.0, 30.0, np.ones(1, bool)) == 0


def test_level_key():
    assert level_key({"mode": "rate", "level": 2}) == ("rate", 2.0)
    assert level_key({}) == ("concurrency", 0.0)


def test_meets_request_slo():
    slo = {"ttft_p95": 500.0, "queue_p95": 100.0, "error_rate": 0.01}
    assert meets_request_slo({"ok": True, "ttft_ms": 500.0, "queue_ms": 100.0}, slo)   # at the limit passes
    assert not meets_request_slo({"ok": True, "ttft_ms": 500.1}, slo)
    assert not meets_request_slo({"ok": True, "ttft_ms": 10.0, "queue_ms": 150.0}, slo)
    assert meets_request_slo({"ok": True}, slo)                  # a missing latency does not fail the request
    assert not meets_request_slo({"ok": False, "ttft_ms": 1.0}, slo)


def _level_records() -> list[dict]:
    """One repeat, measured window [0, 10) s."""
    return [
        # tokens at 2, 3, 4, 5 s; ends at 5 s
        {"start_s": 1.0, "ttft_ms": 1000.0, "itl_ms": [1000.0] * 3, "tpot_ms": 1000.0, "e2e_ms": 4000.0,
         "output_tokens": 4, "ok": True},
        # tokens at 5, 7, 9 s; ends at 9 s; TTFT over the SLO
        {"start_s": 2.0, "ttft_ms": 3000.0, "itl_ms": [2000.0] * 2, "tpot_ms": 2000.0, "e2e_ms": 7000.0,
         "output_tokens": 3, "ok": True},
        # tokens at 9 and 11 s: one inside the window; ends at 11 s, after the window
        {"start_s": 8.0, "ttft_ms": 1000.0, "itl_ms": [2000.0], "tpot_ms": 2000.0, "e2e_ms": 3000.0,
         "output_tokens": 2, "ok": True},
        {"start_s": 3.0, "ok": False, "error": "timeout"},
        {"start_s": 4.0, "ok": False, "error": "cancelled"},
    ]


def test_summarize_level_by_hand():
    s = summarize_level(_level_records(), {0: (0.0, 10.0)}, slo={"ttft_p95": 2000.0})
    assert (s["requests"], s["ok"], s["errors"], s["cancelled"]) == (4, 3, 1, 1)   # cancelled is not judged
    assert s["error_classes"] == {"timeout": 1} and s["error_rate"] == 0.25
    assert s["output_tok_s"] == pytest.approx((4 + 3 + 1) / 10)
    assert s["goodput_tok_s"] == pytest.approx((4 + 1) / 10)    # the 3000 ms TTFT request is not good
    assert s["request_s"] == pytest.approx(2 / 10)             # completions inside the window: at 5 s and 9 s
    assert s["in_flight_mean"] == pytest.approx((4 + 7 + 2) / 10)  # busy seconds inside the window / 10 s
    assert s["output_tokens_mean"] == 3.0
    assert s["ttft_ms"] == {"p50": 1000.0, "p90": 2600.0, "p95": 2800.0, "p99": 2960.0, "mean": 1666.667}
    assert s["tpot_ms"]["p50"] == 2000.0
    assert s["itl_ms"]["p50"] == 1500.0 and s["itl_ms"]["mean"] == 1500.0  # 1000 ×3, 2000 ×3
    assert s["queue_ms"]["p95"] is None
    assert s["output_tok_s_repeats"] == [0.8]
    # fewer than 5 samples: no interval for the p95s; one repeat: none for the throughput
    assert s["ci95"] == {"ttft_p95_ms": None, "tpot_p95_ms": None, "output_tok_s": None, "goodput_tok_s": None}


def test_summarize_level_takes_the_median_over_repeats():
    recs = [{"start_s": 0.0, "ttft_ms": 1000.0, "itl_ms": [1000.0] * 9, "ok": True, "repeat": 0, "output_tokens": 10},
            {"start_s": 100.0, "ttft_ms": 1000.0, "itl_ms": [1000.0] * 4, "ok": True, "repeat": 1, "output_tokens": 5},
            {"start_s": 200.0, "ttft_ms": 1000.0, "ok": True, "repeat": 2, "output_tokens": 1, "e2e_ms": 1000.0}]
    s = summarize_level(recs, {0: (0.0, 20.0), 1: (100.0, 120.0), 2: (200.0, 220.0)})
    assert s["output_tok_s_repeats"] == [0.5, 0.25, 0.05]
    assert s["output_tok_s"] == 0.25
    lo, hi = s["ci95"]["output_tok_s"]
    assert 0.05 <= lo <= 0.25 <= hi <= 0.5


def test_repeats_ci():
    assert repeats_ci([3.0]) is None and repeats_ci([]) is None
    assert repeats_ci([5.0, 5.0, 5.0]) == [5.0, 5.0]
    # two repeats: a resample's median is 0 (¼), 5 (½) or 10 (¼), so the 2.5/97.5 percentiles are the extremes
    assert repeats_ci([0.0, 10.0]) == [0.0, 10.0]
    assert repeats_ci([1.0, 2.0, 7.0], seed=3) == repeats_ci([1.0, 2.0, 7.0], seed=3)   # a fixed seed repeats


def _ttft_arrays(values: list[float]) -> tuple[LevelArrays, np.ndarray]:
    a = LevelArrays([{"start_s": 0.0, "ttft_ms": v, "tpot_ms": 10.0, "ok": True} for v in values])
    return a, np.ones(len(values), bool)


def test_bootstrap_ci_needs_five_samples():
    a, ok = _ttft_arrays([100.0] * 4)
    assert bootstrap_ci(a, ok, {0: (0.0, 1.0)}) == {"ttft_p95_ms": None, "tpot_p95_ms": None}
    a, ok = _ttft_arrays([100.0] * 5)
    assert bootstrap_ci(a, ok, {0: (0.0, 1.0)}) == {"ttft_p95_ms": [100.0, 100.0], "tpot_p95_ms": [10.0, 10.0]}


def test_bootstrap_ci_resamples_with_a_fixed_seed():
    a, ok = _ttft_arrays([float(v) for v in range(1, 101)])
    ci = bootstrap_ci(a, ok, {0: (0.0, 1.0)})["ttft_p95_ms"]
    assert ci == bootstrap_ci(a, ok, {0: (0.0, 1.0)})["ttft_p95_ms"]        # seed 0 by default
    assert ci[0] < 95.05 < ci[1] <= 100.0                                    # contains the sample p95


def test_bootstrap_ci_order_statistics_for_large_samples():
    # n = 3000 > 2000: ranks n·0.95 ∓ 1.96·√(n·0.95·0.05) = 2850 ∓ 23.40 → floor 2826, ceil 2874 (0-based)
    a, ok = _ttft_arrays([float(v) for v in range(1, 3001)])
    assert bootstrap_ci(a, ok, {0: (0.0, 1.0)})["ttft_p95_ms"] == [2827.0, 2875.0]


def test_check_slo_missing_data_fails():
    level = {"error_rate": 0.02, "ttft_ms": {"p95": 600.0}, "tpot_ms": {"p95": 80.0}}
    slo = {"ttft_p95": 500.0, "tpot_p95": 80.0, "error_rate": 0.01, "e2e_p99": 1000.0}
    assert check_slo(level, slo) == ["ttft_p95", "error_rate", "e2e_p99"]
    assert check_slo(level | {"error_rate": 0.01, "ttft_ms": {"p95": 500.0}}, {"ttft_p95": 500.0,
                                                                               "error_rate": 0.01}) == []


def test_vectorised_tokens_match_the_per_record_definition_on_random_requests():
    """The closed form (requests without ITLs) and the per-record count agree for windows anywhere around them."""
    rng = np.random.default_rng(7)
    recs = []
    for _ in range(300):
        n = int(rng.integers(1, 40))
        ttft = float(rng.uniform(1, 900))
        recs.append({"start_s": float(rng.uniform(0, 50)), "ttft_ms": ttft, "output_tokens": n, "ok": True,
                     "e2e_ms": ttft + float(rng.uniform(0, 5000)) * (n > 1)})
    arrays = LevelArrays(recs)
    for _ in range(50):
        t0 = float(rng.uniform(-5, 60))
        t1 = t0 + float(rng.uniform(0.1, 30))
        expected = sum(tokens_in_window(r, t0, t1) for r in recs)
        assert arrays.tokens_in_window(t0, t1, np.ones(len(recs), bool)) == expected
