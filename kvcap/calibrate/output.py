"""The calibrated scenario (an ordinary scenario file with a ``calibration:`` section) and the fit table."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kvcap.calibrate.fit import Fit
from kvcap.calibrate.observe import Observation, ServerFacts
from kvcap.calibrate.simulate import (
    COST_KEYS,
    StepCost,
    cost_vector,
    group_sections,
    groups,
    key,
    length_spec,
    serving_section,
)
from kvcap.report.console import make_console
from kvcap.specs.calibration import CalibrationSection
from kvcap.specs.lengths import parse_length
from kvcap.specs.scenario import build_scenario

METRICS = ("throughput", "ttft_p50", "ttft_p95", "tpot_p50", "tpot_p95")


def engine_of(facts: ServerFacts, asked: str | None) -> str:
    """The scheduling profile: as asked, else llama.cpp's when the server answered /props, else vLLM's."""
    if asked:
        return asked
    return "llamacpp" if (facts.engine or "").replace(".", "").lower() == "llamacpp" else "vllm"


def kv_tokens_of(facts: ServerFacts, slots: int, memory_arithmetic: bool) -> tuple[int | None, str]:
    """The KV pool in tokens: llama.cpp's n_ctx per slot × slots; else, without a model and GPU to do the memory
    arithmetic, a pool that never limits (slots × the longest context), since the runs did not show one."""
    if facts.n_ctx and facts.total_slots:
        return facts.n_ctx * facts.total_slots, "server /props n_ctx per slot × total_slots"
    if facts.kv_tokens and facts.kv_tokens_source:
        return facts.kv_tokens, facts.kv_tokens_source
    if memory_arithmetic:
        return None, "memory arithmetic (--model, --gpu)"
    return slots * (facts.max_model_len or 131072), "not observed: slots × max_model_len, so it never limits"


def base_scenario(cost: StepCost, engine: str, slots: int, kv_tokens: int | None, model: str | None,
                  gpu: str | None, prefix_caching: bool | None = None) -> dict[str, Any]:
    """Everything but workload and load: what the simulator needs to be this server (prefix caching as the
    server said, else the engine's default)."""
    data: dict[str, Any] = {"serving": serving_section(cost, engine, slots, kv_tokens)}
    if prefix_caching is not None:
        data["serving"]["enable_prefix_caching"] = prefix_caching
    if model:
        data["model"] = {"config": model} if model.endswith(".json") else {"preset": model}
    if gpu:
        data["cluster"] = {"gpu": {"preset": gpu}}
    return data


def _err(sim: float, meas: float) -> float | None:
    return round(100 * (sim / meas - 1), 2) if meas > 0 else None


def table_rows(obs: list[Observation], simulated: dict[tuple[str, str, float], Observation],
               held_out: set[tuple[str, str, float]]) -> list[dict[str, Any]]:
    """Per measured level: measured vs simulated (throughput in tok/s, times in ms) and the error in %."""
    rows = []
    for o in obs:
        s = simulated.get(key(o))
        meas = {m: getattr(o, m) * (1 if m == "throughput" else 1e3) for m in METRICS}
        sim = {m: (getattr(s, m) * (1 if m == "throughput" else 1e3)) if s else None for m in METRICS}
        rows.append({"run": o.run, "mode": o.mode, "level": o.level, "held_out": key(o) in held_out,
                     "measured": {m: round(v, 3) for m, v in meas.items()},
                     "simulated": {m: None if v is None else round(v, 3) for m, v in sim.items()},
                     "error_pct": {m: None if sim[m] is None else _err(sim[m], meas[m]) for m in METRICS}})
    return rows


def calibration_section(runs: list[str], result: Fit, engine: str, kv_source: str, rows: list[dict[str, Any]],
                        fit_error: dict[str, float | None], holdout_error: dict[str, float | None] | None,
                        profile: Profiled) -> CalibrationSection:
    """The scenario's ``calibration:`` section: the fit, its table and what the profile covered."""
    cost = dict(zip(COST_KEYS, cost_vector(result.cost), strict=True))
    data: dict[str, Any] = {
        "source_runs": runs, "engine": engine,
        "coefficients": {k: {"value_s": v, "stderr_s": result.stderr.get(k)} for k, v in cost.items()},
        "stderr_of": "the closed-form least squares on TPOT p50 (relative residuals), before the refinement",
        "slots": {"value": result.slots, "source": result.slots_source}, "kv_tokens_source": kv_source,
        "fit": {"method": "closed-form least squares, refined by Nelder-Mead through the simulator",
                "converged": result.converged, "simulator_runs": result.evaluations,
                "rms_relative_error": round(result.rms_error or 0.0, 5), "notes": result.notes},
        "fit_error_pct": fit_error, "holdout_error_pct": holdout_error, "table": rows,
        "warnings": profile.warnings, "limits": profile.limits, "profiled_input_tokens": profile.input_tokens,
        "profiled_batch": profile.batch}
    if profile.waiting is not None:
        data["profiled_waiting"] = profile.waiting
    return CalibrationSection.model_validate(data)


@dataclass(frozen=True)
class Profiled:
    """What the profile covered and missed, for the section: misfit warnings, limits and the [least, most] spans
    (``waiting``: llama.cpp's only)."""

    warnings: list[str]
    limits: list[str]
    input_tokens: list[int]
    batch: list[int]
    waiting: list[int] | None = None


def measured_load(obs: list[Observation], tpot_s: float) -> dict[str, Any]:
    """The workload and load the runs measured (the load with the most levels), so the calibrated scenario runs
    as is: ``kvcap sim calibrated.yaml`` and ``kvcap ab calibrated.yaml --treatment …`` need no load flags."""
    by_load: dict[tuple[Any, ...], list[Observation]] = {}
    for g, members in groups(obs).items():
        if g[0] != "trace":  # a trace has no load keys
            by_load.setdefault((g[0], g[3], g[4]), []).extend(members)
    if not by_load:
        return {}
    # levels of one load shape whose measured mean lengths differ (a length distribution: each level's sample
    # mean is its own) are one load: all their levels, at the lengths they share on average
    (mode, arrival, window), members = max(by_load.items(), key=lambda kv: len({o.level for o in kv[1]}))
    n_in = pooled_length([o.input_tokens for o in members], [o.length_shapes[0] for o in members])
    n_out = pooled_length([o.output_tokens for o in members], [o.length_shapes[1] for o in members])
    return group_sections((mode, n_in, n_out, arrival, window), sorted({o.level for o in members}), tpot_s)


def pooled_length(means: list[float], shapes: list[str | None]) -> int | str:
    """The profile's length for the scenario: the levels' mean, in the shape of their measured distributions
    pooled (equal weights: the mean of their variances plus the variance of their means; the largest cap)."""
    mean = sum(means) / len(means)
    dists = [parse_length(s) for s in shapes if s is not None]
    if not dists:
        return length_spec(mean, None)
    if dists[0].kind == "uniform":
        return f"uniform:{min(int(d.a) for d in dists)},{max(int(d.b) for d in dists)}"
    var = sum(d.b ** 2 for d in dists) / len(dists) + sum((d.a - mean) ** 2 for d in dists) / len(dists)
    cap = max(d.hi for d in dists)
    return f"{dists[0].kind}:{mean:.1f},{var ** 0.5:.1f}" + (f",{cap}" if cap < 1_000_000 else "")


def write_scenario(path: Path, base: dict[str, Any], calibration: CalibrationSection, name: str) -> dict[str, Any]:
    """Validate as ``kvcap sim`` would read it, then write; returns the data written."""
    data = {"name": name, "description": "fitted by kvcap calibrate from " + ", ".join(calibration.source_runs or []),
            **base, "calibration": calibration.model_dump()}
    build_scenario(data, "calibrated scenario")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False, width=120, allow_unicode=True))
    return data


