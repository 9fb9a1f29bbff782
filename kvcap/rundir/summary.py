"""``summary.json``: per-level statistics, the article's three conditions, the capacities and the diagnosis.

``analysis.summary.build_summary`` builds a :class:`Summary`; ``bench`` and ``sim`` add what only the recording
command knew (``interrupted``, ``sim``, ``client``...); every reader gets the same model back from
``RunDir.summary``.
"""

from __future__ import annotations

from pydantic import Field

from kvcap.rundir.levels import StopReason
from kvcap.rundir.model import Number, RunModel


class Percentiles(RunModel):
    """A latency's distribution over a level's judged requests that succeeded (milliseconds); None without any."""

    p50: float | None = Field(default=None, description="median (ms)")
    p90: float | None = Field(default=None, description="90th percentile (ms)")
    p95: float | None = Field(default=None, description="95th percentile (ms)")
    p99: float | None = Field(default=None, description="99th percentile (ms)")
    mean: float | None = Field(default=None, description="mean (ms)")


class Intervals(RunModel):
    """95% confidence intervals ``[low, high]``; None when there is too little data (under 5 requests, or a
    single repeat for the throughputs)."""

    ttft_p95_ms: list[float] | None = Field(default=None, description="TTFT p95 (ms): requests resampled, or the "
                                                              "order-statistic interval past 2000 requests")
    tpot_p95_ms: list[float] | None = Field(default=None, description="TPOT p95 (ms), as ttft_p95_ms")
    output_tok_s: list[float] | None = Field(default=None, description="median output tokens/s over repeats "
                                                               "(bootstrap over repeats)")
    goodput_tok_s: list[float] | None = Field(default=None, description="median goodput tokens/s over repeats "
                                                                "(bootstrap over repeats)")


class LittlesLaw(RunModel):
    """Little's law cross-check: λ·W against the measured mean number in flight (and the configured
    concurrency); a ratio well below 1 means the client did not keep the load asked for."""

    in_flight: float | None = Field(default=None, description="time-averaged requests in flight, from the records")
    rate_x_response: float | None = Field(default=None, description="completions/s × mean E2E (s): requests in flight "
                                                            "by Little's law")
    ratio_to_concurrency: float | None = Field(default=None, description="in_flight / the configured concurrency "
                                                                 "(closed loop only)")
    mismatch: bool | None = Field(default=None, description="ratio_to_concurrency below 0.85 or above 1.1")


class Stationarity(RunModel):
    """Condition (c): is the server's queue (or, without telemetry, TTFT) growing over the measured window?
    Empty (``{}``) when the level has no window figures at all."""

    source: str | None = Field(default=None, description="what the trend was taken on: "
                                                 "'telemetry:server.requests_waiting', 'client:ttft', or None")
    growing: bool = Field(default=False, description="the trend is significant (one-sided 95%) and large enough")
    slope: float | None = Field(default=None, description="least-squares slope (requests/s, or ms of TTFT per s)")
    lower95: float | None = Field(default=None, description="one-sided 95% lower bound of the slope")
    span_s: float | None = Field(default=None, description="time spanned by the samples (s)")
    growth: float | None = Field(default=None, description="slope × span: requests the queue grew by (telemetry)")
    growth_ms: float | None = Field(default=None, description="slope × span: ms the TTFT grew by (client)")


class NodeFigures(RunModel):
    """One node's telemetry over a level's window; a key is absent when its series is."""

    gpu_util_mean: float | None = Field(default=None, description="GPU utilisation, mean (fraction)")
    gpu_util_max: float | None = Field(default=None, description="GPU utilisation, max (fraction)")
    gpu_mem_used_max_bytes: float | None = Field(default=None, description="GPU memory used, max (bytes)")
    kv_usage_mean: float | None = Field(default=None, description="KV cache usage, mean (fraction of HBM blocks)")
    kv_usage_max: float | None = Field(default=None, description="KV cache usage, max (fraction of HBM blocks)")
    running_mean: float | None = Field(default=None, description="requests running (decoding), mean")
    running_max: float | None = Field(default=None, description="requests running (decoding), max")
    waiting_mean: float | None = Field(default=None, description="requests waiting, mean")
    net_rx_bytes_s_mean: float | None = Field(default=None, description="network received, mean (bytes/s)")
    net_tx_bytes_s_mean: float | None = Field(default=None, description="network sent, mean (bytes/s)")
    net_rx_bytes_s_max: float | None = Field(default=None, description="network received, max (bytes/s)")
    net_tx_bytes_s_max: float | None = Field(default=None, description="network sent, max (bytes/s)")
    link_util_max: float | None = Field(default=None, description="busiest link or NIC direction, max (fraction of its "
                                                          "line rate)")
    host_mem_available_min_bytes: float | None = Field(default=None, description="host memory available, min (bytes)")
    net_rx_gbps_mean: float | None = Field(default=None, description="network received, mean (Gbit/s)")
    net_tx_gbps_mean: float | None = Field(default=None, description="network sent, mean (Gbit/s)")


