"""The server's own per-request ``cached_tokens``: what the client reads from a stream's last usage and timings,
the level figure the analysis makes of the records when no prefix counter speaks, and ``compare``'s evidence from
it (hand-built summaries). Older records without the field still load and get no figure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcap.analysis.effect import CACHED_MARGIN, CachedHits, TierHits, cached_took_effect, effect_signs
from kvcap.analysis.prefix_reuse import cached_figure, figure, record_cached
from kvcap.analysis.summary import build_summary
from kvcap.loadgen.client import Outcome, _handle_event, cached_tokens
from kvcap.rundir import REQUESTS, RunDir
from kvcap.rundir.summary import LevelSummary
from tests.summaries import summary_of

_EMPTY = {"p50": None, "p90": None, "p95": None, "p99": None, "mean": None}


# ------------------------------------------------------------------------------------------------- the client

@pytest.mark.parametrize(("usage", "timings", "want"), [
    ({"prompt_tokens": 41, "prompt_tokens_details": {"cached_tokens": 40}}, {"cache_n": 40}, 40),
    ({"prompt_tokens": 41, "prompt_tokens_details": {"cached_tokens": 0}}, None, 0),  # said, and nothing found
    ({"prompt_tokens": 41}, {"cache_n": 32, "prompt_n": 9}, 32),  # an older llama.cpp: timings alone
    ({"prompt_tokens": 41}, None, None),  # vLLM without --enable-prompt-tokens-details (or nothing found)
    ({"prompt_tokens": 41, "prompt_tokens_details": None}, None, None),
    ({"prompt_tokens": 41, "prompt_tokens_details": {"cached_tokens": "x"}}, {"cache_n": 7}, 7),
])
def test_the_count_is_the_usage_detail_else_llamacpps_cache_n(usage, timings, want):
    assert cached_tokens(usage, timings) == want


def test_the_stream_keeps_the_last_timings_it_saw():
    o = Outcome(t_sched=0.0)
    events = [b'data: {"choices":[{"text":"a","finish_reason":null}],"timings":{"cache_n":3}}',
              b'data: {"choices":[{"text":"","finish_reason":"length"}],"usage":{"prompt_tokens":9,'
              b'"completion_tokens":1},"timings":{"cache_n":8,"prompt_n":1}}', b"data: [DONE]"]
    assert [_handle_event(e, o, False, 1.0) for e in events] == [False, False, True]
    assert o.usage is not None and cached_tokens(o.usage, o.timings) == 8


# ------------------------------------------------------------------------------------------------- the analysis

def _record(level: float, ok: bool = True, phase: str = "measure", **extra) -> dict:
    return {"mode": "concurrency", "level": level, "repeat": 0, "phase": phase, "worker": 0, "index": 0,
            "start_s": 1.0, "end_s": 1.5, "send_delay_ms": 0.0, "ok": ok, "error": None if ok else "timeout",
            "status": 200, "input_tokens": 100, "output_tokens": 4, "requested_output_tokens": 4,
            "tokens_source": "usage", "ttft_ms": 10.0, "tpot_ms": 5.0, "e2e_ms": 25.0, "itl_ms": [5.0] * 3,
            "queue_ms": None, "finish_reason": "length", "truncated": False, "early_stop": False, "retries": 0,
            "group": None, **extra}


def _run(tmp_path: Path, records: list[dict]) -> Path:
    (tmp_path / REQUESTS).write_text("".join(json.dumps(r) + "\n" for r in records))
    return tmp_path


def test_a_level_sums_its_measured_successes_and_a_missing_count_is_zero(tmp_path):
    recs = [_record(1, cached_tokens=60), _record(1, cached_tokens=None),  # vLLM: nothing found, nothing said
            _record(1, cached_tokens=99, phase="warmup"), _record(1, ok=False, cached_tokens=99),
            _record(4, cached_tokens=90), _record(4, cached_tokens=30)]
    got = record_cached(_run(tmp_path, recs) / REQUESTS)
    assert got == {("concurrency", 1.0): cached_figure(200, 60), ("concurrency", 4.0): cached_figure(200, 120)}
    one = got[("concurrency", 4.0)].to_json()
    assert one == {"source": "records", "prompt_tokens": 200, "hbm_hit_tokens": 120, "tier_hit_tokens": None,
                   "hbm_hit_rate": 0.6, "tier_hit_rate": None, "server_cached_tokens": 120}


def test_records_without_the_field_load_and_get_no_figure(tmp_path):
    run = RunDir(_run(tmp_path, [_record(1), _record(1, cached_tokens=None)]))
    assert record_cached(run.dir / REQUESTS) == {}
    summary = build_summary(run, {})
    assert [lv.ok for lv in summary.levels] == [2] and summary.levels[0].prefix_reuse is None


def test_a_bench_run_without_prefix_counters_gets_its_figure_from_the_records(tmp_path):
    run = RunDir(_run(tmp_path, [_record(2, cached_tokens=80), _record(2, cached_tokens=16)]))
    reuse = build_summary(run, {}).levels[0].prefix_reuse
    assert reuse is not None and reuse.source == "records"
    assert (reuse.prompt_tokens, reuse.hbm_hit_tokens, reuse.server_cached_tokens, reuse.tier_hit_tokens) == (
        200, 96, 96, None)


# ------------------------------------------------------------------------------------------------- compare

def lv(level: float, prompt: int | None = None, cached: int | None = None, run_max: float | None = None,
       tier: float | None = None) -> LevelSummary:
    """A summary level: ``cached`` the server's cached tokens out of ``prompt`` (a figure from the records'
    cached_tokens); ``tier``: a sim records' figure with that many tier-hit tokens instead; ``run_max``: the
    server's running maximum (telemetry)."""
    data = {"mode": "concurrency", "level": level, "requests": 10, "ok": 10, "errors": 0, "cancelled": 0,
            "error_classes": {}, "output_tok_s": 0.0, "goodput_tok_s": 0.0, "ttft_ms": _EMPTY, "tpot_ms": _EMPTY,
            "slo_ok": True, "failed_checks": [], "server_running_max": run_max}
    if cached is not None and prompt is not None:
        data["prefix_reuse"] = cached_figure(prompt, cached).to_json()
    elif tier is not None:
        data["prefix_reuse"] = figure("records", 10_000, 0, tier).to_json()
    return LevelSummary.model_validate(data)


