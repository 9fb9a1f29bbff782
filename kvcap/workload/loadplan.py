"""What load to offer, as data shared by ``bench`` (real HTTP) and ``sim`` (the simulator): the levels of one
load model, their phases (warm-up, measured window by duration or request count), repeats and the seed."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from kvcap.errors import InputError
from kvcap.specs.load import LoadSpec
from kvcap.workload.arrivals import arrival_offsets, parse_arrival
from kvcap.workload.trace import TraceRow

Mode = Literal["concurrency", "rate", "trace"]


@dataclass(frozen=True)
class LoadPlan:
    """What to offer: the levels of one load model, their phases, repeats and the seed."""

    mode: Mode
    levels: tuple[float, ...]
    warmup_s: float = 10.0
    duration_s: float | None = 60.0
    requests: int | None = None
    repeats: int = 1
    first_repeat: int = 0
    """Index of the first repeat (``ab`` interleaves arms by running one repeat at a time into the same run)."""
    arrival: str = "poisson"
    seed: int = 0
    max_inflight: int = 20_000
    drain_timeout_s: float = 120.0
    trace: tuple[TraceRow, ...] = ()
    trace_speed: float = 1.0

    @classmethod
    def from_spec(cls, spec: LoadSpec, *, trace: Sequence[TraceRow] = (), trace_speed: float = 1.0,
                  **runtime: Any) -> LoadPlan:
        """The one translation from a validated load spec (bench flags, scenario or experiment file) to a plan.

        A trace replaces the spec's levels (one level: its time compression). ``runtime`` takes the knobs that
        are not part of the spec (``max_inflight``, ``drain_timeout_s``, ``first_repeat``, ``repeats`` for ``ab``'s
        one-repeat-at-a-time runs)."""
        if trace:
            mode: Mode = "trace"
            levels: tuple[float, ...] = (trace_speed,)
        elif spec.concurrency:
            mode, levels = "concurrency", tuple(float(x) for x in spec.concurrency)
        elif spec.rate:
            mode, levels = "rate", tuple(float(x) for x in spec.rate)
        else:
            raise InputError("no load levels: set load.concurrency or load.rate (or give a trace)")
        if any(x <= 0 for x in levels):
            raise InputError("load levels must be positive")
        parse_arrival(spec.arrival)
        fields: dict[str, Any] = {"warmup_s": spec.warmup, "duration_s": spec.measured_duration,
                                  "requests": spec.requests, "repeats": spec.repeats, "arrival": spec.arrival,
                                  "seed": spec.seed, "trace": tuple(trace), "trace_speed": trace_speed}
        return cls(mode=mode, levels=levels, **{**fields, **runtime})

    def manifest(self) -> dict[str, Any]:
        d: dict[str, Any] = {"load.mode": self.mode, f"load.{self.mode}": list(self.levels),
                             "load.warmup": self.warmup_s, "load.duration": self.duration_s,
                             "load.requests": self.requests, "load.repeats": self.repeats, "load.seed": self.seed}
        if self.mode == "rate":
            d["load.arrival"] = self.arrival
        if self.mode == "trace":
            d["load.trace_speed"] = self.trace_speed
            d["load.trace_requests"] = len(self.trace)
        return d


def trace_schedule(plan: LoadPlan) -> tuple[list[TraceRow], list[float]]:
    """The trace rows one level replays and their offsets (s): time-compressed, cut to warm-up + duration,
    and to the warm-up rows + ``requests`` when a request count is set."""
    rows = list(plan.trace)
    offsets = [r.arrival_s / plan.trace_speed for r in rows]
    if plan.duration_s is not None:
        keep = [k for k, t in enumerate(offsets) if t < plan.warmup_s + plan.duration_s]
        rows, offsets = [rows[k] for k in keep], [offsets[k] for k in keep]
    if plan.requests is not None:
        n_warm = sum(1 for t in offsets if t < plan.warmup_s)
        rows, offsets = rows[: n_warm + plan.requests], offsets[: n_warm + plan.requests]
    return rows, offsets


def rate_schedule(plan: LoadPlan, level: float, repeat: int) -> list[float]:
    """Open-loop arrival offsets (s) of one level, fixed in advance, seeded by (seed, level, repeat)."""
    return [float(x) for x in rate_offsets(plan, level, repeat)]


def rate_offsets(plan: LoadPlan, level: float, repeat: int) -> np.ndarray:
    """``rate_schedule`` as a float64 array (8 bytes an arrival: a million-request level's schedule in 8 MB)."""
    kind, cv = parse_arrival(plan.arrival)
    seed = (plan.seed, round(level * 1000), repeat)
    if plan.requests is not None:
        n = math.ceil(level * plan.warmup_s) + plan.requests
        offs = arrival_offsets(kind, cv, level, 0.0, seed=seed, max_n=n)  # type: ignore[arg-type]
    else:
        offs = arrival_offsets(kind, cv, level, plan.warmup_s + (plan.duration_s or 0.0), seed=seed)  # type: ignore[arg-type]
    return np.ascontiguousarray(offs, dtype=float)
