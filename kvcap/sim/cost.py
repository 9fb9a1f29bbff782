"""Time of one serving-engine iteration on one GPU of a tensor-parallel group: a calibrated roofline.

Why a roofline and not a table of measured kernels: the simulator must price batches of any shape, for any
model preset and GPU, millions of times per run. Each operator class is priced as
``max(FLOPs / (peak × e_c), bytes / (HBM bandwidth × e_m)) + c0``; the classes run back to back (engines do
not overlap a layer's GEMMs with its attention), so their times add:

* GEMMs (QKV, O, gate+up, down, MoE experts, LM head): weights read once per step, activations in and out;
  past one GEMM tile the compute side counts tokens rounded up to the tile (``gemm_token_tile``), the
  measured staircase.
* attention: KV read for every token each sequence attends to, KV written for the new tokens, and the
  attention FLOPs (quadratic for prefill, linear in context for decode); kernels not measured here, so it
  uses the GEMM efficiencies unless the calibration names its own.
* elementwise ops (norms, rotary, activation, residual add, embedding): memory-bound with a latency floor.
* tensor-parallel all-reduces: two per layer of tokens × hidden × activation bytes, ring over the link.

Efficiencies come from ``kvcap/sim/calibration/<gpu>.yaml`` (fitted by ``scripts/calibrate_cost_model.py``
from Vidur's measured A100 kernel timings; see docs/cost-model.md). KV bytes come from :mod:`kvcap.plan`.
A :class:`CostModel` precomputes every per-model coefficient, so one call is a few dozen float operations
and a batch is described by totals (:class:`BatchShape`), which also gives pure-decode spans in closed form.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any, Literal

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field

from kvcap.errors import InputError
from kvcap.plan import (
    DTYPE_BYTES,
    kv_element_bytes,
    kv_heads_per_gpu,
    kv_layer_bytes_per_token,
    ssm_state_bytes,
)
from kvcap.specs.hardware import GpuSpec, LinkSpec, host_link_for
from kvcap.specs.model import ModelSpec

Bound = Literal["compute", "memory"]

CALIBRATION_DIR = "calibration"
DEFAULT_CALIBRATION = "a100"
"""GPUs without their own file borrow this one's efficiencies (flagged by ``Calibration.defaulted_from``)."""


# --------------------------------------------------------------------------------------------- calibration


class Calibration(BaseModel):
    """Fitted efficiencies and overheads for one GPU family; see docs/cost-model.md for how each was fitted."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    gpu: str
    """The GPU preset whose nominal peak and bandwidth the efficiencies are relative to."""
    applies_to: tuple[str, ...] = ()
    source: str = ""
    compute_efficiency: float = Field(gt=0, le=1)
    """e_c: achieved / nominal dense tensor FLOP/s of large GEMMs."""
    memory_efficiency: float = Field(gt=0, le=1)
    """e_m: achieved / nominal HBM bandwidth of weight-streaming (small-batch) GEMMs."""
    gemm_op_overhead_s: float = Field(ge=0)
    """c0: fixed time added to every GEMM op (launch, ramp, tail)."""
    gemm_token_tile: int = Field(ge=1)
    """Past one tile, tokens are rounded up to a multiple of this on the compute side (the GEMM M-tile): the
    measured staircase. Below one tile the compute side counts the tokens themselves (small-M and GEMV
    kernels; the data cannot tell, the memory side wins there)."""
    elementwise_efficiency: float = Field(gt=0, le=1)
    elementwise_op_floor_s: float = Field(ge=0)
    """An elementwise op never takes less than this (it is a floor, not an addend: that fits the data)."""
    attention_compute_efficiency: float | None = Field(default=None, gt=0, le=1)
    """None: not measured, use compute_efficiency."""
    attention_memory_efficiency: float | None = Field(default=None, gt=0, le=1)
    """None: not measured, use memory_efficiency."""
    attention_op_overhead_s: float | None = Field(default=None, ge=0)
    """None: not measured, use gemm_op_overhead_s (one attention kernel per attention layer)."""
    step_overhead_s: float = Field(default=0.0, ge=0)
    """CPU-side scheduling, sampling, input preparation per step; not in kernel data (0 unless set)."""
    all_reduce_latency_s: float = Field(ge=0)
    """Fixed time of one all-reduce besides link hops (NCCL launch and synchronisation)."""
    nvlink_efficiency: float = Field(gt=0, le=1)
    """Achieved ring bus bandwidth / nominal per-direction NVLink bandwidth (fitted on 2-GPU all-reduce)."""
    defaulted_from: str | None = None
    """Set when this GPU had no file of its own and borrowed another's numbers."""
    fit: dict[str, Any] = Field(default_factory=dict)
    """Fit errors and fitting metadata, as written by scripts/calibrate_cost_model.py (not used for costing)."""

    @property
    def attn_compute_efficiency(self) -> float:
        return self.attention_compute_efficiency or self.compute_efficiency

    @property
    def attn_memory_efficiency(self) -> float:
        return self.attention_memory_efficiency or self.memory_efficiency

    @property
    def attn_op_overhead_s(self) -> float:
        return self.gemm_op_overhead_s if self.attention_op_overhead_s is None else self.attention_op_overhead_s


