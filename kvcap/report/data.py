"""What the report shows, read out of compare results, summaries and run directories into plain values: per-arm
summaries (rebuilt when only part of the evidence came along), load levels, telemetry series and level windows.

No HTML here: the sections turn these values into markup.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvcap.analysis.summary import build_summary
from kvcap.analysis.telemetry import Telemetry, read_telemetry, series
from kvcap.report.charts import thin
from kvcap.report.format import ARMS, is_finite
from kvcap.rundir import RunDir
from kvcap.rundir.compare import Comparison
from kvcap.rundir.levels import LevelRow
from kvcap.rundir.summary import Capacity, LevelSummary, Limits, Percentiles, Summary

Rows = list[dict[str, Any]]


@dataclass
class Arm:
    """What the sections need of one arm: its label and colour, its summary and (if given) its run directory."""

    label: str
    colour: str
    summary: Summary
    run: RunDir | None = None


def capacity_figure(summary: Summary, key: str) -> float | None:
    """One of the summary's capacities (``effective``, ``resident``, ``stress_limit``); None where unknown."""
    v = getattr(summary.capacity, key)
    return float(v) if is_finite(v) else None


def quantile(lv: LevelSummary, metric: str, q: str) -> float | None:
    """A level's latency percentile, e.g. ``quantile(lv, "ttft", "p95")``; None where missing or not finite."""
    v = getattr(getattr(lv, f"{metric}_ms"), q)
    return v if is_finite(v) else None


def levels_from_per_level(result: Comparison, i: int) -> list[LevelSummary]:
    """Levels rebuilt from ``per_level`` (arm ``i``: 0 control, 1 treatment) when neither summaries nor run
    directories came along (a saved ``compare --json``): p95s only, so p99 plots say 'no data'; the counts are
    absent."""
    return [LevelSummary(mode=row.mode, level=row.level, output_tok_s=row.output_tok_s[i],
                         goodput_tok_s=row.goodput_tok_s[i], ttft_ms=Percentiles(p95=row.ttft_p95_ms[i]),
                         tpot_ms=Percentiles(p95=row.tpot_p95_ms[i]), slo_ok=row.slo_ok[i],
                         server_running_max=row.server_running_max[i])
            for row in result.per_level]


def summary_from_per_level(result: Comparison, i: int) -> Summary:
    """An arm's summary as far as a saved ``compare --json`` tells it: its levels from ``per_level``, the
    comparison's SLO, capacities unknown (the key numbers come from the comparison's arm results)."""
    unknown = Capacity(slo=result.slo, effective=None, stress_limit=None, resident=None, resident_source=None,
                       resident_lower_bound=False, limited_by=None, scaling=[])
    return Summary(source=None, arm=None, slo=result.slo, levels=levels_from_per_level(result, i),
                   capacity=unknown, limits=Limits(duration_s=None, requests=None, rule="", notes=[]))


def coerce_runs(runs: dict[str, Any] | None) -> dict[str, RunDir]:
    """Run directories keyed by arm, from RunDirs or paths; arms given as None are left out."""
    out: dict[str, RunDir] = {}
    for k, v in (runs or {}).items():
        if v is not None:
            out[k] = v if isinstance(v, RunDir) else RunDir(v)
    return out


def arm_summaries(result: Comparison, runs: dict[str, RunDir]) -> dict[str, Summary]:
    """Per-arm summaries as the report reads them: from the result, else rebuilt from the run directories, else
    from ``per_level`` (a saved comparison: only in part)."""
    out: dict[str, Summary] = {}
    for i, arm in enumerate(ARMS):
        if result.summaries is not None:
            out[arm] = getattr(result.summaries, arm)
        elif arm in runs:
            out[arm] = build_summary(runs[arm], result.slo)
        else:
            out[arm] = summary_from_per_level(result, i)
    return out


def modes_in(arms: Sequence[Arm]) -> list[str]:
    """The load modes the arms' levels used, in order of first appearance."""
    modes: list[str] = []
    for a in arms:
        for lv in a.summary.levels:
            if lv.mode not in modes:
                modes.append(lv.mode)
    return modes


def capacity_mode(arms: Sequence[Arm]) -> str:
    """The mode capacities are counted in: concurrency when any level used it (or none has a mode)."""
    modes = [lv.mode for a in arms for lv in a.summary.levels]
    return "concurrency" if "concurrency" in modes or not modes else modes[0]


def mode_levels(summary: Summary, mode: str) -> list[LevelSummary]:
    """A summary's levels of one mode with a finite level value, in increasing level."""
    return sorted((lv for lv in summary.levels if lv.mode == mode and is_finite(lv.level)), key=lambda lv: lv.level)


def level_values(arms: Sequence[Arm], mode: str) -> list[float]:
    """Every distinct level value of one mode across the arms, increasing."""
    return sorted({float(lv.level) for a in arms for lv in mode_levels(a.summary, mode)})


def telemetry_series(rows: Telemetry | Rows, name: str, node: str | None = None) -> list[tuple[float, float]]:
    """The analysis' series of ``name`` (summed, averaged or maximised over labels as the analysis does),
    thinned to at most ``MAX_POINTS`` for plotting."""
    return thin(series(rows, name, node=node))


def level_windows(levels: Iterable[LevelRow]) -> Rows:
    """One entry per (mode, level, repeat) — workers merged — with its full span and its measured window."""
    merged: dict[tuple[str, float, int], dict[str, Any]] = {}
    for info in levels:
        key = (info.mode, float(info.level), info.repeat)
        m = merged.setdefault(key, {"mode": key[0], "level": info.level, "repeat": key[2]})
        for k, f in (("t_start_s", min), ("measure_start_s", min), ("t_end_s", max), ("measure_end_s", max)):
            v = getattr(info, k)
            if is_finite(v):
                m[k] = f(m[k], v) if k in m else v
    return sorted(merged.values(), key=lambda m: m.get("t_start_s", m.get("measure_start_s", 0.0)))


def run_telemetry(run: RunDir | None) -> tuple[Telemetry, Rows] | None:
    """A run's telemetry rows (one source kind per metric) and its level windows; None without a run directory
    or when its files cannot be read."""
    if run is None:
        return None
    try:
        return read_telemetry(run), level_windows(run.levels())
    except (OSError, ValueError):
        return None


def error_class_totals(levels: Iterable[LevelSummary]) -> dict[str, int]:
    """Errors per class summed over the levels."""
    errs: dict[str, int] = defaultdict(int)
    for lv in levels:
        for k, v in lv.error_classes.items():
            errs[k] += v
    return errs
