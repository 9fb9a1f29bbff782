"""A scenario resolved into what `plan` needs: the model, GPU and link specs (presets with explicit figures
applied), the weights dtype and the load figures Little's law uses."""

from __future__ import annotations

from dataclasses import dataclass

from kvcap.specs.hardware import GpuSpec, LinkSpec, host_link_for, load_gpu, load_link
from kvcap.specs.model import ModelSpec, load_model
from kvcap.specs.scenario import Scenario


@dataclass(frozen=True)
class PlanInputs:
    """Everything `plan` needs, resolved from a scenario (CLI flags are scenario overrides)."""

    scenario: Scenario
    model: ModelSpec
    gpu: GpuSpec
    host_link: LinkSpec
    interconnect: LinkSpec
    weights_dtype: str
    rate: float | None
    response_time_s: float | None
    concurrency: int | None = None


def resolve_gpu(scenario: Scenario) -> GpuSpec:
    ref = scenario.cluster.gpu
    gpu = load_gpu(ref.preset)
    updates = {k: v for k, v in {"memory_bytes": ref.memory, "memory_bandwidth_bytes_s": ref.memory_bandwidth,
                                 "bf16_tflops": ref.bf16_tflops, "fp8_tflops": ref.fp8_tflops}.items()
               if v is not None}
    return gpu.model_copy(update=updates) if updates else gpu


def resolve_link(ref_preset: str | None, bandwidth: float | None, latency: float | None,
                 default: LinkSpec) -> LinkSpec:
    """A preset (or the default) with explicit bandwidth/latency applied; its efficiency and kind are kept."""
    link = load_link(ref_preset) if ref_preset else default
    if bandwidth is not None:
        link = link.model_copy(update={"bandwidth_bits_s": bandwidth * 8.0, "key": "custom",
                                       "name": f"{bandwidth * 8 / 1e9:g} Gbps {link.kind}"})
    if latency is not None:
        link = link.model_copy(update={"latency_s": latency})
    return link


def resolve(scenario: Scenario, rate: float | None = None, response_time_s: float | None = None,
            concurrency: int | None = None) -> PlanInputs:
    model = load_model(scenario.model.ref, scenario.model.num_parameters)
    gpu = resolve_gpu(scenario)
    c = scenario.cluster
    host_link = resolve_link(c.host_link.preset, c.host_link.bandwidth, c.host_link.latency, host_link_for(gpu))
    inter = resolve_link(c.interconnect.preset, c.interconnect.bandwidth, c.interconnect.latency,
                         load_link("eth-100g"))
    if rate is None and scenario.load.rate:
        rate = max(scenario.load.rate)
    if response_time_s is None:
        response_time_s = scenario.load.response_time
    if concurrency is None and scenario.load.concurrency:
        concurrency = max(scenario.load.concurrency)
    return PlanInputs(scenario=scenario, model=model, gpu=gpu, host_link=host_link, interconnect=inter,
                      weights_dtype=scenario.model.weights_dtype or model.native_dtype, rate=rate,
                      response_time_s=response_time_s, concurrency=concurrency)
