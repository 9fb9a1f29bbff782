"""Bench run directories → per-level observations and the server's facts, read through the one analysis path."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvcap.analysis.summary import build_summary
from kvcap.calibrate.steps import step_splits
from kvcap.errors import InputError
from kvcap.rundir import RunDir
from kvcap.rundir.manifest import Manifest
from kvcap.rundir.summary import LevelSummary, Percentiles
from kvcap.specs.lengths import parse_length
from kvcap.specs.scenario import VLLM_NULL_BLOCKS
from kvcap.workload.trace import TraceRow


@dataclass(frozen=True)
class Observation:
    """One measured level: what was asked, what came back (times in seconds, throughput in output tok/s)."""

    run: str
    mode: str
    level: float
    ttft_p50: float
    ttft_p95: float
    tpot_p50: float
    tpot_p95: float
    throughput: float
    input_tokens: float
    output_tokens: float
    in_flight: float | None = None
    running_max: float | None = None
    kv_usage_max: float | None = None
    arrival: str = "poisson"
    """The open-loop arrival process the run used (rate levels only)."""
    window: tuple[float | None, float | None, int | None, int] = (None, None, None, 0)
    """The run's (warm-up s, measured duration s, measured requests, seed): an open-loop level past capacity
    queues for as long as it runs, so the simulator must run it for exactly as long."""
    length_shapes: tuple[str | None, str | None] = (None, None)
    """The prompt and output length distributions the run measured where it asked for one (None: a fixed
    length): the simulator replays their shape around this level's measured means, since TTFT's tail is the
    long prompts'."""
    pure_step: float | None = None
    """The median decode step that carried no one's prompt, read from the records (None: not told; see
    :mod:`kvcap.calibrate.steps`)."""
    prompt_step: float | None = None
    """What one other request's prompt added to a step, read the same way (None: not told)."""
    trace: tuple[TraceRow, ...] = field(default=(), compare=False, repr=False)
    """A trace level's schedule as it was sent (arrival from the level's start, prompt and asked output per
    request), rebuilt from its records: the simulator replays exactly that."""

    @property
    def label(self) -> str:
        return f"c={self.level:g}" if self.mode == "concurrency" else f"{self.mode}={self.level:g}"


@dataclass(frozen=True)
class ServerFacts:
    """What the server said about itself at preflight (manifest ``server``); None where it did not say."""

    engine: str | None = None
    total_slots: int | None = None
    n_ctx: int | None = None
    max_model_len: int | None = None
    kv_tokens: int | None = None
    """The KV pool in tokens: vLLM's ``(num_gpu_blocks − 1) × block_size`` (it holds one null block back),
    SGLang's ``max_total_num_tokens``."""
    kv_tokens_source: str | None = None
    max_running: int | None = None
    """SGLang's ``max_running_requests``: its slot limit (vLLM does not publish ``max_num_seqs``)."""
    prefix_caching: bool | None = None


def _ms(block: Percentiles, key: str) -> float | None:
    v = getattr(block, key)
    return None if v is None else float(v) / 1000.0


def level_observation(run: str, lv: LevelSummary, arrival: str = "poisson",
                      window: tuple[float | None, float | None, int | None, int] = (None, None, None, 0),
                      length_shapes: tuple[str | None, str | None] = (None, None)) -> Observation | None:
    """A summary level → an observation; None when it has no successful request to learn from."""
    ttft50, tpot50 = _ms(lv.ttft_ms, "p50"), _ms(lv.tpot_ms, "p50")
    if not lv.ok or ttft50 is None or tpot50 is None:
        return None
    return Observation(
        run=run, mode=lv.mode, level=float(lv.level), ttft_p50=ttft50,
        ttft_p95=_ms(lv.ttft_ms, "p95") or ttft50, tpot_p50=tpot50, tpot_p95=_ms(lv.tpot_ms, "p95") or tpot50,
        throughput=float(lv.output_tok_s or 0.0), input_tokens=float(lv.input_tokens_mean or 0.0),
        output_tokens=float(lv.output_tokens_mean or 0.0), in_flight=lv.in_flight_mean,
        running_max=lv.server_running_max, kv_usage_max=lv.kv_usage_max, arrival=arrival,
        window=window, length_shapes=length_shapes)


def with_steps(obs: list[Observation], records: list[dict[str, Any]]) -> list[Observation]:
    """The observations with their pure and prompt steps read from ``records`` (the run's)."""
    splits = step_splits(records, {(o.mode, o.level): o.tpot_p50 * 1e3 for o in obs})
    return [replace(o, pure_step=s.pure_s, prompt_step=s.prompt_s) if (s := splits.get((o.mode, o.level))) else o
            for o in obs]


def server_facts(manifest: Manifest | None) -> ServerFacts:
    s = manifest.server if manifest is not None else {}

    def num(key: str) -> int | None:
        v = s.get(key)
        return int(v) if isinstance(v, (int, float)) and v > 0 else None

    engine = s.get("engine")
    blocks, block_size, sglang = num("num_gpu_blocks"), num("block_size"), num("max_total_num_tokens")
    kv, kv_source = None, None
    engines = num("kv_engines") or 1
    if blocks and block_size:  # one endpoint is one simulated replica: data-parallel engines' pools add up
        kv = (blocks - VLLM_NULL_BLOCKS) * block_size * engines
        kv_source = ("server /metrics vllm:cache_config_info (num_gpu_blocks − 1 null block) × block_size"
                     + (f" × {engines} engines" if engines > 1 else ""))
    elif sglang:
        kv, kv_source = sglang, "server /get_server_info max_total_num_tokens"
    caching = s.get("enable_prefix_caching")
    return ServerFacts(engine=str(engine) if engine else None, total_slots=num("total_slots"), n_ctx=num("n_ctx"),
                       max_model_len=num("max_model_len"), kv_tokens=kv, kv_tokens_source=kv_source,
                       max_running=num("max_running_requests"),
                       prefix_caching=caching if isinstance(caching, bool) else None)


