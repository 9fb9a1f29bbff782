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


# ------------------------------------------------------------------ weights that do not fit: an answer, not a refusal

# Llama-3.1-70B from its config (kvcap/specs/presets/models/llama-3.1-70b.json): 70,553,706,496 parameters,
# hidden 8192, intermediate 28672, 80 layers, 64 query / 8 KV heads of 128, vocab 128256, untied embeddings.
N_70B, EMB_70B = 70_553_706_496, 2 * 128_256 * 8192
BUDGET_24G = 24 * 2**30 * 0.9                       # --gpu-mem 24GiB at the default utilization 0.9
OVERHEAD = 650 * 2**20                              # serving.runtime_overhead default


def act_70b(tp: int) -> float:
    """The activation peak by hand: 2048 tokens × (4·hidden + (64 + 2·8)·128/tp + 3·28672/tp) × 2 B, plus
    256 rows × 128256 fp32 logits × 2 copies."""
    return 2048 * (4 * 8192 + (64 + 16) * 128 / tp + 3 * 28672 / tp) * 2 + 256 * 128_256 * 4 * 2


def test_70b_on_24gib_answers_with_the_smallest_parallelism_that_fits():
    r = plan(resolve(load_scenario(None, {"model.preset": "llama-3.1-70b", "cluster.gpu.memory": "24GiB"})),
             allow_unfit=True)
    assert r.fits is False and "do not fit" in r.fit_problem
    assert r.weights_bytes == N_70B * 2                              # bf16
    assert r.kv_bytes_per_token == 2 * 8 * 128 * 2 * 80 == 327_680   # K and V × 8 heads × 128 × 2 B × 80 layers
    assert r.kv_bytes_per_request == 1280 * 327_680                  # 1024 + 256 tokens, whole blocks of 16
    assert r.resident_requests == {"hbm": 0, "host": 0, "remote": 0, "total": 0}
    opts = {(o.weights_dtype, o.pp == 1): o for o in r.fit_options}
    assert [o.weights_dtype for o in r.fit_options] == ["bf16", "bf16", "int8", "int8", "int4", "int4"]
    # bf16: 141.1 GB / tp ≤ 21.6 GiB − activations − overhead needs tp ≥ 7; 7 does not divide 64 heads → 8
    assert (N_70B * 2 / 7 + act_70b(7) + OVERHEAD) < BUDGET_24G < N_70B * 2 / 6
    tp8 = opts[("bf16", True)]
    assert (tp8.tp, tp8.pp, tp8.gpus) == (8, 1, 8)
    usable = BUDGET_24G - N_70B * 2 / 8 - act_70b(8) - OVERHEAD
    assert tp8.usable_kv_bytes_per_gpu == pytest.approx(usable)
    assert tp8.kv_bytes_per_token_per_gpu == 327_680 / 8                      # one KV head per rank
    assert tp8.kv_tokens_per_replica == int(usable // (40_960 * 16)) * 16 == 108_064
    assert tp8.requests_per_replica == int(usable // (1280 * 40_960)) == 84
    assert tp8.replicas_on_cluster == 0                                       # the cluster is one GPU
    # pipeline only: pp must divide the 80 layers; 131.4 GiB / 5 > 21.6 GiB, so 8 (7 would not divide 80)
    pp8 = opts[("bf16", False)]
    assert (pp8.tp, pp8.pp) == (1, 8)
    assert pp8.usable_kv_bytes_per_gpu == pytest.approx(BUDGET_24G - N_70B * 2 / 8 - act_70b(1) - OVERHEAD)
    # int8: 1 B per parameter, embeddings and LM head kept at 2 B: 72.7 GB → tp=2 is 36 GB, tp=4 fits
    w8 = (N_70B - EMB_70B) * 1 + EMB_70B * 2
    int8 = opts[("int8", True)]
    assert int8.tp == 4 and N_70B * 2 / 2 > w8 / 2 > BUDGET_24G
    assert int8.usable_kv_bytes_per_gpu == pytest.approx(BUDGET_24G - w8 / 4 - act_70b(4) - OVERHEAD)
    # int4: 0.5 B + a 16-bit scale and 4-bit zero per 128 → 39.8 GB at tp=1, tp=2 fits
    w4 = (N_70B - EMB_70B) * (0.5 + 2.5 / 128) + EMB_70B * 2
    int4 = opts[("int4", True)]
    assert int4.tp == 2 and w4 > BUDGET_24G
    assert int4.weights_bytes_per_gpu == pytest.approx(w4 / 2)
    assert int4.requests_per_replica == int((BUDGET_24G - w4 / 2 - act_70b(2) - OVERHEAD) // (1280 * 163_840))


def test_strict_plan_still_refuses_what_cannot_be_simulated():
    from kvcap.errors import InputError

    with pytest.raises(InputError, match="do not fit"):
        run_plan({"model.preset": "llama-3.1-70b", "cluster.gpu.memory": "24GiB"})


def test_a_plan_that_fits_has_no_options_and_the_same_numbers():
    over = {"model.preset": "llama-3.1-8b", "cluster.gpu.preset": "rtx4090"}
    strict, lenient = run_plan(over), plan(resolve(load_scenario(None, over)), allow_unfit=True)
    assert strict.fits and strict.fit_problem is None and strict.fit_options == []
    assert strict == lenient


def test_kv_room_for_less_than_one_request_does_not_fit():
    # 8B bf16 on an RTX 4090 leaves ~5.7 GiB for KV: a 64k-token request needs 8 GiB (131,072 B per token)
    r = plan(resolve(load_scenario(None, {"model.preset": "llama-3.1-8b", "cluster.gpu.preset": "rtx4090",
                                          "workload.input_tokens": 65_536, "workload.output_tokens": 1})),
             allow_unfit=True)
    assert r.fits is False and "less than one request" in r.fit_problem
    assert r.usable_kv_bytes_per_gpu > 0 and r.kv_bytes_per_request_per_gpu > r.usable_kv_bytes_per_gpu
    best = r.fit_options[0]
    assert best.weights_dtype == "bf16" and (best.tp, best.pp) == (2, 1) and best.requests_per_replica >= 1
