"""What one GPU holds: KV bytes per token and per sequence (GQA/MHA, MLA latents, sliding windows, SSM state),
weights and the activation peak, and the memory a serving engine keeps out of the KV pool — the way vLLM profiles
it. Pure functions; the simulator's cost model and tiers use the same ones."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvcap.specs.hardware import GpuSpec
from kvcap.specs.model import ModelSpec
from kvcap.specs.scenario import ServingSpec

DTYPE_BYTES: dict[str, float] = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp8": 1.0, "int8": 1.0,
                                 "int4": 0.5 + 2.5 / 128}
"""int4 includes a 16-bit scale and a 4-bit zero point per group of 128 (AWQ/GPTQ style)."""
SAMPLER_COPIES = 2
"""vLLM's profiling run samples max_num_seqs rows of fp32 logits; logits plus one working copy."""


def kv_element_bytes(model: ModelSpec, kv_dtype: str, weights_dtype: str) -> float:
    """'auto' means the model's 16-bit dtype (vLLM's default), also for fp8/int4 checkpoints."""
    if kv_dtype == "auto":
        return 4.0 if weights_dtype == "fp32" else 2.0
    return DTYPE_BYTES[kv_dtype]


def kv_heads_per_gpu(model: ModelSpec, tp: int) -> int:
    """KV heads one tensor-parallel rank holds (heads are replicated when tp exceeds them)."""
    return max(1, math.ceil(model.num_kv_heads / tp))


def kv_layer_bytes_per_token(model: ModelSpec, elem_bytes: float, tp: int = 1) -> float:
    """Bytes one attention layer stores per token on one GPU of a tp group (tp=1: the whole layer).

    GQA/MHA: K and V, one vector per KV head. MLA: one latent (kv_lora_rank + rope dims), no ×2, and every
    rank keeps the whole latent (it is not split by tensor parallelism).
    """
    if model.attention == "mla":
        return (model.mla_kv_lora_rank + model.mla_rope_head_dim) * elem_bytes
    return 2 * kv_heads_per_gpu(model, tp) * model.head_dim * elem_bytes


def kv_bytes_per_token(model: ModelSpec, elem_bytes: float, tp: int = 1, pp: int = 1) -> float:
    """Full-context rate: every attention layer holds this token (before any window is reached)."""
    return kv_layer_bytes_per_token(model, elem_bytes, tp) * model.attention_layers / pp


def ssm_state_bytes(model: ModelSpec, tp: int = 1, pp: int = 1, state_bytes: float = 2.0) -> float:
    """Fixed per-sequence state of SSM/linear layers (16-bit), split across tp ranks and pp stages."""
    n = sum(k in ("ssm", "linear") for k in model.layer_kinds)
    return n * model.ssm_state_elements * state_bytes / tp / pp