def observe(paths: list[str | Path]) -> tuple[list[Observation], ServerFacts]:
    """Every level with successful requests from every run; the first run's server facts (runs of one server).

    A run with no successful request, or fewer than two usable levels in all, is bad input: the fit would have
    nothing to stand on.
    """
    obs: list[Observation] = []
    facts: ServerFacts | None = None
    for path in paths:
        run = RunDir(path)
        manifest = run.manifest
        summary = build_summary(run)
        fixed = manifest.fixed if manifest is not None else {}
        arrival = str(fixed.get("load.arrival") or "poisson")
        window = (fixed.get("load.warmup"), fixed.get("load.duration"), fixed.get("load.requests"),
                  int(fixed.get("load.seed") or 0))
        shapes = measured_shapes(run, fixed.get("workload.input_tokens"), fixed.get("workload.output_tokens"))
        got = [o for lv in summary.levels
               if (o := level_observation(str(path), lv, arrival, window,
                                          shapes.get((lv.mode, float(lv.level)), (None, None))))
               is not None]
        got = with_steps(got, run.records())
        if any(o.mode == "trace" for o in got):
            warmup = float(fixed.get("load.warmup") or 0.0)
            got = [replace(o, trace=sent_schedule(run, o.level, warmup), window=(warmup, None, None, 0))
                   if o.mode == "trace" else o for o in got]
        if not got:
            raise InputError(f"run {str(path)!r} has no successful requests: nothing to calibrate on")
        obs += got
        facts = facts or server_facts(manifest)
    if len(obs) < 2:
        raise InputError(f"calibrate needs at least 2 load levels with successful requests; got {len(obs)} "
                         f"({', '.join(o.label for o in obs)}): bench more levels, e.g. --concurrency 1,2,4,8")
    return obs, facts or ServerFacts()


Shapes = dict[tuple[str, float], tuple[str | None, str | None]]


def measured_shapes(run: RunDir, input_spec: Any, output_spec: Any) -> Shapes:
    """Per (mode, level): the (prompt, output) length shapes its successful measured requests had, for specs that
    asked for a distribution; None for a fixed length (or a spec that does not parse): the measured mean is
    replayed then. Measured, not asked: the server counts the tokens, and what a bench realises of the asked
    spread can be narrower. Each level its own: a level
    held out of the fit lends nothing to the others."""
    kinds = [_kind(input_spec), _kind(output_spec)]
    if not any(kinds):
        return {}
    values: dict[tuple[str, float], tuple[list[int], list[int]]] = {}
    for r in run.records():
        if r.get("ok") and r.get("phase", "measure") == "measure" and r.get("mode") != "trace":
            v = values.setdefault((str(r["mode"]), float(r["level"])), ([], []))
            v[0].append(int(r.get("input_tokens") or 0))
            v[1].append(int(r.get("output_tokens") or 0))
    return {k: (_shape(kinds[0], v[0]), _shape(kinds[1], v[1])) for k, v in values.items()}


def _kind(spec: Any) -> str | None:
    if not isinstance(spec, str) or ":" not in spec:
        return None
    try:
        kind = parse_length(spec).kind
    except InputError:
        return None
    return None if kind == "fixed" else kind


def _shape(kind: str | None, values: list[int]) -> str | None:
    """A length spec of ``kind`` with the values' mean, spread and extremes."""
    v = [x for x in values if x > 0]
    if kind is None or len(v) < 2:
        return None
    if kind == "uniform":
        return f"uniform:{min(v)},{max(v)}"
    mean = sum(v) / len(v)
    sd = (sum((x - mean) ** 2 for x in v) / (len(v) - 1)) ** 0.5
    return f"{kind}:{mean:.1f},{sd:.1f},{max(v)}"


def sent_schedule(run: RunDir, level: float, warmup_s: float) -> tuple[TraceRow, ...]:
    """The rows a trace level sent, from its first repeat's records: each request's scheduled send time (its
    ``start_s``: latencies count from it) less the level's start (its measured window's start less the warm-up),
    its prompt and the output it asked for. Hash ids are not in records: prefix reuse is not replayed."""
    infos = [i for i in run.levels() if i.mode == "trace" and float(i.level) == level and i.repeat == 0]
    recs = [r for r in run.records() if r.get("mode") == "trace" and float(r["level"]) == level
            and int(r.get("repeat", 0)) == 0]
    if not recs:
        return ()
    t0 = infos[0].measure_start_s - warmup_s if infos else min(float(r["start_s"]) for r in recs)
    return tuple(sorted((TraceRow(max(float(r["start_s"]) - t0, 0.0), max(int(r["input_tokens"]), 1),
                                  max(int(r.get("requested_output_tokens") or r["output_tokens"]), 1))
                         for r in recs), key=lambda row: row.arrival_s))