UNKNOWN_TIERS = (TierHits({}, False), TierHits({}, False))


def test_more_cached_prompt_tokens_in_the_treatment_is_the_sign_with_numbers_and_source():
    control = summary_of(lv(1, 10_000, 2_000), lv(4, 40_000, 4_000))
    treatment = summary_of(lv(1, 10_000, 9_000), lv(4, 40_000, 36_000))
    took, evidence, warning = effect_signs(control, treatment, UNKNOWN_TIERS)
    assert (took, warning) == (True, None)
    assert evidence == ["more prompt tokens served from the server's cache: 45,000 cached tokens in the treatment "
                        "(90.0% of 50,000 prompt tokens) vs 6,000 in the control (12.0% of 50,000), more than the "
                        "5% margin, from the server's per-request cached_tokens"]


def test_a_rise_within_the_margin_is_no_sign_and_the_warning_says_what_was_looked_at():
    control = summary_of(lv(1, 10_000, 2_000, run_max=1.0))
    within = 2_000 + int(CACHED_MARGIN * 10_000)  # exactly the margin: not beyond it
    took, evidence, warning = effect_signs(control, summary_of(lv(1, 10_000, within, run_max=1.0)), UNKNOWN_TIERS)
    assert (took, evidence) == (False, [])
    assert warning == ("no server-side sign that the treatment took effect (no more requests running or parked, "
                       "no more cached prompt tokens (the server's per-request cached_tokens))")
    # no telemetry: the cached tokens alone are looked at
    took, _, warning = effect_signs(summary_of(lv(1, 10_000, 2_000)), summary_of(lv(1, 10_000, 2_100)),
                                    UNKNOWN_TIERS)
    assert took is False and warning == ("no server-side sign that the treatment took effect (no more cached "
                                         "prompt tokens (the server's per-request cached_tokens))")


def test_more_requests_held_still_counts_when_the_cache_did_not_move():
    took, evidence, warning = effect_signs(summary_of(lv(1, 10_000, 0, run_max=2.0)),
                                           summary_of(lv(1, 10_000, 0, run_max=8.0)), UNKNOWN_TIERS)
    assert (took, evidence, warning) == (True, [], None)


def test_only_shared_levels_count_and_an_arm_without_the_figure_is_unknown():
    control = CachedHits.of(summary_of(lv(1, 10_000, 1_000), lv(8, 10_000, 9_000)))
    treatment = CachedHits.of(summary_of(lv(1, 10_000, 5_000), lv(16, 10_000, 0)))
    assert cached_took_effect(control, treatment) is True  # c=1 alone: 10% → 50%
    silent = CachedHits.of(summary_of(lv(1)))
    assert cached_took_effect(silent, treatment) is None and cached_took_effect(control, silent) is None


def test_sim_and_counter_figures_keep_their_old_signs():
    # a sim run's records figure carries no server_cached_tokens: no cached sign, the old warning word for word
    control, treatment = summary_of(lv(1, tier=0.0, run_max=4.0)), summary_of(lv(1, tier=0.0, run_max=4.0))
    tiers = TierHits.of(control, False), TierHits.of(treatment, False)
    assert CachedHits.of(control).levels == {}
    took, evidence, warning = effect_signs(control, treatment, tiers)
    assert (took, evidence) == (False, [])
    assert warning == "no server-side sign that the treatment took effect (no more requests running or parked)"
    took, _, warning = effect_signs(summary_of(lv(1)), summary_of(lv(1)), UNKNOWN_TIERS)
    assert took is None and warning is not None and warning.startswith("no server telemetry in these runs")