def round_up(n: int, block: int) -> int:
    return -(-n // block) * block


def kv_bytes_per_sequence(model: ModelSpec, tokens: int, elem_bytes: float, block_size: int = 16,
                          tp: int = 1, pp: int = 1) -> float:
    """KV one sequence of ``tokens`` tokens holds, in whole blocks; sliding layers hold min(T, W) tokens."""
    per_layer = kv_layer_bytes_per_token(model, elem_bytes, tp)
    full_tokens = round_up(tokens, block_size)
    window = model.sliding_window or tokens
    slide_tokens = round_up(min(tokens, window), block_size)
    n_full = sum(k == "full" for k in model.layer_kinds)
    n_slide = sum(k == "sliding" for k in model.layer_kinds)
    return per_layer * (n_full * full_tokens + n_slide * slide_tokens) / pp + ssm_state_bytes(model, tp, pp)


def weights_bytes(model: ModelSpec, dtype: str) -> float:
    """All parameters (MoE: every expert) at ``dtype``; embeddings stay 16-bit in quantized checkpoints."""
    if dtype in ("fp32", "fp16", "bf16"):
        return model.num_parameters * DTYPE_BYTES[dtype]
    emb = min(model.embedding_parameters, model.num_parameters)
    return (model.num_parameters - emb) * DTYPE_BYTES[dtype] + emb * 2.0


def activation_peak_bytes(model: ModelSpec, max_num_batched_tokens: int, max_num_seqs: int,
                          tp: int = 1, act_bytes: float = 2.0) -> float:
    """Peak transient memory of one forward pass over ``max_num_batched_tokens`` (vLLM's profiling run).

    Per token: a few hidden-size residual/norm buffers, the QKV projection, and the MLP's gate+up output plus
    its activation (3 × intermediate; MoE: for each routed expert); plus the sampler's fp32 logits for
    ``max_num_seqs`` rows.
    """
    q_kv = (model.num_attention_heads + 2 * model.num_kv_heads) * model.head_dim
    if model.moe is not None:
        inter = model.moe.experts_per_token * model.moe.expert_intermediate_size + model.moe.shared_intermediate_size
    else:
        inter = model.intermediate_size
    per_token = 4 * model.hidden_size + q_kv / tp + 3 * inter / tp
    sampler = max_num_seqs * model.vocab_size * 4.0 * SAMPLER_COPIES
    return max_num_batched_tokens * per_token * act_bytes + sampler


def resolved_kv_dtype(kv_dtype: str, weights_dtype: str) -> str:
    """The name of the KV dtype 'auto' resolves to (the model's 16-bit dtype, as kv_element_bytes counts it)."""
    if kv_dtype != "auto":
        return kv_dtype
    return weights_dtype if weights_dtype in ("fp32", "fp16", "bf16") else "bf16"


@dataclass(frozen=True)
class MemoryBudget:
    """One GPU's memory as the engine splits it (bytes): what is left for KV is ``usable`` (may be negative)."""

    weights_total: float
    weights_gpu: float
    activation: float
    budget: float
    usable: float


def memory_budget(model: ModelSpec, gpu_memory_bytes: float, sv: ServingSpec, weights_dtype: str,
                  tp: int, pp: int) -> MemoryBudget:
    """GPU memory × utilization − this GPU's share of the weights − activation peak − runtime overhead − reserve."""
    w_total = weights_bytes(model, weights_dtype)
    w_gpu = w_total / (tp * pp)
    act = activation_peak_bytes(model, sv.max_num_batched_tokens, sv.max_num_seqs, tp)
    budget = gpu_memory_bytes * sv.gpu_memory_utilization
    return MemoryBudget(weights_total=w_total, weights_gpu=w_gpu, activation=act, budget=budget,
                        usable=budget - w_gpu - act - sv.runtime_overhead - sv.reserve)


def no_room_problem(model: ModelSpec, gpu: GpuSpec, sv: ServingSpec, weights_dtype: str, tp: int, pp: int,
                    mem: MemoryBudget) -> str | None:
    """Why no KV cache at all can exist on one GPU (weights over the budget, or nothing left after them); None: some."""
    if mem.weights_gpu >= mem.budget:
        return (f"{model.name} weights ({mem.weights_gpu / 2**30:.1f} GiB per GPU at {weights_dtype}, tp={tp}, "
                f"pp={pp}) do not fit in {gpu.memory_bytes / 2**30:.1f} GiB × {sv.gpu_memory_utilization:g} "
                f"utilization on {gpu.name}: use more GPUs per replica, a smaller weights dtype or a bigger GPU")
    if mem.usable <= 0:
        return (f"no memory left for KV cache on {gpu.name}: budget {mem.budget / 2**30:.2f} GiB − weights "
                f"{mem.weights_gpu / 2**30:.2f} GiB − activations {mem.activation / 2**30:.2f} GiB − "
                f"overhead/reserve {(sv.runtime_overhead + sv.reserve) / 2**30:.2f} GiB ≤ 0")
    return None


def given_pool(mem: MemoryBudget, kv_tokens: int, kv_bytes_per_token_per_gpu: float,
               block_size: int) -> MemoryBudget:
    """The budget with ``usable`` set to a pool known in tokens (``serving.kv_tokens``), whole blocks only."""
    usable = (kv_tokens // block_size) * block_size * kv_bytes_per_token_per_gpu
    return MemoryBudget(weights_total=mem.weights_total, weights_gpu=mem.weights_gpu, activation=mem.activation,
                        budget=mem.budget, usable=usable)


def slot_tokens(pool_tokens: int, slots: int) -> int:
    """llama.cpp split KV: each of the slots gets an even share of the pool."""
    return pool_tokens // slots


def kv_blocks(usable_bytes: float, kv_bytes_per_token_per_gpu: float, block_size: int) -> int:
    """Whole KV blocks in the usable bytes of one GPU (none when nothing is usable)."""
    return max(0, int(usable_bytes // (kv_bytes_per_token_per_gpu * block_size)))
