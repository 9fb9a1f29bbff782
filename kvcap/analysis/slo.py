"""SLO specs: ``ttft_p95=500ms,tpot_p95=80ms,error_rate=1%`` → {key: ms or fraction}."""

from __future__ import annotations

import re

from kvcap.errors import InputError
from kvcap.units import parse_duration, parse_fraction

METRICS = ("ttft", "tpot", "itl", "e2e", "queue")
PERCENTILES = ("p50", "p90", "p95", "p99")
_KEY = re.compile(r"^(ttft|tpot|itl|e2e|queue)_(p50|p90|p95|p99)$")


def parse_slo(spec: str | dict[str, str] | None) -> dict[str, float]:
    """Latency keys in milliseconds, ``error_rate`` as a fraction. Units are required for latencies."""
    if not spec:
        return {}
    items = spec.items() if isinstance(spec, dict) else (
        part.split("=", 1) if "=" in part else (part, "") for part in spec.split(",") if part.strip())
    out: dict[str, float] = {}
    for key, value in items:
        key = str(key).strip()
        value = str(value).strip()
        if not value:
            raise InputError(f"SLO item {key!r} needs a value, e.g. ttft_p95=500ms")
        if key == "error_rate":
            out[key] = parse_fraction(value, "SLO error_rate")
        elif _KEY.match(key):
            out[key] = parse_duration(value, f"SLO {key}", bare_unit=None) * 1e3
        else:
            raise InputError(f"unknown SLO key {key!r}: use ttft|tpot|itl|e2e|queue _p50|p90|p95|p99, or error_rate")
    return out


def format_slo(slo: dict[str, float]) -> str:
    return ", ".join(f"{k} ≤ {v:g} ms" if k != "error_rate" else f"{k} ≤ {v:.2%}" for k, v in slo.items())
