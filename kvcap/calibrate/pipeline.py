"""Runs → observations → fit → the calibrated scenario and its table: the one path ``kvcap calibrate`` takes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from kvcap.calibrate.closed_form import DEFAULT_BUDGET, batch, load_of, waiting_at_server
from kvcap.calibrate.fit import MAX_EVALS, Simulator, fit, summary_errors
from kvcap.calibrate.observe import Observation, observe
from kvcap.calibrate.output import (
    Profiled,
    base_scenario,
    calibration_section,
    engine_of,
    kv_tokens_of,
    measured_load,
    row_label,
    table_rows,
    write_scenario,
)
from kvcap.calibrate.prefill_floor import prefill_floor_s
from kvcap.calibrate.simulate import StepCost, key, simulate
from kvcap.errors import InputError
from kvcap.specs.scenario import build_scenario


def split_holdout(obs: list[Observation], holdout: tuple[float, ...],
                  trace: bool = False) -> tuple[list[Observation], list[Observation]]:
    """(levels to fit on, levels held out): closed- and open-loop levels by value, trace levels all together
    (``trace``); every held-out level must have been measured, two must remain."""
    levels = [o for o in obs if o.mode != "trace"]
    missing = [f"{v:g}" for v in holdout if not any(o.level == v for o in levels)]
    if trace and not any(o.mode == "trace" for o in obs):
        missing.append("trace")
    if missing:
        raise InputError(f"--holdout {','.join(missing)}: no such measured level "
                         f"(measured: {', '.join(sorted({o.label for o in obs}))})")

    def held(o: Observation) -> bool:
        return trace if o.mode == "trace" else o.level in holdout

    kept = [o for o in obs if not held(o)]
    if len(kept) < 2:
        raise InputError(f"--holdout leaves {len(kept)} level(s) to fit on; calibrate needs at least 2")
    return kept, [o for o in obs if held(o)]


def calibrate(runs: list[str], out: Path, engine: str | None = None, holdout: tuple[float, ...] = (),
              model: str | None = None, gpu: str | None = None, max_evals: int = MAX_EVALS,
              holdout_trace: bool = False, kv_unified: bool = False) -> dict[str, Any]:
    """Fit, write ``out`` (only when the fit converged), and return what ``--json`` prints. ``kv_unified``: the
    llama.cpp server ran with ``--kv-unified`` (its /props does not say so): a step is one forward pass."""
    obs, facts = observe(runs)
    fitted, held = split_holdout(obs, holdout, holdout_trace)
    profile = engine_of(facts, engine)
    if kv_unified and profile != "llamacpp":
        raise InputError(f"--kv-unified is a llama.cpp server's option; the profile here is {profile} "
                         "(pass --engine llamacpp if the server is llama.cpp)")
    hint = min(o.tpot_p50 for o in obs)

    budget: int | None = None
    """The per-step token budget the scenario states (None: the engine default)."""

    def base_for(cost: StepCost, slots: int, budget: int | None = None) -> tuple[dict[str, Any], str]:
        kv, source = kv_tokens_of(facts, slots, memory_arithmetic=bool(model and gpu))
        data = base_scenario(cost, profile, slots, kv, model, gpu, facts.prefix_caching)
        if budget is not None:
            data["serving"]["max_num_batched_tokens"] = budget
        if kv_unified:
            data["serving"]["kv_unified"] = True
        return data, source

    def sim_for(budget: int | None) -> Callable[[int], Simulator]:
        return lambda slots: lambda cost: simulate(base_for(cost, slots, budget)[0], fitted, hint)

    result = fit(fitted, facts, sim_for(None), max_evals)
    offered = max(load_of(o) * o.input_tokens for o in fitted)
    if offered > DEFAULT_BUDGET:  # the profile put the default budget to the test: does the server have one?
        try:
            unbounded = fit(fitted, facts, sim_for(NO_BUDGET), max_evals)
        except InputError:
            unbounded = None
        if unbounded is not None and (unbounded.rms_error or 1.0) < (result.rms_error or 0.0) * BUDGET_GAIN:
            note = (f"step budget: the profile offered up to ~{offered:,.0f} prompt tokens at once; the fit is "
                    f"{unbounded.rms_error:.1%} off (RMS) with every waiting prompt in one step, "
                    f"{result.rms_error:.1%} with the engine's {DEFAULT_BUDGET:,}-token budget: kept without one")
            result, budget = replace(unbounded, notes=[*unbounded.notes, note]), NO_BUDGET
    base, kv_source = base_for(result.cost, result.slots, budget)
    simulated = simulate(base, obs, hint)
    rows = table_rows(obs, simulated, {key(o) for o in held})
    fit_error = summary_errors([r for r in rows if not r["held_out"]])
    holdout_error = summary_errors([r for r in rows if r["held_out"]]) if held else None
    floor = partial(prefill_floor_s, build_scenario(base, "calibrated scenario")) if model and gpu else None
    cannot = limits(fitted, DEFAULT_BUDGET if budget is None else None, floor)
    waiting: list[int] | None = None
    if profile == "llamacpp":  # its steps slow as requests wait: what the profile queued bounds what it can say
        queued = [waiting_at_server(o, result.slots) for o in fitted]
        waiting = [round(min(queued)), round(max(queued))]
        if max(queued) < 0.5:
            cannot.append(
                f"no fitted level queued requests for the {result.slots} slots: llama.cpp's steps slow as requests "
                "wait (it wakes every waiting connection for each result it sends: step_cost.per_waiting), so "
                "predictions past the slots assume a queue costs nothing; profile one level at 4-8x the slots "
                f"(e.g. --concurrency {8 * result.slots})")
    covered = Profiled(warnings=misfits(rows), limits=cannot,
                       input_tokens=[round(min(o.input_tokens for o in fitted)),
                                     round(max(o.input_tokens for o in fitted))],
                       batch=[round(min(batch(o, result.slots) for o in fitted)),
                              round(max(batch(o, result.slots) for o in fitted))], waiting=waiting)
    section = calibration_section(runs, result, profile, kv_source, rows, fit_error, holdout_error, covered)
    written = write_scenario(out, {**base, **measured_load(obs, hint)}, section,
                             name=f"calibrated-{Path(runs[0]).name}")["calibration"]
    return {"scenario": str(out), "engine": profile, "slots": result.slots, "slots_source": result.slots_source,
            "kv_tokens": base["serving"].get("kv_tokens"), "step_cost": written["coefficients"],
            "fit": written["fit"], "table": rows, "fit_error": fit_error, "holdout_error": holdout_error,
            "warnings": covered.warnings, "limits": covered.limits}


MISFIT_PCT = 25.0
"""A fitted level the calibrated scenario misses by more than this (throughput, TTFT or TPOT p50) is said out
loud: the refinement weighs only some metrics at some levels, and a scenario that cannot reproduce the runs it
came from should not pass silently."""


def misfits(rows: list[dict[str, Any]]) -> list[str]:
    """One line per fitted level and metric past :data:`MISFIT_PCT`."""
    out = []
    for r in rows:
        if r["held_out"]:
            continue
        bad = [f"{m} {e:+.0f}%" for m in ("throughput", "ttft_p50", "tpot_p50")
               if (e := r["error_pct"].get(m)) is not None and abs(e) > MISFIT_PCT]
        if bad:
            out.append(f"the calibrated scenario misses fitted level {row_label(r)} ({', '.join(bad)}): "
                       "its predictions carry at least that error; see the fit table")
    return out


NO_BUDGET = 1 << 20
"""``max_num_batched_tokens`` of a server that puts every waiting prompt in one step (no budget seen)."""
BUDGET_GAIN = 0.8
"""The fit without a step budget is taken only where its RMS error is below this share of the default's."""
ONE_LENGTH = 1.25
"""Fitted levels whose mean prompt lengths all lie within this ratio sent one prompt length."""


