"""The KV pool and slot limit as real engines publish them (the exposition and JSON shapes their servers answer),
read by preflight and turned into the calibrated scenario's ``kv_tokens`` and slots."""

from __future__ import annotations

from kvcap.calibrate.fit import estimate_slots
from kvcap.calibrate.observe import Observation, server_facts
from kvcap.calibrate.output import kv_tokens_of
from kvcap.loadgen.preflight import cache_config, sglang_facts
from kvcap.rundir import Manifest


def _manifest(server: dict) -> Manifest:
    """A bench manifest carrying only what the server said of itself."""
    return Manifest(source="bench", run_id="r", started_at=0.0, fixed={}, server=server)

# vLLM 0.x /metrics (labels as a real engine prints them: strings, "None" for unset)
VLLM = (
    "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
    "# TYPE vllm:cache_config_info gauge\n"
    'vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",cpu_offload_gb="0",'
    'enable_prefix_caching="True",gpu_memory_utilization="0.82",is_attention_free="False",num_cpu_blocks="1024",'
    'num_gpu_blocks="573",num_gpu_blocks_override="None",sliding_window="None",swap_space_bytes="4294967296"} 1.0\n'
    "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
    "# TYPE vllm:num_requests_running gauge\n"
    'vllm:num_requests_running{engine="0",model_name="m"} 0.0\n')


def test_vllm_cache_config_gives_blocks_block_size_and_prefix_caching():
    assert cache_config(VLLM) == {"num_gpu_blocks": 573, "block_size": 16, "enable_prefix_caching": True,
                                  "kv_engines": 1, "engine": "vllm"}
    facts = server_facts(_manifest(cache_config(VLLM)))
    assert kv_tokens_of(facts, 8, memory_arithmetic=False) == ((573 - 1) * 16, facts.kv_tokens_source)  # null block
    assert "cache_config_info" in (facts.kv_tokens_source or "")


def test_data_parallel_engines_each_with_a_pool_add_up():
    text = "".join(f'vllm:cache_config_info{{block_size="16",engine="{i}",num_gpu_blocks="100"}} 1.0\n'
                   for i in range(4))
    got = cache_config("# TYPE vllm:cache_config_info gauge\n" + text)
    assert got["kv_engines"] == 4 and got["num_gpu_blocks"] == 100
    assert server_facts(_manifest(got)).kv_tokens == 4 * (100 - 1) * 16  # less each engine's null block


def test_no_or_broken_cache_config_says_nothing():
    assert cache_config("") == {}
    assert cache_config('vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1.0\n') == {}
    assert cache_config("vllm:cache_config_info{{{ nonsense\n") == {}


def test_sglang_server_info_gives_the_pool_and_the_running_limit_never_its_keys():
    top = {"api_key": "secret", "max_total_num_tokens": 9000, "max_running_requests": 48, "context_length": 4096}
    assert sglang_facts(top) == {"max_total_num_tokens": 9000, "max_running_requests": 48, "engine": "sglang"}
    nested = {"max_running_requests": None, "internal_states": [{"max_total_num_tokens": 32768}]}
    assert sglang_facts(nested) == {"max_total_num_tokens": 32768, "engine": "sglang"}
    assert sglang_facts({"version": "1"}) == {}
    facts = server_facts(_manifest(sglang_facts(top)))
    assert facts.kv_tokens == 9000 and "max_total_num_tokens" in (facts.kv_tokens_source or "")
    obs = [Observation("r", "concurrency", c, 0.1, 0.1, 0.01, 0.01, 100.0 * c, 64, 32) for c in (1, 2)]
    assert estimate_slots(obs, facts) == (48, "server /get_server_info max_running_requests")
