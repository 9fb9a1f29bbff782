"""The report's plotted sections: each metric against load level (SLO limits and capacities marked), the server
over time (measured windows shaded, level starts dashed) and per-node utilisation over time. Where levels carry
``prefix_reuse``, the share of prompt tokens served from the HBM prefix cache and from a lower tier is plotted
against level beside TTFT: what a tier saves shows next to what it does to latency.

Turns the values of :mod:`kvcap.report.data` into :mod:`kvcap.report.charts` charts; the titles and labels, which
may carry run data, are escaped by the charts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvcap.analysis.telemetry import Telemetry
from kvcap.analysis.telemetry_nodes import nodes
from kvcap.report.charts import Band, HLine, LegendItem, Series, VLine, svg_chart
from kvcap.report.data import (
    Arm,
    Rows,
    capacity_figure,
    capacity_mode,
    level_values,
    mode_levels,
    modes_in,
    quantile,
    run_telemetry,
    telemetry_series,
)
from kvcap.report.format import esc, fmt, fmtm, is_finite, level_name

MODE_AXIS = {"concurrency": "concurrency (requests in flight)", "rate": "offered rate (req/s)",
             "trace": "trace speed-up (×)"}
PLOTS: list[tuple[str, str, str, str | None]] = [
    ("output throughput", "output_tok_s", "tok/s", None),
    ("goodput (tokens of requests within the SLO)", "goodput_tok_s", "tok/s", None),
    ("TTFT p95", "ttft", "ms", "p95"),
    ("TTFT p99", "ttft", "ms", "p99"),
    ("TPOT p95", "tpot", "ms", "p95"),
    ("TPOT p99", "tpot", "ms", "p99"),
]
"""The plots against load level: title, metric, unit, percentile (None: the metric is a plain number)."""
HIT_RATE_CLASS = "plot hit-rates"
"""The CSS class of the hit-rate chart (a report with no level reporting prefix reuse has none)."""
TIER_DASH = "5,3"
"""The dash of a tier's hit-rate line (the HBM line of the same arm is solid)."""
MARKERS = (("effective", "eff", None), ("resident", "res", "2,3"), ("stress_limit", "stress", "7,4"))
"""Capacity markers on the plots against level: capacity key, short label, dash."""
NODE_PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22")
NODE_METRICS = (("gpu.util", "GPU utilisation per node", "utilisation (%)", 100.0),
                ("net.rx_bytes_s", "network receive per node", "Gbps", 8 / 1e9),
                ("net.tx_bytes_s", "network transmit per node", "Gbps", 8 / 1e9))
"""Per-node charts: metric, title, y label, scale from the metric's unit to the plotted one."""
KV_NAMES = {"server.kv_usage": "KV cache usage", "server.kv_usage_host": "host KV usage"}
KV_STYLES = (("#6a4c93", None), ("#8d6e63", "5,3"))
TIME_AXIS = "time since start (s)"
TIMESERIES_CLASS = "plot timeseries"


# ---------------------------------------------------------------------------------------------------- against load


def _capacity_markers(arms: Sequence[Arm]) -> tuple[list[VLine], list[LegendItem]]:
    """A vertical line per arm and capacity (labelled with the arm's initial when comparing), and a legend entry
    per capacity that any arm has."""
    compare = len(arms) > 1
    vlines: list[VLine] = []
    extra: list[LegendItem] = []
    for key, short, dash in MARKERS:
        present = False
        for a in arms:
            x = capacity_figure(a.summary, key)
            if x is not None:
                present = True
                label = f"{a.label[:1].upper()} {short}" if compare else short
                vlines.append(VLine(x, label, a.colour, dash))
        if present:
            extra.append(LegendItem(key.replace("_", " "), "#5b6472", dash))
    return vlines, extra


def _level_series(a: Arm, mode: str, metric: str, unit: str, q: str | None) -> Series:
    """One arm's metric against level, each point with a tooltip naming its level."""
    pts, tips = [], []
    for lv in mode_levels(a.summary, mode):
        y = quantile(lv, metric, q) if q else getattr(lv, metric)
        if is_finite(y):
            pts.append((float(lv.level), float(y)))
            tips.append(f"{level_name(mode, lv.level)}: {fmtm(y)} {unit}")
    return Series(a.label, a.colour, pts, tips=tips)


