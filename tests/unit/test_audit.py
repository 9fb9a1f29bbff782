"""`audit_table` against hand-computed values: the article's table checked by its own arithmetic.

Closed loop at concurrency C: E2E = N·C/T and E2E = TTFT + (N−1)·TPOT, so a table with throughput and TTFT
already fixes the mean TPOT. The article's table (8/16/24 streams, 97/140/148 tok/s, 256 output tokens) then
implies 81.8 / 113 / ≤159 ms, over its own 80 ms SLO even at the VRAM-only control.
"""

from __future__ import annotations

import json
import math

import pytest

from kvcap.analysis.slo import parse_slo
from kvcap.audit.across_levels import audit_table
from kvcap.audit.table import read_table
from kvcap.plan import plan, resolve
from kvcap.specs.scenario import load_scenario
from tests.conftest import ROOT

ARTICLE = ROOT / "tests" / "data" / "article_table.csv"
SLO = parse_slo("ttft_p95=500ms,tpot_p95=80ms")


def implied_tpot_ms(tok_s: float, conc: float, n: int, ttft_ms: float) -> float:
    """E2E = N / (T/C); TPOT = (E2E − TTFT)/(N − 1)."""
    return (n / (tok_s / conc) - ttft_ms / 1e3) / (n - 1) * 1e3


def article_plan(model: str, input_tokens: int = 1024):
    return plan(resolve(load_scenario(None, {
        "model.preset": model, "cluster.gpu.preset": "rtx4090", "cluster.nodes": 4,
        "workload.input_tokens": input_tokens, "workload.output_tokens": 256})))


def find(result: dict, check: str, level=None) -> dict:
    hits = [f for f in result["findings"] if f["check"] == check and f["level"] == level]
    assert len(hits) == 1, (check, level, [(f["check"], f["level"]) for f in result["findings"]])
    return hits[0]


@pytest.fixture(scope="module")
def article() -> dict:
    return audit_table(read_table(ARTICLE), output_tokens=256, input_tokens=1024, slo=SLO,
                       plan=article_plan("llama-3.1-8b"), claimed_effective=16)


def test_implied_tpot_matches_the_formula(article):
    by_level = {lv["level"]: lv for lv in article["levels"]}
    for level, tok_s, ttft in ((8, 97, 250), (16, 140, 430), (24, 148, 900)):
        lv = by_level[level]
        assert lv["per_stream_tok_s"] == pytest.approx(tok_s / level, abs=1e-4)
        assert lv["implied_e2e_s"] == pytest.approx(256 / (tok_s / level), abs=1e-4)
        assert lv["implied_tpot_ms"] == pytest.approx(implied_tpot_ms(tok_s, level, 256, ttft), abs=1e-3)
    assert by_level[8]["implied_tpot_ms"] == pytest.approx(81.82, abs=0.01)   # (256/12.125 − 0.25)/255 s
    assert by_level[16]["implied_tpot_ms"] == pytest.approx(113.05, abs=0.01)
    assert by_level[24]["implied_tpot_ms"] == pytest.approx(159.27, abs=0.01)
    assert by_level[24]["ms_per_token"] == pytest.approx(1000 / (148 / 24), abs=1e-3)  # ≈ 162 ms
    # '>900' TTFT is a lower bound, so the TPOT derived from it is an upper bound
    assert by_level[24]["implied_tpot_bound"] == "upper"
    assert by_level[8]["implied_tpot_bound"] is None


def test_implied_tpot_breaks_the_slo_even_at_the_control(article):
    f8, f16, f24 = (find(article, "implied_tpot", lv) for lv in (8, 16, 24))
    assert f8["severity"] == "error" and f16["severity"] == "error"
    assert f8["implied_tpot_ms"] > 80 and f8["slo_key"] == "tpot_p95"
    assert f24["severity"] == "warn"          # only an upper bound: undecidable on TPOT alone…
    assert "cannot meet both" in f24["message"]  # …but TPOT ≤ 80 would need TTFT ≥ 21 s
    assert f24["ttft_ms_needed_for_tpot_slo"] == pytest.approx(256 / (148 / 24) * 1e3 - 255 * 80, abs=0.1)
    assert "81.8" in f8["message"] and "cap" in f8["message"]


