"""The step cost and the limits that make the simulator reproduce measured levels.

First the slots (the server's own figure, else what the runs showed), and the step cost in closed form
(:mod:`kvcap.calibrate.closed_form`). Then refined through the simulator itself (a small Nelder–Mead on the
coefficients, bounded in evaluations): it minimises the relative errors of TPOT p50 (and of the two steps where the
records told them) at every fitted level, of throughput where the server sets it (not an open loop far below
saturation: there it is the arrivals'), and of TTFT p50 at the lowest-load level of each workload — TTFT under load
is mostly queueing, which the limits, not the step cost, decide, and a closed loop's busier levels hold the
arrival's phase against the step. That phase is what tells the front end (``per_request``) from prefill, so when
both are to be fitted a second stage refines those two on every unqueued level's TTFT with the step terms held (they
must not bend to it).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvcap.calibrate.closed_form import batch, closed_form
from kvcap.calibrate.observe import Observation, ServerFacts
from kvcap.calibrate.simulate import COST_KEYS, StepCost, cost_from, cost_vector, key
from kvcap.errors import InputError
from kvcap.specs.scenario import ServingSpec

KV_FULL = 0.99
"""KV usage at or above this share: the server was full."""
DEFAULT_SLOTS = ServingSpec().max_num_seqs
PLATEAU_GAIN = 1.05
"""Throughput that grows less than this from one level to the next has stopped growing (the slots are full)."""
MAX_EVALS = 120
"""Simulator runs the refinement may spend."""
X_TOL = 5e-3
"""Refinement converged: the simplex spans less than this share of each first estimate…"""
F_TOL = 1e-6
"""…or its objective values (mean squared relative error) agree this closely: (0.1%)², the simulator's own
sampling noise on a level's medians, below which the coefficients are not told apart."""
NOISE_X = 0.05
NOISE_F = 0.05
"""…or the simplex spans under ``NOISE_X`` of each first estimate and its objective values agree within ``NOISE_F``
of the best: it sits on the simulator's own roughness (a median moving by a step as a coefficient moves by
0.1%), where wandering on tells the coefficients apart no better."""
WORST_RMS = 0.5
"""A refined fit whose RMS relative error stays above this did not find the server."""


@dataclass
class Fit:
    cost: StepCost
    stderr: dict[str, float | None]
    slots: int
    slots_source: str
    converged: bool
    evaluations: int
    rms_error: float | None
    notes: list[str] = field(default_factory=list)


def estimate_slots(obs: list[Observation], facts: ServerFacts) -> tuple[int, str]:
    """Max running sequences: the server's own figure; else the telemetry's running maximum once the server
    showed it was full (fewer running than the load offered, or the KV usage at 100%); else the load level where
    throughput stopped growing. A server never seen full keeps the engine's default limit: the runs give only a
    lower bound, and capping at it would predict a wall nobody measured."""
    if facts.total_slots:
        return facts.total_slots, "server /props total_slots"
    if facts.max_running:
        return facts.max_running, "server /get_server_info max_running_requests"
    running = [o.running_max for o in obs if o.running_max]
    top = max(o.level if o.mode == "concurrency" else (o.in_flight or 0.0) for o in obs)
    never = f"never seen full: the engine default {DEFAULT_SLOTS} (at least {{}} ran at once)"
    if running:
        m = round(max(running))
        if m < top:
            return m, "telemetry server.requests_running max (fewer running than offered)"
        if any((o.kv_usage_max or 0.0) >= KV_FULL for o in obs):
            return m, "telemetry server.requests_running max (with the KV usage at 100%)"
        return max(m, DEFAULT_SLOTS), never.format(m)
    full = queued_open_loop(obs)
    if full:
        return max(1, round(max(decoding(o) for o in full))), (
            "sequences decoding at once (throughput × TPOT p50) where the open loop queued: "
            + ", ".join(o.label for o in full))
    for lo, hi in rising_pairs([o for o in obs if o.mode == "concurrency"]):
        if hi.throughput < lo.throughput * PLATEAU_GAIN:
            return int(lo.level), f"throughput plateau from c={lo.level:g}"
    return max(round(top), DEFAULT_SLOTS), never.format(round(top))


