"""The cost model's fitted numbers: the :class:`Calibration` schema and its YAML files in ``kvcap/sim/calibration/``.

Why apart from the cost model: the numbers are data with their own life — fitted by
``scripts/calibrate_cost_model.py`` from measured kernel timings, validated on load (pydantic: ranges, no
unknown keys), looked up by GPU key or family with a documented fallback — and a fitter writes them as well
as the simulator reads them. The cost model only multiplies by them.
"""

from __future__ import annotations

from functools import cache
from importlib import resources
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field

from kvcap.specs.hardware import GpuSpec

CALIBRATION_DIR = "calibration"
DEFAULT_CALIBRATION = "a100"
"""GPUs without their own file borrow this one's efficiencies (flagged by ``Calibration.defaulted_from``)."""

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

