"""Prefix reuse in the judgement: the prefill-recompute bound against the park-only KV bound, the tier-hit evidence
and the idle-tier warning of ``compare``, and the figure read from server counters.

Levels are hand-made summaries (p50 TTFT/TPOT in ms) with a ``prefix_reuse`` figure; the thresholds are the
diagnosis module's (``REUSE_SHARE``, ``SHORT_FRACTION``, ``DECLARED_SHORT``).
"""

from __future__ import annotations

import json
import shutil

from kvcap.analysis.diagnosis import PARK_ONLY, RECOMPUTE, diagnose
from kvcap.analysis.effect import TierHits, idle_tier_warning, tier_evidence, tier_took_effect
from kvcap.analysis.prefix_reuse import figure, from_counters
from kvcap.analysis.summary import build_summary
from kvcap.analysis.telemetry import Telemetry
from kvcap.analysis.telemetry_figures import TelemetryFigures
from kvcap.rundir import RunDir
from kvcap.rundir.manifest import Manifest
from kvcap.rundir.summary import LevelSummary
from tests.conftest import ROOT
from tests.summaries import summary_of

_EMPTY = {"p50": None, "p90": None, "p95": None, "p99": None, "mean": None}
PROMPT = 100_000


def lv(c: float, ttft: float, tpot: float, hbm: float | None = None, tier: float | None = None,
       source: str = "records", **extra) -> LevelSummary:
    """A summary level; ``hbm``/``tier``: the shares of its prompt tokens served from each cache (no figure
    when both are None)."""
    data = {"mode": "concurrency", "level": c, "requests": 100, "ok": 100, "errors": 0, "cancelled": 0,
            "error_classes": {}, "output_tok_s": 0.0, "goodput_tok_s": 0.0, "ttft_ms": _EMPTY | {"p50": ttft},
            "tpot_ms": _EMPTY | {"p50": tpot}, "slo_ok": True, "failed_checks": [], **extra}
    if hbm is not None or tier is not None:
        data["prefix_reuse"] = figure(source, PROMPT, None if hbm is None else hbm * PROMPT,
                                      None if tier is None else tier * PROMPT).to_json()
    return LevelSummary.model_validate(data)



def test_prefill_recompute_when_hits_fall_as_queues_grow():
    levels = [lv(1, 100.0, 20.0, hbm=0.6), lv(8, 150.0, 21.0, hbm=0.55),
              lv(16, 900.0, 30.0, hbm=0.1, server_waiting_mean=3.0)]
    f = diagnose(levels, "control")
    assert [x.bound for x in f] == ["prefill_recompute"]
    assert f[0].evidence == ("from c=16 requests queue (server waiting 3.0 on average) while the prompt tokens "
                             "served from a cache fall from 60% at c=1 to 10% (10% HBM prefix cache of 100,000 "
                             "prompt tokens)")
    assert f[0].direction == RECOMPUTE
    assert f[0].direction.startswith("prefill recompute bounds this level — a prefix tier can help")


def test_a_tier_that_keeps_the_hits_is_no_recompute():
    # the same load with a tier: the cached share holds (HBM hits fall, tier hits make up for them)
    levels = [lv(1, 100.0, 20.0, hbm=0.6, tier=0.0), lv(8, 150.0, 21.0, hbm=0.5, tier=0.05),
              lv(16, 900.0, 21.0, hbm=0.1, tier=0.45, server_waiting_mean=3.0)]
    f = diagnose(levels, "treatment")
    assert "prefill_recompute" not in [x.bound for x in f]
    assert [x.bound for x in f] == ["kv_capacity"] and f[0].direction != PARK_ONLY  # reuse exists: not park-only


def test_declared_shared_prefixes_with_few_hits_is_recompute():
    # server counters: queries >> hits from the first level, prompts share prefixes per the manifest
    levels = [lv(1, 100.0, 20.0, hbm=0.05, source="telemetry"),
              lv(8, 900.0, 21.0, hbm=0.04, tier=0.0, source="telemetry", server_waiting_mean=2.0)]
    f = diagnose(levels, "control", shared_prefixes=True)
    assert [x.bound for x in f] == ["prefill_recompute"]
    assert f[0].evidence == ("from c=8 requests queue (server waiting 2.0 on average) while the workload shares "
                             "prefixes and only 4% of prompt tokens are served from a cache (4% HBM prefix cache, "
                             "0% tier of 100,000 prompt tokens)")
    # the same figures without declared sharing: no reuse anywhere, so the KV bound says a tier can only park
    g = diagnose(levels, "control")
    assert [x.bound for x in g] == ["kv_capacity"] and g[0].direction == PARK_ONLY


