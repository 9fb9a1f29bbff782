"""The per-model coefficients a :class:`~kvcap.sim.cost.CostModel` precomputes, one frozen class per operator
family, and the functions that derive them from a model's shape and a GPU's achieved rates.

Seconds are already divided by the achieved rate, so a step's time is a few multiply-adds; the raw FLOPs and bytes
are kept beside them for what :class:`~kvcap.sim.step_cost.IterationCost` reports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import final

from kvcap.sim.calibration_io import Calibration
from kvcap.sim.model_shape import AttentionShape, RoutedExperts
from kvcap.sim.roofline import AchievedRates, ElementwiseOp, LinearOp, all_reduce_coefficients
from kvcap.specs.hardware import LinkSpec
from kvcap.specs.model import ModelSpec


@final
@dataclass(frozen=True, slots=True)
class LinearTerms:
    """One group of identical GEMMs in a step (or the LM head, per sampled row instead of per token)."""

    compute_s_per_token: float
    weight_s: float
    """Reading the weights, once per step."""
    act_s_per_token: float
    overhead_s: float
    flops_per_token: float
    weight_bytes: float
    act_bytes_per_token: float


@final
@dataclass(frozen=True, slots=True)
class ExpertTerms:
    """A step's routed MoE experts: the weights read are those of the experts its tokens touch."""

    compute_s_per_token: float
    weight_s_per_expert: float
    experts: float
    idle: float
    """P(an expert is idle | one token)."""
    act_s_per_token: float
    overhead_s: float
    flops_per_token: float
    bytes_per_expert: float
    act_bytes_per_token: float


@final
@dataclass(frozen=True, slots=True)
class ElementwiseTerms:
    """One kind of elementwise op, ``count`` of them per step."""

    s_per_token: float
    floor_s: float
    count: float
    bytes_per_token: float
    """Every op of the kind together."""


@final
@dataclass(frozen=True, slots=True)
class AttentionTerms:
    """Seconds of the attention (and SSM state) kernels, full-attention and sliding-window layers apart."""

    full_pair_s: float
    """Per causal query-key pair."""
    full_context_s: float
    """Per context token read."""
    full_token_s: float
    """Per new token (its KV written, Q and O)."""
    sliding_pair_s: float
    sliding_context_s: float
    sliding_token_s: float
    state_s: float
    """Per sequence: SSM state read and written."""
    overhead_s: float
    """Every attention and state kernel's fixed time."""


@final
@dataclass(frozen=True, slots=True)
class AttentionTotals:
    """The raw amounts of the attention kernels, summed over the layers of each kind."""

    full_pair_flops: float
    sliding_pair_flops: float
    full_kv_bytes: float
    """KV bytes read per context token."""
    sliding_kv_bytes: float
    kv_write_bytes: float
    """KV bytes written per new token."""
    qo_bytes: float
    """Q and O bytes per token."""
    state_bytes: float
    """SSM state bytes per sequence."""


@final
@dataclass(frozen=True, slots=True)
class AllReduceTerms:
    """The step's tensor-parallel all-reduces (zeros at tp=1)."""

    fixed_s: float
    s_per_token: float
    bytes_per_token: float
    """What this GPU sends."""


@final
@dataclass(frozen=True, slots=True)
class LinearStep:
    """The terms of a step that depend only on its tokens and sampled rows (everything but attention and
    communication): GEMMs, LM head, elementwise ops."""

    gemm_s: float
    compute_s: float
    memory_s: float
    flops: float
    weight_bytes: float
    act_bytes: float
    elem_s: float


def gemm_terms(groups: list[tuple[LinearOp, int]], rates: AchievedRates, c0: float) -> tuple[LinearTerms, ...]:
    """One :class:`LinearTerms` per group of ``n`` identical ops."""
    pc, bm = rates.gemm_flops_s, rates.gemm_bytes_s
    return tuple(LinearTerms(
        compute_s_per_token=op.flops_per_token * n / pc, weight_s=op.weight_bytes * n / bm,
        act_s_per_token=op.act_bytes_per_token * n / bm, overhead_s=(c0 * n) if op.k else 0.0,
        flops_per_token=op.flops_per_token * n, weight_bytes=op.weight_bytes * n,
        act_bytes_per_token=op.act_bytes_per_token * n) for op, n in groups)


