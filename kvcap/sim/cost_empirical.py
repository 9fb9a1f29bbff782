"""A measured step-time model (``serving.step_cost``) in place of the roofline: what ``kvcap calibrate`` fits.

Why a second cost model: the roofline prices a step from a GPU's datasheet and preset kernel timings; a server
already measured is better described by its own coefficients. A step takes

    base·passes + per_decode·(sequences that sample) + per_prefill_token·(prompt tokens)
        + per_context_token·(decode KV) + per_waiting·(sequences that sample)·(requests waiting),
    at least floor·passes

where passes are the forward passes the engine runs for the step (1, but for llama.cpp's split KV), the sequences
that sample are the decoders plus the prefill chunks (``BatchShape.n_sampled``: a prompt that finishes in the step
samples its first token; engines also compute a row of logits for a partial chunk) and decode KV is the sum of the
decoders' context lengths. It implements :class:`~kvcap.sim.step_cost.StepCostModel`, as the roofline does, with the
pure-decode spans in closed form. It has no bytes or FLOPs: the breakdown puts the per-sequence and per-token terms
under ``gemm_s``, the context term under ``attn_s``, ``base`` under ``overhead_s``, and calls every step
compute-bound (there is no roofline to say otherwise).
"""

from __future__ import annotations

import numpy as np

from kvcap.sim.batch_shape import BatchShape
from kvcap.sim.step_cost import IterationCost, StepCostModel
from kvcap.specs.model import ModelSpec


class EmpiricalCost(StepCostModel):
    """Linear step time (seconds per unit; see the module docstring); ``model`` is kept for the replica's
    sliding-window lookup and reports. Treat as read-only.

    A plain class, not a dataclass: compiled, the interface's ``model`` attribute would read as a default."""

    __slots__ = ("base", "floor", "model", "per_context_token", "per_decode", "per_prefill_token", "per_waiting")

    def __init__(self, model: ModelSpec, *, base: float, per_decode: float, per_prefill_token: float,
                 per_context_token: float, floor: float = 0.0, per_waiting: float = 0.0) -> None:
        self.model = model
        self.base = base
        self.per_decode = per_decode
        self.per_prefill_token = per_prefill_token
        self.per_context_token = per_context_token
        self.floor = floor
        """Seconds a forward pass takes at least (``StepCost.floor``)."""
        self.per_waiting = per_waiting
        """Seconds per sequence that samples per request waiting at the server (``StepCost.per_waiting``)."""

    def iteration_time(self, batch: BatchShape) -> IterationCost:
        """One step over ``batch``; an empty batch costs nothing (as the roofline's)."""
        if batch.n_prefill_tokens + batch.n_decode <= 0:
            return IterationCost(bound="compute")
        rows = ((self.per_decode + self.per_waiting * batch.waiting) * batch.n_sampled
                + self.per_prefill_token * batch.n_prefill_tokens)
        attn = self.per_context_token * batch.decode_context_tokens
        fixed = self.base * batch.passes
        total = max(fixed + rows + attn, self.floor * batch.passes)
        fixed += total - (fixed + rows + attn)  # the floor's share is the step's fixed part
        return IterationCost(total_s=total, gemm_s=rows, attn_s=attn, overhead_s=fixed, compute_s=rows + attn,
                             bound="compute")

    def decode_step_times(self, batch: BatchShape, steps: int) -> np.ndarray:
        """Each of ``steps`` pure-decode steps, every context growing by one per step: a line in the step index."""
        if steps <= 0 or batch.n_decode <= 0:
            return np.zeros(0)
        if batch.n_prefill_tokens or batch.n_prefill_seqs:
            raise ValueError("decode_step_times takes a pure-decode batch (no prefill chunks)")
        first, slope = self._decode_line(batch)
        times = first + slope * np.arange(steps, dtype=float)
        return np.maximum(times, self.floor * batch.passes) if self.floor else times

    def step_time(self, batch: BatchShape) -> float:
        """``iteration_time(batch).total_s``."""
        return self.iteration_time(batch).total_s

    def decode_step_ends(self, batch: BatchShape, steps: int, t0: float) -> np.ndarray:
        """The ends of a span's steps: ``t0 + cumsum(decode_step_times(batch, steps))``."""
        ends = self.decode_step_times(batch, steps).cumsum()
        ends += t0
        return ends

    def decode_steps_time(self, batch: BatchShape, steps: int) -> float:
        """Σ of :meth:`decode_step_times`, in closed form."""
        if batch.n_prefill_tokens or batch.n_prefill_seqs:
            raise ValueError("decode_steps_time takes a pure-decode batch (no prefill chunks)")
        if steps <= 0 or batch.n_decode <= 0:
            return 0.0
        first, slope = self._decode_line(batch)
        low = self.floor * batch.passes
        if first >= low:
            return steps * first + slope * steps * (steps - 1) / 2
        # the line starts under the floor: the steps before it climbs past the floor take the floor
        under = steps if slope <= 0 else min(steps, int(np.ceil((low - first) / slope)))
        rest = steps - under
        start = first + slope * under
        return under * low + rest * start + slope * rest * (rest - 1) / 2

    def _decode_line(self, batch: BatchShape) -> tuple[float, float]:
        """(first step's seconds, growth per step) of a pure-decode span."""
        n = batch.n_decode
        first = (self.base * batch.passes + (self.per_decode + self.per_waiting * batch.waiting) * n
                 + self.per_context_token * batch.decode_context_tokens)
        return first, self.per_context_token * n
