"""What a step runs, before any GPU is involved: model-shape arithmetic (operators per layer for dense, GQA,
MLA, MoE and hybrid models), the roofline primitives and the batch totals, against hand-computed shapes and
the plan's weight bytes."""

from __future__ import annotations

import pytest

from kvcap.plan import weights_bytes
from kvcap.sim import model_shape
from kvcap.sim.batch_shape import BatchShape
from kvcap.sim.calibration_io import load_calibration
from kvcap.sim.cost import iteration_time
from kvcap.sim.roofline import AchievedRates, all_reduce_coefficients, roofline
from kvcap.specs.hardware import load_gpu, load_link
from kvcap.specs.model import load_model

A100 = load_gpu("a100-80gb")
LLAMA31 = load_model("llama-3.1-8b")


# --------------------------------------------------------------------------------------------- model shape


def test_dense_layer_ops_of_llama2_7b():
    m = load_model("llama-2-7b")  # hidden 4096, 32 heads = 32 KV heads of 128, MLP 11008
    shapes = [(op.name, op.k, op.n) for op in model_shape.dense_layer_ops(m)]
    assert shapes == [("attn_pre_proj", 4096, 3 * 4096), ("attn_post_proj", 4096, 4096),
                      ("mlp_up_proj", 4096, 2 * 11008), ("mlp_down_proj", 11008, 4096)]
    qkv = model_shape.dense_layer_ops(m)[0]
    assert qkv.weight_bytes == 4096 * 12288 * 2 and qkv.act_bytes_per_token == (4096 + 12288) * 2
    assert qkv.flops_per_token == 2 * 4096 * 12288
    # tp=2: 16 query and 16 KV heads per GPU, half the MLP width
    assert [(op.k, op.n) for op in model_shape.dense_layer_ops(m, tp=2, weights_dtype="int8")] == [
        (4096, (16 + 32) * 128), (16 * 128, 4096), (4096, 11008), (5504, 4096)]
    assert model_shape.dense_layer_ops(m, tp=2, weights_dtype="int8")[3].weight_bytes == 5504 * 4096 * 1


def test_elementwise_ops_and_their_counts():
    m = load_model("llama-2-7b")
    per_layer = {op.name: op.bytes_per_token for op in model_shape.elementwise_layer_ops(m)}
    assert per_layer == {"input_layernorm": 2 * 4096 * 2, "post_attention_layernorm": 2 * 4096 * 2,
                         "attn_rope": 2 * (32 + 32) * 128 * 2, "mlp_act": 3 * 11008 * 2, "add": 3 * 4096 * 2}
    groups = [(op.name, n) for op, n in model_shape.elementwise_groups(m, 1, "bf16", 2.0)]
    assert groups == [("input_layernorm", 32), ("post_attention_layernorm", 32), ("add", 32), ("attn_rope", 32),
                      ("mlp_act", 32), ("final_norm", 1), ("embedding", 1)]
    embedding = model_shape.elementwise_groups(m, 1, "int4", 2.0)[-1][0]
    assert embedding.bytes_per_token == 4096 * (2 + 2)  # the table stays 16-bit in a quantized checkpoint


def test_gemm_groups_account_for_every_layer_parameter():
    m = load_model("llama-2-7b")
    groups = model_shape.gemm_groups(m, 1, "bf16", 2.0)
    assert [(op.name, n) for op, n in groups] == [("attn_pre_proj", 32), ("attn_post_proj", 32),
                                                   ("mlp_up_proj", 32), ("mlp_down_proj", 32), ("other", 32)]
    # what the four GEMMs leave of the layer parameters is the RMSNorm weights: 2 × 4096 per layer + the final
    # one; under 1%, so priced as bytes only
    other = groups[-1][0]
    assert (other.k, other.n) == (0, 0) and other.weight_bytes == (2 * 4096 * 32 + 4096) / 32 * 2
    mixtral = load_model("mixtral-8x7b")  # no dense MLP: attention, then norms + routers as bytes
    names = [(op.name, n) for op, n in model_shape.gemm_groups(mixtral, 1, "bf16", 2.0)]
    assert names == [("attn_pre_proj", 32), ("attn_post_proj", 32), ("other", 32)]
    assert model_shape.gemm_groups(mixtral, 1, "bf16", 2.0)[-1][0].weight_bytes == (266240 + 32 * 4096 * 8) / 32 * 2


def test_routed_experts_of_mixtral():
    m = load_model("mixtral-8x7b")  # 32 MoE layers, 8 experts of 14336, 2 per token
    e = model_shape.routed_experts(m, 1, "bf16", 2.0)
    assert e is not None and model_shape.routed_experts(load_model("llama-2-7b"), 1, "bf16", 2.0) is None
    assert e.flops_per_token == 32 * 2 * (2 * 3 * 4096 * 14336)  # 2 experts' gate, up and down GEMMs
    assert e.bytes_per_touched_expert == 32 * 3 * 4096 * 14336 * 2
    assert (e.experts, e.idle, e.ops) == (8.0, 0.75, 64)
    assert e.act_bytes_per_token == 32 * 2 * (2 * 4096 + 3 * 14336) * 2
    assert model_shape.routed_experts(m, 2, "bf16", 2.0).bytes_per_touched_expert == 32 * 3 * 4096 * 7168 * 2