def routed_expert_terms(experts: RoutedExperts | None, rates: AchievedRates, c0: float) -> ExpertTerms | None:
    """None without experts."""
    if experts is None:
        return None
    pc, bm = rates.gemm_flops_s, rates.gemm_bytes_s
    return ExpertTerms(
        compute_s_per_token=experts.flops_per_token / pc, weight_s_per_expert=experts.bytes_per_touched_expert / bm,
        experts=experts.experts, idle=experts.idle, act_s_per_token=experts.act_bytes_per_token / bm,
        overhead_s=experts.ops * c0, flops_per_token=experts.flops_per_token,
        bytes_per_expert=experts.bytes_per_touched_expert, act_bytes_per_token=experts.act_bytes_per_token)


def lm_head_terms(head: LinearOp, rates: AchievedRates, c0: float) -> LinearTerms:
    """As one :func:`gemm_terms` group, per sampled row."""
    pc, bm = rates.gemm_flops_s, rates.gemm_bytes_s
    return LinearTerms(
        compute_s_per_token=head.flops_per_token / pc, weight_s=head.weight_bytes / bm,
        act_s_per_token=head.act_bytes_per_token / bm, overhead_s=c0, flops_per_token=head.flops_per_token,
        weight_bytes=head.weight_bytes, act_bytes_per_token=head.act_bytes_per_token)


def elementwise_terms(groups: list[tuple[ElementwiseOp, int]], rates: AchievedRates,
                       calib: Calibration) -> tuple[ElementwiseTerms, ...]:
    be, floor = rates.elementwise_bytes_s, calib.elementwise_op_floor_s
    return tuple(ElementwiseTerms(s_per_token=op.bytes_per_token / be, floor_s=floor, count=float(n),
                                  bytes_per_token=op.bytes_per_token * n) for op, n in groups)


def attention_terms(a: AttentionShape, rates: AchievedRates, calib: Calibration) -> AttentionTerms:
    pa, ba = rates.attn_flops_s, rates.attn_bytes_s
    n_full, n_slide, kv_tok, qo_tok = a.full_layers, a.sliding_layers, a.kv_bytes_per_token, a.qo_bytes_per_token
    return AttentionTerms(
        full_pair_s=n_full * a.pair_flops / pa, full_context_s=n_full * kv_tok / ba,
        full_token_s=n_full * (kv_tok + qo_tok) / ba, sliding_pair_s=n_slide * a.pair_flops / pa,
        sliding_context_s=n_slide * kv_tok / ba, sliding_token_s=n_slide * (kv_tok + qo_tok) / ba,
        state_s=2.0 * a.state_bytes / ba,
        overhead_s=(n_full + n_slide + a.state_layers) * calib.attn_op_overhead_s)


def attention_totals(a: AttentionShape) -> AttentionTotals:
    n_full, n_slide, kv_tok = a.full_layers, a.sliding_layers, a.kv_bytes_per_token
    return AttentionTotals(
        full_pair_flops=a.pair_flops * n_full, sliding_pair_flops=a.pair_flops * n_slide,
        full_kv_bytes=kv_tok * n_full, sliding_kv_bytes=kv_tok * n_slide, kv_write_bytes=kv_tok * (n_full + n_slide),
        qo_bytes=a.qo_bytes_per_token * (n_full + n_slide), state_bytes=a.state_bytes)


def all_reduce_terms(model: ModelSpec, tp: int, act_bytes: float, link: LinkSpec,
                      calib: Calibration) -> AllReduceTerms:
    """Two all-reduces per layer (after attention / mixer and after the MLP)."""
    if tp <= 1:
        return AllReduceTerms(fixed_s=0.0, s_per_token=0.0, bytes_per_token=0.0)
    n_ar = 2 * model.num_layers
    payload = model.hidden_size * act_bytes  # bytes per token
    fixed, per_byte = all_reduce_coefficients(tp, link, calib)
    return AllReduceTerms(fixed_s=n_ar * fixed, s_per_token=n_ar * per_byte * payload,
                          bytes_per_token=n_ar * payload * 2 * (tp - 1) / tp)
