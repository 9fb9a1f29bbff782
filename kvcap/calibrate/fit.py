"""The step cost and the limits that make the simulator reproduce measured levels.

First in closed form: below the slot limit every decode step runs ``B = min(load, slots)`` sequences, so a pure
decode step (read from the records where they tell it, :mod:`kvcap.calibrate.steps`; else TPOT) ≈ base +
per_decode·B (+ per_context_token·B·context when the runs' context lengths differ enough to tell
that term apart), a relative-error least squares whose covariance gives each coefficient's standard error; the
first step of a lone request (c=1, else the lowest load) carries its prompt, so TTFT − step there ≈
per_prefill_token·prompt (no standard error: one level gives it) — unless the records show the steps that
carried one prompt: their extra over a pure step is per_prefill_token·prompt itself, and TTFT's rest is the
front end.
Then refined through the simulator itself (a small Nelder–Mead on the coefficients, bounded in evaluations):
it minimises the relative errors of TPOT p50 (and of the two steps where the records told them) at every
fitted level, of throughput where the server sets it (not
an open loop far below saturation: there it is the arrivals'), and of TTFT p50 at the lowest-load level of each
workload — TTFT under load is mostly queueing, which the limits, not the step cost, decide, and a closed loop's
busier levels hold the arrival's phase against the step. That phase is what tells the front end
(``per_request``) from prefill, so when both are to be fitted a second stage refines those two on every
unqueued level's TTFT with the step terms held (they must not bend to it).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvcap.calibrate.observe import Observation, ServerFacts
from kvcap.calibrate.simulate import COST_KEYS, StepCost, cost_from, cost_vector, key
from kvcap.errors import InputError
from kvcap.specs.scenario import ServingSpec

KV_FULL = 0.99
"""KV usage at or above this share: the server was full."""
DEFAULT_SLOTS = ServingSpec().max_num_seqs
DEFAULT_BUDGET = ServingSpec().max_num_batched_tokens
"""Prompts up to this many tokens finish in one step (the engine's default budget): a step that carried one
carried all of it."""
PLATEAU_GAIN = 1.05
"""Throughput that grows less than this from one level to the next has stopped growing (the slots are full)."""
CONTEXT_SPREAD = 0.2
"""Context lengths must differ by this share across levels before the per-context term is fitted."""
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


def batch(o: Observation, slots: int) -> float:
    """Sequences decoding together at this level."""
    load = o.level if o.mode == "concurrency" else (o.in_flight or 1.0)
    return float(max(1.0, min(load, slots)))


def context(o: Observation) -> float:
    """Mean KV a decoding sequence attends to: its prompt and half its output."""
    return o.input_tokens + o.output_tokens / 2


def step_line_targets(obs: list[Observation]) -> list[float]:
    """What the decode line is fitted to: every level's pure decode step when the records told each (TPOT also
    spreads over its tokens the steps that carried other requests' prompts, c − 1 of them per request in a
    closed loop of c out of lockstep, which a line through TPOT would read as cost per sequence), else TPOT p50."""
    pure = [o.pure_step for o in obs]
    return [float(v) for v in pure if v is not None] if all(v is not None for v in pure) else [o.tpot_p50 for o in obs]


def measured_prompt_cost(obs: list[Observation], per_decode: float) -> tuple[float, str] | None:
    """per_prefill_token from the steps that carried one prompt (their extra over a pure step, less the one
    more sequence that samples in it, ``per_decode``, per prompt token; the median over the levels that told
    it), when prompts fit one step of the default budget."""
    per = [(max(o.prompt_step - per_decode, 0.0) / o.input_tokens, o) for o in obs
           if o.prompt_step is not None and 0 < o.input_tokens <= DEFAULT_BUDGET]
    if not per:
        return None
    value = float(np.median([v for v, _ in per]))
    return value, ("per_prefill_token from the steps that carried one prompt, against pure decode steps "
                   f"(records of {', '.join(o.label for _, o in per)})")


def waiting_at_server(o: Observation, slots: int) -> float:
    """Requests waiting at the server for a slot at this level: a closed loop's users past the slots, an open
    loop's mean in flight past them."""
    load = o.level if o.mode == "concurrency" else (o.in_flight or 0.0)
    return max(0.0, load - slots)


WAITING_NOISE = 0.03
"""A queued level's pure step must lie this share above the line before a cost of waiting requests is believed."""


