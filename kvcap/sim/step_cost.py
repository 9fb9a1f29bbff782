"""What the simulator asks of a step-time model: :class:`StepCostModel`, and the breakdown of one step it
returns (:class:`IterationCost`).

Why an interface: the replica times its steps the same way whether the step time comes from the calibrated
roofline (:class:`kvcap.sim.cost.CostModel`) or from a measured line (:class:`kvcap.sim.cost_empirical.
EmpiricalCost`); both implement these calls, and callers are typed against them alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from kvcap.sim.batch_shape import BatchShape
from kvcap.specs.model import ModelSpec

Bound = Literal["compute", "memory"]


@dataclass(slots=True)
class IterationCost:
    """One iteration on one GPU of the tp group. Seconds and bytes are per GPU; treat as read-only; build it by
    keyword (a term left out is zero).

    ``total_s = gemm_s + attn_s + elem_s + comm_s + overhead_s``. ``compute_s`` and ``memory_s`` split the
    roofline time (everything but per-op overheads, communication and step overhead) by which side won each
    term (elementwise ops count as memory); ``bound`` names the larger: what a faster GPU would have to
    improve for this step.
    """

    total_s: float = 0.0
    gemm_s: float = 0.0
    """Linear layers and LM head, with their per-op overhead."""
    attn_s: float = 0.0
    """Attention (and SSM state) kernels: KV reads and writes, attention FLOPs, per-layer overhead."""
    elem_s: float = 0.0
    """Norms, rotary embedding, activation, residual add, embedding lookup."""
    comm_s: float = 0.0
    """Tensor-parallel all-reduces (zero at tp=1); not overlapped with compute."""
    overhead_s: float = 0.0
    """Fixed per-step overhead (Calibration.step_overhead_s)."""
    compute_s: float = 0.0
    memory_s: float = 0.0
    flops: float = 0.0
    weight_read_bytes: float = 0.0
    kv_read_bytes: float = 0.0
    kv_write_bytes: float = 0.0
    act_bytes: float = 0.0
    """Activation traffic of GEMMs, attention inputs/outputs and elementwise ops."""
    comm_bytes: float = 0.0
    """Bytes this GPU sends in the step's all-reduces (ring: 2(tp-1)/tp of each payload)."""
    bound: Bound = "memory"


class StepCostModel:
    """The calls a replica makes of its cost model. ``model`` is the model it prices (the replica reads its
    sliding window)."""

    __slots__ = ()

    model: ModelSpec

    def iteration_time(self, batch: BatchShape) -> IterationCost:
        """One step over ``batch``, term by term; an empty batch costs nothing."""
        raise NotImplementedError

    def step_time(self, batch: BatchShape) -> float:
        """``iteration_time(batch).total_s`` (the simulator's per-step call)."""
        raise NotImplementedError

    def decode_steps_time(self, batch: BatchShape, steps: int) -> float:
        """Total seconds of ``steps`` pure-decode steps, every context growing by one per step."""
        raise NotImplementedError

    def decode_step_times(self, batch: BatchShape, steps: int) -> np.ndarray:
        """Seconds of each of those steps, as one vector."""
        raise NotImplementedError

    def decode_step_ends(self, batch: BatchShape, steps: int, t0: float) -> np.ndarray:
        """``t0 + cumsum(decode_step_times(batch, steps))``: the ends of a span's steps."""
        raise NotImplementedError