def test_max_mean_output_for_slo(article):
    for level, tok_s, ttft in ((8, 97, 250), (16, 140, 430)):
        f = find(article, "implied_tpot", level)
        ms_tok = 1000 / (tok_s / level)
        expected = math.floor((ttft - 80) / (ms_tok - 80))
        assert f["max_mean_output_tokens_for_slo"] == expected
        n = expected
        assert implied_tpot_ms(tok_s, level, n, ttft) <= 80 < implied_tpot_ms(tok_s, level, n + 1, ttft)
    assert find(article, "implied_tpot", 8)["max_mean_output_tokens_for_slo"] == 68
    assert find(article, "implied_tpot", 16)["max_mean_output_tokens_for_slo"] == 10
    # throughput that 256-token requests at TPOT = 80 ms would give: C·N / (TTFT + 255·0.08)
    assert find(article, "implied_tpot", 8)["required_output_tok_s_for_slo"] == pytest.approx(
        8 * 256 / (0.25 + 255 * 0.08), abs=0.01)


def test_scaling_efficiency(article):
    s16, s24 = find(article, "scaling", 16), find(article, "scaling", 24)
    assert s16["scaling_efficiency"] == pytest.approx((140 / 97 - 1) / 1.0, abs=1e-4)
    assert s16["scaling_efficiency"] == pytest.approx(0.443, abs=1e-3)
    assert s24["scaling_efficiency"] == pytest.approx((148 / 140 - 1) / 0.5, abs=1e-4)
    assert s24["scaling_efficiency"] == pytest.approx(0.114, abs=1e-3)
    assert s24["marginal_tok_s_per_stream"] == pytest.approx(1.0)
    assert s16["severity"] == s24["severity"] == "warn"   # sub-linear, but above the 0.1 floor
    assert "crosses arms" in s16["message"] and "crosses arms" not in s24["message"]


def test_scaling_below_floor_fails_condition_a():
    rows = [{"concurrency": 16, "output_tok_s": 140}, {"concurrency": 32, "output_tok_s": 145}]
    r = audit_table(rows, output_tokens=None)
    f = find(r, "scaling", 32)
    assert f["scaling_efficiency"] == pytest.approx((145 / 140 - 1) / 1.0, abs=1e-4)
    assert f["severity"] == "error" and "no longer grows" in f["message"]
    assert r["effective"]["level"] == 16 and r["effective"]["stress_limit"] == 32


def test_littles_law(article):
    f = find(article, "littles_law", 8)
    assert f["request_s"] == pytest.approx(97 / 256, abs=1e-4)
    assert f["little_ratio"] == pytest.approx(1.0) and "identity" in f["message"]
    # at the SLO's TPOT each request takes TTFT + 255·80 ms: the table's request rate keeps fewer in flight
    assert f["in_flight_within_slo"] == pytest.approx(97 / 256 * (0.25 + 255 * 0.08), abs=1e-3)
    assert find(article, "littles_law", 16)["in_flight_within_slo"] == pytest.approx(140 / 256 * 20.83, abs=1e-3)


def test_littles_law_with_measured_rate_and_e2e():
    ok = audit_table([{"concurrency": 8, "output_tok_s": 97, "request_s": 0.379, "e2e_ms": 21100}],
                     output_tokens=256)
    f = find(ok, "littles_law", 8)
    assert f["little_ratio"] == pytest.approx(0.379 * 21.1 / 8, abs=1e-4)
    assert f["severity"] == "info"
    bad = audit_table([{"concurrency": 8, "output_tok_s": 97, "e2e_ms": 12000}], output_tokens=256)
    f = find(bad, "littles_law", 8)
    assert f["little_ratio"] == pytest.approx(97 / 256 * 12 / 8, abs=1e-4)
    assert f["severity"] == "warn" and "idled" in f["message"]
    # a measured request rate with a known length tests λ·N = T; the rate alone only gives the length (identity)
    real = audit_table([{"concurrency": 8, "output_tok_s": 97, "request_s": 0.2, "output_tokens": 256}],
                       output_tokens=None)
    f = find(real, "littles_law", 8)
    assert f["little_ratio"] == pytest.approx(0.2 * (256 * 8 / 97) / 8, abs=1e-4) and f["severity"] == "warn"
    ident = audit_table([{"concurrency": 8, "output_tok_s": 97, "request_s": 0.2}], output_tokens=None)
    assert "identity" in find(ident, "littles_law", 8)["message"]


