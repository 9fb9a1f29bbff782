"""Runs → observations → fit → the calibrated scenario and its table: the one path ``kvcap calibrate`` takes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvcap.calibrate.fit import MAX_EVALS, Simulator, fit, summary_errors
from kvcap.calibrate.observe import Observation, observe
from kvcap.calibrate.output import (
    base_scenario,
    calibration_section,
    engine_of,
    kv_tokens_of,
    measured_load,
    row_label,
    table_rows,
    write_scenario,
)
from kvcap.calibrate.simulate import StepCost, key, simulate
from kvcap.errors import InputError


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
              holdout_trace: bool = False) -> dict[str, Any]:
    """Fit, write ``out`` (only when the fit converged), and return what ``--json`` prints."""
    obs, facts = observe(runs)
    fitted, held = split_holdout(obs, holdout, holdout_trace)
    profile = engine_of(facts, engine)
    hint = min(o.tpot_p50 for o in obs)

    def base_for(cost: StepCost, slots: int) -> tuple[dict[str, Any], str]:
        kv, source = kv_tokens_of(facts, slots, memory_arithmetic=bool(model and gpu))
        return base_scenario(cost, profile, slots, kv, model, gpu, facts.prefix_caching), source

    def sim_for(slots: int) -> Simulator:
        return lambda cost: simulate(base_for(cost, slots)[0], fitted, hint)

    result = fit(fitted, facts, sim_for, max_evals)
    base, kv_source = base_for(result.cost, result.slots)
    simulated = simulate(base, obs, hint)
    rows = table_rows(obs, simulated, {key(o) for o in held})
    fit_error = summary_errors([r for r in rows if not r["held_out"]])
    holdout_error = summary_errors([r for r in rows if r["held_out"]]) if held else None
    section = calibration_section(runs, result, profile, kv_source, rows, fit_error, holdout_error)
    section["warnings"] = misfits(rows)
    write_scenario(out, {**base, **measured_load(obs, hint)}, section, name=f"calibrated-{Path(runs[0]).name}")
    return {"scenario": str(out), "engine": profile, "slots": result.slots, "slots_source": result.slots_source,
            "kv_tokens": base["serving"].get("kv_tokens"), "step_cost": section["coefficients"],
            "fit": section["fit"], "table": rows, "fit_error": fit_error, "holdout_error": holdout_error,
            "warnings": section["warnings"]}


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
            out.append(f"the calibrated scenario misses fitted level {row_label(r)} ({', '.join(bad)}): its predictions "
                       "carry at least that error; see the fit table")
    return out