def limits(fitted: list[Observation], budget: int | None,
           prefill_floor: Callable[[float], float] | None = None) -> list[str]:
    """What the fitted levels could not show, said once: a what-if along that axis extrapolates the fit.

    - One prompt length: TTFT holds the front end's time per request plus the prefill of that length; a second
      length is what tells the two apart.
    - The per-step token budget: a profile that never offered more prompt tokens at once than the scenario's
      budget cannot show whether the server batches more in a step; the scenario keeps the engine's default
      (``budget``; None: the fit chose no budget, having seen more).
    - Prefix-cache hits: where the model and GPU are known (``prefill_floor``: seconds a prompt of N tokens takes
      at least, :mod:`kvcap.calibrate.prefill_floor`), a fitted level whose TTFT p50 is below its prompts' floor
      was served from the server's cache, and the fitted prompt cost is a cache hit's, so prompts the server has
      not seen will take longer than predicted."""
    out: list[str] = []
    levels = [o for o in fitted if o.mode != "trace"]
    if levels and len(levels) == len(fitted) and not any(o.length_shapes[0] for o in levels):
        lengths = [o.input_tokens for o in levels]
        if max(lengths) <= ONE_LENGTH * max(min(lengths), 1.0):
            n = round(float(np.median(lengths)))
            out.append(f"every fitted level sent prompts of ~{n} tokens: the front end's time per request and the "
                       "prefill's time per prompt token are told apart by that one length only, so predictions for "
                       f"other prompt lengths extrapolate; profile a second length too (e.g. --input-tokens {4 * n})")
    offered = max(load_of(o) * o.input_tokens for o in fitted)
    if budget is not None and offered <= budget:
        out.append(f"the profile never offered more than ~{offered:,.0f} prompt tokens at once, within the "
                   f"{budget:,}-token step budget the scenario keeps (the engine default): whether the server puts "
                   "more prompt tokens in one step was not measured, and predictions past it assume that budget")
    cached = [(o, f) for o in fitted if prefill_floor and o.ttft_p50 < (f := prefill_floor(o.input_tokens))]
    if cached:
        o, f = cached[0]
        out.append(f"TTFT p50 at {', '.join(x.label for x, _ in cached)} is below what computing the prompts takes "
                   f"on this GPU at its peak FLOPs ({o.ttft_p50 * 1e3:.1f} ms at {o.label} for ~{o.input_tokens:,.0f}"
                   f" tokens, at least {f * 1e3:.1f} ms): the server served them from its prefix cache, so the fitted "
                   "prompt cost is a cache hit's and prompts it has not seen will take longer than predicted; "
                   "profile with prompts it has not cached (or with prefix caching off)")
    return out