def test_request_rate_reveals_mean_output_length():
    r = audit_table([{"concurrency": 8, "output_tok_s": 97, "ttft_ms": 250, "request_s": 97 / 60}],
                    output_tokens=256, slo=SLO)
    assert find(r, "output_length", 8)["mean_output_tokens"] == pytest.approx(60)
    lv = r["levels"][0]
    assert lv["output_tokens_source"] == "request_s"
    assert lv["implied_tpot_ms"] == pytest.approx(implied_tpot_ms(97, 8, 60, 250), abs=1e-3)
    assert find(r, "implied_tpot", 8)["severity"] == "info"   # ≤ 68 tokens: within 80 ms


def test_ttft_against_slo(article):
    assert find(article, "ttft_slo", 8)["severity"] == "info"
    assert find(article, "ttft_slo", 16)["severity"] == "info"
    f = find(article, "ttft_slo", 24)
    assert f["severity"] == "error" and f["value_bound"] == "lower" and "lower bound" in f["message"]
    assert "read as the p95" in find(article, "ttft_slo", 8)["message"]


def test_percentile_labels_decide_what_can_be_concluded():
    rows = [{"concurrency": 1, "output_tok_s": 50, "ttft_p50_ms": 600},    # median over → p95 over
            {"concurrency": 2, "output_tok_s": 90, "ttft_p99_ms": 400},    # p99 under → p95 under
            {"concurrency": 4, "output_tok_s": 160, "ttft_p50_ms": 400}]   # median under: cannot tell
    r = audit_table(rows, output_tokens=None, slo={"ttft_p95": 500.0})
    assert [find(r, "ttft_slo", c)["severity"] for c in (1, 2, 4)] == ["error", "info", "warn"]


def test_table_tpot_consistency():
    good = audit_table([{"concurrency": 8, "output_tok_s": 97, "ttft_ms": 250, "tpot_ms": 82}],
                       output_tokens=256, slo=SLO)
    assert find(good, "tpot_consistency", 8)["severity"] == "info"
    bad = audit_table([{"concurrency": 8, "output_tok_s": 97, "ttft_ms": 250, "tpot_ms": 40}],
                      output_tokens=256, slo=SLO)
    f = find(bad, "tpot_consistency", 8)
    assert f["severity"] == "warn" and f["relative_difference"] == pytest.approx(40 / 81.8173 - 1, abs=1e-3)
    assert find(bad, "tpot_slo", 8)["severity"] == "info"       # the table's own TPOT passes…
    assert find(bad, "implied_tpot", 8)["severity"] == "error"  # …its throughput says otherwise


def test_effective_capacity_and_the_claim(article):
    eff = article["effective"]
    assert eff["level"] is None                     # 8 already fails the implied TPOT
    assert eff["first_failing_level"] == 8 and eff["limited_by"] == ["implied_tpot"]
    assert eff["without_implied_tpot"] == 16        # the article's 16 follows from TTFT alone
    assert eff["stress_limit"] == 24
    f = find(article, "effective_capacity")
    assert f["severity"] == "error" and "not supported" in f["message"]
    assert [lv["passes"] for lv in article["levels"]] == [False, False, False]
    assert article["levels"][2]["failed_checks"] == ["ttft_slo"]
    assert "effective capacity" in article["summary"]
    json.dumps(article)  # the CLI's --json prints it as is