SAME_LENGTH = 0.05
"""Levels whose measured mean prompt and output lengths are within this of each other ran one workload."""


def rising_pairs(obs: list[Observation]) -> list[tuple[Observation, Observation]]:
    """Successive levels of one workload (the same prompt and output lengths), each pair a higher load than the
    last: a plateau means something only between loads of the same requests (profiles at two prompt lengths,
    given together, each keep their own ladder)."""
    ladders: list[list[Observation]] = []
    for o in sorted(obs, key=lambda o: (o.input_tokens, o.output_tokens)):
        for ladder in ladders:  # measured means of one asked workload differ a little from level to level
            if (abs(o.input_tokens - ladder[0].input_tokens) <= SAME_LENGTH * ladder[0].input_tokens
                    and abs(o.output_tokens - ladder[0].output_tokens) <= SAME_LENGTH * ladder[0].output_tokens):
                ladder.append(o)
                break
        else:
            ladders.append([o])
    pairs = []
    for ladder in ladders:
        ladder.sort(key=lambda o: o.level)
        pairs += [(lo, hi) for lo, hi in itertools.pairwise(ladder) if hi.level > lo.level]
    return pairs


QUEUED = 2.0
"""An open-loop level holding this many times the requests it decodes (plus one) was queueing: its requests
waited before their prefill, not in it (a prompt takes a step or a few, a decode the rest of the request)."""


def decoding(o: Observation) -> float:
    """Sequences decoding at once, by Little's law on the decode phase: output tokens/s × seconds per token."""
    return o.throughput * o.tpot_p50


def queued_open_loop(obs: list[Observation]) -> list[Observation]:
    """Open-loop levels where the server was full: more in flight than decoding by :data:`QUEUED`, or a rate
    whose throughput stopped growing below a higher offered rate of the same workload (the slots, or the KV pool
    for these lengths, were taken; in both cases the decoding count is the limit the simulator must hold)."""
    full = [o for o in obs if o.mode in ("rate", "trace") and o.in_flight is not None
            and o.in_flight >= QUEUED * decoding(o) + 1]
    for lo, hi in rising_pairs([o for o in obs if o.mode == "rate"]):
        if hi.throughput < lo.throughput * PLATEAU_GAIN:
            full += [o for o in (lo, hi) if o not in full]
    return full


OPEN_LOOP_ROOM = 0.5
"""An open-loop level whose mean in-flight count stays under this share of the slots is far from saturation."""


def arrival_bound(o: Observation, slots: int) -> bool:
    """An open-loop level far below saturation: it delivers what was offered, so its throughput is the arrival
    process's, not the server's — and on a run of a fixed request count it is the span of the arrivals and the
    last request's time, a sample's accident. The fit leaves such a throughput out."""
    return o.mode in ("rate", "trace") and o.in_flight is not None and o.in_flight <= OPEN_LOOP_ROOM * slots


def relative_errors(measured: list[Observation], simulated: dict[tuple[str, str, float], Observation],
                    slots: int, every_unqueued_ttft: bool = False) -> np.ndarray:
    """The refinement's residuals: TPOT p50 everywhere, the pure decode step and a prompt's step wherever both
    sides' records told them (:mod:`kvcap.calibrate.steps`), throughput wherever the server and not the arrivals set
    it (:func:`arrival_bound`), TTFT p50 at each workload's lowest load (and at every closed-loop level that
    never queues when ``per_request`` is fitted: they tell it apart)."""
    res: list[float] = []
    lowest: dict[tuple[str, float, float], Observation] = {}
    for o in measured:
        g = (o.mode, round(o.input_tokens), round(o.output_tokens))
        if g not in lowest or batch(o, slots) < batch(lowest[g], slots):
            lowest[g] = o
    for o in measured:
        s = simulated.get(key(o))
        if s is None:
            res += [1.0, 1.0]
            continue
        res.append(s.tpot_p50 / o.tpot_p50 - 1)
        if o.pure_step is not None and s.pure_step is not None:
            res.append(s.pure_step / o.pure_step - 1)
            if o.prompt_step is not None and s.prompt_step is not None:
                # as a share of a pure step, not of itself: a prompt may add next to nothing to its step
                res.append((s.prompt_step - o.prompt_step) / o.pure_step)
        if not arrival_bound(o, slots):
            res.append(s.throughput / o.throughput - 1 if o.throughput > 0 else 0.0)
        if o is lowest[(o.mode, round(o.input_tokens), round(o.output_tokens))] or (
                every_unqueued_ttft and o.mode == "concurrency" and o.level <= slots):
            res.append(s.ttft_p50 / o.ttft_p50 - 1)
    return np.array(res)


