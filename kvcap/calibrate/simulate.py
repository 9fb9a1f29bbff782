"""A candidate step cost → the scenario that carries it → the simulator run over the observed levels."""

from __future__ import annotations

import tempfile
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvcap.calibrate.observe import Observation, level_observation, with_steps
from kvcap.rundir import RunDir
from kvcap.rundir.summary import Summary
from kvcap.sim.run import SimConfig, run_sim
from kvcap.specs.lengths import parse_length
from kvcap.specs.scenario import StepCost, build_scenario
from kvcap.workload.loadplan import LoadPlan

SIM_REQUESTS_MIN = 64
"""Measured requests per simulated level (at least; 8 per stream above that): enough for stable medians."""


COST_KEYS = tuple(StepCost.model_fields)
"""The coefficients in their order (base, per_decode, per_prefill_token, per_context_token, per_request, floor,
per_waiting): the fit's vector."""


def cost_vector(cost: StepCost) -> tuple[float, ...]:
    return tuple(getattr(cost, k) for k in COST_KEYS)


def cost_from(values: Sequence[float]) -> StepCost:
    """The scenario's own ``serving.step_cost`` (one definition of the step cost) from the fit's vector."""
    return StepCost(**dict(zip(COST_KEYS, (float(v) for v in values), strict=True)))


def duration(seconds: float) -> str:
    """A unit string the scenario schema reads back exactly enough (ns resolution)."""
    return f"{seconds * 1e3:.6g}ms"


def serving_section(cost: StepCost, engine: str, slots: int, kv_tokens: int | None) -> dict[str, Any]:
    out: dict[str, Any] = {"engine": engine, "max_num_seqs": int(slots),
                           "step_cost": {k: duration(v) for k, v in zip(COST_KEYS, cost_vector(cost), strict=True)}}
    if kv_tokens is not None:
        out["kv_tokens"] = int(kv_tokens)
    return out


Group = tuple[str, int | str, int | str, str, tuple[float | None, float | None, int | None, int]]
"""(mode, prompt length, output length, arrival, window); a length is a token count or a distribution's spec."""


def length_spec(mean: float, asked: str | None) -> int | str:
    """What the simulated workload asks: the measured mean, in the measured distribution's shape if any."""
    if asked is None:
        return max(1, round(mean))
    return parse_length(asked).scaled(mean).spec


def groups(obs: list[Observation]) -> dict[Group, list[Observation]]:
    """Levels that one simulated run can reproduce: same mode, same (rounded) lengths; open loop also the same
    arrival process and window; a trace level alone (its own schedule: the arrival slot names its run)."""
    out: dict[Group, list[Observation]] = defaultdict(list)
    for o in obs:
        closed = o.mode == "concurrency"
        arrival = f"{o.run}@{o.level:g}" if o.mode == "trace" else "" if closed else o.arrival
        shaped = o.mode != "trace"  # a trace replays its own lengths
        timed = o.window[1] is not None or o.window[2] is not None
        out[(o.mode, length_spec(o.input_tokens, o.length_shapes[0] if shaped else None),
             length_spec(o.output_tokens, o.length_shapes[1] if shaped else None), arrival,
             (None, None, None, 0) if closed and not timed else o.window)].append(o)
    return out


def group_sections(key: Group, levels: list[float], tpot_s: float) -> dict[str, Any]:
    """The workload and load sections of one simulated run: the run's own window (warm-up, then its duration or
    count) and, open loop, its seed. A closed loop's users start together, and the phase they start in fades
    over many requests: a window of a few requests each measures that start, not the steady state, so the
    simulator measures the same window.
    A closed loop of unknown window: a warm-up of a few requests' length, then a count."""
    mode, n_in, n_out, arrival, (warmup, measured, requests, seed) = key
    if mode == "trace":  # the rows sent, each request's own lengths: replayed whole after the same warm-up
        return {"workload": {"input_tokens": n_in, "output_tokens": n_out},
                "load": {"warmup": warmup or 0.0, "duration": None, "requests": None}}
    if mode == "concurrency" and (measured is not None or requests is not None):
        load: dict[str, Any] = {"concurrency": sorted({int(v) for v in levels}), "warmup": warmup or 0.0,
                                "duration": measured, "requests": requests}
    elif mode == "concurrency":
        load = {"concurrency": sorted({int(v) for v in levels}), "duration": None,
                "warmup": duration(3 * parse_length(n_out).mean * max(tpot_s, 1e-4)),
                "requests": int(max(SIM_REQUESTS_MIN, 8 * max(levels)))}
    else:
        load = {"rate": sorted(set(levels)), "arrival": arrival, "warmup": warmup or 0.0, "duration": measured,
                "requests": requests, "seed": seed}
    return {"workload": {"input_tokens": n_in, "output_tokens": n_out}, "load": load}


def simulate(base: dict[str, Any], obs: list[Observation],
             tpot_hint_s: float) -> dict[tuple[str, str, float], Observation]:
    """Simulate every observed level with the scenario ``base`` (serving, model, cluster set); keyed like
    :func:`key`. Each group is one ``run_sim`` into a scratch directory (the simulator writes run directories)."""
    out: dict[tuple[str, str, float], Observation] = {}
    with tempfile.TemporaryDirectory(prefix="kvcap-calibrate-") as tmp:
        for i, (gkey, members) in enumerate(groups(obs).items()):
            data = {**base, **group_sections(gkey, [o.level for o in members], tpot_hint_s)}
            scenario = build_scenario(data, "calibrated scenario")
            plan = LoadPlan.from_spec(scenario.load, trace=members[0].trace if gkey[0] == "trace" else ())
            summary = Summary.model_validate(run_sim(SimConfig(scenario=scenario, plan=plan, out=Path(tmp) / f"g{i}",
                                                               record_itl=True, overwrite=True)))
            by_level = {float(lv.level): lv for lv in summary.levels}
            got: dict[tuple[str, str, float], Observation] = {}
            for o in members:
                lv = by_level.get(o.level) if gkey[0] != "trace" else next(iter(by_level.values()), None)
                one = level_observation(o.run, lv) if lv is not None else None
                if one is not None:
                    got[key(o)] = one
            if any(o.pure_step is not None for o in members):  # the steps the measured side could tell
                read = with_steps(list(got.values()), RunDir(Path(tmp) / f"g{i}").records())
                got = dict(zip(got, read, strict=True))
            out.update(got)
    return out


def key(o: Observation) -> tuple[str, str, float]:
    return (o.run, o.mode, o.level)
