"""Time of one serving-engine iteration on one GPU of a tensor-parallel group: a calibrated roofline, summed.

Each operator class of a step is priced as ``max(FLOPs / (peak × e_c), bytes / (HBM bandwidth × e_m)) + c0``
(:mod:`kvcap.sim.roofline`); the classes run back to back (engines do not overlap a layer's GEMMs with its
attention), so their times add:

* GEMMs (QKV, O, gate+up, down, MoE experts, LM head): weights read once per step, activations in and out;
  past one GEMM tile the compute side counts tokens rounded up to the tile (``gemm_token_tile``), the
  measured staircase.
* attention: KV read for every token each sequence attends to, KV written for the new tokens, and the
  attention FLOPs (quadratic for prefill, linear in context for decode); kernels not measured here, so it
  uses the GEMM efficiencies unless the calibration names its own.
* elementwise ops (norms, rotary, activation, residual add, embedding): memory-bound with a latency floor.
* tensor-parallel all-reduces: two per layer of tokens × hidden × activation bytes, ring over the link.

Which operators a model runs comes from :mod:`kvcap.sim.model_shape`; efficiencies from
:mod:`kvcap.sim.calibration_io` (``kvcap/sim/calibration/<gpu>.yaml``, fitted by
``scripts/calibrate_cost_model.py`` from Vidur's measured A100 kernel timings; see docs/cost-model.md).
A :class:`CostModel` precomputes every per-model coefficient, so one call is a few dozen float operations
and a batch is described by totals (:class:`~kvcap.sim.batch_shape.BatchShape`), which also gives pure-decode
spans in closed form.
"""

from __future__ import annotations

import math
from itertools import accumulate
from typing import Any

import numpy as np

from kvcap.errors import InputError
from kvcap.plan import DTYPE_BYTES, kv_element_bytes
from kvcap.sim.batch_shape import BatchShape, windowed_totals
from kvcap.sim.calibration_io import Calibration, load_calibration
from kvcap.sim.cost_terms import (
    LinearStep,
    all_reduce_terms,
    attention_terms,
    attention_totals,
    elementwise_terms,
    gemm_terms,
    lm_head_terms,
    routed_expert_terms,
)
from kvcap.sim.model_shape import (
    attention_shape,
    ceil_div,
    dense_layer_ops,
    elementwise_groups,
    elementwise_layer_ops,
    gemm_groups,
    lm_head_op,
    routed_experts,
    weight_element_bytes,
)
from kvcap.sim.roofline import (
    AchievedRates,
    default_tp_link,
    roofline,
)
from kvcap.sim.step_cost import IterationCost, StepCostModel
from kvcap.specs.hardware import GpuSpec, LinkSpec
from kvcap.specs.model import ModelSpec

# --------------------------------------------------------------------------------------------- cost model


_CLEAR = 1.0 + 1e-9
"""A line leads the other by this factor at both ends of a span: it leads at every step, rounding and all."""
_PY_STEPS = 48
"""Spans up to this many steps get their step ends summed in Python (:meth:`CostModel.decode_step_ends`)."""

LINEAR_CACHE = 1 << 16
"""Most (tokens, rows) pairs a cost model remembers the step terms of (a run meets a few thousand)."""