def waiting_cost(queued: list[Observation], slots: int, line: Callable[[float, float], float],
                 ) -> tuple[float, str] | None:
    """per_waiting from the levels with requests waiting at the server: their pure decode step's excess over the
    line through the unqueued levels, per sequence that samples per request waiting (the median over them);
    None where no such level told a pure step."""
    told = [o for o in queued if o.pure_step is not None]
    if not told:
        return None
    per, excess = [], []
    for o in told:
        b, expected = batch(o, slots), line(batch(o, slots), context(o))
        excess.append(o.pure_step / expected - 1)
        per.append((o.pure_step - expected) / (b * waiting_at_server(o, slots)))
    labels = ", ".join(f"{o.label} ({waiting_at_server(o, slots):g} waiting, {100 * e:+.1f}%)"
                       for o, e in zip(told, excess, strict=True))
    value = float(np.median(per))
    if value <= 0 or float(np.median(excess)) < WAITING_NOISE:
        return 0.0, f"per_waiting 0: the pure steps of {labels} are within {WAITING_NOISE:.0%} of the line"
    return value, f"per_waiting from the pure steps of {labels} against the line through the unqueued levels"


def closed_form(obs: list[Observation], slots: int) -> tuple[StepCost, dict[str, float | None], list[str]]:
    """The linear first estimate and its standard errors (None where the data cannot give one). The decode line
    goes through the levels with no request waiting at the server where two batch sizes or more remain (a queue
    at the door can slow the steps: ``per_waiting``, told from the others)."""
    free = [o for o in obs if waiting_at_server(o, slots) < 0.5]
    queued = [o for o in obs if o not in free]
    unseparated = bool(queued) and len({round(batch(o, slots), 6) for o in free}) < 2
    if queued and not unseparated:
        obs = free
    else:
        queued = []
    b = np.array([batch(o, slots) for o in obs])
    if len(set(b.round(6))) < 2:
        raise InputError(f"every level runs the same batch ({b[0]:g} sequences): base and per-sequence cost cannot "
                         "be told apart; bench levels below the slot count, e.g. --concurrency 1,2,4,8")
    ctx = np.array([context(o) for o in obs])
    y = np.array(step_line_targets(obs))
    floor, on_line = step_floor(obs, b, y)
    b, ctx, y = b[on_line], ctx[on_line], y[on_line]
    cols = [np.ones_like(b), b]
    use_ctx = len(y) >= 4 and (ctx.max() - ctx.min()) / ctx.mean() > CONTEXT_SPREAD
    if use_ctx:
        cols.append(b * ctx)
    x = np.stack(cols, axis=1) / y[:, None]  # relative errors: every level weighs the same
    coef, *_ = np.linalg.lstsq(x, np.ones_like(y), rcond=None)
    dof = len(y) - x.shape[1]
    err: list[float | None] = [None] * x.shape[1]
    if dof > 0:
        resid = np.ones_like(y) - x @ coef
        cov = float(resid @ resid) / dof * np.linalg.pinv(x.T @ x)
        err = [float(np.sqrt(max(v, 0.0))) for v in np.diag(cov)]
    notes = [] if use_ctx else ["per_context_token not fitted: the levels' context lengths hardly differ (0 s)"]
    base, per_decode = max(float(coef[0]), 0.0), max(float(coef[1]), 0.0)
    per_ctx = max(float(coef[2]), 0.0) if use_ctx else 0.0
    per_waiting = 0.0
    told = waiting_cost(queued, slots, lambda bs, c: max(floor, base + per_decode * bs + per_ctx * bs * c))
    if told is not None:
        per_waiting, why = told
        notes.append(why)
    elif unseparated:
        notes.append("per_waiting not fitted: the levels without requests waiting for a slot ran fewer than two batch "
                     "sizes, so the line goes through the queued ones too")
    elif queued:
        notes.append("per_waiting not fitted: no level with requests waiting at the server told a pure decode step")
    lone = [o for o in obs if o.mode == "concurrency" and o.level == 1]
    low = lone[0] if lone else min(obs, key=lambda o: (batch(o, slots), o.level))
    ppt, per_request, how = prefill_and_overhead(obs, low, slots, (base, per_decode, per_ctx))
    measured = measured_prompt_cost(obs, per_decode)
    if measured is not None:  # the front end is what TTFT holds beyond the prompt's own step
        bl = batch(low, slots)
        beyond = low.ttft_p50 - max(floor, base + per_decode * bl + per_ctx * bl * low.input_tokens)
        ppt, how = measured
        per_request = max(beyond - ppt * low.input_tokens, 0.0)
    stderr = {"base": err[0], "per_decode": err[1], "per_context_token": err[2] if use_ctx else None,
              "per_prefill_token": None, "per_request": None, "floor": None, "per_waiting": None}
    notes.append(how + ("" if lone else ": with no lone request (c=1) its queueing is in it too, the refinement "
                        "trims it"))
    if floor:
        notes.append(f"floor: the pure decode step at the smallest batch ({floor * 1e3:.3f} ms) is over "
                     f"{FLOOR_GAP:.0%} above the line through the larger ones: a step takes at least that")
    return cost_from((base, per_decode, ppt, per_ctx, per_request, floor, per_waiting)), stderr, notes