def test_without_slo_only_scaling_limits():
    r = audit_table(read_table(ARTICLE), output_tokens=256)
    assert r["effective"]["level"] == 24
    assert find(r, "implied_tpot", 8)["severity"] == "info"


def test_vram_bound_gqa_8b():
    r = audit_table(read_table(ARTICLE), output_tokens=256, input_tokens=1024, slo=SLO,
                    plan=article_plan("llama-3.1-8b"))
    f = find(r, "vram_bound", 8)
    assert f["hbm_requests"] == 128 and f["hbm_requests_per_gpu"] == 32
    assert f["attention"] == "GQA" and f["control_concurrency"] == 8
    assert f["severity"] == "warn" and "not VRAM-bound" in f["message"] and "nothing to spill" in f["message"]
    p = article_plan("llama-3.1-8b")
    assert f["vram_bound_above_tokens"] == p.kv_tokens_per_gpu // 2 // 16 * 16   # 2 streams per GPU
    assert 20_000 < f["vram_bound_above_tokens"] < 21_000


def test_vram_bound_mha_7b():
    p = article_plan("llama-2-7b")
    r = audit_table(read_table(ARTICLE), output_tokens=256, slo=SLO, plan=p)
    f = find(r, "vram_bound", 8)
    assert f["attention"] == "MHA" and f["hbm_requests"] == 48 == p.resident_requests["hbm"]
    assert f["severity"] == "warn"                   # still 12 per GPU > 2 at 1280 tokens
    assert f["vram_bound_above_tokens"] == p.kv_tokens_per_gpu // 2 // 16 * 16
    assert f["vram_bound_above_tokens"] < 8_000      # 4× smaller than the GQA model's
    assert f["model_context"] == 4096 and "context" in f["message"]


def test_vram_bound_when_control_fills_hbm():
    p = article_plan("llama-2-7b", input_tokens=4096)   # 4352 tokens: 3 per GPU, 12 in all
    rows = [{"arm": "control", "concurrency": 12, "output_tok_s": 120},
            {"arm": "spill", "concurrency": 24, "output_tok_s": 150}]
    f = find(audit_table(rows, output_tokens=256, plan=p), "vram_bound", 12)
    assert p.resident_requests["hbm"] == 12
    assert f["severity"] == "info" and "consistent" in f["message"]


def test_arms_sharing_levels_scale_separately():
    rows = [{"arm": "A", "concurrency": 8, "output_tok_s": 97}, {"arm": "A", "concurrency": 16, "output_tok_s": 99},
            {"arm": "B", "concurrency": 8, "output_tok_s": 96}, {"arm": "B", "concurrency": 16, "output_tok_s": 140}]
    r = audit_table(rows, output_tokens=None)
    effs = {(f["arm"], f["level"]): f["scaling_efficiency"] for f in r["findings"] if f["check"] == "scaling"}
    assert effs == {("A", 16): pytest.approx(99 / 97 - 1, abs=1e-4), ("B", 16): pytest.approx(140 / 96 - 1, abs=1e-4)}
    assert r["effective"]["by_arm"] == {"A": 8, "B": 16}


def test_units_and_annotations_in_cells(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("Concurrency,Output tok/s,TTFT (ms)\n8,97 tok/s,250 ms\n16,140 (+44%),0.43s\n", encoding="utf-8")
    r = audit_table(read_table(path), output_tokens=256, slo=SLO)
    lv = {x["level"]: x for x in r["levels"]}
    assert lv[16]["output_tok_s"] == 140 and lv[16]["ttft_ms"] == pytest.approx(430)
    assert lv[16]["implied_tpot_ms"] == pytest.approx(implied_tpot_ms(140, 16, 256, 430), abs=1e-3)


def test_no_output_tokens():
    r = audit_table([{"concurrency": 8, "output_tok_s": 97, "ttft_ms": 250}], output_tokens=None, slo=SLO)
    f = find(r, "implied_tpot", 8)
    assert f["severity"] == "info" and "--output-tokens" in f["message"]
    assert not [x for x in r["findings"] if x["check"] == "littles_law"]