def _hit_series(a: Arm, mode: str, tier: bool, compare: bool) -> Series:
    """One arm's HBM (or tier) hit rate against level in %, each point's tooltip with its tokens."""
    which = "tier" if tier else "HBM"
    pts, tips = [], []
    for lv in mode_levels(a.summary, mode):
        reuse = lv.prefix_reuse
        rate = None if reuse is None else reuse.tier_hit_rate if tier else reuse.hbm_hit_rate
        if reuse is None or rate is None or not is_finite(rate):
            continue
        hits = reuse.tier_hit_tokens if tier else reuse.hbm_hit_tokens
        pts.append((float(lv.level), 100.0 * rate))
        tips.append(f"{level_name(mode, lv.level)}: {fmt(100.0 * rate)} % ({fmt(hits)} of {fmt(reuse.prompt_tokens)} "
                    f"prompt tokens, from {reuse.source})")
    name = f"{a.label} {which}" if compare else ("HBM prefix cache" if not tier else "lower tier")
    return Series(name, a.colour, pts, dash=TIER_DASH if tier else None, tips=tips)


def hit_rate_chart(arms: Sequence[Arm], mode: str, x_ticks: Sequence[float] | None = None,
                   vlines: Sequence[VLine] = (), extra: Sequence[LegendItem] = ()) -> str:
    """Prompt tokens served from the HBM prefix cache and from a lower tier, in % of the prompt tokens, against
    level (per arm: HBM solid, tier dashed); empty when no level of this mode reports prefix reuse."""
    series = [s for a in arms for tier in (False, True) if (s := _hit_series(a, mode, tier, len(arms) > 1)).points]
    if not series:
        return ""
    axis = MODE_AXIS.get(mode, mode)
    return svg_chart(f"prompt tokens served from cache vs {axis.split(' (')[0]}", series, x_label=axis,
                     y_label="hit rate (% of prompt tokens)", vlines=vlines, x_ticks=x_ticks, legend_extra=extra,
                     css_class=HIT_RATE_CLASS)


def _slo_lines(slo: dict[str, float], metric: str, q: str | None) -> list[HLine]:
    """The SLO limit on this metric's percentile, if the SLO has one."""
    key = f"{metric}_{q}"
    if q and key in slo and is_finite(slo[key]):
        return [HLine(float(slo[key]), f"SLO {key} ≤ {fmt(slo[key])} ms")]
    return []


def _mode_plots(arms: Sequence[Arm], mode: str, slo: dict[str, float], markers: bool) -> list[str]:
    """Every plot of :data:`PLOTS` for one load mode (capacity markers only in the mode capacities count in)."""
    levels = level_values(arms, mode)
    x_ticks = levels if len(levels) <= 12 else None
    vlines, extra = _capacity_markers(arms) if markers else ([], [])
    axis = MODE_AXIS.get(mode, mode)
    charts = [svg_chart(f"{title} vs {axis.split(' (')[0]}", [_level_series(a, mode, metric, unit, q) for a in arms],
                        x_label=axis, y_label=f"{title.split(' (')[0]} ({unit})", hlines=_slo_lines(slo, metric, q),
                        vlines=vlines, x_ticks=x_ticks, legend_extra=extra)
              for title, metric, unit, q in PLOTS]
    hits = hit_rate_chart(arms, mode, x_ticks, vlines, extra)
    if hits:  # after the TTFT charts, so it lies beside them in the grid
        after_ttft = max(i for i, (_, metric, _, _) in enumerate(PLOTS) if metric == "ttft") + 1
        charts.insert(after_ttft, hits)
    return charts


def level_plots(arms: Sequence[Arm], slo: dict[str, float]) -> str:
    """Each metric against load, one series per arm, SLO limits as horizontal lines, capacities as vertical ones."""
    modes = modes_in(arms)
    if not modes:
        return '<p class="muted">No levels to plot.</p>'
    cap_mode = capacity_mode(arms)
    parts = []
    for mode in modes:
        if len(modes) > 1:
            parts.append(f"<h3>{esc(MODE_AXIS.get(mode, mode))}</h3>")
        parts.append('<div class="plots">')
        parts += _mode_plots(arms, mode, slo, markers=mode == cap_mode)
        parts.append("</div>")
    return "\n".join(parts)


# ---------------------------------------------------------------------------------------------------- over time


def _window_bands(windows: Rows, with_repeat: bool) -> list[Band]:
    """A shaded band per measured window, labelled with its level (and repeat, past the first, if asked)."""
    return [Band(w["measure_start_s"], w["measure_end_s"], level_name(w["mode"], w["level"])
                 + (f" #{w['repeat']}" if with_repeat and w["repeat"] else ""))
            for w in windows if "measure_start_s" in w and "measure_end_s" in w]


