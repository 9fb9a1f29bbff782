"""The step cost's first estimate, in closed form, from the measured levels (``fit`` then refines it through the
simulator).

Below the slot limit every decode step runs ``B = min(load, slots)`` sequences, so a pure decode step (read from the
records where they tell it, :mod:`kvcap.calibrate.steps`; else TPOT) ≈ base + per_decode·B (+ per_context_token·B·
context when the runs' context lengths differ enough): a relative-error least squares whose covariance gives each
coefficient's standard error. The levels with requests waiting for a slot stay off that line; their pure steps'
excess over it is ``per_waiting``. The prompt's cost and the front end come from TTFT, or from the steps that carried
one prompt where the records show them.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvcap.calibrate.observe import Observation
from kvcap.calibrate.simulate import StepCost
from kvcap.errors import InputError
from kvcap.specs.scenario import ServingSpec

DEFAULT_BUDGET = ServingSpec().max_num_batched_tokens
"""Prompts up to this many tokens finish in one step (the engine's default budget): a step that carried one
carried all of it."""
CONTEXT_SPREAD = 0.2
"""Context lengths must differ by this share across levels before the per-context term is fitted."""


def load_of(o: Observation) -> float:
    """Requests the level held at once: its users, or its measured in-flight mean (open loop, trace)."""
    return o.level if o.mode == "concurrency" else (o.in_flight or 1.0)


def batch(o: Observation, slots: int) -> float:
    """Sequences decoding together at this level."""
    return float(max(1.0, min(load_of(o), slots)))


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
    return max(0.0, load_of(o) - slots)


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


def closed_form(obs: list[Observation], slots: int, front_end: bool = False,
                ) -> tuple[StepCost, dict[str, float | None], list[str]]:
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

    def line(bs: float, c: float) -> float:
        """The fitted pure decode step of ``bs`` sequences attending to ``c`` tokens each."""
        return max(floor, base + per_decode * bs + per_ctx * bs * c)

    per_waiting = 0.0
    told = waiting_cost(queued, slots, line)
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
    ppt, per_request, how = prefill_and_overhead(obs, low, slots, (base, per_decode, per_ctx), front_end)
    measured = measured_prompt_cost(obs, per_decode)
    if measured is not None:  # the front end is what TTFT holds beyond the prompt's own step
        bl = batch(low, slots)
        beyond = low.ttft_p50 - line(bl, low.input_tokens)
        ppt, how = measured
        per_request = max(beyond - ppt * low.input_tokens, 0.0)
    stderr = {"base": err[0], "per_decode": err[1], "per_context_token": err[2] if use_ctx else None,
              "per_prefill_token": None, "per_request": None, "floor": None, "per_waiting": None}
    notes.append(how + ("" if lone else ": with no lone request (c=1) its queueing is in it too, the refinement "
                        "trims it"))
    if floor:
        notes.append(f"floor: the pure decode step at the smallest batch ({floor * 1e3:.3f} ms) is over "
                     f"{FLOOR_GAP:.0%} above the line through the larger ones: a step takes at least that")
    cost = StepCost(base=float(base), per_decode=float(per_decode), per_prefill_token=float(ppt),
                    per_context_token=float(per_ctx), per_request=float(per_request), floor=float(floor),
                    per_waiting=float(per_waiting))
    return cost, stderr, notes


FLOOR_GAP = 0.05
"""The smallest batch's pure decode step this far above the line through the larger ones is a floor."""


def step_floor(obs: list[Observation], b: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    """(floor, the levels the line goes through). The decode step of a real server is a roofline — flat while
    something the batch does not change sets it, a line above — and a line through small batches alone
    understates what each sequence costs at the batches a what-if asks about. Told only
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
                         line: tuple[float, float, float], front_end: bool = False) -> tuple[float, float, str]:
    """(per_prefill_token, per_request, how) from TTFT. A closed loop of equal requests starts them together, so
    at c users one step carries c prompts: TTFT − step ≈ per_request + per_prefill_token·c·prompt, a line over
    the unqueued levels of ``low``'s workload, believed when it explains each of them (:data:`LINE_FIT`).
    A closed loop out of lockstep breaks the line (a request sent as another finishes waits for the step that
    just began, so from c = 2 TTFT holds a step more), but the simulator reproduces that wait: with two unqueued
    levels or more, the lowest level's TTFT beyond its step starts half as prefill, half as ``per_request``, and
    the refinement splits it on every unqueued level's TTFT. With fewer, all of it is prefill and
    ``per_request`` stays 0 (not fitted) — unless ``front_end``: the fitted prompts were served from a prefix
    cache the simulator replays too, so TTFT's rest is mostly the front end; it starts half and half."""
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
    if front_end and rest > 0:
        return (rest / 2 / max(low.input_tokens, 1.0), rest / 2, f"per_prefill_token and per_request from TTFT at "
                f"{low.label} through the simulator, which serves the fitted prompts from its prefix cache too")
    return (rest / max(low.input_tokens, 1.0), 0.0, f"per_prefill_token from TTFT at {low.label} "
            f"({low.input_tokens:g} prompt tokens); per_request not fitted (no TTFT over two unqueued levels)")
