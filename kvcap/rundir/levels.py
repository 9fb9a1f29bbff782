"""``levels.jsonl``: one line per level repeat — its windows, the load it achieved, the client's health.

``bench`` writes one line per repeat (merged over its workers), ``sim`` one with the engine's counters; the analysis
reads the windows (``measure_start_s``/``measure_end_s``) and the achieved load. The line is open to keys a
recorder adds for its own diagnosis (a worker's identity, a preflight's findings): they are kept, not judged.
"""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field

from kvcap.rundir.model import Number, RunModel


class ClientHealth(RunModel):
    """The load generator's own health over the level (bench; sim writes only ``warnings``)."""

    model_config = ConfigDict(extra="allow")
    loop_lag_p50_ms: float | None = Field(default=None, description="event-loop lag, median (ms)")
    loop_lag_p99_ms: float | None = Field(default=None, description="event-loop lag, 99th percentile (ms)")
    loop_lag_max_ms: float | None = Field(default=None, description="event-loop lag, max (ms)")
    cpu_fraction: float | None = Field(default=None, description="CPU time of the client process / wall time")
    warnings: list[str] = Field(default_factory=list, description="what may have limited the client")
    per_worker: list[dict[str, Any]] | None = Field(default=None,
                                                    description="bench with workers: each worker's figures")


class SimLevel(RunModel):
    """What ``sim`` adds: the engine's counters over the level repeat."""

    model_config = ConfigDict(extra="allow")
    events: int = Field(description="engine events")
    wall_s: float = Field(description="wall time in the engine (s)")
    simulated_s: float = Field(description="simulated time (s)")
    realtime_factor: float | None = Field(default=None, description="simulated_s / wall_s")
    native: bool | None = Field(default=None, description="the compiled engine ran")
    preemptions: int = Field(default=0, description="requests preempted")
    running_peak: int | None = Field(default=None, description="most requests running at once")
    waiting_peak: int | None = Field(default=None, description="most requests waiting at once")
    finished: int = Field(description="requests finished")
    errors: int = Field(description="requests failed")
    cancelled: int = Field(default=0, description="requests cancelled at the level's end")


class StopReason(RunModel):
    """Where bench's error rule (``--max-error-rate``) stopped the sweep, and why."""

    reason: str = Field(description="why, in words")
    mode: str = Field(description="the level's load model")
    level: Number = Field(description="the level it stopped at")
    repeat: int = Field(description="the repeat it stopped in")
    at_s: float | None = Field(default=None, description="when (run seconds)")
    errors: int | None = Field(default=None, description="requests failed among the last window")
    window: int | None = Field(default=None, description="the requests the rule looks back over")
    max_error_rate: float | None = Field(default=None, description="the rule's limit (fraction)")
    error_classes: dict[str, int] = Field(default_factory=dict, description="the window's failures per class")


class LevelRow(RunModel):
    """One line of ``levels.jsonl``."""

    model_config = ConfigDict(extra="allow")
    mode: str = Field(description="load model: 'concurrency', 'rate' or 'trace'")
    level: Number = Field(description="the load: concurrency, rate (requests/s) or trace speed (×)")
    repeat: int = Field(default=0, description="the repeat (0-based)")
    target: Number | None = Field(default=None, description="the load asked of this line's client(s)")
    t_start_s: float | None = Field(default=None, description="the level repeat's start, run seconds")
    t_end_s: float | None = Field(default=None, description="its end (the last request finished), run seconds")
    measure_start_s: float = Field(description="measured window start, run seconds")
    measure_end_s: float = Field(description="measured window end, run seconds")
    sent_measured: int | None = Field(default=None, description="requests sent inside the measured window")
    late_sends: int | None = Field(default=None, description="open loop: sends later than their schedule")
    achieved_rate: float | None = Field(default=None, description="open loop: requests/s actually sent")
    backoff_s: float | None = Field(default=None, description="bench: time spent backing off on errors (s)")
    stopped: StopReason | None = Field(default=None, description="bench: where the error rule stopped the sweep")
    worker: int | None = Field(default=None, description="bench: the worker that wrote this line (one worker)")
    workers: int | None = Field(default=None, description="bench: the workers merged into this line")
    concurrency_this_worker: int | None = Field(default=None,
                                                description="bench: this worker's share of the concurrency")
    client: ClientHealth = Field(default_factory=ClientHealth, description="the load generator's health")
    interrupted: bool = Field(default=False, description="the level was interrupted (Ctrl-C)")
    sim: SimLevel | None = Field(default=None, description="sim: the engine's counters")
    trace_requests: int | None = Field(default=None, description="trace mode: the trace rows replayed")