def calibration_names() -> tuple[str, ...]:
    root = resources.files("kvcap.sim").joinpath(CALIBRATION_DIR)
    return tuple(sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".yaml")))


@cache
def _read_calibration(name: str) -> Calibration:
    text = resources.files("kvcap.sim").joinpath(CALIBRATION_DIR, f"{name}.yaml").read_text()
    return Calibration(**(yaml.safe_load(text) or {}))


def load_calibration(gpu: GpuSpec | str) -> Calibration:
    """The GPU's own file (``<key>.yaml``, else its family ``a100.yaml`` for ``a100-80gb``), else the default's.

    A borrowed calibration keeps the default's efficiencies but says so in ``defaulted_from``.
    """
    key = (gpu.key or gpu.name) if isinstance(gpu, GpuSpec) else gpu
    key = key.lower()
    names = calibration_names()
    for candidate in (key, key.split("-")[0]):
        if candidate in names:
            return _read_calibration(candidate)
    for name in names:
        calib = _read_calibration(name)
        if key in calib.applies_to:
            return calib
    base = _read_calibration(DEFAULT_CALIBRATION)
    return base.model_copy(update={"gpu": key, "applies_to": (key,), "defaulted_from": DEFAULT_CALIBRATION})


# ---------------------------------------------------------------------------------------------- batch shape


def _window_sum(context: int, tokens: int, window: int) -> int:
    """Σ_{i=1..tokens} min(context + i, window): query-key pairs of a chunk on a sliding-window layer."""
    lo, hi = context + 1, context + tokens
    if hi <= window:
        return (lo + hi) * tokens // 2
    if lo > window:
        return tokens * window
    inside = window - lo + 1
    return (lo + window) * inside // 2 + (tokens - inside) * window