def test_lm_head_and_attention_shapes():
    head = model_shape.lm_head_op(load_model("llama-2-7b"), 2, "int4", 2.0)
    assert (head.k, head.n, head.weight_bytes) == (4096, 16000, 4096 * 16000 * 2)  # 16-bit head
    gqa = model_shape.attention_shape(LLAMA31, 1, 2.0, 2.0)  # 32 query heads, 8 KV heads of 128
    assert (gqa.full_layers, gqa.sliding_layers, gqa.state_layers) == (32, 0, 0)
    assert gqa.pair_flops == 4 * 32 * 128 and gqa.kv_bytes_per_token == 2 * 8 * 128 * 2
    assert gqa.qo_bytes_per_token == 2 * 32 * 128 * 2 and gqa.state_bytes == 0
    mla = model_shape.attention_shape(load_model("deepseek-v2-lite"), 1, 2.0, 2.0)  # 16 heads, latent 512, rope 64
    assert mla.pair_flops == 16 * (2 * (512 + 64) + 2 * 512)
    hybrid = model_shape.attention_shape(load_model("jamba-mini"), 1, 2.0, 2.0)  # 4 attention layers of 32
    assert (hybrid.full_layers, hybrid.state_layers) == (4, 28) and hybrid.state_bytes > 0


def test_weight_bytes_agree_with_plan():
    cost = iteration_time(LLAMA31, A100, BatchShape.of(prefill=[(256, 0)]))
    untied_input_embedding = LLAMA31.vocab_size * LLAMA31.hidden_size * 2
    assert cost.weight_read_bytes == pytest.approx(weights_bytes(LLAMA31, "bf16") - untied_input_embedding)
    tied = load_model("gemma-3-4b")
    assert tied.tie_word_embeddings
    assert iteration_time(tied, A100, BatchShape.of(decode=[10])).weight_read_bytes == pytest.approx(
        weights_bytes(tied, "bf16"), rel=1e-3)
    int4 = iteration_time(LLAMA31, A100, BatchShape.of(decode=[10]), weights_dtype="int4")
    assert int4.weight_read_bytes == pytest.approx(weights_bytes(LLAMA31, "int4") - untied_input_embedding)
    assert int4.gemm_s < 0.5 * iteration_time(LLAMA31, A100, BatchShape.of(decode=[10])).gemm_s


def test_moe_reads_only_the_experts_it_touches():
    mixtral = load_model("mixtral-8x7b")
    all_layers = weights_bytes(mixtral, "bf16") - mixtral.vocab_size * mixtral.hidden_size * 2
    one = iteration_time(mixtral, A100, BatchShape.of(decode=[100]))
    many = iteration_time(mixtral, A100, BatchShape.of(prefill=[(2048, 0)]))
    assert one.weight_read_bytes < 0.4 * all_layers  # 2 of 8 experts plus attention
    assert many.weight_read_bytes == pytest.approx(all_layers, rel=1e-6)
    assert one.flops == pytest.approx(2 * mixtral.active_parameters, rel=0.05)


# --------------------------------------------------------------------------------------------- batch totals


def test_batch_shape_totals():
    shape = BatchShape.of(prefill=[(100, 0), (50, 200)], decode=[10, 20, 30])
    assert (shape.n_prefill_tokens, shape.n_prefill_seqs, shape.prefill_context_tokens) == (150, 2, 200)
    assert shape.prefill_attn_pairs == 100 * 101 / 2 + 200 * 50 + 50 * 51 / 2
    assert (shape.n_decode, shape.decode_context_tokens, shape.n_tokens, shape.n_sampled) == (3, 60, 153, 5)
    windowed = BatchShape.of(prefill=[(100, 0), (50, 200)], decode=[10, 20, 300], window=64)
    assert windowed.decode_window_tokens == 10 + 20 + 64
    assert windowed.prefill_window_context_tokens == 0 + 64
    brute = sum(min(i, 64) for i in range(1, 101)) + sum(min(200 + i, 64) for i in range(1, 51))
    assert windowed.prefill_window_attn_pairs == brute
    merged = shape + windowed
    assert merged.n_decode == 6 and merged.decode_window_tokens == 60 + 94
    assert (shape + BatchShape()).decode_window_tokens is None


# --------------------------------------------------------------------------------------------- roofline


def test_roofline_takes_the_slower_side_plus_overhead():
    assert roofline(2.0, 1.0, 0.5) == (2.5, 2.0, 0.0)
    assert roofline(1.0, 2.0, 0.5) == (2.5, 0.0, 2.0)
    assert roofline(1.0, 1.0, 0.0) == (1.0, 0.0, 1.0)  # a tie counts as memory-bound


def test_achieved_rates_and_all_reduce_coefficients():
    calib = load_calibration(A100)
    rates = AchievedRates.of(A100, "bf16", calib)
    assert rates.gemm_flops_s == A100.bf16_tflops * 1e12 * calib.compute_efficiency
    assert rates.gemm_bytes_s == A100.memory_bandwidth_bytes_s * calib.memory_efficiency
    assert rates.elementwise_bytes_s == A100.memory_bandwidth_bytes_s * calib.elementwise_efficiency
    assert rates.attn_flops_s == rates.gemm_flops_s  # attention not measured: the GEMM efficiencies
    pcie = load_link("pcie4-x16")
    assert all_reduce_coefficients(1, pcie, calib) == (0.0, 0.0)
    fixed, per_byte = all_reduce_coefficients(4, pcie, calib)  # a ring of 4: 6 hops, 6/4 of the payload
    assert fixed == pytest.approx(calib.all_reduce_latency_s + 6 * pcie.latency_s)
    assert per_byte == pytest.approx(1.5 / (pcie.bytes_s * pcie.efficiency))
