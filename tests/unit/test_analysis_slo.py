"""SLO specs, and what a mean or another percentile can still tell about an SLO on a given percentile."""

from __future__ import annotations

import pytest

from kvcap.analysis.slo import format_slo, judge_statistic, parse_slo, percentile_limits, percentile_number
from kvcap.errors import InputError


def test_parse_slo():
    assert parse_slo("ttft_p95=500ms, tpot_p95=0.08s,error_rate=1%") == {
        "ttft_p95": 500.0, "tpot_p95": 80.0, "error_rate": 0.01}
    assert parse_slo({"e2e_p99": "30s", "queue_p50": "250us"}) == {"e2e_p99": 30000.0, "queue_p50": 0.25}
    assert parse_slo(None) == {} and parse_slo("") == {}


@pytest.mark.parametrize(("spec", "words"), [
    ("ttft_p95=500", "needs a unit"), ("ttft_p95", "needs a value"), ("ttft_p97=1s", "unknown SLO key"),
    ("goodput=1", "unknown SLO key"), ("error_rate=2", "between 0 and 1"),
])
def test_parse_slo_errors(spec, words):
    with pytest.raises(InputError, match=words):
        parse_slo(spec)


def test_format_slo():
    assert format_slo({"ttft_p95": 500.0, "error_rate": 0.01}) == "ttft_p95 ≤ 500 ms, error_rate ≤ 1.00%"


def test_percentile_limits():
    slo = {"ttft_p95": 500.0, "itl_p99": 90.0, "tpot_p95": 80.0, "error_rate": 0.01, "e2e_p50": 9000.0}
    assert percentile_limits(slo, "tpot") == [("itl_p99", "p99", 90.0), ("tpot_p95", "p95", 80.0)]  # itl is tpot
    assert percentile_limits(slo, "ttft") == [("ttft_p95", "p95", 500.0)]
    assert percentile_limits(slo, "queue") == []


def test_percentile_number():
    assert percentile_number("p95") == 95 and percentile_number("p50") == 50
    assert percentile_number("mean") is None and percentile_number("") is None and percentile_number("p999") is None


@pytest.mark.parametrize(("value", "bound", "stat", "slo_stat", "verdict"), [
    (600.0, None, "p95", "p95", "fail"), (400.0, None, "p95", "p95", "pass"), (500.0, None, "p95", "p95", "pass"),
    (600.0, None, "", "p95", "fail"),            # unlabelled: read as the SLO's own statistic
    (600.0, None, "p50", "p95", "fail"),         # the median already over → the p95 is over too
    (400.0, None, "p50", "p95", "unknown"),      # the median under says nothing about the p95
    (400.0, None, "p99", "p95", "pass"),         # the p99 under → the p95 is under too
    (600.0, None, "p99", "p95", "unknown"),
    (600.0, None, "mean", "p95", "fail"),        # the mean over → (barring outliers) the p90+ is over
    (600.0, None, "mean", "p50", "unknown"),     # not so for the median
    (400.0, None, "mean", "p95", "unknown"),
    (900.0, "lower", "p95", "p95", "fail"),      # '>900' over 500 fails
    (400.0, "lower", "p95", "p95", "unknown"),   # '>400' may be anything above
    (900.0, "upper", "p95", "p95", "unknown"),   # '<900' may be under 500
    (400.0, "upper", "p95", "p95", "pass"),
    (600.0, None, "max", "p95", "unknown"),      # a statistic it cannot place
])
def test_judge_statistic(value, bound, stat, slo_stat, verdict):
    assert judge_statistic(value, bound, stat, slo_stat, 500.0)[0] == verdict


def test_judge_statistic_says_why():
    assert judge_statistic(600.0, None, "p95", "p95", 500.0) == ("fail", "")
    assert judge_statistic(600.0, None, "", "p95", 500.0) == ("fail", "unlabelled, read as the p95")
    assert judge_statistic(600.0, None, "p50", "p95", 500.0) == (
        "fail", "the table gives the p50, the SLO is on the p95")