def test_kv_full_without_reuse_is_park_only():
    levels = [lv(1, 100.0, 20.0, hbm=0.0, tier=0.0),
              lv(48, 2000.0, 21.0, hbm=0.01, tier=0.0, kv_usage_max=0.97, server_waiting_mean=1.0,
                 server_parked_mean=12.0)]
    f = diagnose(levels, "treatment")
    assert [x.bound for x in f] == ["kv_capacity"]
    assert f[0].direction.startswith("decode KV capacity bounds it — a tier can only park")
    assert "12.0 parked in a lower tier" in f[0].evidence


def test_without_reuse_figures_the_kv_bound_reads_as_before():
    levels = [lv(1, 100.0, 20.0), lv(48, 2000.0, 21.0, kv_usage_max=0.97, server_waiting_mean=1.0,
                                      server_parked_mean=12.0)]
    f = diagnose(levels, "treatment")
    assert [x.bound for x in f] == ["kv_capacity"]
    assert f[0].direction.startswith("the offload tier holds the extra requests but only HBM-resident ones decode")


def _manifest(offload: str) -> Manifest:
    return Manifest.model_validate({"source": "sim", "run_id": "0" * 12, "started_at": 0.0,
                                    "fixed": {"serving.kv_offload": offload}})


def test_tier_hits_are_the_treatments_evidence_with_numbers():
    control = TierHits.of(summary_of(lv(1, 100.0, 20.0, hbm=0.3, tier=0.0), lv(8, 100.0, 20.0, hbm=0.2, tier=0.0)),
                          records_hit_nothing=False)
    treatment = TierHits.of(summary_of(lv(1, 100.0, 20.0, hbm=0.3, tier=0.1), lv(8, 100.0, 20.0, hbm=0.2, tier=0.2)),
                            records_hit_nothing=False)
    assert tier_took_effect(control, treatment) is True
    assert tier_took_effect(treatment, control) is False
    assert tier_evidence(control, treatment) == (
        "more prompt tokens loaded from a lower tier: 30,000 tier-hit tokens in the treatment (15.0% of 200,000 "
        "prompt tokens) vs 0 in the control (0.0% of 200,000 prompt tokens), from the measured requests' records")
    unknown = TierHits.of(summary_of(lv(1, 100.0, 20.0)), records_hit_nothing=False)
    assert tier_took_effect(unknown, treatment) is None  # no figure, records silent: cannot tell
    zero = TierHits.of(summary_of(lv(1, 100.0, 20.0)), records_hit_nothing=True)
    assert tier_took_effect(zero, treatment) is True and zero.total() == (0.0, 0.0)


def test_a_tier_turned_on_with_no_hit_tokens_is_a_warning():
    zero = TierHits.of(summary_of(lv(1, 100.0, 20.0)), records_hit_nothing=True)
    w = idle_tier_warning(_manifest("remote"), zero)
    assert w is not None and w.startswith("tier on, no hit tokens: it cannot have saved work")
    assert "serving.kv_offload=remote" in w
    assert idle_tier_warning(_manifest("none"), zero) is None  # no tier turned on
    hit = TierHits.of(summary_of(lv(1, 100.0, 20.0, hbm=0.1, tier=0.01)), records_hit_nothing=False)
    assert idle_tier_warning(_manifest("remote"), hit) is None  # it served some
    unknown = TierHits.of(summary_of(lv(1, 100.0, 20.0)), records_hit_nothing=False)
    assert idle_tier_warning(_manifest("remote"), unknown) is None  # unknown is not zero
    # a connector the server's counters show, with no token from it, on a scenario that says nothing of tiers
    seen = TierHits.of(summary_of(lv(1, 100.0, 20.0, hbm=0.1, tier=0.0, source="telemetry")), False)
    w = idle_tier_warning(_manifest("none"), seen)
    assert w is not None and "the server's offload counters" in w


