"""Model-shape arithmetic: the operators one step of a model runs on one GPU of a tensor-parallel group.

Why apart from the cost model: these are facts about the checkpoint (matrix shapes, bytes per token, which
layers attend, slide, route to experts or keep a state), not about the GPU; the calibration fitter prices the
very same operators (``scripts/calibrate_cost_model.py`` uses :func:`dense_layer_ops` and
:func:`elementwise_layer_ops`), so the fit and the cost model cannot disagree about them.

Covered: dense GQA/MHA attention + gated MLP (Vidur's op names), MLA (absorbed attention), MoE (shared and
routed experts), sliding-window layers and hybrid SSM / linear-attention layers (a fixed per-sequence state);
whatever parameters the preset counts beyond those shapes becomes one extra dense GEMM per layer. KV bytes
come from :mod:`kvcap.plan`, never re-derived.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcap.errors import InputError
from kvcap.plan import DTYPE_BYTES, kv_heads_per_gpu, kv_layer_bytes_per_token, ssm_state_bytes
from kvcap.sim.roofline import ElementwiseOp, LinearOp
from kvcap.specs.model import ModelSpec


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def weight_element_bytes(weights_dtype: str) -> float:
    if weights_dtype not in DTYPE_BYTES:
        raise InputError(f"unknown weights dtype {weights_dtype!r}: known {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[weights_dtype]


def embedding_element_bytes(weights_dtype: str) -> float:
    """Embeddings and LM head stay 16-bit in quantized checkpoints (as :func:`kvcap.plan.weights_bytes`)."""
    return DTYPE_BYTES[weights_dtype] if weights_dtype in ("fp32", "fp16", "bf16") else 2.0


# ------------------------------------------------------------------------------------------------ one layer


def dense_layer_ops(model: ModelSpec, tp: int = 1, weights_dtype: str = "bf16", act_bytes: float = 2.0,
                    intermediate: int | None = None) -> tuple[LinearOp, ...]:
    """The four GEMMs of one GQA attention + gated-MLP layer on one GPU of a tp group (Vidur's op names).

    QKV is column-parallel (KV heads replicated once tp exceeds them, as :func:`kvcap.plan.kv_heads_per_gpu`),
    O and down are row-parallel, gate+up is one fused column-parallel GEMM.
    """
    wb = weight_element_bytes(weights_dtype)
    h, hd = model.hidden_size, model.head_dim
    q = ceil_div(model.num_attention_heads, tp)
    kv = kv_heads_per_gpu(model, tp)
    inter = ceil_div(intermediate or model.intermediate_size, tp)
    shapes = (("attn_pre_proj", h, (q + 2 * kv) * hd), ("attn_post_proj", q * hd, h),
              ("mlp_up_proj", h, 2 * inter), ("mlp_down_proj", inter, h))
    return tuple(LinearOp(name, k, n, k * n * wb, (k + n) * act_bytes) for name, k, n in shapes)


def elementwise_layer_ops(model: ModelSpec, tp: int = 1, act_bytes: float = 2.0,
                          intermediate: int | None = None) -> tuple[ElementwiseOp, ...]:
    """The elementwise kernels of one layer, with Vidur's op names: bytes read + written per token.

    Norms read and write hidden; rotary rewrites this GPU's Q and K heads; SiLU-and-mul reads gate+up and
    writes the product; the residual add reads two hidden vectors and writes one.
    """
    h, hd = model.hidden_size, model.head_dim
    q = ceil_div(model.num_attention_heads, tp)
    kv = kv_heads_per_gpu(model, tp)
    inter = ceil_div(intermediate or model.intermediate_size, tp)
    return (ElementwiseOp("input_layernorm", 2 * h * act_bytes),
            ElementwiseOp("post_attention_layernorm", 2 * h * act_bytes),
            ElementwiseOp("attn_rope", 2 * (q + kv) * hd * act_bytes),
            ElementwiseOp("mlp_act", 3 * inter * act_bytes),
            ElementwiseOp("add", 3 * h * act_bytes))


# ------------------------------------------------------------------------------------------------ the model


def moe_layer_count(model: ModelSpec) -> tuple[int, int]:
    """(layers with a dense MLP, layers with experts)."""
    n_moe = model.moe.moe_layers if model.moe else 0
    return model.num_layers - n_moe, n_moe


def gemm_groups(model: ModelSpec, tp: int, weights_dtype: str, act_bytes: float) -> list[tuple[LinearOp, int]]:
    """Every GEMM but the routed experts and the LM head, as (op, layers that hold it).

    Attention projections (GQA/MHA), dense MLPs, shared experts; then whatever the preset's parameter count
    holds beyond those shapes and the routed experts (MLA and SSM projections, routers) as one dense GEMM of
    hidden-sized activations per layer, so weight bytes still add up (what is left is small: norms, biases).
    """
    wb = weight_element_bytes(weights_dtype)
    h, moe = model.hidden_size, model.moe
    n_dense, n_moe = moe_layer_count(model)
    groups: list[tuple[LinearOp, int]] = []
    known_params = 0.0
    if model.attention == "gqa" and model.attention_layers:
        qkv, o = dense_layer_ops(model, tp, weights_dtype, act_bytes)[:2]
        groups += [(qkv, model.attention_layers), (o, model.attention_layers)]
        known_params += model.attention_layers * sum(op.k * op.n for op in dense_layer_ops(model, 1)[:2])
    if n_dense:
        groups += [(op, n_dense) for op in dense_layer_ops(model, tp, weights_dtype, act_bytes)[2:]]
        known_params += n_dense * 3 * h * model.intermediate_size
    if moe and moe.shared_intermediate_size:
        shared = dense_layer_ops(model, tp, weights_dtype, act_bytes, moe.shared_intermediate_size)[2:]
        groups += [(op, n_moe) for op in shared]
        known_params += n_moe * 3 * h * moe.shared_intermediate_size
    if moe:
        known_params += n_moe * moe.num_experts * 3 * h * moe.expert_intermediate_size
    layer_params = model.num_parameters - model.embedding_parameters
    residual = max(layer_params - known_params, 0.0)
    if residual > 0.01 * layer_params:
        groups.append((LinearOp("other", h, max(1, round(residual / model.num_layers / h / tp)),
                                residual / model.num_layers / tp * wb, 2 * h * act_bytes), model.num_layers))
    elif residual > 0:
        groups.append((LinearOp("other", 0, 0, residual / model.num_layers / tp * wb, 0.0), model.num_layers))
    return groups


@dataclass(frozen=True, slots=True)
class RoutedExperts:
    """The routed experts of every MoE layer together (one fused kernel per layer, 2 GEMM ops each)."""

    flops_per_token: float
    """``experts_per_token`` experts' gate+up and down, summed over the MoE layers."""
    bytes_per_touched_expert: float
    """Weights of one expert in every MoE layer: read once per step for each expert the batch touches."""
    experts: float
    idle: float
    """P(an expert is not chosen by one token) = 1 − experts_per_token / experts."""
    act_bytes_per_token: float
    ops: int


def routed_experts(model: ModelSpec, tp: int, weights_dtype: str, act_bytes: float) -> RoutedExperts | None:
    """The model's routed experts on one GPU of the tp group (None for a dense model)."""
    moe = model.moe
    if not moe:
        return None
    wb = weight_element_bytes(weights_dtype)
    h = model.hidden_size
    n_moe = moe.moe_layers
    e_inter = ceil_div(moe.expert_intermediate_size, tp)
    return RoutedExperts(flops_per_token=n_moe * moe.experts_per_token * 2.0 * 3 * h * e_inter,
                         bytes_per_touched_expert=n_moe * 3 * h * e_inter * wb,
                         experts=float(moe.num_experts), idle=1.0 - moe.experts_per_token / moe.num_experts,
                         act_bytes_per_token=n_moe * moe.experts_per_token * (2 * h + 3 * e_inter) * act_bytes,
                         ops=2 * n_moe)


def lm_head_op(model: ModelSpec, tp: int, weights_dtype: str, act_bytes: float) -> LinearOp:
    """The LM head's column-parallel share of the vocabulary (16-bit in quantized checkpoints)."""
    h, vocab = model.hidden_size, ceil_div(model.vocab_size, tp)
    return LinearOp("lm_head", h, vocab, h * vocab * embedding_element_bytes(weights_dtype), (h + vocab) * act_bytes)


def elementwise_groups(model: ModelSpec, tp: int, weights_dtype: str,
                       act_bytes: float) -> list[tuple[ElementwiseOp, int]]:
    """Every elementwise kernel of a step, as (op, how many run): per-layer norms and residual adds, rotary on
    attention layers, the MLP activation (dense and expert widths), the final norm and the embedding."""
    h = model.hidden_size
    moe = model.moe
    n_dense, n_moe = moe_layer_count(model)
    per_layer = elementwise_layer_ops(model, tp, act_bytes)
    norms, rope, add = per_layer[:2], per_layer[2], per_layer[4]
    ew: list[tuple[ElementwiseOp, int]] = [(op, model.num_layers) for op in norms] + [(add, model.num_layers)]
    if model.attention_layers:
        ew.append((rope, model.attention_layers))
    if n_dense:
        ew.append((per_layer[3], n_dense))
    if moe:
        act_inter = moe.experts_per_token * moe.expert_intermediate_size + moe.shared_intermediate_size
        ew.append((elementwise_layer_ops(model, tp, act_bytes, act_inter)[3], n_moe))
    eb = embedding_element_bytes(weights_dtype)
    ew += [(ElementwiseOp("final_norm", 2 * h * act_bytes), 1), (ElementwiseOp("embedding", h * (eb + act_bytes)), 1)]
    return ew


@dataclass(frozen=True, slots=True)
class AttentionShape:
    """Per-layer attention (and state) traffic on one GPU, by layer kind."""

    full_layers: int
    sliding_layers: int
    state_layers: int
    """SSM and linear-attention layers: a fixed per-sequence state instead of a KV cache."""
    pair_flops: float
    """FLOPs per query-key pair per layer (absorbed form for MLA)."""
    kv_bytes_per_token: float
    """KV bytes of one token in one attention layer (:func:`kvcap.plan.kv_layer_bytes_per_token`)."""
    qo_bytes_per_token: float
    """Q read and O written per token per layer."""
    state_bytes: float
    """Per-sequence state of all state layers, read and written each step (:func:`kvcap.plan.ssm_state_bytes`)."""


def attention_shape(model: ModelSpec, tp: int, kv_element_bytes: float, act_bytes: float) -> AttentionShape:
    kinds = model.layer_kinds
    n_state = kinds.count("ssm") + kinds.count("linear")
    q = ceil_div(model.num_attention_heads, tp)
    if model.attention == "mla":  # absorbed MLA: scores over the latent + rope dims, values over the latent
        pair_flops = q * (2.0 * (model.mla_kv_lora_rank + model.mla_rope_head_dim) + 2.0 * model.mla_kv_lora_rank)
    else:
        pair_flops = 4.0 * q * model.head_dim
    return AttentionShape(full_layers=kinds.count("full"), sliding_layers=kinds.count("sliding"),
                          state_layers=n_state, pair_flops=pair_flops,
                          kv_bytes_per_token=kv_layer_bytes_per_token(model, kv_element_bytes, tp),
                          qo_bytes_per_token=2.0 * q * model.head_dim * act_bytes,
                          state_bytes=ssm_state_bytes(model, tp) if n_state else 0.0)
