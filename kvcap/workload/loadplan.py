"""What load to offer, as data shared by ``bench`` (real HTTP) and ``sim`` (the simulator): the levels of one
load model, their phases (warm-up, measured window by duration or request count), repeats and the seed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

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