def _percent(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    return [(t, v * 100) for t, v in points]


def _request_chart(label: str, counts: dict[str, list[tuple[float, float]]], style: dict[str, Any]) -> str:
    """Requests running / waiting (/ parked in a lower tier) over time; empty when neither of the first two is
    recorded."""
    if not (counts["running"] or counts["waiting"]):
        return ""
    series = [Series("running", "#2a9d8f", counts["running"], markers=False),
              Series("waiting", "#d1495b", counts["waiting"], dash="5,3", markers=False),
              Series("parked in a lower tier", "#e9a23b", counts["parked"], dash="2,2", markers=False)]
    title = "running / waiting / parked" if counts["parked"] else "running / waiting"
    return svg_chart(f"{label}: server requests {title}", [s for s in series if s.points], y_label="requests",
                     **style)


def _kv_charts(label: str, kv: dict[str, list[tuple[float, float]]], style: dict[str, Any]) -> list[str]:
    """KV usage: fractions together in %, any other gauge (bytes, blocks) on its own axis, placed first."""
    fractions = {n: s for n, s in kv.items() if max(v for _, v in s) <= 1.0001}
    charts = [svg_chart(f"{label}: {n}", [Series(n, "#6a4c93", s, markers=False)], y_label=n, **style)
              for n, s in kv.items() if n not in fractions]
    if fractions:
        series = [Series(KV_NAMES[n], c, _percent(s), dash=d, markers=False)
                  for (n, s), (c, d) in zip(fractions.items(), KV_STYLES)]
        charts.append(svg_chart(f"{label}: KV cache usage", series, y_label="usage (%)", **style))
    return charts


def _arm_time_series(a: Arm, rows: Telemetry, windows: Rows) -> str:
    """One arm's charts over time; empty when it has neither request counts nor KV usage."""
    counts = {k: telemetry_series(rows, f"server.requests_{k}") for k in ("running", "waiting", "parked")}
    kv = {n: telemetry_series(rows, n) for n in KV_NAMES}
    kv = {n: s for n, s in kv.items() if s}
    if not (counts["running"] or counts["waiting"] or kv):
        return ""
    style: dict[str, Any] = {"x_label": TIME_AXIS, "bands": _window_bands(windows, with_repeat=True),
             "vlines": [VLine(w["t_start_s"], "", "#8a94a3", "3,3") for w in windows if "t_start_s" in w],
             "legend_extra": [LegendItem("measured window", "#c9ced6", box=True),
                              LegendItem("level start", "#8a94a3", "3,3")],
             "css_class": TIMESERIES_CLASS}
    charts = [_request_chart(a.label, counts, style), *_kv_charts(a.label, kv, style)]
    links = telemetry_series(rows, "link.util")
    if links:
        charts.append(svg_chart(f"{a.label}: busiest link utilisation", [Series(
            "link.util (max over links)", "#3d5a80", _percent(links), markers=False)],
            y_label="utilisation (% of line rate)", **style))
    return f"<h3>{esc(a.label)}</h3><div class=\"plots\">{''.join(c for c in charts if c)}</div>"


def time_series(arms: Sequence[Arm]) -> str:
    """Server running/waiting (and KV usage) over each run, measured windows shaded, level starts dashed."""
    parts = []
    for a in arms:
        telemetry = run_telemetry(a.run)
        section = _arm_time_series(a, *telemetry) if telemetry else ""
        if section:
            parts.append(section)
    if not parts:
        return '<p class="muted">No server telemetry in the run directories (no metrics endpoint was scraped).</p>'
    return "\n".join(parts)


def node_charts(a: Arm) -> str:
    """GPU utilisation and network Gbps over time, one line per node, level windows shaded."""
    telemetry = run_telemetry(a.run)
    if telemetry is None:
        return ""
    rows, windows = telemetry
    names = nodes(rows)
    bands = _window_bands(windows, with_repeat=False)
    out = []
    for metric, title, y, scale in NODE_METRICS:
        lines = []
        for i, node in enumerate(names):
            pts = telemetry_series(rows, metric, node=node)
            if pts:
                lines.append(Series(node, NODE_PALETTE[i % len(NODE_PALETTE)], [(t, v * scale) for t, v in pts],
                                    markers=False))
        if lines:
            out.append(svg_chart(f"{a.label}: {title}", lines, x_label=TIME_AXIS, y_label=y, bands=bands,
                                 css_class=TIMESERIES_CLASS))
    return "".join(out)