def nelder_mead(f: Callable[[np.ndarray], float], x0: np.ndarray, step: float = 0.1, max_evals: int = MAX_EVALS,
                x_tol: float = X_TOL, f_tol: float = F_TOL) -> tuple[np.ndarray, float, int, bool]:
    """Minimise ``f`` from ``x0`` (standard coefficients 1, 2, ½, ½); returns (x, f(x), evaluations, converged)."""
    n = len(x0)
    pts = [x0] + [x0 + step * np.eye(n)[i] for i in range(n)]
    vals = [f(p) for p in pts]
    evals = len(pts)
    while evals < max_evals:
        order = np.argsort(vals)
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        spread = max(float(np.max(np.abs(p - pts[0]))) for p in pts[1:])
        f_spread = vals[-1] - vals[0]
        if spread < x_tol or f_spread < f_tol or (spread < NOISE_X and f_spread <= NOISE_F * vals[0]):
            return pts[0], vals[0], evals, True
        centre = np.mean(pts[:-1], axis=0)
        xr = centre + (centre - pts[-1])
        fr = f(xr)
        evals += 1
        if vals[0] <= fr < vals[-2]:
            pts[-1], vals[-1] = xr, fr
        elif fr < vals[0]:
            xe = centre + 2 * (centre - pts[-1])
            fe = f(xe)
            evals += 1
            pts[-1], vals[-1] = (xe, fe) if fe < fr else (xr, fr)
        else:
            xc = centre + 0.5 * (pts[-1] - centre)
            fc = f(xc)
            evals += 1
            if fc < vals[-1]:
                pts[-1], vals[-1] = xc, fc
            else:
                pts = [pts[0] + 0.5 * (p - pts[0]) for p in pts]
                vals = [vals[0]] + [f(p) for p in pts[1:]]
                evals += n
    best = int(np.argmin(vals))
    return pts[best], vals[best], evals, False


Simulator = Callable[[StepCost], dict[tuple[str, str, float], Observation]]


FRONT_END_LADDER = (0.0, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0)
"""With the steps read from the records, the front end is tried at these shares of its first estimate and the
best is kept (see :func:`refine`)."""
ENGINE_TERMS = ("base", "per_decode", "per_context_token", "per_prefill_token")
FIRST_TOKEN_TERMS = ("per_prefill_token", "per_request")


