"""The report's hit-rate chart (issue 32): per level, the share of prompt tokens served from the HBM prefix cache
and from a lower tier, beside TTFT — drawn only where levels carry ``prefix_reuse``."""

from __future__ import annotations

import re

from kvcap.analysis.prefix_reuse import figure
from kvcap.report.data import Arm
from kvcap.report.html import render_html_single
from kvcap.report.plots import HIT_RATE_CLASS, TIER_DASH, hit_rate_chart
from kvcap.rundir.summary import LevelSummary
from tests.summaries import summary_of

_EMPTY = {"p50": None, "p90": None, "p95": None, "p99": None, "mean": None}
PROMPT = 100_000


def _level(c: int, hbm: float | None = None, tier: float | None = None) -> LevelSummary:
    data = {"mode": "concurrency", "level": c, "requests": 100, "ok": 100, "errors": 0, "cancelled": 0,
            "error_classes": {}, "output_tok_s": 10.0 * c, "goodput_tok_s": 10.0 * c,
            "ttft_ms": _EMPTY | {"p95": 100.0 * c, "p99": 120.0 * c}, "tpot_ms": _EMPTY | {"p95": 20.0},
            "slo_ok": True, "failed_checks": []}
    if hbm is not None:
        tier_tokens = None if tier is None else tier * PROMPT
        data["prefix_reuse"] = figure("records", PROMPT, hbm * PROMPT, tier_tokens).to_json()
    return LevelSummary.model_validate(data)


def _tips(svg: str, series: str) -> list[str]:
    return re.findall(rf"<circle [^>]*><title>{re.escape(series)}: ([^<]*)</title>", svg)


def test_a_run_with_prefix_reuse_plots_its_hit_rates_beside_ttft() -> None:
    page = render_html_single(summary_of(_level(4, 0.5, 0.25), _level(8, 0.4, 0.3)))
    assert page.count(f'class="{HIT_RATE_CLASS}"') == 1
    chart = page[page.index(f'class="{HIT_RATE_CLASS}"'):]
    chart = chart[: chart.index("</svg>")]
    assert _tips(chart, "HBM prefix cache") == ["c=4: 50 % (50,000 of 100,000 prompt tokens, from records)",
                                                "c=8: 40 % (40,000 of 100,000 prompt tokens, from records)"]
    assert _tips(chart, "lower tier") == ["c=4: 25 % (25,000 of 100,000 prompt tokens, from records)",
                                          "c=8: 30 % (30,000 of 100,000 prompt tokens, from records)"]
    # after the TTFT charts, before TPOT's: in the grid it lies beside TTFT
    at = page.index(HIT_RATE_CLASS)
    assert page.index("TTFT p99 vs concurrency") < at < page.index("TPOT p95 vs concurrency")


def test_a_run_without_prefix_reuse_has_no_hit_rate_chart() -> None:
    page = render_html_single(summary_of(_level(4), _level(8)))
    assert "TTFT p95 vs concurrency" in page and HIT_RATE_CLASS not in page


def test_compared_arms_each_get_an_hbm_and_a_tier_line() -> None:
    control = Arm("control", "#1f6fb4", summary_of(_level(4, 0.5), _level(8, 0.2)))
    treatment = Arm("treatment", "#e0661b", summary_of(_level(4, 0.5, 0.4), _level(8, 0.2, 0.6)))
    svg = hit_rate_chart([control, treatment], "concurrency")
    lines = re.findall(r'<polyline class="series" points="[^"]*" fill="none" stroke="([^"]*)" stroke-width="2"'
                       r'( stroke-dasharray="[^"]*")?><title>([^<]*)</title>', svg)
    # the control reports no tier: no tier line for it; a tier line is its arm's colour, dashed
    assert [(name, colour, bool(dash)) for colour, dash, name in lines] == [
        ("control HBM", "#1f6fb4", False), ("treatment HBM", "#e0661b", False),
        ("treatment tier", "#e0661b", True)]
    assert f'stroke-dasharray="{TIER_DASH}"' in svg
    assert _tips(svg, "treatment tier")[1] == "c=8: 60 % (60,000 of 100,000 prompt tokens, from records)"
    assert hit_rate_chart([control], "rate") == ""  # no level of that mode: no chart