class Imbalance(RunModel):
    """Load that could be spread over the nodes is not: the hottest node bounds the cluster."""

    metric: str = Field(description="what decided: 'requests_held', 'waiting_mean' or a utilisation key")
    hot: str = Field(description="the busiest node")
    hot_value: float = Field(description="its value of ``metric``")
    cold: str = Field(description="the least busy node")
    cold_value: float = Field(description="its value of ``metric``")
    cold_kv_usage_max: float | None = Field(default=None, description="the cold node's KV usage, max (fraction)")
    fair_share: float | None = Field(default=None, description="requests held per node if spread evenly")
    in_flight: Number | None = Field(default=None, description="the level's load in flight (None: unknown)")
    replicas: int | None = Field(default=None, description="servers (replicas) that could share the load")


class PrefixReuse(RunModel):
    """A level's prompt tokens and the part of them served from a cache instead of computed: the HBM prefix cache
    and a lower KV tier (an offload connector). From the records where they carry hit counts (every measured
    request that succeeded, all repeats), else from the server's counters' increase over the level's window, else
    from the server's own per-request count in ``bench`` records (``cached_tokens``). That count does not say which
    cache served the tokens: the figure puts the total in ``hbm_hit_tokens`` and again in ``server_cached_tokens``
    (present only then: the split is unknown), ``tier_hit_tokens`` None. Absent from a level whose run has none."""

    source: str = Field(description="'records' or 'telemetry'")
    prompt_tokens: Number = Field(description="prompt tokens (records: their input tokens; telemetry: the prefix "
                                              "cache's queried tokens, else the prompt-token counter)")
    hbm_hit_tokens: Number | None = Field(default=None, description="prompt tokens found in the HBM prefix cache "
                                                                    "(None: not reported)")
    tier_hit_tokens: Number | None = Field(default=None, description="prompt tokens loaded from a lower KV tier "
                                                                     "(None: no tier reported)")
    tier_query_tokens: Number | None = Field(default=None, description="telemetry: tokens the tier was asked for "
                                                                       "(None: not reported)")
    hbm_hit_rate: float | None = Field(default=None, description="hbm_hit_tokens / prompt_tokens")
    tier_hit_rate: float | None = Field(default=None, description="tier_hit_tokens / prompt_tokens")
    server_cached_tokens: Number | None = Field(default=None, description="records, bench: the server's own "
                                                "per-request cached_tokens, summed — HBM and any tier together "
                                                "(also in hbm_hit_tokens); absent when the split is known")


