"""Roofline primitives: an operator's time is the slower of its compute and its memory traffic, plus overheads.

Why a roofline and not a table of measured kernels: the simulator must price batches of any shape, for any
model preset and GPU, millions of times per run. An operator class is priced as
``max(FLOPs / (peak × e_c), bytes / (HBM bandwidth × e_m)) + c0`` with the calibration's efficiencies
(:mod:`kvcap.sim.calibration_io`); tensor-parallel all-reduces as a ring over a link. Here: the operator
kinds (:class:`LinearOp`, :class:`ElementwiseOp`), the achieved rates, the max itself and the all-reduce
model. Which operators a model runs is :mod:`kvcap.sim.model_shape`'s business; summing them per step is
:mod:`kvcap.sim.cost`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcap.sim.calibration_io import Calibration
from kvcap.specs.hardware import GpuSpec, LinkSpec, host_link_for


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


def roofline(compute_s: float, memory_s: float, overhead_s: float) -> tuple[float, float, float]:
    """One op class: the slower of its compute and memory times plus its overhead, and which side bound it:
    (time, compute seconds if compute won else 0, memory seconds if memory won else 0)."""
    if compute_s > memory_s:
        return compute_s + overhead_s, compute_s, 0.0
    return memory_s + overhead_s, 0.0, memory_s


def gemm_peak_flops(gpu: GpuSpec, weights_dtype: str) -> float:
    """Dense peak for the GEMMs: FP8 tensor cores for fp8 weights where the GPU has them, else 16-bit.

    int8/int4 are taken as weight-only quantization (dequantized to 16-bit in the kernel), the common case.
    """
    if weights_dtype == "fp8" and gpu.fp8_tflops:
        return gpu.fp8_tflops * 1e12
    if weights_dtype == "fp16" and gpu.fp16_tflops:
        return gpu.fp16_tflops * 1e12
    return gpu.bf16_tflops * 1e12


@dataclass(frozen=True, slots=True)
class AchievedRates:
    """Nominal peaks and bandwidths times the calibration's efficiencies: what each op class achieves."""

    gemm_flops_s: float
    gemm_bytes_s: float
    attn_flops_s: float
    """Attention runs at the 16-bit peak whatever the weights' dtype."""
    attn_bytes_s: float
    elementwise_bytes_s: float

    @classmethod
    def of(cls, gpu: GpuSpec, weights_dtype: str, calib: Calibration) -> AchievedRates:
        bw = gpu.memory_bandwidth_bytes_s
        return cls(gemm_flops_s=gemm_peak_flops(gpu, weights_dtype) * calib.compute_efficiency,
                   gemm_bytes_s=bw * calib.memory_efficiency,
                   attn_flops_s=gpu.bf16_tflops * 1e12 * calib.attn_compute_efficiency,
                   attn_bytes_s=bw * calib.attn_memory_efficiency,
                   elementwise_bytes_s=bw * calib.elementwise_efficiency)


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
