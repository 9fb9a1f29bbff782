"""Published serving measurements (summary points, not run directories) → the observations ``calibrate.fit`` takes.

Why: benchmark reports of real vLLM give, per load level, only means (TTFT, TPOT, output throughput) of a
``benchmark_serving.py`` run — a Poisson rate with a fixed request count, or N requests sent at once (a burst).
That is enough to calibrate on the lowest levels and predict the rest, if the simulator replays the same runs and
reduces its records the same way: means, and throughput = output tokens / (last completion − first send).
Means stand in for the observations' p50 (and p95) fields on both sides, so the fit compares like with like.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from kvcap.calibrate.fit import PLATEAU_GAIN, Fit, Simulator, fit
from kvcap.calibrate.observe import Observation, ServerFacts
from kvcap.calibrate.prefill_floor import prefill_floor_s
from kvcap.calibrate.simulate import StepCost, key, serving_section
from kvcap.errors import InputError
from kvcap.rundir import RunDir
from kvcap.sim.run import SimConfig, run_sim
from kvcap.specs.lengths import parse_length
from kvcap.specs.scenario import Scenario, build_scenario
from kvcap.workload.loadplan import LoadPlan
from kvcap.workload.trace import TraceRow

MODES = ("rate", "burst")
MAX_EVALS = 300
"""Simulator runs the refinement may spend: a Poisson set of 200 requests with ShareGPT-like lengths gives a
flatter, rougher objective than a closed loop, which needs more runs to settle than the fit's default."""
CACHED = "cached"
"""The fit's mode for a point whose measured TTFT is below :func:`ttft_floor_s`: part of its prompts were served
from vLLM's prefix cache (on by default in V1; ``benchmark_serving.py`` also sends ``input_requests[0]`` once as a
test prompt before the run, so a burst of one is a cache hit: see benchmarks/README.md, ``calibration.py``). Its
TPOT and throughput still count; its TTFT prices no prefill. In a mode of its own it is not its group's lowest-load
TTFT, so the refinement takes TTFT from the lowest uncached level."""


ITL_PERCENTILES = (50, 90, 99)
ITL_KEYS = tuple(f"itl_p{q}_ms" for q in ITL_PERCENTILES)
"""Inter-token gap percentiles a published point may carry (``benchmark_serving.py`` reports them): the median is
mostly pure decode steps, the upper ones the steps that carried prompts. The fit takes the median of its fitted
points (:func:`observations`); the upper ones only show where a prediction's step is off. Fitted too, they
made prompts nearly free on the sets whose fitted levels found their prompts cached and pushed the RTX 4090 Llama
sets' per-sequence cost up (see benchmarks/README.md, ``calibration.py``): a linear step cannot hold both a prompt
that rides free and one that does not."""


@dataclass(frozen=True)
class PublishedSet:
    """One published series: the scenario it ran (GPU, model, engine limits, lengths), how load was offered,
    the measured KV pool in tokens where the source states it, and the points."""

    name: str
    scenario: dict[str, Any]
    mode: str
    requests: int | None
    kv_tokens: int | None
    points: tuple[dict[str, float], ...]
    seed: int | None = None
    """``benchmark_serving.py``'s ``--seed`` where the source states it: its arrivals' draws are then known
    (:func:`rate_replay`)."""
    order: tuple[float, ...] = ()
    """The levels in the order the source ran them on one server, where it says (see :meth:`warm`); such a set's
    scenario hashes prompts at the server's KV block size (``serving.hash_block_tokens``)."""

    def warm(self, level: float) -> bool:
        """This level ran after another run of the same prompts on the same server: with vLLM's prefix cache on
        (V1's default), its prompts may have been served from what that server still held, so it is replayed
        after those runs (:func:`session_replay`)."""
        return level in self.order and self.order.index(level) > 0

    def itl(self, level: float) -> dict[str, float] | None:
        """The point's published inter-token gap percentiles (ms), where it gives all of :data:`ITL_KEYS`."""
        point = next((p for p in self.points if p["level"] == level), {})
        return {k: point[k] for k in ITL_KEYS} if all(k in point for k in ITL_KEYS) else None

    def saturated(self, level: float) -> bool:
        """The server was past what it could serve as offered at this level, so TTFT is mostly the queue's order:
        a rate whose measured throughput grew less than :data:`~kvcap.calibrate.fit.PLATEAU_GAIN` over the next
        lower rate's, or a burst whose prompts do not fit one step's token budget together (they wait for each
        other's prefill)."""
        if self.mode == "burst":
            budget = build_scenario(self.scenario, f"published set {self.name}").serving.max_num_batched_tokens
            return level * self.lengths[0] > budget
        thr = {p["level"]: p["output_tok_s"] for p in self.points}
        lower = [v for v in thr if v < level]
        return bool(lower) and thr[level] < PLATEAU_GAIN * thr[max(lower)]

    @property
    def lengths(self) -> tuple[float, float]:
        """Mean prompt and output tokens of the workload."""
        w = self.scenario["workload"]
        return parse_length(w["input_tokens"]).mean, parse_length(w["output_tokens"]).mean


