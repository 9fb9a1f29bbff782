"""The telemetry catalog on the tier names issue 32 added, from literal ``/metrics`` text: LMCache's multiprocess
server (``lmcache_mp_*``, its own endpoint, detected by its prefix) and vLLM's labelled
``vllm:prompt_tokens_by_source`` (one normalised name per ``source`` value), by a scrape and by Prometheus."""

from __future__ import annotations

from collections import defaultdict

import pytest

from kvcap.telemetry.catalog import detect_engine, entry, normalise
from kvcap.telemetry.prometheus import rows_from_matrix, selector
from kvcap.telemetry.scrape import parse_metrics

LMCACHE_MP = """\
# HELP lmcache_mp_lookup_hit_l1_tokens_total Tokens found in L1
# TYPE lmcache_mp_lookup_hit_l1_tokens_total counter
lmcache_mp_lookup_hit_l1_tokens_total{cache_salt="",model_name="m"} 3584.0
# HELP lmcache_mp_lookup_hit_l2_tokens_total Tokens found in L2
# TYPE lmcache_mp_lookup_hit_l2_tokens_total counter
lmcache_mp_lookup_hit_l2_tokens_total{cache_salt="",model_name="m"} 512.0
# TYPE lmcache_mp_lookup_hit_tokens_total counter
lmcache_mp_lookup_hit_tokens_total{cache_salt="",model_name="m"} 4096.0
# TYPE lmcache_mp_lookup_requested_tokens_total counter
lmcache_mp_lookup_requested_tokens_total{cache_salt="",model_name="m"} 8192.0
# TYPE lmcache_mp_l1_write_chunks_total counter
lmcache_mp_l1_write_chunks_total{cache_salt=""} 32.0
# TYPE lmcache_mp_l1_read_chunks_total counter
lmcache_mp_l1_read_chunks_total{cache_salt=""} 14.0
# TYPE lmcache_mp_l1_evicted_chunks_total counter
lmcache_mp_l1_evicted_chunks_total{cache_salt=""} 3.0
# TYPE lmcache_mp_l1_usage_ratio gauge
lmcache_mp_l1_usage_ratio 0.0625
# TYPE lmcache_mp_event_bus_queue_depth gauge
lmcache_mp_event_bus_queue_depth 0.0
"""

VLLM_BY_SOURCE = """\
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 300.0
# HELP vllm:prompt_tokens_by_source_total Number of prompt tokens by source.
# TYPE vllm:prompt_tokens_by_source_total counter
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 1000.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_cache_hit"} 200.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="external_kv_transfer"} 40.0
vllm:prompt_tokens_by_source_total{engine="1",model_name="m",source="local_compute"} 500.0
vllm:prompt_tokens_by_source_total{engine="1",model_name="m",source="local_cache_hit"} 100.0
vllm:prompt_tokens_by_source_total{engine="1",model_name="m",source="external_kv_transfer"} 0.0
vllm:prompt_tokens_by_source_total{engine="1",model_name="m",source="a_source_vllm_adds_later"} 7.0
"""


def _sums(rows: list[dict]) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for r in rows:
        out[r["name"]] += r["value"]
    return dict(out)


def test_lmcache_multiprocess_server_names() -> None:
    rows = parse_metrics(LMCACHE_MP, 1.0, "metrics:lmcache", node="n1")
    assert _sums(rows) == {
        "server.offload_l1_hit_tokens_total": 3584, "server.offload_l2_hit_tokens_total": 512,
        "server.offload_hit_tokens_total": 4096, "server.offload_requested_tokens_total": 8192,
        "server.offload_l1_write_chunks_total": 32, "server.offload_l1_read_chunks_total": 14,
        "server.offload_l1_evicted_chunks_total": 3, "server.kv_usage_host": 0.0625}
    assert {r["labels"]["engine"] for r in rows} == {"lmcache_mp"}  # its own endpoint, told by its prefix
    assert detect_engine(["lmcache:num_hit_tokens_total"]) == "lmcache"  # the in-engine connector stays apart
    assert entry("lmcache_mp_l1_read_chunks_total").unit == "chunks"


def test_one_label_value_one_normalised_name() -> None:
    rows = parse_metrics(VLLM_BY_SOURCE, 1.0, "metrics:vllm", node="n1")
    assert _sums(rows) == {"server.prefix_cache_hits_total": 300, "server.prompt_tokens_computed_total": 1500,
                           "server.prompt_tokens_prefix_cache_hits_total": 300,
                           "server.prompt_tokens_offload_hits_total": 40}
    by_source = [r for r in rows if r["labels"]["raw"] == "vllm:prompt_tokens_by_source_total"]
    assert len(by_source) == 6  # a source the catalog does not know is left out, not lumped in
    assert all(r["labels"]["engine"] == "vllm" and r["labels"]["source"] for r in by_source)
    # the rule needs the label: the name alone (or with another value) is unknown, either spelling of the counter
    assert normalise("vllm:prompt_tokens_by_source_total") is None
    assert normalise("vllm:prompt_tokens_by_source", {"source": "external_kv_transfer"}) == \
        "server.prompt_tokens_offload_hits_total"
    assert normalise("vllm:prompt_tokens_by_source_total", {"source": "remote"}) is None
    assert normalise("vllm:prefix_cache_hits_total", {"source": "local_compute"}) == "server.prefix_cache_hits_total"


def test_labelled_names_through_prometheus() -> None:
    assert "vllm:prompt_tokens_by_source_total" in selector() and "lmcache_mp_l1_usage_ratio" in selector()
    assert "source=" not in selector()  # the name regex holds names only: the label rule is applied to the rows
    matrix = [{"metric": {"__name__": "vllm:prompt_tokens_by_source_total", "instance": "gpu-a:8000", "job": "vllm",
                          "source": source}, "values": [[100.0, str(v)]]}
              for source, v in (("local_cache_hit", 64), ("local_compute", 960), ("somewhere_else", 1))]
    rows = rows_from_matrix(matrix, 90.0, "prometheus:test")
    assert {r["name"]: r["value"] for r in rows} == {"server.prompt_tokens_prefix_cache_hits_total": 64,
                                                     "server.prompt_tokens_computed_total": 960}
    assert all(r["t_s"] == pytest.approx(10.0) and r["labels"]["node"] == "gpu-a" for r in rows)