@dataclass(slots=True)
class BatchShape:
    """One iteration's work as totals, so a step costs O(1) whatever the batch size.

    Prefill chunks: ``n_prefill_tokens`` new tokens in ``n_prefill_seqs`` chunks, which attend to
    ``prefill_context_tokens`` earlier tokens (chunked prefill, prefix-cache hits) and form
    ``prefill_attn_pairs`` = Σ (context × tokens + tokens(tokens+1)/2) causal query-key pairs. Decode:
    ``n_decode`` sequences, one token each, attending to ``decode_context_tokens`` cached tokens in all.
    The ``*_window_*`` fields are the same sums with every context capped at the sliding window (None: no
    sliding layers, or equal to the uncapped sums). Treat instances as values; build them with :meth:`of`.
    """

    n_prefill_tokens: int = 0
    n_prefill_seqs: int = 0
    prefill_context_tokens: int = 0
    prefill_attn_pairs: float = 0.0
    n_decode: int = 0
    decode_context_tokens: int = 0
    prefill_window_context_tokens: int | None = None
    prefill_window_attn_pairs: float | None = None
    decode_window_tokens: int | None = None

    @classmethod
    def of(cls, prefill: Iterable[tuple[int, int]] = (), decode: Iterable[int] = (),
           window: int | None = None) -> BatchShape:
        """From per-sequence lists: ``prefill`` as (chunk tokens, context before the chunk), ``decode`` as
        each decoding sequence's cached context; ``window`` is the model's sliding window, if any."""
        chunks = [(int(t), int(c)) for t, c in prefill if t > 0]
        contexts = [int(c) for c in decode]
        shape = cls(n_prefill_tokens=sum(t for t, _ in chunks), n_prefill_seqs=len(chunks),
                    prefill_context_tokens=sum(c for _, c in chunks),
                    prefill_attn_pairs=float(sum(c * t + t * (t + 1) // 2 for t, c in chunks)),
                    n_decode=len(contexts), decode_context_tokens=sum(contexts))
        if window:
            shape.prefill_window_context_tokens = sum(min(c, window) for _, c in chunks)
            shape.prefill_window_attn_pairs = float(sum(_window_sum(c, t, window) for t, c in chunks))
            shape.decode_window_tokens = sum(min(c, window) for c in contexts)
        return shape

    @property
    def n_tokens(self) -> int:
        return self.n_prefill_tokens + self.n_decode

    @property
    def n_sampled(self) -> int:
        """Rows of logits: one per decoding sequence and one per prefill chunk (engines compute them all)."""
        return self.n_decode + self.n_prefill_seqs

    def __add__(self, other: BatchShape) -> BatchShape:
        def win(a: BatchShape, field: str, full: str) -> Any:
            value = getattr(a, field)
            return getattr(a, full) if value is None else value

        windowed = any(getattr(s, f) is not None for s in (self, other)
                       for f in ("prefill_window_context_tokens", "prefill_window_attn_pairs",
                                 "decode_window_tokens"))
        out = BatchShape(self.n_prefill_tokens + other.n_prefill_tokens, self.n_prefill_seqs + other.n_prefill_seqs,
                         self.prefill_context_tokens + other.prefill_context_tokens,
                         self.prefill_attn_pairs + other.prefill_attn_pairs, self.n_decode + other.n_decode,
                         self.decode_context_tokens + other.decode_context_tokens)
        if windowed:
            for field, full in (("prefill_window_context_tokens", "prefill_context_tokens"),
                                ("prefill_window_attn_pairs", "prefill_attn_pairs"),
                                ("decode_window_tokens", "decode_context_tokens")):
                setattr(out, field, win(self, field, full) + win(other, field, full))
        return out


# ------------------------------------------------------------------------------------------------- results


@dataclass(slots=True)
class IterationCost:
    """One iteration on one GPU of the tp group. Seconds and bytes are per GPU; treat as read-only.

    ``total_s = gemm_s + attn_s + elem_s + comm_s + overhead_s``. ``compute_s`` and ``memory_s`` split the
    roofline time (everything but per-op overheads, communication and step overhead) by which side won each
    term (elementwise ops count as memory); ``bound`` names the larger: what a faster GPU would have to
    improve for this step.
    """

    total_s: float
    gemm_s: float
    """Linear layers and LM head, with their per-op overhead."""
    attn_s: float
    """Attention (and SSM state) kernels: KV reads and writes, attention FLOPs, per-layer overhead."""
    elem_s: float
    """Norms, rotary embedding, activation, residual add, embedding lookup."""
    comm_s: float
    """Tensor-parallel all-reduces (zero at tp=1); not overlapped with compute."""
    overhead_s: float
    """Fixed per-step overhead (Calibration.step_overhead_s)."""
    compute_s: float
    memory_s: float
    flops: float
    weight_read_bytes: float
    kv_read_bytes: float
    kv_write_bytes: float
    act_bytes: float
    """Activation traffic of GEMMs, attention inputs/outputs and elementwise ops."""
    comm_bytes: float
    """Bytes this GPU sends in the step's all-reduces (ring: 2(tp-1)/tp of each payload)."""
    bound: Bound


def _empty() -> IterationCost:
    return IterationCost(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, "memory")


# ---------------------------------------------------------------------------------------------- operators


@dataclass(frozen=True, slots=True)
class LinearOp:
    """One GEMM on one GPU: [tokens × k] @ [k × n]; weights read once, activations in and out."""

    name: str
    k: int
    n: int
    weight_bytes: float
    act_bytes_per_token: float

    @property
    def flops_per_token(self) -> float:
        return 2.0 * self.k * self.n


@dataclass(frozen=True, slots=True)
class ElementwiseOp:
    """One memory-bound elementwise kernel: bytes read plus written per token."""

    name: str
    bytes_per_token: float


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def weight_element_bytes(weights_dtype: str) -> float:
    if weights_dtype not in DTYPE_BYTES:
        raise InputError(f"unknown weights dtype {weights_dtype!r}: known {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[weights_dtype]


def embedding_element_bytes(weights_dtype: str) -> float:
    """Embeddings and LM head stay 16-bit in quantized checkpoints (as :func:`kvcap.plan.weights_bytes`)."""
    return DTYPE_BYTES[weights_dtype] if weights_dtype in ("fp32", "fp16", "bf16") else 2.0


def dense_layer_ops(model: ModelSpec, tp: int = 1, weights_dtype: str = "bf16", act_bytes: float = 2.0,
                    intermediate: int | None = None) -> tuple[LinearOp, ...]:
    """The four GEMMs of one GQA attention + gated-MLP layer on one GPU of a tp group (Vidur's op names).

    QKV is column-parallel (KV heads replicated once tp exceeds them, as :func:`kvcap.plan.kv_heads_per_gpu`),
    O and down are row-parallel, gate+up is one fused column-parallel GEMM.
    """
    wb = weight_element_bytes(weights_dtype)
    h, hd = model.hidden_size, model.head_dim
    q = _ceil_div(model.num_attention_heads, tp)
    kv = kv_heads_per_gpu(model, tp)
    inter = _ceil_div(intermediate or model.intermediate_size, tp)
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
    q = _ceil_div(model.num_attention_heads, tp)
    kv = kv_heads_per_gpu(model, tp)
    inter = _ceil_div(intermediate or model.intermediate_size, tp)
    return (ElementwiseOp("input_layernorm", 2 * h * act_bytes),
            ElementwiseOp("post_attention_layernorm", 2 * h * act_bytes),
            ElementwiseOp("attn_rope", 2 * (q + kv) * hd * act_bytes),
            ElementwiseOp("mlp_act", 3 * inter * act_bytes),
            ElementwiseOp("add", 3 * h * act_bytes))


def gemm_peak_flops(gpu: GpuSpec, weights_dtype: str) -> float:
    """Dense peak for the GEMMs: FP8 tensor cores for fp8 weights where the GPU has them, else 16-bit.

    int8/int4 are taken as weight-only quantization (dequantized to 16-bit in the kernel), the common case.
    """
    if weights_dtype == "fp8" and gpu.fp8_tflops:
        return gpu.fp8_tflops * 1e12
    if weights_dtype == "fp16" and gpu.fp16_tflops:
        return gpu.fp16_tflops * 1e12
    return gpu.bf16_tflops * 1e12


def default_tp_link(gpu: GpuSpec, calib: Calibration) -> LinkSpec:
    """The GPU's NVLink (per direction = half the bidirectional figure) with the fitted efficiency, else PCIe."""
    if gpu.nvlink_bytes_s:
        return LinkSpec(key="nvlink", name=f"NVLink ({gpu.name})", kind="nvlink",
                        bandwidth_bits_s=gpu.nvlink_bytes_s / 2 * 8, efficiency=calib.nvlink_efficiency,
                        latency_s=1e-6, source="GpuSpec.nvlink_bytes_s / 2; efficiency from the calibration")
    return host_link_for(gpu)


def all_reduce_coefficients(workers: int, link: LinkSpec, calib: Calibration) -> tuple[float, float]:
    """(fixed s, s per payload byte) of a ring all-reduce over ``workers`` GPUs: fixed latency + 2(p-1) hops,
    and 2(p-1)/p of the payload at the link's achieved bandwidth (NVLink: the calibration's efficiency)."""
    if workers <= 1:
        return 0.0, 0.0
    eff = calib.nvlink_efficiency if link.kind == "nvlink" else link.efficiency
    hops = 2 * (workers - 1)
    return calib.all_reduce_latency_s + hops * link.latency_s, hops / workers / (link.bytes_s * eff)


def all_reduce_time(nbytes: float, workers: int, link: LinkSpec, calib: Calibration) -> float:
    """Seconds of one all-reduce of ``nbytes`` (see :func:`all_reduce_coefficients`)."""
    fixed, per_byte = all_reduce_coefficients(workers, link, calib)
    return fixed + per_byte * nbytes if workers > 1 else 0.0


# --------------------------------------------------------------------------------------------- cost model


class CostModel:
    """Everything about (model, GPU, tp, dtypes, calibration) precomputed; :meth:`iteration_time` is cheap.

    Coefficients are stored already divided by the achieved peak or bandwidth, so a call only multiplies
    batch totals by constants and takes a handful of ``max``es.
    """

    __slots__ = ("_attn", "_comm", "_elem", "_gemm", "_head", "_moe", "_raw", "act_bytes", "calib", "gpu",
                 "kv_element_bytes", "link", "model", "tp", "weights_dtype")

    def __init__(self, model: ModelSpec, gpu: GpuSpec, *, tp: int = 1, weights_dtype: str = "bf16",
                 kv_dtype: str = "auto", act_bytes: float = 2.0, calib: Calibration | None = None,
                 tp_link: LinkSpec | None = None) -> None:
        if not isinstance(tp, int) or tp < 1:
            raise InputError(f"tensor parallel size must be a positive integer, got {tp!r}")
        if kv_dtype != "auto" and kv_dtype not in DTYPE_BYTES:
            raise InputError(f"unknown KV dtype {kv_dtype!r}: known auto, {', '.join(DTYPE_BYTES)}")
        wb = weight_element_bytes(weights_dtype)
        calib = calib or load_calibration(gpu)
        self.model, self.gpu, self.tp, self.calib = model, gpu, tp, calib
        self.weights_dtype, self.act_bytes = weights_dtype, act_bytes
        self.kv_element_bytes = kv_element_bytes(model, kv_dtype, weights_dtype)
        self.link = tp_link or default_tp_link(gpu, calib)

        bw = gpu.memory_bandwidth_bytes_s
        pc = gemm_peak_flops(gpu, weights_dtype) * calib.compute_efficiency
        bm = bw * calib.memory_efficiency
        pa = gpu.bf16_tflops * 1e12 * calib.attn_compute_efficiency
        ba = bw * calib.attn_memory_efficiency
        be = bw * calib.elementwise_efficiency
        c0 = calib.gemm_op_overhead_s
        h, ab = model.hidden_size, act_bytes
        moe = model.moe
        n_moe = moe.moe_layers if moe else 0
        n_dense = model.num_layers - n_moe

        # GEMM groups, each summed over the layers that hold it: (op, layers)
        groups: list[tuple[LinearOp, int]] = []
        known_params = 0.0
        if model.attention == "gqa" and model.attention_layers:
            qkv, o = dense_layer_ops(model, tp, weights_dtype, ab)[:2]
            groups += [(qkv, model.attention_layers), (o, model.attention_layers)]
            known_params += model.attention_layers * sum(op.k * op.n for op in dense_layer_ops(model, 1)[:2])
        if n_dense:
            groups += [(op, n_dense) for op in dense_layer_ops(model, tp, weights_dtype, ab)[2:]]
            known_params += n_dense * 3 * h * model.intermediate_size
        if moe and moe.shared_intermediate_size:
            shared = dense_layer_ops(model, tp, weights_dtype, ab, moe.shared_intermediate_size)[2:]
            groups += [(op, n_moe) for op in shared]
            known_params += n_moe * 3 * h * moe.shared_intermediate_size
        # routed experts: a fused MoE kernel per layer; weights of the experts the batch touches
        if moe:
            e_inter = _ceil_div(moe.expert_intermediate_size, tp)
            known_params += n_moe * moe.num_experts * 3 * h * moe.expert_intermediate_size
            moe_flops = n_moe * moe.experts_per_token * 2.0 * 3 * h * e_inter  # per token, all MoE layers
            moe_act = n_moe * moe.experts_per_token * (2 * h + 3 * e_inter) * ab
            self._moe: tuple[float, ...] | None = (
                moe_flops / pc, n_moe * 3 * h * e_inter * wb / bm,  # s per token; s per touched expert
                float(moe.num_experts), 1.0 - moe.experts_per_token / moe.num_experts,  # P(expert idle | token)
                moe_act / bm, 2 * n_moe * c0, moe_flops, n_moe * 3 * h * e_inter * wb, moe_act)
        else:
            self._moe = None
        # whatever the preset's parameter count holds beyond the shapes above (MLA and SSM projections,
        # routers): priced as dense GEMMs of hidden-sized activations, so weight bytes still add up
        layer_params = model.num_parameters - model.embedding_parameters
        residual = max(layer_params - known_params, 0.0)
        if residual > 0.01 * layer_params:
            groups.append((LinearOp("other", h, max(1, round(residual / model.num_layers / h / tp)),
                                    residual / model.num_layers / tp * wb, 2 * h * ab), model.num_layers))
        elif residual > 0:  # norms and biases: bytes only
            groups.append((LinearOp("other", 0, 0, residual / model.num_layers / tp * wb, 0.0), model.num_layers))
        self._gemm = tuple((op.flops_per_token * n / pc, op.weight_bytes * n / bm, op.act_bytes_per_token * n / bm,
                            (c0 * n) if op.k else 0.0, op.flops_per_token * n, op.weight_bytes * n,
                            op.act_bytes_per_token * n) for op, n in groups)
        eb = embedding_element_bytes(weights_dtype)
        vocab = _ceil_div(model.vocab_size, tp)
        head = LinearOp("lm_head", h, vocab, h * vocab * eb, (h + vocab) * ab)
        self._head = (head.flops_per_token / pc, head.weight_bytes / bm, head.act_bytes_per_token / bm, c0,
                      head.flops_per_token, head.weight_bytes, head.act_bytes_per_token)

        # elementwise: (s per token, floor, count, bytes per token)
        ew: list[tuple[ElementwiseOp, int]] = []
        per_layer = elementwise_layer_ops(model, tp, ab)
        norms, rope, add = per_layer[:2], per_layer[2], per_layer[4]
        ew += [(op, model.num_layers) for op in norms] + [(add, model.num_layers)]
        if model.attention_layers:
            ew.append((rope, model.attention_layers))
        if n_dense:
            ew.append((per_layer[3], n_dense))
        if moe:
            act_inter = moe.experts_per_token * moe.expert_intermediate_size + moe.shared_intermediate_size
            ew.append((elementwise_layer_ops(model, tp, ab, act_inter)[3], n_moe))
        ew += [(ElementwiseOp("final_norm", 2 * h * ab), 1), (ElementwiseOp("embedding", h * (eb + ab)), 1)]
        floor = calib.elementwise_op_floor_s
        self._elem = tuple((op.bytes_per_token / be, floor, float(n), op.bytes_per_token * n) for op, n in ew)

        # attention: full and sliding layers separately (different contexts), SSM/linear state
        kinds = model.layer_kinds
        n_full, n_slide = kinds.count("full"), kinds.count("sliding")
        n_state = kinds.count("ssm") + kinds.count("linear")
        q = _ceil_div(model.num_attention_heads, tp)
        if model.attention == "mla":  # absorbed MLA: scores over the latent + rope dims, values over the latent
            pair_flops = q * (2.0 * (model.mla_kv_lora_rank + model.mla_rope_head_dim) + 2.0 * model.mla_kv_lora_rank)
        else:
            pair_flops = 4.0 * q * model.head_dim
        kv_tok = kv_layer_bytes_per_token(model, self.kv_element_bytes, tp)
        qo_tok = 2.0 * q * model.head_dim * ab  # read Q, write O
        state = ssm_state_bytes(model, tp) if n_state else 0.0  # per sequence, read and written each step
        self._attn = (n_full * pair_flops / pa, n_full * kv_tok / ba, n_full * (kv_tok + qo_tok) / ba,
                      n_slide * pair_flops / pa, n_slide * kv_tok / ba, n_slide * (kv_tok + qo_tok) / ba,
                      2.0 * state / ba, (n_full + n_slide + n_state) * calib.attn_op_overhead_s)
        self._raw = (pair_flops * n_full, pair_flops * n_slide, kv_tok * n_full, kv_tok * n_slide,
                     kv_tok * (n_full + n_slide), qo_tok * (n_full + n_slide), state)

        # tensor-parallel all-reduces: two per layer (after attention / mixer and after the MLP)
        if tp > 1:
            n_ar = 2 * model.num_layers
            payload = h * ab  # bytes per token
            fixed, per_byte = all_reduce_coefficients(tp, self.link, calib)
            self._comm = (n_ar * fixed, n_ar * per_byte * payload, n_ar * payload * 2 * (tp - 1) / tp)
        else:
            self._comm = (0.0, 0.0, 0.0)

    # ------------------------------------------------------------------------------------------------ calls

    def iteration_time(self, batch: BatchShape) -> IterationCost:
        """Cost of one iteration over ``batch`` (see :class:`IterationCost` for the parts)."""
        t = batch.n_prefill_tokens + batch.n_decode
        if t <= 0:
            return _empty()
        tile = self.calib.gemm_token_tile
        tt = t if t <= tile else -(-t // tile) * tile  # compute side: whole GEMM tiles past the first
        gemm = compute = memory = flops = wbytes = abytes = 0.0
        for fc, wm, am, oc, f, w, a in self._gemm:
            dg, dc, dm = _roofline(fc * tt, wm + am * t, oc)
            gemm, compute, memory = gemm + dg, compute + dc, memory + dm
            flops += f * t
            wbytes += w
            abytes += a * t
        if self._moe is not None:
            fc, wm, n_exp, idle, am, oc, f, w, a = self._moe
            touched = n_exp * (1.0 - idle ** t)  # expected distinct experts hit by t tokens
            dg, dc, dm = _roofline(fc * t, wm * touched + am * t, oc)
            gemm, compute, memory = gemm + dg, compute + dc, memory + dm
            flops += f * t
            wbytes += w * touched
            abytes += a * t
        s = batch.n_decode + batch.n_prefill_seqs
        fc, wm, am, oc, f, w, a = self._head
        dg, dc, dm = _roofline(fc * (s if s <= tile else -(-s // tile) * tile), wm + am * s, oc)
        gemm, compute, memory = gemm + dg, compute + dc, memory + dm
        flops += f * s
        wbytes += w
        abytes += a * s

        elem = 0.0
        for sec, floor, n, b in self._elem:
            x = sec * t
            elem += n * (x if x > floor else floor)
            abytes += b * t
        memory += elem

        fpair, fkv, ftok, spair, skv, stok, state, attn_oc = self._attn
        raw = self._raw
        ctx = batch.prefill_context_tokens + batch.decode_context_tokens
        pairs = batch.prefill_attn_pairs + batch.decode_context_tokens
        c, m = fpair * pairs, fkv * ctx + ftok * t
        if c > m:
            attn = c
            compute += c
        else:
            attn = m
            memory += m
        kv_read = raw[2] * ctx
        flops += raw[0] * pairs
        if spair:
            wctx, wpairs = _windowed(batch)
            c, m = spair * wpairs, skv * wctx + stok * t
            if c > m:
                attn += c
                compute += c
            else:
                attn += m
                memory += m
            kv_read += raw[3] * wctx
            flops += raw[1] * wpairs
        kv_write = raw[4] * t
        if state:
            attn += state * s
            memory += state * s
            kv_read += raw[6] * s
            kv_write += raw[6] * s
        attn += attn_oc
        comm_fixed, comm_tok, comm_b = self._comm
        comm = comm_fixed + comm_tok * t
        overhead = self.calib.step_overhead_s
        return IterationCost(gemm + attn + elem + comm + overhead, gemm, attn, elem, comm, overhead, compute,
                             memory, flops, wbytes, kv_read, kv_write, abytes + raw[5] * t, comm_b * t,
                             "compute" if compute > memory else "memory")

    def decode_steps_time(self, batch: BatchShape, steps: int) -> float:
        """Total seconds of ``steps`` successive pure-decode iterations, every context growing by one per step.

        Only the attention term changes from step to step, and it is the max of two lines in the step index,
        so the sum is exact in closed form (O(1)); models with sliding-window layers are summed step by step
        with each windowed context growing until it reaches the window (O(steps)).
        """
        if batch.n_prefill_tokens or batch.n_prefill_seqs:
            raise ValueError("decode_steps_time takes a pure-decode batch (no prefill chunks)")
        if steps <= 0 or batch.n_decode <= 0:
            return 0.0
        n = batch.n_decode
        if self._attn[3]:  # sliding layers: each windowed context grows until it reaches the window
            window = self.model.sliding_window or 0
            start = batch.decode_context_tokens if batch.decode_window_tokens is None else batch.decode_window_tokens
            total = 0.0
            for i in range(steps):
                total += self.iteration_time(BatchShape(
                    n_decode=n, decode_context_tokens=batch.decode_context_tokens + i * n,
                    decode_window_tokens=min(start + i * n, n * window) if window else None)).total_s
            return total
        first = self.iteration_time(batch)
        fpair, fkv, ftok = self._attn[:3]
        ctx = batch.decode_context_tokens
        c0, m0 = fpair * ctx, fkv * ctx + ftok * n
        rest = first.total_s - max(c0, m0)  # everything but the full-attention roofline is constant
        return steps * rest + _sum_max_lines(c0, fpair * n, m0, fkv * n, steps)

    def decode_step_times(self, batch: BatchShape, steps: int) -> np.ndarray:
        """Seconds of each of ``steps`` successive pure-decode iterations (contexts growing by one per step).

        The per-step form of :meth:`decode_steps_time` (same sum), as one numpy vector: the simulator needs
        every step's end to time each token without looping in Python."""
        if steps <= 0 or batch.n_decode <= 0:
            return np.zeros(0)
        if batch.n_prefill_tokens or batch.n_prefill_seqs:
            raise ValueError("decode_step_times takes a pure-decode batch (no prefill chunks)")
        n = batch.n_decode
        if self._attn[3]:
            window = self.model.sliding_window or 0
            start = batch.decode_context_tokens if batch.decode_window_tokens is None else batch.decode_window_tokens
            return np.fromiter((self.iteration_time(BatchShape(
                n_decode=n, decode_context_tokens=batch.decode_context_tokens + i * n,
                decode_window_tokens=min(start + i * n, n * window) if window else None)).total_s
                for i in range(steps)), float, count=steps)
        first = self.iteration_time(batch)
        fpair, fkv = self._attn[0], self._attn[1]
        ctx = batch.decode_context_tokens
        c0, m0 = fpair * ctx, fkv * ctx + self._attn[2] * n
        i = np.arange(steps, dtype=float)
        return (first.total_s - max(c0, m0)) + np.maximum(c0 + fpair * n * i, m0 + fkv * n * i)

    def layer_times(self, tokens: int) -> tuple[float, float]:
        """(GEMM s, elementwise s) of one dense attention + MLP layer over ``tokens``: what Vidur measured."""
        if tokens <= 0:
            return 0.0, 0.0
        calib = self.calib
        pc = gemm_peak_flops(self.gpu, self.weights_dtype) * calib.compute_efficiency
        bm = self.gpu.memory_bandwidth_bytes_s * calib.memory_efficiency
        be = self.gpu.memory_bandwidth_bytes_s * calib.elementwise_efficiency
        tile = calib.gemm_token_tile
        tt = tokens if tokens <= tile else _ceil_div(tokens, tile) * tile
        gemm = sum(max(op.flops_per_token * tt / pc, (op.weight_bytes + op.act_bytes_per_token * tokens) / bm)
                   + calib.gemm_op_overhead_s
                   for op in dense_layer_ops(self.model, self.tp, self.weights_dtype, self.act_bytes))
        elem = sum(max(op.bytes_per_token * tokens / be, calib.elementwise_op_floor_s)
                   for op in elementwise_layer_ops(self.model, self.tp, self.act_bytes))
        return gemm, elem


def _windowed(batch: BatchShape) -> tuple[int, float]:
    """(KV tokens read, query-key pairs) on a sliding-window layer; uncapped sums where no window was given."""
    pc = batch.prefill_window_context_tokens
    pp = batch.prefill_window_attn_pairs
    dw = batch.decode_window_tokens
    if dw is None:
        dw = batch.decode_context_tokens
    return ((batch.prefill_context_tokens if pc is None else pc) + dw,
            (batch.prefill_attn_pairs if pp is None else pp) + dw)


def _sum_line(a: float, b: float, start: int, stop: int) -> float:
    """Σ_{i=start}^{stop-1} (a + b·i)."""
    n = stop - start
    return n * a + b * n * (start + stop - 1) / 2 if n > 0 else 0.0


def _sum_max_lines(a1: float, b1: float, a2: float, b2: float, k: int) -> float:
    """Σ_{i=0}^{k-1} max(a1 + b1·i, a2 + b2·i), exactly: the two lines cross at most once."""
    if b1 == b2:
        return k * max(a1, a2) + b1 * k * (k - 1) / 2
    if b1 < b2:  # make line 1 the steeper one
        a1, b1, a2, b2 = a2, b2, a1, b1
    cross = (a2 - a1) / (b1 - b2)  # line 1 >= line 2 from here on
    j = min(max(math.ceil(cross), 0), k)
    return _sum_line(a2, b2, 0, j) + _sum_line(a1, b1, j, k)


# ------------------------------------------------------------------------------------------ pure function

_CACHE: dict[tuple[Any, ...], tuple[Any, ...]] = {}
_CACHE_LIMIT = 256


def cost_model(model: ModelSpec, gpu: GpuSpec, *, tp: int = 1, weights_dtype: str = "bf16",
               kv_dtype: str = "auto", act_bytes: float = 2.0, calib: Calibration | None = None,
               tp_link: LinkSpec | None = None) -> CostModel:
    """A cached :class:`CostModel` for these arguments (keyed by object identity: specs are frozen)."""
    key = (id(model), id(gpu), tp, weights_dtype, kv_dtype, act_bytes, id(calib), id(tp_link))
    hit = _CACHE.get(key)
    if hit is not None and hit[0] is model and hit[1] is gpu and hit[2] is calib and hit[3] is tp_link:
        return hit[4]
    cm = CostModel(model, gpu, tp=tp, weights_dtype=weights_dtype, kv_dtype=kv_dtype, act_bytes=act_bytes,
                   calib=calib, tp_link=tp_link)
    if len(_CACHE) >= _CACHE_LIMIT:
        _CACHE.clear()
    _CACHE[key] = (model, gpu, calib, tp_link, cm)
    return cm


def _roofline(compute_s: float, memory_s: float, overhead_s: float) -> tuple[float, float, float]:
    """One op class: the slower of its compute and memory times plus its overhead, and which side bound it."""
    if compute_s > memory_s:
        return compute_s + overhead_s, compute_s, 0.0
    return memory_s + overhead_s, 0.0, memory_s


def iteration_time(model: ModelSpec, gpu: GpuSpec, batch: BatchShape, *, tp: int = 1,
                   weights_dtype: str = "bf16", kv_dtype: str = "auto", act_bytes: float = 2.0,
                   calib: Calibration | None = None, tp_link: LinkSpec | None = None) -> IterationCost:
    """Time of one engine iteration over ``batch`` on one GPU of a ``tp``-way tensor-parallel group.

    ``weights_dtype`` and ``kv_dtype`` as in :mod:`kvcap.plan` (``auto`` KV = 16-bit); ``calib`` defaults to
    :func:`load_calibration` for the GPU; ``tp_link`` defaults to the GPU's NVLink, else its PCIe link.
    """
    return cost_model(model, gpu, tp=tp, weights_dtype=weights_dtype, kv_dtype=kv_dtype, act_bytes=act_bytes,
                      calib=calib, tp_link=tp_link).iteration_time(batch)
