"""``summary.json`` from a run directory: per-level statistics, SLO checks and capacities.

One path for every source: ``bench`` and ``sim`` directories are read the same way.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

from kvcap.analysis.stats import check_slo, level_key, summarize_level
from kvcap.rundir import RunDir


def build_summary(run: RunDir, slo: dict[str, float] | None = None) -> dict[str, Any]:
    slo = slo if slo is not None else (run.manifest.get("slo") or {})
    records = run.records()
    level_infos = run.levels()
    by_level: dict[tuple[str, float], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        by_level[level_key(r)].append(r)
    infos: dict[tuple[str, float], dict[int, dict[str, Any]]] = defaultdict(dict)
    for info in level_infos:
        infos[(str(info["mode"]), float(info["level"]))][int(info.get("repeat", 0))] = info
    levels = []
    for key in sorted(set(by_level) | set(infos), key=lambda k: (k[0], k[1])):
        mode, level = key
        recs = by_level.get(key, [])
        reps = infos.get(key, {})
        if reps:
            windows = [(reps[k]["measure_start_s"], reps[k]["measure_end_s"]) for k in sorted(reps)]
        else:  # no level lines (e.g. killed run): the span of its measured requests
            starts = [r["start_s"] for r in recs if r.get("phase") == "measure"] or [0.0]
            windows = [(min(starts), max(starts) + 1e-9)]
        stats = summarize_level(recs, windows)
        failed = check_slo(stats, slo) if slo else []
        entry = {"mode": mode, "level": int(level) if level.is_integer() else level, **stats,
                 "slo_ok": not failed and stats["ok"] > 0, "failed_checks": failed}
        rates = [i.get("achieved_rate") for i in reps.values() if i.get("achieved_rate") is not None]
        if rates:
            entry["achieved_rate"] = round(float(np.median(rates)), 4)
        entry["client_warnings"] = sorted({w for i in reps.values() for w in (i.get("client") or {}).get("warnings", [])})
        levels.append(entry)
    return {"source": run.manifest.get("source"), "arm": run.manifest.get("arm"), "slo": slo,
            "levels": levels, "capacity": basic_capacity(levels, slo, run.telemetry())}


def basic_capacity(levels: list[dict[str, Any]], slo: dict[str, float],
                   telemetry: list[dict[str, Any]]) -> dict[str, Any]:
    """Largest level within the SLO (effective), largest admitted at all (stress limit), most held (resident)."""
    ok_levels = [lv for lv in levels if lv["ok"] > 0]
    passing = [lv for lv in ok_levels if lv["slo_ok"]]
    effective = max((lv["level"] for lv in passing), default=None)
    stress = max((lv["level"] for lv in ok_levels), default=None)
    above = [lv for lv in ok_levels if effective is None or lv["level"] > effective]
    limited_by = above[0]["failed_checks"][0] if above and above[0]["failed_checks"] else None
    running = [row["value"] for row in telemetry if row.get("name") == "server.requests_running"]
    resident = int(max(running)) if running else None
    return {"slo": slo, "effective": effective if slo else None, "stress_limit": stress, "resident": resident,
            "resident_source": "telemetry" if running else None, "limited_by": limited_by}