class LevelSummary(RunModel):
    """One (mode, level) over its repeats: counts, throughput, goodput, latency percentiles, the conditions it
    fails, and the server's telemetry over its measured windows (those keys absent without telemetry).

    ``summary.json`` always has the keys down to ``failed_checks``; those marked optional are absent only from a
    level rebuilt from ``compare.json``'s ``per_level`` (the report of a saved comparison)."""

    mode: str = Field(description="load model: 'concurrency', 'rate' or 'trace'")
    level: Number = Field(description="the load: concurrency (requests), rate (requests/s) or trace speed (×)")
    requests: int | None = Field(default=None, description="measured requests judged (started in the window, not "
                                                            "cancelled)")
    ok: int | None = Field(default=None, description="judged requests that succeeded")
    errors: int | None = Field(default=None, description="judged requests that failed")
    cancelled: int | None = Field(default=None, description="measured requests cancelled at the level's end")
    error_classes: dict[str, int] = Field(default_factory=dict, description="failed requests per error class, in "
                                                                           "order of first seen")
    output_tok_s: float = Field(description="output tokens/s received inside the window (median over repeats)")
    request_s: float | None = Field(default=None, description="requests/s completed inside the window (median "
                                                              "over repeats)")
    output_tok_s_repeats: list[float] = Field(default_factory=list, description="output_tok_s of each repeat")
    goodput_tok_s: float = Field(description="output tokens/s of the requests within every SLO limit "
                                             "(median over repeats)")
    goodput_tok_s_repeats: list[float] = Field(default_factory=list, description="goodput_tok_s of each repeat")
    in_flight_mean: float | None = Field(default=None, description="time-averaged requests in flight (median over "
                                                                   "repeats)")
    error_rate: float | None = Field(default=None, description="errors / requests (fraction)")
    truncated: int | None = Field(default=None, description="successful requests cut short of the output asked")
    output_tokens_mean: float | None = Field(default=None, description="mean output tokens of the successful requests")
    input_tokens_mean: float | None = Field(default=None, description="mean input tokens of the successful "
                                                                      "requests, as the server counted them")
    ttft_ms: Percentiles = Field(default_factory=Percentiles, description="time to first token (ms)")
    tpot_ms: Percentiles = Field(default_factory=Percentiles, description="time per output token after the first "
                                                                          "(ms)")
    e2e_ms: Percentiles = Field(default_factory=Percentiles, description="end-to-end latency (ms)")
    itl_ms: Percentiles = Field(default_factory=Percentiles, description="inter-token latency, every gap (ms)")
    queue_ms: Percentiles = Field(default_factory=Percentiles, description="time queued at the server before the "
                                                                           "first token's work (ms)")
    send_delay_ms: Percentiles = Field(default_factory=Percentiles, description="how late the client sent each "
                                                                                "request (ms), every measured one")
    ci95: Intervals = Field(default_factory=Intervals, description="95% confidence intervals")
    slo_ok: bool = Field(description="no SLO item and no condition failed, and some request succeeded")
    failed_checks: list[str] = Field(default_factory=list, description="SLO items and conditions "
                                                                      "(throughput_growth, error_rate, timeouts, "
                                                                      "queue_growth, preemptions) this level fails")
    achieved_rate: float | None = Field(default=None, description="requests/s actually sent (open loop; median over "
                                                                  "repeats)")
    client_warnings: list[str] = Field(default_factory=list, description="the load generator's warnings")
    server_running_max: Number | None = Field(default=None, description="requests running (decoding), max")
    server_running_mean: float | None = Field(default=None, description="requests running (decoding), mean")
    server_waiting_mean: float | None = Field(default=None, description="requests waiting, mean")
    server_waiting_max: Number | None = Field(default=None, description="requests waiting, max")
    server_parked_max: Number | None = Field(default=None, description="requests parked in a lower KV tier, max")
    server_parked_mean: float | None = Field(default=None, description="requests parked in a lower KV tier, mean")
    link_util_max: float | None = Field(default=None, description="busiest link, max (fraction of its capacity)")
    gpu_util_mean: float | None = Field(default=None, description="GPU utilisation, mean (fraction)")
    kv_usage_mean: float | None = Field(default=None, description="KV cache usage, mean (fraction of HBM blocks)")
    kv_usage_max: float | None = Field(default=None, description="KV cache usage, max (fraction of HBM blocks)")
    net_rx_bytes_s_mean: float | None = Field(default=None, description="network received, mean (bytes/s)")
    net_tx_bytes_s_mean: float | None = Field(default=None, description="network sent, mean (bytes/s)")
    nodes: dict[str, NodeFigures] | None = Field(default=None, description="per node (present with node-labelled "
                                                                   "telemetry)")
    imbalance: Imbalance | None = Field(default=None,
                                        description="load that could be spread is not (absent: none seen)")
    littles_law: LittlesLaw | None = Field(default=None, description="Little's law cross-check")
    scaling_efficiency: float | None = Field(default=None, description="condition (a): throughput gain over the "
                                                               "proportional gain from the previous level")
    stationarity: Stationarity = Field(default_factory=Stationarity, description="condition (c)")
    preemptions: Number | None = Field(default=None, description="server preemptions during the window")
    prefix_reuse: PrefixReuse | None = Field(default=None, description="prompt tokens served from the HBM prefix "
                                                                       "cache and from a lower tier (absent: no "
                                                                       "such data, or none ever hit)")


class ScalingPoint(RunModel):
    """A level's scaling efficiency, for the capacity's curve."""

    level: Number = Field(description="the level")
    efficiency: float | None = Field(description="its scaling_efficiency (None for the first)")


class Capacity(RunModel):
    """The capacities the levels support."""

    slo: dict[str, float] = Field(description="the SLO judged against (ms, error_rate a fraction)")
    effective: Number | None = Field(description="the largest level of the passing run from below: stable "
                                                  "concurrency within the SLO and all three conditions")
    stress_limit: Number | None = Field(description="the largest level where any request succeeded")
    resident: int | None = Field(description="the most requests the server held at once (telemetry), or the "
                                             "client's estimate")
    resident_source: str | None = Field(description="'telemetry', 'telemetry:running+parked' or "
                                                    "'client_estimate'")
    resident_lower_bound: bool = Field(description="resident is a lower bound (nothing ever had to wait)")
    limited_by: str | None = Field(description="the first failed check of the first level above effective")
    scaling: list[ScalingPoint] = Field(description="each successful level's scaling efficiency")


