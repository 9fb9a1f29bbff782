"""``summary.json`` from a run directory: per-level statistics, the article's three conditions, capacities.

One path for every source: ``bench`` and ``sim`` directories are read the same way.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

from kvcap.analysis.capacity import apply_conditions, capacities, littles_law, stationarity
from kvcap.analysis.diagnosis import diagnose
from kvcap.analysis.engine_limits import engine_limits
from kvcap.analysis.lengths import input_length_warnings
from kvcap.analysis.prefix_reuse import (
    figure,
    from_counters,
    record_hits,
    reusable_share,
    shares_prefixes,
    users_think,
)
from kvcap.analysis.stats import check_slo, summarize_level
from kvcap.analysis.telemetry_figures import telemetry_figures
from kvcap.analysis.telemetry_nodes import imbalance
from kvcap.rundir import REQUESTS, RunDir
from kvcap.rundir.levels import LevelRow
from kvcap.rundir.manifest import Manifest
from kvcap.rundir.store.column_reader import Reader, read_columns
from kvcap.rundir.store.columns import LevelArrays
from kvcap.rundir.store.level_blocks import Level
from kvcap.rundir.summary import LevelSummary, Limits, Summary
from kvcap.specs.load import LIMIT_RULE


def build_summary(run: RunDir, slo: dict[str, float] | None = None, reader: Reader | None = None,
                  write_copies: bool = False) -> Summary:
    """``reader``: how records become per-level columns (default: streamed from ``requests.jsonl``);
    ``write_copies``: write the JSONL files' column copies where missing (the run's writer closing its own run:
    later reports and comparisons skip the parse)."""
    manifest = run.manifest
    slo = slo if slo is not None else run.slo
    infos: dict[tuple[str, float], dict[int, LevelRow]] = defaultdict(dict)
    for info in run.levels():
        infos[(info.mode, float(info.level))][info.repeat] = info
    known = {key: {k: (reps[k].measure_start_s, reps[k].measure_end_s) for k in sorted(reps)}
             for key, reps in infos.items()}
    by_level = reader(run.dir / REQUESTS, known) if reader else read_columns(run.dir / REQUESTS, known,
                                                                               write_copy=write_copies)
    levels: list[dict[str, Any]] = []
    extra: dict[str, dict[float, dict[str, Any]]] = defaultdict(dict)
    keys = sorted(set(by_level) | set(infos), key=lambda k: (k[0], k[1]))
    # no level lines (e.g. a killed run): the span of its measured requests, per repeat
    own = {key: known[key] if infos.get(key) else (by_level.get(key) or Level.of(LevelArrays())).own_windows()
           for key in keys}
    first = {key: next(iter(w.values()), (0.0, 0.0)) for key, w in own.items()}
    figures = telemetry_figures(run, [first[k] for k in keys], write_copies)
    per_node = dict(zip(keys, figures.nodes.result())) if figures.node_names else {}
    for w, key in enumerate(keys):
        mode, level = key
        recs = by_level.get(key) or Level.of(LevelArrays())
        reps = infos.get(key, {})
        windows = own[key]
        stats = summarize_level(recs, windows, slo=slo)
        failed = check_slo(stats, slo) if slo else []
        value = int(level) if level.is_integer() else level
        entry = {"mode": mode, "level": value, **stats, "slo_ok": not failed and stats["ok"] > 0,
                 "failed_checks": failed}
        rates = [i.achieved_rate for i in reps.values() if i.achieved_rate is not None]
        if rates:
            entry["achieved_rate"] = round(float(np.median(rates)), 4)
        entry["client_warnings"] = sorted({w for i in reps.values() for w in i.client.warnings})
        w0, w1 = first[key]
        entry.update(figures.level(w))
        if figures.node_names:
            entry["nodes"] = per_node[key]
            hot = imbalance(entry["nodes"], replicas=figures.n_servers,
                            in_flight=value if mode == "concurrency" else stats.get("in_flight_mean"))
            if hot:
                entry["imbalance"] = hot
        entry["littles_law"] = littles_law(entry)
        extra[mode][value] = {"stationarity": stationarity(recs, (w0, w1), figures.waiting_trend[w]),
                              "preemptions": figures.preemptions(w)}
        levels.append(entry)
    for mode in {lv["mode"] for lv in levels}:
        apply_conditions([lv for lv in levels if lv["mode"] == mode], slo, extra[mode])
    hits = record_hits(run)
    for w, (key, entry) in enumerate(zip(keys, levels)):
        reuse = hits.levels.get(key, figure("records", 0, 0, 0)) if hits.levels else (
            from_counters(figures.increases(w)) or hits.cached.get(key))
        if reuse is not None:
            entry["prefix_reuse"] = reuse.to_json()
    capacity = capacities(levels, slo, figures.maxima(figures.resident), figures.maxima(figures.waiting))
    if figures.parked:
        capacity["resident_source"] = "telemetry:running+parked"
    summary = Summary.model_validate({
        "source": manifest.source if manifest else None, "arm": manifest.arm if manifest else None, "slo": slo,
        "limits": level_limits(manifest), "levels": levels, "capacity": capacity})
    summary.diagnosis = diagnose(summary.levels, (manifest.arm if manifest else None) or "run",
                                 shared_prefixes=shares_prefixes(manifest), reusable=reusable_share(manifest),
                                 thinks=users_think(manifest), limits=engine_limits(manifest))
    summary.warnings = input_length_warnings(manifest, summary.levels)
    return summary


def level_limits(manifest: Manifest | None) -> Limits:
    """What ended each level's measured window, as the run was asked (both limits: ``LIMIT_RULE``), and any
    precedence taken on the inputs (``manifest.notes``) — so a count that stopped short is never a surprise."""
    fixed = manifest.fixed if manifest is not None else {}
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
    return Limits(duration_s=duration, requests=requests, rule=rule,
                  notes=list(manifest.notes) if manifest is not None else [])


def best_goodput_level(levels: list[LevelSummary]) -> LevelSummary | None:
    """The level with the highest goodput (``goodput_tok_s``), the first of equals in the summary's order (mode,
    then level); None without levels. The one definition for ``compare``'s verdict, the reports and ``search``."""
    return max(levels, key=lambda lv: lv.goodput_tok_s, default=None)
