"""GPU and link catalogs (bundled YAML with a source for every value) and their typed records."""

from __future__ import annotations

from functools import cache
from importlib import resources
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict

from kvcap.errors import InputError
from kvcap.specs.model import close_matches


class GpuSpec(BaseModel):
    """One accelerator. Memory in bytes, bandwidth in bytes/s, compute dense (no sparsity)."""

    model_config = ConfigDict(frozen=True)
    key: str = ""
    name: str
    vendor: str = ""
    memory_bytes: int
    memory_bandwidth_bytes_s: float
    bf16_tflops: float
    fp16_tflops: float | None = None
    fp8_tflops: float | None = None
    int8_tops: float | None = None
    pcie_gen: int = 4
    pcie_lanes: int = 16
    nvlink_bytes_s: float | None = None
    tdp_watts: float | None = None
    source: str = ""


class LinkSpec(BaseModel):
    """A link: nominal per-direction line rate (bits/s), achievable efficiency, one-way latency."""

    model_config = ConfigDict(frozen=True)
    key: str = ""
    name: str
    kind: Literal["ethernet", "rdma", "pcie", "nvlink", "custom"]
    bandwidth_bits_s: float
    efficiency: float = 1.0
    latency_s: float = 0.0
    source: str = ""

    @property
    def bytes_s(self) -> float:
        """Nominal bytes per second per direction (bits / 8: never mixed)."""
        return self.bandwidth_bits_s / 8.0

    @property
    def effective_bytes_s(self) -> float:
        return self.bytes_s * self.efficiency


@cache
def _catalog(file: str) -> dict[str, dict[str, Any]]:
    text = resources.files("kvcap.specs.presets").joinpath(file).read_text()
    return yaml.safe_load(text) or {}


def gpu_names() -> tuple[str, ...]:
    """The GPU presets in the catalog's order (the order `kvcap plan --help` lists them in)."""
    return tuple(_catalog("gpus.yaml"))


def _entry(file: str, name: str, what: str) -> tuple[str, dict[str, Any]]:
    key = name.lower()
    catalog = _catalog(file)
    if key not in catalog:
        raise InputError(f"unknown {what} {name!r}: {close_matches(key, tuple(sorted(catalog)))}")
    return key, catalog[key]


def load_gpu(name: str) -> GpuSpec:
    key, entry = _entry("gpus.yaml", name, "GPU")
    return GpuSpec(key=key, **entry)


def load_link(name: str) -> LinkSpec:
    key, entry = _entry("links.yaml", name, "link")
    return LinkSpec(key=key, **entry)


def host_link_for(gpu: GpuSpec) -> LinkSpec:
    """The GPU's PCIe host link (x16 of its generation), the path to host-memory KV."""
    key = f"pcie{gpu.pcie_gen}-x16"
    if key in _catalog("links.yaml"):
        return load_link(key)
    return load_link("pcie4-x16")

