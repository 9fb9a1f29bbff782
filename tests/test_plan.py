"""`kvcap plan` against known truths: a real vLLM profile, the article's arithmetic, Little's law, link units."""

import pytest

from kvcap.plan import plan, resolve
from kvcap.specs.scenario import load_scenario
from tests.conftest import ROOT


def run_plan(overrides, **kw):
    return plan(resolve(load_scenario(None, overrides), **kw))


def test_rtx4090_llama31_8b_matches_vllm_profile():
    # vLLM 0.19, RTX 4090 (25,250,627,584 B), Llama-3.1-8B bf16, util 0.9, 2048 batched tokens, block 16:
    # 2,588 GPU blocks = 41,408 KV tokens; weights ≈ 14.96 GiB; activation + other ≈ 1.15 GiB.
    r = run_plan({"model.preset": "llama-3.1-8b", "cluster.gpu.preset": "rtx4090",
                  "serving.max_num_batched_tokens": 2048})
    assert r.gpu_memory_bytes == 25_250_627_584
    assert r.weights_bytes_per_gpu / 2**30 == pytest.approx(14.96, abs=0.01)
    assert (r.activation_peak_bytes_per_gpu + r.runtime_overhead_bytes_per_gpu) / 2**30 == pytest.approx(1.15, rel=0.1)
    assert r.kv_blocks_per_gpu == pytest.approx(2588, rel=0.10)
    assert r.kv_tokens_per_gpu == pytest.approx(41_408, rel=0.10)
    assert r.kv_tokens_per_gpu == r.kv_blocks_per_gpu * 16


def test_article_cluster_gqa_vs_mha():
    # 4 nodes × one 24 GB card, 1024 in / 256 out: GQA 8B ≈ 32 per card, MHA 7B ≈ 11-12 per card
    base = {"cluster.nodes": 4, "cluster.gpu.preset": "rtx4090", "workload.input_tokens": 1024,
            "workload.output_tokens": 256}
    gqa = run_plan({**base, "model.preset": "llama-3.1-8b"})
    mha = run_plan({**base, "model.preset": "llama-2-7b"})
    assert gqa.kv_bytes_per_request == 1280 * 131_072
    assert mha.kv_bytes_per_request == 1280 * 524_288
    assert 30 <= gqa.resident_requests_per_gpu["hbm"] <= 34
    assert 10 <= mha.resident_requests_per_gpu["hbm"] <= 13
    assert gqa.resident_requests["hbm"] == 4 * int(gqa.resident_requests_per_gpu["hbm"])


def test_tiers_rates_and_littles_law():
    r = run_plan({"model.preset": "llama-3.1-8b", "cluster.nodes": 4, "cluster.host_memory": "128GiB",
                  "cluster.remote_memory": "256GiB", "serving.kv_offload": "host+remote",
                  "workload.input_tokens": 1200, "workload.output_tokens": 300}, rate=3.0, response_time_s=10.0)
    # the article: 3 req/s × 1200 in = 3600 tok/s, × 300 out = 900 tok/s
    assert r.input_tok_s == 3600 and r.output_tok_s == 900
    assert r.active_sequences == pytest.approx(30.0)
    per_req = 1504 * 131_072  # 1500 tokens rounded up to 94 blocks of 16
    assert r.kv_bytes_per_request == per_req
    assert r.resident_requests["host"] == 4 * int(64 * 2**30 // per_req)
    assert r.resident_requests["remote"] == int(256 * 2**30 // per_req)
    assert r.resident_requests["total"] == sum(r.resident_requests[t] for t in ("hbm", "host", "remote"))


def test_link_budget_in_both_units_and_warning():
    # 24 in flight on 4 GPUs that hold only 8 of them in HBM: 16 parked across 4 NICs of 100 Gbps.
    r = run_plan({"model.preset": "llama-3.1-8b", "cluster.nodes": 4, "cluster.remote_memory": "256GiB",
                  "serving.kv_offload": "remote", "serving.max_num_seqs": 2,
                  "cluster.interconnect.bandwidth": "100Gbps"}, concurrency=24, response_time_s=1.0)
    assert r.resident_requests["hbm"] == 8
    (b,) = r.links
    assert b.parked_requests == 16 and b.parked_per_link == 4
    assert b.required_bytes_s == pytest.approx(4 * 1280 * 131_072 / 1.0)
    assert b.required_gbps == pytest.approx(b.required_bytes_s * 8 / 1e9)
    assert b.capacity_gbps == pytest.approx(100.0) and b.capacity_bytes_s == pytest.approx(12.5e9)
    assert r.link["required_gbps"] == pytest.approx(b.required_gbps)
    # decoding parked KV in place would stream it every step: ≈ 4 × 160 MiB over ≈ 12.5 GB/s × 0.9
    assert b.decode_in_place_s_per_step == pytest.approx(4 * 1280 * 131_072 / (12.5e9 * 0.9), rel=0.01)
    tight = run_plan({"model.preset": "llama-3.1-8b", "cluster.nodes": 4, "cluster.remote_memory": "256GiB",
                      "serving.kv_offload": "remote", "serving.max_num_seqs": 2,
                      "cluster.interconnect.bandwidth": "10Gbps"}, concurrency=24, response_time_s=0.5)
    assert any("more than" in w and "Gbps" in w for w in tight.warnings)


def test_seed_scenario_file_plans():
    r = plan(resolve(load_scenario(ROOT / "scenarios" / "seed-reference.yaml")))
    assert r.nodes == 4 and r.gpus == 4 and r.model == "llama-2-7b" and r.attention_kind.startswith("MHA")
    assert r.tokens_per_request == 1024 + 192  # the means of normal:1024,64 and uniform:128,256
    # what the file's comment says: 512 KiB per token, 983 blocks, 12 requests per card, 48 in the cluster
    assert r.kv_bytes_per_token == 524_288 and r.kv_blocks_per_gpu == 983
    assert r.resident_requests["hbm"] == 48
