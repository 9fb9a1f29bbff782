"""SLO specs: ``ttft_p95=500ms,tpot_p95=80ms,error_rate=1%`` → {key: ms or fraction}, and what a statistic can
tell about them.

A measured run has every percentile; a published table may give only a mean or another percentile than the
SLO's, so `judge_statistic` says when such a number still decides the SLO (a median over the limit means the
p95 is over it too) and when it cannot.
"""

from __future__ import annotations

import re

from kvcap.errors import InputError
from kvcap.units import parse_duration, parse_fraction

_KEY = re.compile(r"^(ttft|tpot|itl|e2e|queue)_(p50|p90|p95|p99)$")

SloItem = tuple[str, str, float]
"""(SLO key, its percentile label, limit in ms), e.g. ('tpot_p95', 'p95', 80.0)."""


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


def percentile_limits(slo: dict[str, float], metric: str) -> list[SloItem]:
    """The SLO's percentile limits on one metric (itl counts as tpot)."""
    out = []
    for key, limit in slo.items():
        m = re.fullmatch(r"(ttft|tpot|itl|e2e|queue)_(p\d{2})", key)
        if m and ("tpot" if m.group(1) == "itl" else m.group(1)) == metric:
            out.append((key, m.group(2), float(limit)))
    return out


def percentile_number(stat: str) -> int | None:
    """'p95' → 95; None for 'mean', '' and anything else."""
    return int(stat[1:]) if re.fullmatch(r"p\d{2}", stat) else None


def judge_statistic(value: float, bound: str | None, stat: str, slo_stat: str, limit: float) -> tuple[str, str]:
    """'pass' | 'fail' | 'unknown' for a statistic against an SLO on (maybe) another statistic, and a note why.

    ``bound`` is None for an exact value, "lower" when the true value is at least ``value``, "upper" when at
    most. A lower percentile (or the mean, against p90 and above) already over the limit means the SLO's
    percentile is over it too; a higher percentile under the limit means it passes; anything else cannot be
    decided. ``stat`` '' (unlabelled) is read as the SLO's own statistic.
    """
    if stat == slo_stat:
        rel, note = "same", ""
    elif stat == "":
        rel, note = "same", f"unlabelled, read as the {slo_stat}"
    else:
        mine, theirs = percentile_number(stat), percentile_number(slo_stat)
        if stat == "mean":
            rel = "below" if theirs is not None and theirs >= 90 else "unknown"
        elif mine is not None and theirs is not None:
            rel = "below" if mine < theirs else "above"
        else:
            rel = "unknown"
        note = f"the table gives the {stat}, the SLO is on the {slo_stat}"
    if value > limit:
        ok = bound in (None, "lower") and rel in ("same", "below")
        return ("fail" if ok else "unknown"), note
    ok = bound in (None, "upper") and rel in ("same", "above")
    return ("pass" if ok else "unknown"), note