FLOOR_GAP = 0.05
"""The smallest batch's pure decode step this far above the line through the larger ones is a floor."""


def step_floor(obs: list[Observation], b: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    """(floor, the levels the line goes through). The decode step of a real server is a roofline — flat while
    something the batch does not change sets it, a line above — and a line through small batches alone
    understates what each sequence costs at the batches a what-if asks about (llama.cpp on CPU: 0.68, 0.79 and
    1.19 ms pure steps at 1, 2 and 4 sequences, 2.02 ms at 8 — a line through all three said 1.82). Told only
    from the records' pure steps at three batch sizes or more (TPOT mixes in the prompts; two points make any
    line): the smallest batch's step, when over :data:`FLOOR_GAP` above the line through the others, is the
    floor, and the line goes through the others."""
    everything = np.ones(len(y), dtype=bool)
    sizes = sorted(set(b.round(6)))
    if len(sizes) < 3 or any(o.pure_step is None for o in obs):
        return 0.0, everything
    small = b.round(6) == sizes[0]
    slope, intercept = np.polyfit(b[~small], y[~small], 1)
    low = float(np.mean(y[small]))
    if slope <= 0 or low <= (1 + FLOOR_GAP) * (intercept + slope * sizes[0]):
        return 0.0, everything
    return low, ~small


LINE_FIT = 0.10
"""The TTFT line must explain every unqueued level within this share before it is believed (else the levels
were not in lockstep, or TTFT is not prefill-bound, and ``per_request`` is left out)."""


def unqueued(obs: list[Observation], slots: int) -> list[Observation]:
    """Closed-loop levels that never queue (load within the slots): their TTFT is the front end plus the prompt
    steps, which is what tells ``per_request`` from ``per_prefill_token``."""
    return [o for o in obs if o.mode == "concurrency" and o.level <= slots]


def prefill_and_overhead(obs: list[Observation], low: Observation, slots: int,
                         line: tuple[float, float, float]) -> tuple[float, float, str]:
    """(per_prefill_token, per_request, how) from TTFT. A closed loop of equal requests starts them together, so
    at c users one step carries c prompts: TTFT − step ≈ per_request + per_prefill_token·c·prompt, a line over
    the unqueued levels of ``low``'s workload, believed when it explains each of them (:data:`LINE_FIT`).
    A closed loop out of lockstep breaks the line (a request sent as another finishes waits for the step that
    just began, so from c = 2 TTFT holds a step more), but the simulator reproduces that wait: with two unqueued
    levels or more, the lowest level's TTFT beyond its step starts half as prefill, half as ``per_request``, and
    the refinement splits it on every unqueued level's TTFT. With fewer, all of it is prefill and
    ``per_request`` stays 0 (not fitted)."""
    base, per_decode, per_ctx = line

    def beyond_step(o: Observation) -> float:
        b = batch(o, slots)
        return o.ttft_p50 - (base + per_decode * b + per_ctx * b * o.input_tokens)

    same = [o for o in unqueued(obs, slots)
            if (round(o.input_tokens), round(o.output_tokens)) == (round(low.input_tokens), round(low.output_tokens))]
    tokens = np.array([o.level * o.input_tokens for o in same])
    if len(same) >= 2 and np.ptp(tokens) > 0:
        y = np.array([beyond_step(o) for o in same])
        slope, intercept = np.polyfit(tokens, y, 1)
        line = intercept + slope * tokens
        if slope > 0 and intercept > 0 and np.all(np.abs(line - y) <= LINE_FIT * np.abs(y)):
            return float(slope), float(intercept), (f"per_prefill_token and per_request from TTFT over "
                                                    f"c={', '.join(f'{o.level:g}' for o in same)}")
    rest = max(beyond_step(low), 0.0)
    if len(same) >= 2 and rest > 0:
        return (rest / 2 / max(low.input_tokens, 1.0), rest / 2, f"per_prefill_token and per_request from TTFT "
                f"over c={', '.join(f'{o.level:g}' for o in same)} through the simulator (no line: the levels are "
                "not in lockstep)")
    return (rest / max(low.input_tokens, 1.0), 0.0, f"per_prefill_token from TTFT at {low.label} "
            f"({low.input_tokens:g} prompt tokens); per_request not fitted (no TTFT over two unqueued levels)")


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
        max_evals: int = MAX_EVALS) -> Fit:
    """Closed form, then refined by ``sim_for(slots)``; a refinement that does not converge (or converges on
    nothing like the server) is bad input: the caller writes nothing."""
    slots, source = estimate_slots(obs, facts)
    start, stderr, notes = closed_form(obs, slots)
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