def row_label(row: dict[str, Any]) -> str:
    """A table row's level as the tables print it: c=8, rate=4, trace=1."""
    return f"c={row['level']:g}" if row["mode"] == "concurrency" else f"{row['mode']}={row['level']:g}"


def render_table(rows: list[dict[str, Any]], title: str) -> None:
    from rich.table import Table

    t = Table(title=title)
    t.add_column("level")
    for head in ("tok/s", "TTFT p50 ms", "TTFT p95 ms", "TPOT p50 ms", "TPOT p95 ms"):
        t.add_column(head + " meas/sim (err)", justify="right")
    for r in rows:
        cells = []
        for m in METRICS:
            sim, err = r["simulated"][m], r["error_pct"][m]
            cells.append(f"{r['measured'][m]:.1f} / " + ("–" if sim is None else f"{sim:.1f} ({err:+.1f}%)"))
        t.add_row(row_label(r) + (" (held out)" if r["held_out"] else ""), *cells)
    make_console().print(t)


PROFILED_SPAN = 1.5
"""A what-if's mean prompt more than this factor outside the calibrated prompt lengths is called an extrapolation."""


def extrapolation(calibration: CalibrationSection | None, input_mean: float) -> str | None:
    """The note ``kvcap sim`` prints when a calibrated scenario is asked about prompts well outside the lengths it
    was fitted on: the prefill's cost per token, and how prompts share a step, were measured only there."""
    span = calibration.profiled_input_tokens if calibration is not None else None
    if not span:
        return None
    lo, hi = span
    if lo / PROFILED_SPAN <= input_mean <= hi * PROFILED_SPAN:
        return None
    profiled = f"{lo}" if lo == hi else f"{lo}–{hi}"
    return (f"prompts of ~{input_mean:.0f} tokens on a scenario calibrated on prompts of ~{profiled}: this prediction "
            "extrapolates the fitted prefill cost (see the scenario's calibration.limits)")


def batch_extrapolation(calibration: CalibrationSection | None, peak: int) -> str | None:
    """The note ``kvcap sim`` prints when a calibrated scenario ran far more sequences at once than the profile
    did: the step's cost per sequence was measured only up to there, and real steps bend past it (the roofline's
    flat part ends), so a line fitted on small batches may not hold at large ones."""
    span = calibration.profiled_batch if calibration is not None else None
    if not span or peak <= span[1] * PROFILED_SPAN:
        return None
    return (f"up to {peak} sequences ran at once on a scenario calibrated at up to {span[1]}: this prediction "
            "extrapolates the fitted step line (profile at the batch you will ask about)")


def queue_extrapolation(calibration: CalibrationSection | None, waiting_peak: float) -> str | None:
    """The note ``kvcap sim`` prints when requests waited for a slot past what the profile queued, on a scenario
    whose profile recorded its queue (``profiled_waiting``: llama.cpp, whose steps slow as requests wait)."""
    span = calibration.profiled_waiting if calibration is not None else None
    if not span or waiting_peak <= max(1.0, span[1] * PROFILED_SPAN):
        return None
    if span[1] < 1:
        return (f"up to {waiting_peak:g} requests waited for a slot, and the profile never queued: what a queue costs "
                "the server's steps (llama.cpp: step_cost.per_waiting) is not in this prediction, which may be high "
                "(profile one level at 4-8x the slots)")
    return (f"up to {waiting_peak:g} requests waited for a slot on a scenario calibrated with up to {span[1]:g} "
            "waiting: this prediction extrapolates the fitted cost of a queue")