def refine(obs: list[Observation], start: StepCost, slots: int, sim: Simulator,
           max_evals: int = MAX_EVALS) -> tuple[StepCost, int, bool, float]:
    """Nelder–Mead on the coefficients, each scaled by its first estimate (zeros stay zero: nothing to scale),
    against the simulator; returns (cost, evaluations, converged, RMS relative error).

    With a front end to tell from prefill (``per_request`` started above 0) it goes in two stages: the engine's
    terms (the step's and prefill's) against TPOT, throughput and the lowest level's TTFT with ``per_request``
    held, then the first-token terms (prefill, front end) against every unqueued level's TTFT with the step
    held — the TTFT of a closed loop's busier levels carries the arrival's phase against the step, which should
    split prefill from the front end, not bend the per-sequence cost. Where the records told what a prompt adds
    to a step, the order turns: the front end first (by :data:`FRONT_END_LADDER`), then the engine terms against
    every residual with it held — the steps read from the records now pin prefill apart from the front end."""
    if start.per_request <= 0:
        return _refine_terms(obs, start, slots, sim, COST_KEYS, False, max_evals)
    if not any(o.prompt_step is not None for o in obs):
        step, e1, ok1, _ = _refine_terms(obs, start, slots, sim, ENGINE_TERMS, False, max_evals)
        cost, e2, ok2, rms = _refine_terms(obs, step, slots, sim, FIRST_TOKEN_TERMS, True, max_evals)
        return cost, e1 + e2, ok1 and ok2, rms
    # the records gave the pure step and the prompt's: the front end first, then the step terms with it held.
    # The front end by a ladder, not a simplex: TTFT's rest at the lowest level (its first estimate) also holds
    # the wait for a step in progress, and in a closed loop the front end sets where an arrival falls against the
    # steps (at a step's end, or inside one), so the error moves in jumps as it grows
    ladder = [cost_from([v * share if k == "per_request" else v
                         for k, v in zip(COST_KEYS, cost_vector(start), strict=True)]) for share in FRONT_END_LADDER]
    scored = [(float(np.mean(np.square(relative_errors(obs, sim(c), slots, every_unqueued_ttft=True)))), n, c)
              for n, c in enumerate(ladder)]
    front = min(scored)[2]
    cost, evals, ok, rms = _refine_terms(obs, front, slots, sim, ENGINE_TERMS, True, max_evals)
    return cost, evals + len(ladder), ok, rms


def _refine_terms(obs: list[Observation], start: StepCost, slots: int, sim: Simulator, terms: tuple[str, ...],
                  every_unqueued_ttft: bool, max_evals: int) -> tuple[StepCost, int, bool, float]:
    """:func:`refine` over the named coefficients only (the others held at ``start``)."""
    x0 = np.array(cost_vector(start))
    free = (x0 > 0) & np.array([k in terms for k in COST_KEYS])

    def cost_of(z: np.ndarray) -> StepCost:
        x = x0.copy()
        x[free] = np.abs(z) * x0[free]
        return cost_from(x)

    def objective(z: np.ndarray) -> float:
        r = relative_errors(obs, sim(cost_of(z)), slots, every_unqueued_ttft=every_unqueued_ttft)
        return float(np.mean(r * r))

    z, val, evals, converged = nelder_mead(objective, np.ones(int(free.sum())), max_evals=max_evals)
    return cost_of(z), evals, converged, float(np.sqrt(val))


def fit(obs: list[Observation], facts: ServerFacts, sim_for: Callable[[int], Simulator],
        max_evals: int = MAX_EVALS, front_end: bool = False) -> Fit:
    """Closed form, then refined by ``sim_for(slots)``; a refinement that does not converge (or converges on
    nothing like the server) is bad input: the caller writes nothing."""
    slots, source = estimate_slots(obs, facts)
    start, stderr, notes = closed_form(obs, slots, front_end)
    cost, evals, converged, rms = refine(obs, start, slots, sim_for(slots), max_evals)
    if not converged or not np.isfinite(rms) or rms > WORST_RMS:
        why = (f"not settled after {evals} simulator runs" if not converged
               else f"the best fit is still {rms:.0%} off (RMS relative error)")
        raise InputError(f"the fit did not converge ({why}); nothing written — check that the runs come from one "
                         "server and one configuration")
    return Fit(cost, stderr, slots, source, converged, evals, rms, notes)


def summary_errors(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """Mean absolute error % per metric over table rows."""
    out: dict[str, float | None] = {}
    for m in ("throughput", "ttft_p50", "ttft_p95", "tpot_p50", "tpot_p95"):
        vals = [abs(r["error_pct"][m]) for r in rows if r["error_pct"].get(m) is not None]
        out[m] = round(float(np.mean(vals)), 2) if vals else None
    return out