class CostModel(StepCostModel):
    """Everything about (model, GPU, tp, dtypes, calibration) precomputed; :meth:`iteration_time` is cheap.

    Coefficients are stored already divided by the achieved peak or bandwidth, so a call only multiplies
    batch totals by constants and takes a handful of ``max``es.
    """

    __slots__ = ("_attn", "_comm", "_elem", "_gemm", "_head", "_linear", "_moe", "_raw", "act_bytes", "calib",
                 "gpu", "kv_element_bytes", "link", "model", "tp", "weights_dtype")

    def __init__(self, model: ModelSpec, gpu: GpuSpec, *, tp: int = 1, weights_dtype: str = "bf16",
                 kv_dtype: str = "auto", act_bytes: float = 2.0, calib: Calibration | None = None,
                 tp_link: LinkSpec | None = None) -> None:
        if not isinstance(tp, int) or tp < 1:
            raise InputError(f"tensor parallel size must be a positive integer, got {tp!r}")
        if kv_dtype != "auto" and kv_dtype not in DTYPE_BYTES:
            raise InputError(f"unknown KV dtype {kv_dtype!r}: known auto, {', '.join(DTYPE_BYTES)}")
        weight_element_bytes(weights_dtype)  # raises for an unknown weights dtype, before any other work
        calib = calib or load_calibration(gpu)
        self.model, self.gpu, self.tp, self.calib = model, gpu, tp, calib
        self.weights_dtype, self.act_bytes = weights_dtype, act_bytes
        self.kv_element_bytes = kv_element_bytes(model, kv_dtype, weights_dtype)
        self.link = tp_link or default_tp_link(gpu, calib)
        rates = AchievedRates.of(gpu, weights_dtype, calib)
        c0 = calib.gemm_op_overhead_s
        self._gemm = gemm_terms(gemm_groups(model, tp, weights_dtype, act_bytes), rates, c0)
        self._moe = routed_expert_terms(routed_experts(model, tp, weights_dtype, act_bytes), rates, c0)
        self._head = lm_head_terms(lm_head_op(model, tp, weights_dtype, act_bytes), rates, c0)
        self._elem = elementwise_terms(elementwise_groups(model, tp, weights_dtype, act_bytes), rates, calib)
        shape = attention_shape(model, tp, self.kv_element_bytes, act_bytes)
        self._attn = attention_terms(shape, rates, calib)
        self._raw = attention_totals(shape)
        self._comm = all_reduce_terms(model, tp, act_bytes, self.link, calib)
        self._linear: dict[tuple[int, int], LinearStep] = {}
        """(tokens, sampled rows) → the step's terms that depend on nothing else (:meth:`_linear_terms`)."""

    # ------------------------------------------------------------------------------------------------ calls

    def iteration_time(self, batch: BatchShape) -> IterationCost:
        """Cost of one iteration over ``batch`` (see :class:`IterationCost` for the parts)."""
        if batch.n_prefill_tokens + batch.n_decode <= 0:
            return IterationCost(bound="memory")
        return self._parts(batch)

    def step_time(self, batch: BatchShape) -> float:
        """``iteration_time(batch).total_s`` (the simulator's per-step call)."""
        if batch.n_prefill_tokens + batch.n_decode <= 0:
            return 0.0
        return self._parts(batch).total_s

    def _parts(self, batch: BatchShape) -> IterationCost:
        """:meth:`iteration_time` of a non-empty batch."""
        t = batch.n_prefill_tokens + batch.n_decode
        s = batch.n_decode + batch.n_prefill_seqs
        lin = self._linear.get((t, s))
        if lin is None:
            lin = self._linear_terms(t, s)
            if len(self._linear) < LINEAR_CACHE:
                self._linear[(t, s)] = lin
        compute, memory, flops = lin.compute_s, lin.memory_s, lin.flops

        at = self._attn
        raw = self._raw
        ctx = batch.prefill_context_tokens + batch.decode_context_tokens
        pairs = batch.prefill_attn_pairs + batch.decode_context_tokens
        c, m = at.full_pair_s * pairs, at.full_context_s * ctx + at.full_token_s * t
        if c > m:
            attn = c
            compute += c
        else:
            attn = m
            memory += m
        kv_read = raw.full_kv_bytes * ctx
        flops += raw.full_pair_flops * pairs
        if at.sliding_pair_s:
            wctx, wpairs = windowed_totals(batch)
            c, m = at.sliding_pair_s * wpairs, at.sliding_context_s * wctx + at.sliding_token_s * t
            if c > m:
                attn += c
                compute += c
            else:
                attn += m
                memory += m
            kv_read += raw.sliding_kv_bytes * wctx
            flops += raw.sliding_pair_flops * wpairs
        kv_write = raw.kv_write_bytes * t
        state = at.state_s
        if state:
            attn += state * s
            memory += state * s
            kv_read += raw.state_bytes * s
            kv_write += raw.state_bytes * s
        attn += at.overhead_s
        ar = self._comm
        comm = ar.fixed_s + ar.s_per_token * t
        overhead = self.calib.step_overhead_s
        gemm, elem = lin.gemm_s, lin.elem_s
        return IterationCost(
            total_s=gemm + attn + elem + comm + overhead, gemm_s=gemm, attn_s=attn, elem_s=elem, comm_s=comm,
            overhead_s=overhead, compute_s=compute, memory_s=memory, flops=flops, weight_read_bytes=lin.weight_bytes,
            kv_read_bytes=kv_read, kv_write_bytes=kv_write, act_bytes=lin.act_bytes + raw.qo_bytes * t,
            comm_bytes=ar.bytes_per_token * t, bound="compute" if compute > memory else "memory")

    def _linear_terms(self, t: int, s: int) -> LinearStep:
        """The terms of a step over ``t`` tokens and ``s`` sampled rows that depend on nothing else (everything but
        attention and communication), so a run's steps share them (cached per model) and pay only for their
        attention."""
        tile = self.calib.gemm_token_tile
        tt = t if t <= tile else -(-t // tile) * tile  # compute side: whole GEMM tiles past the first
        gemm = compute = memory = flops = wbytes = abytes = 0.0
        for g in self._gemm:
            dg, dc, dm = roofline(g.compute_s_per_token * tt, g.weight_s + g.act_s_per_token * t, g.overhead_s)
            gemm, compute, memory = gemm + dg, compute + dc, memory + dm
            flops += g.flops_per_token * t
            wbytes += g.weight_bytes
            abytes += g.act_bytes_per_token * t
        moe = self._moe
        if moe is not None:
            touched = moe.experts * (1.0 - moe.idle ** t)  # expected distinct experts hit by t tokens
            dg, dc, dm = roofline(moe.compute_s_per_token * t, moe.weight_s_per_expert * touched
                                  + moe.act_s_per_token * t, moe.overhead_s)
            gemm, compute, memory = gemm + dg, compute + dc, memory + dm
            flops += moe.flops_per_token * t
            wbytes += moe.bytes_per_expert * touched
            abytes += moe.act_bytes_per_token * t
        h = self._head
        dg, dc, dm = roofline(h.compute_s_per_token * (s if s <= tile else -(-s // tile) * tile),
                              h.weight_s + h.act_s_per_token * s, h.overhead_s)
        gemm, compute, memory = gemm + dg, compute + dc, memory + dm
        flops += h.flops_per_token * s
        wbytes += h.weight_bytes
        abytes += h.act_bytes_per_token * s

        elem = 0.0
        for e in self._elem:
            x = e.s_per_token * t
            floor = e.floor_s
            elem += e.count * (x if x > floor else floor)
            abytes += e.bytes_per_token * t
        memory += elem

        return LinearStep(gemm_s=gemm, compute_s=compute, memory_s=memory, flops=flops, weight_bytes=wbytes,
                          act_bytes=abytes, elem_s=elem)

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
        if self._attn.sliding_pair_s:  # sliding layers: each windowed context grows until it reaches the window
            window = self.model.sliding_window or 0
            start = batch.decode_context_tokens if batch.decode_window_tokens is None else batch.decode_window_tokens
            total = 0.0
            for i in range(steps):
                total += self.iteration_time(BatchShape(
                    n_decode=n, decode_context_tokens=batch.decode_context_tokens + i * n,
                    decode_window_tokens=min(start + i * n, n * window) if window else None)).total_s
            return total
        rest, c0, bc, m0, bm = self._decode_lines(batch)  # everything but the full-attention roofline is constant
        return steps * rest + _sum_max_lines(c0, bc, m0, bm, steps)

    def decode_step_times(self, batch: BatchShape, steps: int) -> np.ndarray:
        """Seconds of each of ``steps`` successive pure-decode iterations (contexts growing by one per step).

        The per-step form of :meth:`decode_steps_time` (same sum), as one numpy vector: the simulator needs
        every step's end to time each token without looping in Python."""
        if steps <= 0 or batch.n_decode <= 0:
            return np.zeros(0)
        if batch.n_prefill_tokens or batch.n_prefill_seqs:
            raise ValueError("decode_step_times takes a pure-decode batch (no prefill chunks)")
        n = batch.n_decode
        if self._attn.sliding_pair_s:
            window = self.model.sliding_window or 0
            start = batch.decode_context_tokens if batch.decode_window_tokens is None else batch.decode_window_tokens
            return np.fromiter((self.iteration_time(BatchShape(
                n_decode=n, decode_context_tokens=batch.decode_context_tokens + i * n,
                decode_window_tokens=min(start + i * n, n * window) if window else None)).total_s
                for i in range(steps)), float, count=steps)
        rest, c0, bc, m0, bm = self._decode_lines(batch)
        i = np.arange(steps, dtype=float)
        lead = _leading_line(c0, bc, m0, bm, steps)
        if lead is not None:  # the max of the two lines is that line, step by step: one line's vector
            return rest + (lead[0] + lead[1] * i)
        return rest + np.maximum(c0 + bc * i, m0 + bm * i)

    def decode_step_ends(self, batch: BatchShape, steps: int, t0: float) -> np.ndarray:
        """``t0 + cumsum(decode_step_times(batch, steps))``, the same floats: the ends of a span's steps. A short
        span (most are) is summed in Python, cheaper than numpy's per-call overhead; one line, op for op."""
        if steps > _PY_STEPS or self._attn.sliding_pair_s or steps <= 0 or batch.n_decode <= 0 or batch.n_prefill_seqs:
            ends = self.decode_step_times(batch, steps).cumsum()
            ends += t0
            return ends
        rest, c0, bc, m0, bm = self._decode_lines(batch)
        if steps == 1:  # what the lines below give for one step (the leading line at step 0 is the larger)
            return np.array(((rest + (c0 if c0 > m0 else m0)) + t0,))
        lead = _leading_line(c0, bc, m0, bm, steps)
        if lead is not None:
            a, b = lead
            times = [rest + (a + b * i) for i in range(steps)]
        else:
            times = [rest + max(c0 + bc * i, m0 + bm * i) for i in range(steps)]
        return np.array([t + t0 for t in accumulate(times)])  # accumulate adds in order, as cumsum does

    def _decode_lines(self, batch: BatchShape) -> tuple[float, float, float, float, float]:
        """A full-attention pure-decode span's step i takes ``rest + max(c0 + bc·i, m0 + bm·i)`` seconds: the
        attention roofline's two lines and everything else (constant); returns (rest, c0, bc, m0, bm)."""
        n = batch.n_decode
        at = self._attn
        fpair, fkv = at.full_pair_s, at.full_context_s
        ctx = batch.decode_context_tokens
        c0, m0 = fpair * ctx, fkv * ctx + at.full_token_s * n
        return self.step_time(batch) - max(c0, m0), c0, fpair * n, m0, fkv * n

    def layer_times(self, tokens: int) -> tuple[float, float]:
        """(GEMM s, elementwise s) of one dense attention + MLP layer over ``tokens``: what Vidur measured."""
        if tokens <= 0:
            return 0.0, 0.0
        calib = self.calib
        rates = AchievedRates.of(self.gpu, self.weights_dtype, calib)
        pc, bm, be = rates.gemm_flops_s, rates.gemm_bytes_s, rates.elementwise_bytes_s
        tile = calib.gemm_token_tile
        tt = tokens if tokens <= tile else ceil_div(tokens, tile) * tile
        gemm = sum(max(op.flops_per_token * tt / pc, (op.weight_bytes + op.act_bytes_per_token * tokens) / bm)
                   + calib.gemm_op_overhead_s
                   for op in dense_layer_ops(self.model, self.tp, self.weights_dtype, self.act_bytes))
        elem = sum(max(op.bytes_per_token * tokens / be, calib.elementwise_op_floor_s)
                   for op in elementwise_layer_ops(self.model, self.tp, self.act_bytes))
        return gemm, elem


def _leading_line(a1: float, b1: float, a2: float, b2: float, steps: int) -> tuple[float, float] | None:
    """The line (a, b) of the two that is clearly above the other at step 0 and at step ``steps`` − 1, hence at
    every step in between, rounding included; None if they come close or cross."""
    last = steps - 1
    if a1 > a2 * _CLEAR and a1 + b1 * last > (a2 + b2 * last) * _CLEAR:
        return a1, b1
    if a2 > a1 * _CLEAR and a2 + b2 * last > (a1 + b1 * last) * _CLEAR:
        return a2, b2
    return None


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


def iteration_time(model: ModelSpec, gpu: GpuSpec, batch: BatchShape, *, tp: int = 1,
                   weights_dtype: str = "bf16", kv_dtype: str = "auto", act_bytes: float = 2.0,
                   calib: Calibration | None = None, tp_link: LinkSpec | None = None) -> IterationCost:
    """Time of one engine iteration over ``batch`` on one GPU of a ``tp``-way tensor-parallel group.

    ``weights_dtype`` and ``kv_dtype`` as in :mod:`kvcap.plan` (``auto`` KV = 16-bit); ``calib`` defaults to
    :func:`load_calibration` for the GPU; ``tp_link`` defaults to the GPU's NVLink, else its PCIe link.
    """
    return cost_model(model, gpu, tp=tp, weights_dtype=weights_dtype, kv_dtype=kv_dtype, act_bytes=act_bytes,
                      calib=calib, tp_link=tp_link).iteration_time(batch)