class Limits(RunModel):
    """What ended each level's measured window, as the run was asked."""

    duration_s: Number | None = Field(description="load.duration (s)")
    requests: int | None = Field(description="load.requests")
    rule: str = Field(description="the rule, in words")
    notes: list[str] = Field(description="precedence decisions taken on the inputs (manifest.notes)")


class Finding(RunModel):
    """What bounds an arm, and which way to scale (``analysis.diagnosis``)."""

    arm: str = Field(description="the arm (or 'run')")
    bound: str = Field(description="'client', 'prefill_recompute', 'batch_cap', 'kv_capacity', 'compute', "
                                   "'interconnect', 'imbalance' or 'none_seen'")
    evidence: str = Field(description="the numbers that show it")
    direction: str = Field(description="which way to scale")


class SimTotals(RunModel):
    """What ``sim`` adds: the engine's totals over the levels."""

    levels: int = Field(description="level repeats simulated")
    requests: int = Field(description="requests finished or failed")
    events: int = Field(description="engine events")
    simulated_s: float = Field(description="simulated time (s)")
    engine_wall_s: float = Field(description="wall time in the engine (s)")
    wall_s: float = Field(description="wall time of the whole run (s)")
    realtime_factor: float | None = Field(description="simulated_s / engine_wall_s")
    plan_resident: dict[str, int] = Field(description="the plan's resident requests per KV tier")


class ClientTotals(RunModel):
    """bench: the load generator's health over the whole run (the worst of its workers)."""

    loop_lag_p99_ms_max: Number | None = Field(default=None, description="event-loop lag p99, the worst worker's "
                                                                          "(ms)")
    loop_lag_max_ms: Number | None = Field(default=None, description="event-loop lag, max (ms)")
    cpu_fraction_max: Number | None = Field(default=None, description="CPU time / wall time, the busiest worker's")
    warnings: list[str] = Field(default_factory=list, description="what may have limited the client")


class PrometheusPull(RunModel):
    """bench --prometheus: the run's window pulled from Prometheus into telemetry.jsonl."""

    url: str | None = Field(description="the Prometheus server")
    rows: int = Field(description="telemetry rows written")
    series: int | None = Field(default=None, description="distinct series among them")
    error: str | None = Field(default=None, description="why the pull failed (then rows is 0)")


class LostWorker(RunModel):
    """bench --ray: a worker lost during the run (its requests in flight written as cancelled)."""

    worker: int = Field(description="the worker")
    host: str | None = Field(description="its host")
    node_id: str | None = Field(description="its Ray node")
    reason: str = Field(description="why it was lost")


class Summary(RunModel):
    """``summary.json``."""

    source: str | None = Field(description="'bench' or 'sim' (the manifest's)")
    arm: str | None = Field(description="the arm's name (ab), or None")
    slo: dict[str, float] = Field(description="the SLO: latency keys like 'ttft_p95' in ms, 'error_rate' a "
                                              "fraction")
    limits: Limits = Field(description="what ended the levels' windows")
    levels: list[LevelSummary] = Field(description="one per (mode, level), by mode then level")
    capacity: Capacity = Field(description="the capacities")
    diagnosis: list[Finding] = Field(default_factory=list, description="what bounds the run")
    warnings: list[str] = Field(default_factory=list, description="what the reader must know (input lengths, "
                                                                  "clock offsets)")
    prometheus: PrometheusPull | None = Field(default=None, description="bench: the Prometheus pull")
    interrupted: bool | None = Field(default=None, description="bench/sim: the run was interrupted (Ctrl-C)")
    stopped: StopReason | None = Field(default=None, description="bench: where the error rule stopped the sweep")
    failed: str | None = Field(default=None, description="bench: why the run failed as a whole, or None")
    client: ClientTotals | None = Field(default=None, description="bench: the load generator's loop lag, CPU "
                                                                  "fraction and warnings")
    telemetry_samples: int | None = Field(default=None, description="bench: telemetry samples taken")
    lost_workers: list[LostWorker] | None = Field(default=None, description="bench --ray: workers lost")
    sim: SimTotals | None = Field(default=None, description="sim: the engine's totals")
