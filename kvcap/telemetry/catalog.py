"""One vocabulary for server metrics, whatever the engine: raw Prometheus name → normalised name.

The raw name is kept in ``labels.raw`` of every telemetry row, so nothing is lost by normalising.
"""

from __future__ import annotations

NORMALISED: dict[str, str] = {
    # vLLM (V0 and V1 names)
    "vllm:num_requests_running": "server.requests_running",
    "vllm:num_requests_waiting": "server.requests_waiting",
    "vllm:kv_cache_usage_perc": "server.kv_usage",
    "vllm:gpu_cache_usage_perc": "server.kv_usage",
    "vllm:num_preemptions_total": "server.preemptions_total",
    "vllm:num_preemptions": "server.preemptions_total",
    "vllm:prompt_tokens_total": "server.prompt_tokens_total",
    "vllm:generation_tokens_total": "server.generation_tokens_total",
    "vllm:prefix_cache_hits_total": "server.prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total": "server.prefix_cache_queries_total",
    "vllm:num_requests_swapped": "server.requests_swapped",
    "vllm:cpu_cache_usage_perc": "server.kv_usage_host",
    # SGLang
    "sglang:num_running_reqs": "server.requests_running",
    "sglang:num_queue_reqs": "server.requests_waiting",
    "sglang:token_usage": "server.kv_usage",
    "sglang:prompt_tokens_total": "server.prompt_tokens_total",
    "sglang:generation_tokens_total": "server.generation_tokens_total",
    "sglang:cache_hit_rate": "server.prefix_cache_hit_rate",
    # TGI
    "tgi_batch_current_size": "server.requests_running",
    "tgi_queue_size": "server.requests_waiting",
    # llama.cpp server (--metrics)
    "llamacpp:requests_processing": "server.requests_running",
    "llamacpp:requests_deferred": "server.requests_waiting",
    "llamacpp:kv_cache_usage_ratio": "server.kv_usage",
    "llamacpp:prompt_tokens_total": "server.prompt_tokens_total",
    "llamacpp:tokens_predicted_total": "server.generation_tokens_total",
    "llamacpp:n_decode_total": "server.decode_calls_total",
    # kvcap serve-sim (the simulator's own gauge: requests whose KV is parked in an offload tier)
    "kvcap:num_requests_parked": "server.requests_parked",
    # LMCache
    "lmcache:num_hit_tokens_total": "server.offload_hit_tokens_total",
    "lmcache:num_requested_tokens_total": "server.offload_requested_tokens_total",
    "lmcache:local_cache_usage": "server.kv_usage_host",
}


def normalise(raw: str) -> str | None:
    """Normalised name for a raw sample name (counter ``_total`` suffixes tolerated), or None if unknown."""
    if raw in NORMALISED:
        return NORMALISED[raw]
    if raw.endswith("_total") and raw[: -len("_total")] in NORMALISED:
        return NORMALISED[raw[: -len("_total")]]
    if raw + "_total" in NORMALISED:
        return NORMALISED[raw + "_total"]
    return None
