"""``summary.json`` from a run directory: per-level statistics, the article's three conditions, capacities.

One path for every source: ``bench`` and ``sim`` directories are read the same way.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

from kvcap.analysis.capacity import apply_conditions, capacities, littles_law, stationarity
from kvcap.analysis.columns import LevelArrays, Reader, read_columns
from kvcap.analysis.diagnosis import diagnose
from kvcap.analysis.lengths import input_length_warnings
from kvcap.analysis.stats import check_slo, summarize_level
from kvcap.analysis.telemetry import add, dedupe_sources, imbalance, node_figures, nodes, series, servers, within
from kvcap.rundir import REQUESTS, RunDir
from kvcap.specs.load import LIMIT_RULE


def build_summary(run: RunDir, slo: dict[str, float] | None = None, reader: Reader | None = None) -> dict[str, Any]:
    """``reader``: how records become per-level columns (default: streamed from ``requests.jsonl``)."""
    slo = slo if slo is not None else (run.manifest.get("slo") or {})
    telemetry = dedupe_sources(run.iter_telemetry())
    running, waiting = series(telemetry, "server.requests_running"), series(telemetry, "server.requests_waiting")
    parked = series(telemetry, "server.requests_parked")
    resident_series = add(running, parked) if parked else running
    preempt = series(telemetry, "server.preemptions_total")
    link_util = series(telemetry, "link.util")
    gpu_util = series(telemetry, "gpu.util")
    kv_usage = series(telemetry, "server.kv_usage")
    net_rx, net_tx = series(telemetry, "net.rx_bytes_s"), series(telemetry, "net.tx_bytes_s")
    node_names = nodes(telemetry)
    n_servers = servers(telemetry)
    infos: dict[tuple[str, float], dict[int, dict[str, Any]]] = defaultdict(dict)
    for info in run.levels():
        infos[(str(info["mode"]), float(info["level"]))][int(info.get("repeat", 0))] = info
    known = {key: {k: (reps[k]["measure_start_s"], reps[k]["measure_end_s"]) for k in sorted(reps)}
             for key, reps in infos.items()}
    by_level = (reader or read_columns)(run.dir / REQUESTS, known)
    levels: list[dict[str, Any]] = []
    extra: dict[str, dict[float, dict[str, Any]]] = defaultdict(dict)
    for key in sorted(set(by_level) | set(infos), key=lambda k: (k[0], k[1])):
        mode, level = key
        recs = by_level.get(key) or LevelArrays()
        reps = infos.get(key, {})
        # no level lines (e.g. a killed run): the span of its measured requests, per repeat
        windows = known[key] if reps else recs.own_windows()
        stats = summarize_level(recs, windows, slo=slo)
        failed = check_slo(stats, slo) if slo else []
        value = int(level) if level.is_integer() else level
        entry = {"mode": mode, "level": value, **stats, "slo_ok": not failed and stats["ok"] > 0,
                 "failed_checks": failed}
        rates = [i.get("achieved_rate") for i in reps.values() if i.get("achieved_rate") is not None]
        if rates:
            entry["achieved_rate"] = round(float(np.median(rates)), 4)
        entry["client_warnings"] = sorted({w for i in reps.values()
                                           for w in (i.get("client") or {}).get("warnings", [])})
        w0, w1 = next(iter(windows.values()), (0.0, 0.0))
        level_running = [v for _, v in within(running, w0, w1)]
        level_waiting = [v for _, v in within(waiting, w0, w1)]
        if level_running:
            entry["server_running_max"] = max(level_running)
            entry["server_running_mean"] = round(float(np.mean(level_running)), 3)
        if level_waiting:
            entry["server_waiting_mean"] = round(float(np.mean(level_waiting)), 3)
            entry["server_waiting_max"] = max(level_waiting)
        level_parked = [v for _, v in within(parked, w0, w1)]
        if level_parked:
            entry["server_parked_max"] = max(level_parked)
            entry["server_parked_mean"] = round(float(np.mean(level_parked)), 3)
        for key, ser, fn in (("link_util_max", link_util, max), ("gpu_util_mean", gpu_util, np.mean),
                             ("kv_usage_mean", kv_usage, np.mean), ("kv_usage_max", kv_usage, max),
                             ("net_rx_bytes_s_mean", net_rx, np.mean), ("net_tx_bytes_s_mean", net_tx, np.mean)):
            vals = [v for _, v in within(ser, w0, w1)]
            if vals:
                entry[key] = round(float(fn(vals)), 4)
        if node_names:
            entry["nodes"] = node_figures(telemetry, w0, w1)
            hot = imbalance(entry["nodes"], replicas=n_servers,
                            in_flight=value if mode == "concurrency" else stats.get("in_flight_mean"))
            if hot:
                entry["imbalance"] = hot
        p = within(preempt, w0, w1)
        entry["littles_law"] = littles_law(entry)
        extra[mode][value] = {"stationarity": stationarity(recs, (w0, w1), within(waiting, w0, w1) or None),
                              "preemptions": (p[-1][1] - p[0][1]) if len(p) >= 2 else 0}
        levels.append(entry)
    for mode in {lv["mode"] for lv in levels}:
        apply_conditions([lv for lv in levels if lv["mode"] == mode], slo, extra[mode])
    summary = {"source": run.manifest.get("source"), "arm": run.manifest.get("arm"), "slo": slo,
               "limits": level_limits(run.manifest), "levels": levels,
               "capacity": capacities(levels, slo, resident_series, waiting)}
    if parked:
        summary["capacity"]["resident_source"] = "telemetry:running+parked"
    summary["diagnosis"] = diagnose(summary, run.manifest.get("arm") or "run")
    summary["warnings"] = input_length_warnings(run.manifest, levels)
    return summary


def level_limits(manifest: dict[str, Any]) -> dict[str, Any]:
    """What ended each level's measured window, as the run was asked (both limits: ``LIMIT_RULE``), and any
    precedence taken on the inputs (``manifest.notes``) — so a count that stopped short is never a surprise."""
    fixed = manifest.get("fixed") or {}
    duration, requests = fixed.get("load.duration"), fixed.get("load.requests")
    if duration is not None and requests is not None:
        rule = LIMIT_RULE
    elif requests is not None:
        rule = "a level's measured window ends after load.requests requests"
    elif duration is not None:
        rule = "a level's measured window ends after load.duration"
    else:
        rule = "a level ends when its trace rows are sent"
    if fixed.get("load.mode") == "trace" and (duration is not None or requests is not None):
        rule = "the trace's rows are replayed; " + rule
    return {"duration_s": duration, "requests": requests, "rule": rule, "notes": list(manifest.get("notes") or [])}