def load_sets(path: Path) -> list[PublishedSet]:
    """Read a ``vllm_measured.yaml``-style file; a malformed one is bad input."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
        out = []
        for s in raw["sets"]:
            mode = s["load"]["mode"]
            if mode not in MODES:
                raise ValueError(f"set {s['name']}: load.mode {mode!r} is not one of {', '.join(MODES)}")
            pts = tuple({k: float(v) for k, v in p.items()} for p in s["points"])
            seed, order = s["load"].get("seed"), tuple(float(v) for v in s["load"].get("order", ()))
            scenario = s["scenario"]
            if order:  # replayed as sessions (session_replay): its prompts hashed as the server hashes them
                block = build_scenario(scenario, f"published set {s['name']}").serving.block_size
                scenario = {**scenario, "serving": {**scenario.get("serving", {}), "hash_block_tokens": block}}
            out.append(PublishedSet(str(s["name"]), scenario, mode, s["load"].get("requests"),
                                    (s.get("measured") or {}).get("kv_tokens"), pts,
                                    None if seed is None else int(seed), order))
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError) as e:
        raise InputError(f"published measurements {str(path)!r}: {e}") from None
    return out


def ttft_floor_s(s: PublishedSet, level: float) -> float:
    """The least mean TTFT a level can have with no prefix-cache hit: its mean prompt's
    :func:`~kvcap.calibrate.prefill_floor.prefill_floor_s`; a burst of N prefills first come, first served, so
    its mean waits (N + 1) / 2 of them. A measured TTFT below it was (partly) served from the cache."""
    one = prefill_floor_s(build_scenario(s.scenario, f"published set {s.name}"), s.lengths[0])
    return one * ((level + 1) / 2 if s.mode == "burst" else 1.0)


def observation(run: str, mode: str, level: float, ttft_s: float, tpot_s: float, throughput: float,
                input_tokens: float, output_tokens: float, pure_step_s: float | None = None) -> Observation:
    """A point of means → an observation. A burst of N decodes N together (``in_flight``); a rate level's
    in-flight count is Little's law: completions/s (throughput / mean output) × E2E. ``pure_step_s``: the
    pooled median inter-token gap where the source gives it (see :func:`observations`)."""
    e2e = e2e_s(ttft_s, tpot_s, output_tokens)
    in_flight = level if mode == "burst" else throughput / max(output_tokens, 1.0) * e2e
    return Observation(run=run, mode=mode, level=level, ttft_p50=ttft_s, ttft_p95=ttft_s, tpot_p50=tpot_s,
                       tpot_p95=tpot_s, throughput=throughput, input_tokens=input_tokens,
                       output_tokens=output_tokens, in_flight=in_flight, pure_step=pure_step_s)


def e2e_s(ttft_s: float, tpot_s: float, output_tokens: float) -> float:
    """E2E as the sources derive it from their means: TTFT + TPOT × (mean output − 1)."""
    return ttft_s + tpot_s * max(output_tokens - 1.0, 0.0)


def observations(s: PublishedSet) -> list[Observation]:
    """The set's points as the fit's observations. Where the source gives inter-token gap percentiles, the median
    stands for the pure decode step (``Observation.pure_step``, as a bench run's records give it): at the low
    loads a fit sees, the 90th percentile is within a few % of the median, so nine gaps in ten carried no prompt
    and the median is a decode step as the server ran it. TPOT's mean also spreads over its tokens the steps that
    carried prompts, which a line through TPOT alone reads as cost per sequence."""
    n_in, n_out = s.lengths
    out = []
    for p in s.points:
        gaps = s.itl(p["level"])
        out.append(observation(s.name, s.mode, p["level"], p["ttft_ms"] / 1e3, p["tpot_ms"] / 1e3,
                               p["output_tok_s"], n_in, n_out, gaps["itl_p50_ms"] / 1e3 if gaps else None))
    return out


def scenario_for(s: PublishedSet, cost: StepCost, slots: int, kv_tokens: int | None) -> dict[str, Any]:
    """The set's scenario with the fitted step cost and limits in its serving section (its own budget and
    chunked-prefill settings kept)."""
    serving = {**s.scenario.get("serving", {}), **serving_section(cost, "vllm", slots, kv_tokens)}
    return {**s.scenario, "serving": serving}


REPLAYS = 4
"""Replays of a rate run (each its own arrival draws and order of lengths) whose means stand for it: at the few
requests in flight of a low rate, one order of the requests (which long request overlaps which) moves a fitted
per-sequence cost a lot."""


def plan_for(s: PublishedSet, level: float, order: int = 0) -> tuple[LoadPlan, float]:
    """The run the source made, and when its measured requests start: a burst is a closed loop of N with a quota
    of N (all sent at once, nothing after); a rate is its stated request count as a trace (:func:`rate_replay`),
    after the runs that came before it on the same server where the source says so (:func:`session_replay`)."""
    if s.mode == "burst":
        return LoadPlan(mode="concurrency", levels=(level,), warmup_s=0.0, duration_s=None,
                        requests=int(level)), 0.0
    rows, start = session_replay(s, level, order) if s.warm(level) else (rate_replay(s, level, order), 0.0)
    return LoadPlan(mode="trace", levels=(1.0,), warmup_s=0.0, duration_s=None, trace=rows), start


SESSION_GAP_S = 120.0
"""Seconds from one replayed run's last arrival to the next run's first: every run has drained by then, and an idle
server changes nothing in between (the sources' own gaps: benchmarks/README.md, ``calibration.py``)."""
HASH_STRIDE = 1 << 16
"""Hash ids of request j's prompt blocks: j × this + block (over the 64 blocks of a 1,024-token prompt)."""


def session_replay(s: PublishedSet, level: float, order: int = 0) -> tuple[tuple[TraceRow, ...], float]:
    """The runs of ``s`` up to ``level`` in the order the source ran them on one server (``s.order``), the same
    prompts in each — as hashed prefix blocks at the server's block size, so the simulator's prefix cache finds
    what the runs before left (vLLM V1 caches prompts by default) — and the start of the last run, the measured
    one. Why: replayed cold, every later run paid for prompts the real server served from its cache (no step at
    1 req/s on the H100 sets is long enough to have computed a long prompt)."""
    bs = int(s.scenario["serving"]["hash_block_tokens"])
    rows: list[TraceRow] = []
    start = 0.0
    for rate in s.order[: s.order.index(level) + 1]:
        start = rows[-1].arrival_s + SESSION_GAP_S if rows else 0.0
        rows += [TraceRow(start + r.arrival_s, r.input_tokens, r.output_tokens,
                          tuple(j * HASH_STRIDE + b for b in range(r.input_tokens // bs)))
                 for j, r in enumerate(rate_replay(s, rate, order))]
    return tuple(rows), start


def rate_replay(s: PublishedSet, level: float, order: int = 0) -> tuple[TraceRow, ...]:
    """A rate run as ``benchmark_serving.py`` makes it, replayed: the same requests at every rate (it samples its
    prompts once, with a fixed seed) and Poisson gaps that are the same draws scaled by 1 / rate — it seeds numpy's
    global generator with ``--seed`` and draws ``np.random.gamma(1, 1 / rate)`` after each request it sends. Where
    the source states that seed (``s.seed``) the gaps are its draws (the client's sleeps add their own
    milliseconds), and the sources' run times agree with them (benchmarks/README.md, ``calibration.py``). Otherwise
    they are scaled so the arrivals span their expected (n − 1) / rate: 199 Poisson gaps put the span anywhere
    within ±7% (at 1 req/s the throughput is that span). Lengths, which the sources do not list, are at the
    quantiles of the set's distributions in an order drawn from ``order`` (which of the :data:`REPLAYS`): 200
    lognormal draws with cv 1 put the mean output anywhere within ±8%."""
    n = s.requests or 0
    w = s.scenario["workload"]
    rng = np.random.default_rng(order)
    if s.seed is not None:
        gaps = np.random.RandomState(s.seed).gamma(1.0, 1.0 / level, size=max(n - 1, 0))
    else:
        gaps = rng.exponential(1.0, size=max(n - 1, 0))
        gaps *= len(gaps) / max(float(gaps.sum()), 1e-12) / level  # the expected span, (n - 1) / rate, exactly
    lengths_in = rng.permutation(parse_length(w["input_tokens"]).quantiles(n))
    lengths_out = rng.permutation(parse_length(w["output_tokens"]).quantiles(n))
    starts = np.concatenate(([0.0], np.cumsum(gaps)))
    return tuple(TraceRow(float(t), int(i), int(o)) for t, i, o in zip(starts, lengths_in, lengths_out, strict=True))


def reduce_records(recs: list[dict[str, Any]]) -> tuple[float, float, float, float]:
    """(mean TTFT s, mean TPOT s, output tok/s, mean output tokens), as ``benchmark_serving.py`` reduces a run."""
    ok = [r for r in recs if r["ok"]]
    if not ok:
        return math.nan, math.nan, 0.0, 0.0
    span = max(r["end_s"] for r in ok) - min(r["start_s"] for r in ok)
    tokens = sum(r["output_tokens"] for r in ok)
    tpots = [r["tpot_ms"] for r in ok if r["tpot_ms"] is not None]
    return (float(np.mean([r["ttft_ms"] for r in ok])) / 1e3, float(np.mean(tpots)) / 1e3 if tpots else math.nan,
            tokens / span if span > 0 else 0.0, tokens / len(ok))


def calibrated(s: PublishedSet, cost: StepCost, slots: int, kv_tokens: int | None) -> Scenario:
    """The set's scenario with this step cost, slots and KV pool."""
    return build_scenario(scenario_for(s, cost, slots, kv_tokens), f"published set {s.name}")


Gaps = dict[str, float] | None
"""A point's pooled inter-token gap percentiles (ms, keyed by :data:`ITL_KEYS`), or None."""


def simulate_points(s: PublishedSet, cost: StepCost, slots: int, kv_tokens: int | None, levels: list[float],
                    ) -> tuple[dict[tuple[str, str, float], Observation], dict[tuple[str, str, float], Gaps]]:
    """Replay each level of ``s`` in the simulator with this step cost (:func:`replay_point`); the observations and,
    for the points whose source gives gap percentiles, the simulated ones, keyed like ``calibrate.simulate.key``."""
    scenario = calibrated(s, cost, slots, kv_tokens)
    out: dict[tuple[str, str, float], Observation] = {}
    gaps: dict[tuple[str, str, float], Gaps] = {}
    for level in levels:
        o, g = replay_point(s, scenario, level)
        if o is not None:
            out[key(o)] = o
            if s.itl(level) is not None:
                gaps[key(o)] = g
    return out, gaps


def simulate_set(s: PublishedSet, cost: StepCost, slots: int, kv_tokens: int | None,
                 levels: list[float]) -> dict[tuple[str, str, float], Observation]:
    """:func:`simulate_points`' observations alone (what the fit compares)."""
    return simulate_points(s, cost, slots, kv_tokens, levels)[0]


def _replayed(s: PublishedSet, scenario: Scenario, level: float, record_itl: bool = False
              ) -> Iterator[list[dict[str, Any]]]:
    """The measured records of each run that stands for one point of ``s`` (a rate level :data:`REPLAYS` orders;
    a session's last run only)."""
    with tempfile.TemporaryDirectory(prefix="kvcap-published-") as tmp:
        for i in range(REPLAYS if s.mode == "rate" else 1):
            run = Path(tmp) / f"r{i}"
            plan, start = plan_for(s, level, i)
            run_sim(SimConfig(scenario=scenario, plan=plan, out=run, record_itl=record_itl))
            yield [r for r in RunDir(run).records() if r["start_s"] >= start - 1e-9]


def replay_point(s: PublishedSet, scenario: Scenario, level: float) -> tuple[Observation | None, Gaps]:
    """One point of ``s`` simulated with ``scenario`` as the source ran it (a rate level :data:`REPLAYS` times, the
    means of their reductions) and, where the source gives gap percentiles, the same percentiles of every
    replayed gap pooled (``benchmark_serving.py`` pools every request's gaps of its one run; their median is the
    observation's pure step); (None, None) when no request finished."""
    got, gaps = [], []
    for recs in _replayed(s, scenario, level, record_itl=s.itl(level) is not None):
        got.append(reduce_records(recs))
        gaps += [np.asarray(r["itl_ms"], dtype=float) for r in recs if r["ok"] and r.get("itl_ms")]
    ttft, tpot, thr, n_out = (float(np.mean(v)) for v in zip(*got, strict=True))
    if not (math.isfinite(ttft) and math.isfinite(tpot)):
        return None, None
    pooled = None
    if gaps:
        values = np.percentile(np.concatenate(gaps), ITL_PERCENTILES)
        pooled = {k: float(v) for k, v in zip(ITL_KEYS, values, strict=True)}
    pure = pooled["itl_p50_ms"] / 1e3 if pooled else None
    return observation(s.name, s.mode, level, ttft, tpot, thr, s.lengths[0], n_out, pure), pooled


def replay(s: PublishedSet, scenario: Scenario, level: float) -> Observation | None:
    """:func:`replay_point`'s observation alone."""
    return replay_point(s, scenario, level)[0]


@dataclass(frozen=True)
class Prediction:
    """A calibration on some points of a set and the simulator's prediction of every point of ``target``."""

    fit: Fit
    target: PublishedSet
    kv_tokens: int | None
    fitted: tuple[float, ...]
    measured: list[Observation]
    simulated: dict[tuple[str, str, float], Observation]
    itl: dict[tuple[str, str, float], Gaps] = field(default_factory=dict)
    """Simulated inter-token gap percentiles of the points whose source gives them (:meth:`PublishedSet.itl`)."""


def ttft_cached(s: PublishedSet, o: Observation) -> bool:
    """The measured TTFT is below what an uncached prefill can take (see :data:`CACHED`)."""
    return o.ttft_p50 < ttft_floor_s(s, o.level)


def fit_view(fitted: list[Observation], simulated: dict[tuple[str, str, float], Observation], mode: str,
             ) -> dict[tuple[str, str, float], Observation]:
    """Simulated levels keyed as the fit sees them; a cached point gets its measured TTFT back (no TTFT residual:
    the simulator serves no cache hit it could be compared with); ``mode`` is the set's own."""
    out = {}
    for o in fitted:
        got = simulated.get((o.run, mode, o.level))
        if got is not None:
            out[key(o)] = replace(got, mode=CACHED, ttft_p50=o.ttft_p50, ttft_p95=o.ttft_p95) if o.mode == CACHED \
                else got
    return out


def calibrate_and_predict(s: PublishedSet, fit_levels: tuple[float, ...], target: PublishedSet | None = None,
                          max_evals: int = MAX_EVALS) -> Prediction:
    """Fit on ``fit_levels`` of ``s`` only, then predict every other point of ``s`` — or, with ``target``, every
    point of that set: the same server with its own KV pool (a what-if on memory the fit never saw)."""
    obs = observations(s)
    fitted = [replace(o, mode=CACHED) if ttft_cached(s, o) else o for o in obs if o.level in fit_levels]
    if len(fitted) < 2:
        raise InputError(f"set {s.name}: fit levels {fit_levels} leave {len(fitted)} measured point(s); need 2")
    facts = ServerFacts(max_model_len=s.scenario.get("serving", {}).get("max_model_len"))

    def sim_for(slots: int) -> Simulator:
        return lambda cost: fit_view(fitted, simulate_set(s, cost, slots, s.kv_tokens, [o.level for o in fitted]),
                                     s.mode)

    result = fit(fitted, facts, sim_for, max_evals, front_end=any(s.warm(o.level) for o in fitted))
    dest = target or s
    measured = observations(dest) if target else [o for o in obs if o.level not in fit_levels]
    simulated, itl = simulate_points(dest, result.cost, result.slots, dest.kv_tokens, [o.level for o in measured])
    return Prediction(result, dest, dest.kv_tokens, tuple(fit_levels), measured, simulated, itl)


def errors_pct(meas: Observation, sim: Observation | None) -> dict[str, float | None]:
    """Signed errors in % of mean TTFT, TPOT, E2E and output throughput (None where nothing was simulated)."""
    def err(a: float, b: float) -> float | None:
        return None if sim is None or b <= 0 or not math.isfinite(a) else round(100 * (a / b - 1), 2)

    if sim is None:
        return dict.fromkeys(("ttft", "tpot", "e2e", "throughput"))
    return {"ttft": err(sim.ttft_p50, meas.ttft_p50), "tpot": err(sim.tpot_p50, meas.tpot_p50),
            "e2e": err(e2e_s(sim.ttft_p50, sim.tpot_p50, sim.output_tokens),
                       e2e_s(meas.ttft_p50, meas.tpot_p50, meas.output_tokens)),
            "throughput": err(sim.throughput, meas.throughput)}


def rows(p: Prediction) -> list[dict[str, Any]]:
    """Held-out rows: measured and simulated means (ms, tok/s) and the errors."""
    out = []
    for o in p.measured:
        s = p.simulated.get(key(o))

        def vals(x: Observation | None) -> dict[str, float | None]:
            if x is None:
                return dict.fromkeys(("ttft_ms", "tpot_ms", "e2e_ms", "output_tok_s"))
            return {"ttft_ms": x.ttft_p50 * 1e3, "tpot_ms": x.tpot_p50 * 1e3,
                    "e2e_ms": e2e_s(x.ttft_p50, x.tpot_p50, x.output_tokens) * 1e3, "output_tok_s": x.throughput}

        floor = ttft_floor_s(p.target, o.level)
        out.append({"set": o.run, "level": o.level, "in_flight": o.in_flight, "ttft_floor_ms": floor * 1e3,
                    "ttft_cached": ttft_cached(p.target, o), "warm": p.target.warm(o.level),
                    "saturated": p.target.saturated(o.level), "measured": vals(o),
                    "simulated": vals(s), "error_pct": errors_pct(o, s),
                    "itl_ms": {"measured": p.target.itl(o.level), "simulated": p.itl.get(key(o))}
                    if p.target.itl(o.level) is not None else None})
    return out
