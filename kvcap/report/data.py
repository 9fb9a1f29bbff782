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
from kvcap.rundir.levels import LevelRow
from kvcap.rundir.summary import Summary

Rows = list[dict[str, Any]]


@dataclass
class Arm:
    """What the sections need of one arm: its label and colour, its summary and (if given) its run directory."""

    label: str
    colour: str
    summary: dict[str, Any]
    run: RunDir | None = None


def capacity(summary: Summary | dict[str, Any]) -> dict[str, Any]:
    """The summary's capacities (effective, resident, stress limit, what limited them); empty if it has none."""
    if isinstance(summary, Summary):
        return summary.capacity.to_json()
    return summary.get("capacity") or {}


def quantile(lv: dict[str, Any], metric: str, q: str) -> float | None:
    """A level's latency percentile, e.g. ``quantile(lv, "ttft", "p95")``; None where missing or not finite."""
    v = (lv.get(f"{metric}_ms") or {}).get(q)
    return v if is_finite(v) else None


def levels_from_per_level(result: dict[str, Any], i: int) -> Rows:
    """Summary-shaped levels rebuilt from ``per_level`` when neither summaries nor run directories came along
    (a saved ``compare --json``): p95s only, so p99 plots say 'no data'."""
    out = []
    for row in result.get("per_level") or []:
        def pick(key: str, row: dict[str, Any] = row) -> Any:
            v = row.get(key)
            return v[i] if isinstance(v, list) and len(v) > i else None
        out.append({"mode": row.get("mode", "concurrency"), "level": row.get("level"),
                    "output_tok_s": pick("output_tok_s"), "goodput_tok_s": pick("goodput_tok_s"),
                    "ttft_ms": {"p95": pick("ttft_p95_ms")}, "tpot_ms": {"p95": pick("tpot_p95_ms")},
                    "slo_ok": pick("slo_ok"), "server_running_max": pick("server_running_max")})
    return out


def coerce_runs(runs: dict[str, Any] | None) -> dict[str, RunDir]:
    """Run directories keyed by arm, from RunDirs or paths; arms given as None are left out."""
    out: dict[str, RunDir] = {}
    for k, v in (runs or {}).items():
        if v is not None:
            out[k] = v if isinstance(v, RunDir) else RunDir(v)
    return out


def arm_summaries(result: dict[str, Any], runs: dict[str, RunDir]) -> dict[str, dict[str, Any]]:
    """Per-arm summaries as the report reads them (``summary.json``'s shape, which a rebuilt one has only in part):
    from the result, else rebuilt from the run directories, else from ``per_level``."""
    have = result.get("summaries") or {}
    out: dict[str, dict[str, Any]] = {}
    for i, arm in enumerate(ARMS):
        given = have.get(arm)
        if given:
            out[arm] = given.to_json() if isinstance(given, Summary) else given
        elif arm in runs:
            out[arm] = build_summary(runs[arm], result.get("slo") or {}).to_json()
        else:
            out[arm] = {"levels": levels_from_per_level(result, i), "capacity": {}, "slo": result.get("slo") or {}}
    return out


def modes_in(arms: Sequence[Arm]) -> list[str]:
    """The load modes the arms' levels used, in order of first appearance."""
    modes: list[str] = []
    for a in arms:
        for lv in a.summary.get("levels", []):
            if str(lv.get("mode")) not in modes:
                modes.append(str(lv.get("mode")))
    return modes


def capacity_mode(arms: Sequence[Arm]) -> str:
    """The mode capacities are counted in: concurrency when any level used it (or none has a mode)."""
    modes = [lv.get("mode") for a in arms for lv in a.summary.get("levels", [])]
    return "concurrency" if "concurrency" in modes or not modes else str(modes[0])


def mode_levels(summary: dict[str, Any], mode: str) -> Rows:
    """A summary's levels of one mode with a finite level value, in increasing level."""
    return sorted((lv for lv in summary.get("levels", []) if str(lv.get("mode")) == mode
                   and is_finite(lv.get("level"))), key=lambda lv: lv["level"])


def level_values(arms: Sequence[Arm], mode: str) -> list[float]:
    """Every distinct level value of one mode across the arms, increasing."""
    return sorted({float(lv["level"]) for a in arms for lv in mode_levels(a.summary, mode)})


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


def error_class_totals(levels: Iterable[dict[str, Any]]) -> dict[str, int]:
    """Errors per class summed over the levels (non-numeric counts count as 0)."""
    errs: dict[str, int] = defaultdict(int)
    for lv in levels:
        for k, v in (lv.get("error_classes") or {}).items():
            errs[str(k)] += int(v) if is_finite(v) else 0
    return errs