def test_counters_give_the_figure_summed_over_replicas():
    rows = []
    for replica, (queries, hits, ext) in enumerate(((1000, 400, 100), (3000, 600, 300))):
        for t, k in ((0.0, 0), (5.0, 1), (10.0, 2)):  # each counter grows by its amount every 5 s
            labels = {"replica": str(replica)}
            rows += [{"t_s": t, "source": "metrics:x", "name": name, "labels": labels, "value": 7.0 + k * v}
                     for name, v in (("server.prefix_cache_queries_total", queries),
                                     ("server.prefix_cache_hits_total", hits),
                                     ("server.offload_prefix_hits_total", ext),
                                     ("server.offload_prefix_queries_total", queries - hits))]
    figures = TelemetryFigures([(0.0, 10.0), (5.0, 10.0)])
    figures.add(Telemetry(rows))
    whole = from_counters(figures.increases(0))
    assert whole is not None and whole.to_json() == {
        "source": "telemetry", "prompt_tokens": 8000, "hbm_hit_tokens": 2000, "tier_hit_tokens": 800,
        "tier_query_tokens": 6000, "hbm_hit_rate": 0.25, "tier_hit_rate": 0.1}
    half = from_counters(figures.increases(1))
    assert half is not None and half.prompt_tokens == 4000 and half.tier_hit_tokens == 400
    assert from_counters({"server.prompt_tokens_total": 10.0}) is None  # no prefix or tier counter: no figure


def test_a_real_servers_counters_give_the_figure_and_the_recompute_bound(tmp_path):
    """A bench run (a fake vLLM's) with prefix-cache counters added: prompts share prefixes (the manifest's prefix
    groups); the hits are 60% of the queried tokens at c=2 and 5% at c=4, where requests wait."""
    run = tmp_path / "bench"
    shutil.copytree(ROOT / "tests" / "data" / "summary_golden" / "bench", run)
    (run / "summary.expected.json").unlink()
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["fixed"]["workload.prefix_groups"] = 4
    (run / "manifest.json").write_text(json.dumps(manifest))
    labels = {"model_name": "fake-model", "node": "n0", "engine": "vllm"}
    rows, queries, hits = [], 0.0, 0.0
    windows = {2: (1.023254, 2.913911), 4: (4.924492, 5.608173)}  # repeat 0's measured windows (levels.jsonl)
    for c, (t0, t1) in windows.items():
        for k in range(11):
            t = round(t0 + (t1 - t0) * k / 10, 6)
            rows.append({"t_s": t, "source": "metrics:x", "name": "server.prefix_cache_queries_total",
                         "labels": labels, "value": queries})
            rows.append({"t_s": t, "source": "metrics:x", "name": "server.prefix_cache_hits_total",
                         "labels": labels, "value": hits})
            rows.append({"t_s": t, "source": "metrics:x", "name": "server.requests_waiting",
                         "labels": {**labels, "raw": "extra"}, "value": 3.0 if c == 4 else 0.0})
            if k < 10:
                queries += 1000
                hits += 600 if c == 2 else 50
    with open(run / "telemetry.jsonl", "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    summary = build_summary(RunDir(run))
    reuse = [lv.prefix_reuse for lv in summary.levels]
    assert [r.to_json() if r else None for r in reuse] == [
        {"source": "telemetry", "prompt_tokens": 10000, "hbm_hit_tokens": 6000, "tier_hit_tokens": None,
         "hbm_hit_rate": 0.6, "tier_hit_rate": None},
        {"source": "telemetry", "prompt_tokens": 10000, "hbm_hit_tokens": 500, "tier_hit_tokens": None,
         "hbm_hit_rate": 0.05, "tier_hit_rate": None}]
    found = {f.bound: f for f in summary.diagnosis}
    assert "prefill_recompute" in found and "kv_capacity" not in found and "compute" not in found
    assert "fall from 60% at c=2 to 5%" in found["prefill_recompute"].evidence


def test_the_markdown_report_shows_hit_rates_per_tier_beside_ttft():
    from kvcap.report.markdown import render_markdown_single

    text = render_markdown_single(summary_of(lv(1, 100.0, 20.0, hbm=0.3, tier=0.125), lv(8, 100.0, 20.0)))
    assert "| TTFT p95 ms | TPOT p95 ms | SLO | HBM hit % | tier hit % |" in text
    assert text.count("| 30.0% | 12.5% |") == 1 and "| – | – |" in text
    assert "hit %" not in render_markdown_single(summary_of(lv(1, 100.0, 20.0)))  # no figure: the table as before
