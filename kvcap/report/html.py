"""One self-contained HTML report: verdict first, then the evidence — plots, server time series, fixed variables,
diagnosis and the raw per-level numbers.

The file must open offline, years later, attached to a ticket: no CDN, no fonts, no scripts; every plot is inline
SVG drawn here. Everything that came from a run (model names, manifest values, warnings) is untrusted text and goes
through :func:`esc`, inside SVG ``<text>`` and ``<title>`` too.
"""

from __future__ import annotations

import html
import json
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcap.analysis.slo import format_slo
from kvcap.analysis.telemetry import dedupe_sources, nodes, series
from kvcap.rundir import RunDir

ARMS = ("control", "treatment")
ARM_COLOURS = {"control": "#1f6fb4", "treatment": "#e0661b"}
SINGLE_COLOUR = "#1f6fb4"
VERDICT_MEANING = {
    "performance-scaling": "More memory bought more SLO-bounded concurrency and more goodput, beyond the noise.",
    "capacity-only": "More requests reside in memory, but effective capacity and goodput are not higher beyond "
                     "the noise: the extra memory holds requests, it does not serve more of them within the SLO.",
    "no-gain": "Neither resident requests, effective capacity nor goodput rose beyond the noise.",
    "regression": "The treatment is worse: effective capacity fell, or goodput fell beyond the noise.",
}
MODE_PREFIX = {"concurrency": "c", "rate": "λ", "trace": "trace×"}
MODE_AXIS = {"concurrency": "concurrency (requests in flight)", "rate": "offered rate (req/s)",
             "trace": "trace speed-up (×)"}
NOT_FIXED = {"target.url"}
"""Keys expected to differ between arms (two servers); shown, not flagged. Same set as ``compare`` uses."""
HALO = 'paint-order="stroke" stroke="#fff" stroke-width="3" stroke-linejoin="round"'
"""A white outline under labels drawn over data, so they stay readable where a line crosses them."""
MAX_POINTS = 2000
"""Time series are thinned to this many points per series: the plot stays small, the shape stays."""

CSS = """
:root { --fg:#1d2330; --muted:#5b6472; --line:#d9dee6; --bg:#fff; --soft:#f5f7fa; }
* { box-sizing: border-box; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif;
       color: var(--fg); background: var(--bg); margin: 0; }
main { max-width: 1240px; margin: 0 auto; padding: 24px 28px 60px; }
h1 { font-size: 22px; margin: 0 0 4px; }
h2 { font-size: 17px; margin: 32px 0 10px; padding-bottom: 4px; border-bottom: 1px solid var(--line); }
h3 { font-size: 14px; margin: 18px 0 8px; }
.sub { color: var(--muted); margin: 0 0 18px; }
.verdict { border: 2px solid; border-radius: 8px; padding: 14px 18px; margin: 8px 0 18px; }
.verdict .word { font-size: 24px; font-weight: 700; letter-spacing: .01em; }
.verdict p { margin: 6px 0 0; font-size: 15px; }
.v-performance-scaling { border-color: #2e7d32; background: #eef8f0; } .v-performance-scaling .word { color: #2e7d32; }
.v-capacity-only { border-color: #b7791f; background: #fdf6e7; } .v-capacity-only .word { color: #9a6414; }
.v-no-gain { border-color: #6b7280; background: #f3f4f6; } .v-no-gain .word { color: #4b5563; }
.v-regression { border-color: #c62828; background: #fdeeee; } .v-regression .word { color: #c62828; }
.caution { color: #9a3412; font-weight: 600; }
table { border-collapse: collapse; margin: 6px 0 12px; font-variant-numeric: tabular-nums; }
th, td { border: 1px solid var(--line); padding: 4px 9px; text-align: left; vertical-align: top; }
th { background: var(--soft); font-weight: 600; }
td.num, th.num { text-align: right; white-space: nowrap; } th.num { white-space: normal; }
tr.diff td { background: #fdecec; } tr.under-test td { background: #eaf2fd; } tr.expected td { color: var(--muted); }
.tag { display: inline-block; font-size: 11px; padding: 0 6px; border-radius: 9px; background: var(--soft);
       border: 1px solid var(--line); color: var(--muted); margin-right: 4px; }
.pass { color: #2e7d32; font-weight: 600; } .fail { color: #c62828; font-weight: 600; }
.plots { display: grid; grid-template-columns: repeat(auto-fill, minmax(440px, 1fr)); gap: 14px; }
svg.plot { width: 100%; max-width: 820px; height: auto; border: 1px solid var(--line); border-radius: 6px; background: #fff; }
ul.findings li { margin: 4px 0; }
.muted { color: var(--muted); }
.scroll { overflow-x: auto; }
table.raw, table.perlevel { font-size: 12.5px; } table.raw td, table.raw th, table.perlevel td, table.perlevel th {
  padding: 3px 6px; }
table.raw td:last-child { min-width: 120px; }
table.nodes tr.hot td { background: #fff1e6; font-weight: 600; }
code { font-size: 12.5px; background: var(--soft); padding: 0 3px; border-radius: 3px; }
"""


def esc(value: Any) -> str:
    """HTML-escape anything (quotes too): run data is untrusted and may land in attributes."""
    return html.escape("" if value is None else str(value), quote=True)


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def fmt(v: Any, digits: int | None = None) -> str:
    """Numbers for people: few digits, thousands separators; None → an en dash."""
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        if digits is not None:
            return f"{v:,.{digits}f}"
        if v.is_integer() and abs(v) < 1e15:
            return f"{int(v):,}"
        a = abs(v)
        return f"{v:,.0f}" if a >= 100 else f"{v:.1f}" if a >= 10 else f"{v:.2f}" if a >= 0.1 else f"{v:.3g}"
    return str(v)


def fmtm(v: Any) -> str:
    """A measurement (tok/s, ms): three significant-ish digits, never collapsed to an integer look."""
    if not _finite(v):
        return fmt(v)
    a = abs(v)
    if a == 0:
        return "0"
    return f"{v:,.0f}" if a >= 100 else f"{v:.1f}" if a >= 10 else f"{v:.2f}"


def _level_name(mode: Any, level: Any) -> str:
    return f"{MODE_PREFIX.get(str(mode), str(mode))}={fmt(level)}"


def _value_text(v: Any) -> str:
    """A manifest value as text: strings as they are, everything else as JSON (lists, null, numbers)."""
    if isinstance(v, str):
        return v
    try:
        return json.dumps(v, default=str)
    except (TypeError, ValueError):
        return str(v)


# ---------------------------------------------------------------------------------------------------- SVG plots


@dataclass
class Series:
    """One polyline (optionally with point markers carrying tooltips)."""

    name: str
    colour: str
    points: list[tuple[float, float]]
    dash: str | None = None
    markers: bool = True
    tips: list[str] = field(default_factory=list)


@dataclass
class VLine:
    x: float
    label: str
    colour: str
    dash: str | None = None


@dataclass
class HLine:
    y: float
    label: str
    colour: str = "#c62828"


@dataclass
class Band:
    x0: float
    x1: float
    label: str = ""


@dataclass
class LegendItem:
    label: str
    colour: str
    dash: str | None = None
    marker: bool = False
    box: bool = False


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About ``n`` round tick values (1, 2, 2.5, 5 × 10^k steps) covering [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return []
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / max(n, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = mag
    for m in (1, 2, 2.5, 5, 10):
        step = m * mag
        if step >= raw:
            break
    start = math.ceil(lo / step - 1e-9) * step
    ticks, v = [], start
    while v <= hi + 1e-9 * step and len(ticks) < 50:
        ticks.append(round(v, 10))
        v += step
    return ticks


def _tick_label(v: float) -> str:
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:g}"


def _clip(text: str, px: float, char_px: float = 7.8) -> str:
    """Shorten a label to about ``px`` pixels (an ellipsis at the end); the full text stays in the <title>."""
    n = max(int(px / char_px), 4)
    return text if len(text) <= n else text[: n - 1] + "…"


def svg_chart(title: str, series: Sequence[Series], *, x_label: str, y_label: str,
              hlines: Sequence[HLine] = (), vlines: Sequence[VLine] = (), bands: Sequence[Band] = (),
              x_ticks: Sequence[float] | None = None, legend_extra: Sequence[LegendItem] = (),
              width: int = 560, height: int = 320, css_class: str = "plot") -> str:
    """A line chart as inline SVG, y from 0: reference lines (SLO), markers (capacities) and shaded bands
    (measured windows) drawn under the data. No external anything, so it renders offline and in any browser."""
    pts = [p for s in series for p in s.points if _finite(p[0]) and _finite(p[1])]
    xs = [p[0] for p in pts] + [v.x for v in vlines if _finite(v.x)] + [b for band in bands for b in (band.x0, band.x1)]
    ys = [p[1] for p in pts] + [h.y for h in hlines if _finite(h.y)]
    # legend first: its rows decide the height
    items = [LegendItem(s.name, s.colour, s.dash, s.markers) for s in series]
    items += [LegendItem(h.label, h.colour, "6,4") for h in hlines] + list(legend_extra)
    left, right = 66, 18
    counts: dict[float, int] = defaultdict(int)
    for v in vlines:
        if v.label and _finite(v.x):
            counts[v.x] += 1
    strip = 11 * max(counts.values(), default=0)  # marker labels sit in a strip above the plot, not on the data
    top = 34 + strip + (4 if strip else 0)
    rows: list[list[tuple[LegendItem, float]]] = [[]]
    x_cursor = left
    for it in items:
        w = 30 + 6.6 * len(it.label) + 14
        if x_cursor + w > width - right and rows[-1]:
            rows.append([])
            x_cursor = left
        rows[-1].append((it, x_cursor))
        x_cursor += w
    legend_h = 18 * len([r for r in rows if r])
    height = max(height, 220) + max(legend_h - 18, 0) + strip
    bottom = height - 56 - legend_h
    out = [f'<svg class="{esc(css_class)}" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" '
           f'role="img" aria-label="{esc(title)}">', f"<title>{esc(title)}</title>",
           f'<text x="{left}" y="20" font-size="14" font-weight="600" fill="#1d2330">{esc(_clip(title, width - left))}'
           "</text>"]
    if not pts:
        out.append(f'<text x="{width / 2}" y="{(top + bottom) / 2}" text-anchor="middle" fill="#5b6472" '
                   f'font-size="13">no data</text></svg>')
        return "\n".join(out)
    x0, x1 = min(xs), max(xs)
    if x1 <= x0:
        x0, x1 = x0 - 1, x1 + 1
    pad = (x1 - x0) * 0.04
    x0, x1 = x0 - pad, x1 + pad
    y1 = max(ys) * 1.08 if max(ys) > 0 else 1.0
    y0 = min(0.0, min(ys))
    ticks_y = nice_ticks(y0, y1)
    if ticks_y:
        y1 = max(y1, ticks_y[-1])

    def sx(x: float) -> float:
        return round(left + (x - x0) / (x1 - x0) * (width - left - right), 2)

    def sy(y: float) -> float:
        return round(bottom - (y - y0) / (y1 - y0) * (bottom - top), 2)

    for b in bands:
        out.append(f'<rect x="{sx(b.x0)}" y="{top}" width="{max(sx(b.x1) - sx(b.x0), 0.5)}" '
                   f'height="{bottom - top}" fill="#1d2330" fill-opacity="0.06"/>')
        if b.label:
            out.append(f'<text x="{sx(b.x0) + 3}" y="{top + 11}" font-size="10" fill="#5b6472">{esc(b.label)}</text>')
    # axes and grid
    for t in ticks_y:
        out.append(f'<line x1="{left}" x2="{width - right}" y1="{sy(t)}" y2="{sy(t)}" stroke="#eceff3"/>')
        out.append(f'<text x="{left - 6}" y="{sy(t) + 4}" font-size="11" text-anchor="end" fill="#5b6472">'
                   f"{esc(_tick_label(t))}</text>")
    tx = [t for t in (x_ticks if x_ticks is not None else nice_ticks(x0, x1, 6)) if x0 <= t <= x1]
    for t in tx:
        out.append(f'<line x1="{sx(t)}" x2="{sx(t)}" y1="{bottom}" y2="{bottom + 4}" stroke="#5b6472"/>')
        out.append(f'<text x="{sx(t)}" y="{bottom + 17}" font-size="11" text-anchor="middle" fill="#5b6472">'
                   f"{esc(_tick_label(t))}</text>")
    out.append(f'<line x1="{left}" x2="{width - right}" y1="{bottom}" y2="{bottom}" stroke="#5b6472"/>')
    out.append(f'<line x1="{left}" x2="{left}" y1="{top}" y2="{bottom}" stroke="#5b6472"/>')
    out.append(f'<text x="{(left + width - right) / 2}" y="{bottom + 34}" font-size="12" text-anchor="middle" '
               f'fill="#1d2330">{esc(x_label)}</text>')
    out.append(f'<text transform="translate(16 {(top + bottom) / 2}) rotate(-90)" font-size="12" '
               f'text-anchor="middle" fill="#1d2330">{esc(y_label)}</text>')
    # reference lines
    for h in hlines:
        if not _finite(h.y):
            continue
        out.append(f'<line class="slo-line" x1="{left}" x2="{width - right}" y1="{sy(h.y)}" y2="{sy(h.y)}" '
                   f'stroke="{esc(h.colour)}" stroke-width="1.5" stroke-dasharray="6,4"><title>{esc(h.label)}</title>'
                   f"</line>")
        out.append(f'<text x="{width - right - 4}" y="{sy(h.y) - 4}" font-size="10.5" text-anchor="end" '
                   f'fill="{esc(h.colour)}" {HALO}>{esc(h.label)}</text>')
    stacked: dict[float, int] = defaultdict(int)
    for v in vlines:
        if not _finite(v.x):
            continue
        k = stacked[v.x]
        stacked[v.x] += bool(v.label)
        dash = f' stroke-dasharray="{esc(v.dash)}"' if v.dash else ""
        out.append(f'<line class="marker" x1="{sx(v.x)}" x2="{sx(v.x)}" y1="{top}" y2="{bottom}" '
                   f'stroke="{esc(v.colour)}" stroke-width="1.3" stroke-opacity="0.85"{dash}>'
                   f"<title>{esc(v.label)} = {esc(fmt(v.x))}</title></line>")
        if v.label:
            at_right = sx(v.x) > width - right - 60
            anchor = ' text-anchor="end"' if at_right else ""
            out.append(f'<text x="{sx(v.x) + (-3 if at_right else 3)}" y="{34 + 9 + 11 * k}" font-size="10"{anchor} '
                       f'fill="{esc(v.colour)}" {HALO}>{esc(v.label)}</text>')
    # data
    for s in series:
        good = [(x, y) for x, y in s.points if _finite(x) and _finite(y)]
        if not good:
            continue
        dash = f' stroke-dasharray="{esc(s.dash)}"' if s.dash else ""
        path = " ".join(f"{sx(x)},{sy(y)}" for x, y in good)
        out.append(f'<polyline class="series" points="{path}" fill="none" stroke="{esc(s.colour)}" '
                   f'stroke-width="2"{dash}><title>{esc(s.name)}</title></polyline>')
        if s.markers:
            tips = s.tips if len(s.tips) == len(s.points) else [""] * len(s.points)
            for (x, y), tip in zip(s.points, tips):
                if _finite(x) and _finite(y):
                    out.append(f'<circle cx="{sx(x)}" cy="{sy(y)}" r="3.2" fill="{esc(s.colour)}">'
                               f"<title>{esc(s.name)}: {esc(tip or f'{fmt(x)} → {fmt(y)}')}</title></circle>")
    # legend
    for i, row in enumerate(r for r in rows if r):
        y = bottom + 52 + 18 * i
        for it, x in row:
            dash = f' stroke-dasharray="{esc(it.dash)}"' if it.dash else ""
            if it.box:
                out.append(f'<rect x="{x}" y="{y - 10}" width="22" height="11" fill="#1d2330" fill-opacity="0.1"/>')
            else:
                out.append(f'<line x1="{x}" x2="{x + 22}" y1="{y - 4}" y2="{y - 4}" stroke="{esc(it.colour)}" '
                           f'stroke-width="2"{dash}/>')
            if it.marker:
                out.append(f'<circle cx="{x + 11}" cy="{y - 4}" r="3" fill="{esc(it.colour)}"/>')
            out.append(f'<text class="legend" x="{x + 28}" y="{y}" font-size="11.5" fill="#1d2330">{esc(it.label)}'
                       f"</text>")
    out.append("</svg>")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------------- data access


def _q(lv: dict[str, Any], metric: str, q: str) -> float | None:
    v = (lv.get(f"{metric}_ms") or {}).get(q)
    return v if _finite(v) else None


def _levels_from_per_level(result: dict[str, Any], i: int) -> list[dict[str, Any]]:
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


def _coerce_runs(runs: dict[str, Any] | None) -> dict[str, RunDir]:
    out: dict[str, RunDir] = {}
    for k, v in (runs or {}).items():
        if v is not None:
            out[k] = v if isinstance(v, RunDir) else RunDir(v)
    return out


def _summaries(result: dict[str, Any], runs: dict[str, RunDir]) -> dict[str, dict[str, Any]]:
    """Per-arm summaries: from the result, else rebuilt from the run directories, else from ``per_level``."""
    have = result.get("summaries") or {}
    out: dict[str, dict[str, Any]] = {}
    for i, arm in enumerate(ARMS):
        if have.get(arm):
            out[arm] = have[arm]
        elif arm in runs:
            from kvcap.analysis.summary import build_summary
            out[arm] = build_summary(runs[arm], result.get("slo") or {})
        else:
            out[arm] = {"levels": _levels_from_per_level(result, i), "capacity": {}, "slo": result.get("slo") or {}}
    return out


def telemetry_series(rows: list[dict[str, Any]], name: str, node: str | None = None) -> list[tuple[float, float]]:
    """The analysis' series of ``name`` (summed, averaged or maximised over labels as the analysis does),
    thinned to at most ``MAX_POINTS`` for plotting."""
    pts = series(rows, name, node=node)
    if len(pts) > MAX_POINTS:
        step = math.ceil(len(pts) / MAX_POINTS)
        pts = pts[::step]
    return pts


def level_windows(levels: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per (mode, level, repeat) — workers merged — with its full span and its measured window."""
    merged: dict[tuple[str, float, int], dict[str, Any]] = {}
    for info in levels:
        try:
            key = (str(info.get("mode", "concurrency")), float(info["level"]), int(info.get("repeat", 0)))
        except (KeyError, TypeError, ValueError):
            continue
        m = merged.setdefault(key, {"mode": key[0], "level": info["level"], "repeat": key[2]})
        for k, f in (("t_start_s", min), ("measure_start_s", min), ("t_end_s", max), ("measure_end_s", max)):
            v = info.get(k)
            if _finite(v):
                m[k] = f(m[k], v) if k in m else v
    return sorted(merged.values(), key=lambda m: m.get("t_start_s", m.get("measure_start_s", 0.0)))


# ---------------------------------------------------------------------------------------------------- sections


@dataclass
class Arm:
    """What the plots need of one arm."""

    key: str
    label: str
    colour: str
    summary: dict[str, Any]
    run: RunDir | None = None


def _cap(summary: dict[str, Any]) -> dict[str, Any]:
    return summary.get("capacity") or {}


PLOTS: list[tuple[str, str, str, str | None]] = [
    ("output throughput", "output_tok_s", "tok/s", None),
    ("goodput (tokens of requests within the SLO)", "goodput_tok_s", "tok/s", None),
    ("TTFT p95", "ttft", "ms", "p95"),
    ("TTFT p99", "ttft", "ms", "p99"),
    ("TPOT p95", "tpot", "ms", "p95"),
    ("TPOT p99", "tpot", "ms", "p99"),
]
MARKERS = (("effective", "eff", None), ("resident", "res", "2,3"), ("stress_limit", "stress", "7,4"))


def _capacity_mode(arms: Sequence[Arm]) -> str:
    modes = [lv.get("mode") for a in arms for lv in a.summary.get("levels", [])]
    return "concurrency" if "concurrency" in modes or not modes else str(modes[0])


def _level_plots(arms: Sequence[Arm], slo: dict[str, float]) -> str:
    """Each metric against load, one series per arm, SLO limits as horizontal lines, capacities as vertical ones."""
    modes: list[str] = []
    for a in arms:
        for lv in a.summary.get("levels", []):
            if str(lv.get("mode")) not in modes:
                modes.append(str(lv.get("mode")))
    if not modes:
        return '<p class="muted">No levels to plot.</p>'
    cap_mode = _capacity_mode(arms)
    compare = len(arms) > 1
    parts = []
    for mode in modes:
        levels = sorted({float(lv["level"]) for a in arms for lv in a.summary.get("levels", [])
                         if str(lv.get("mode")) == mode and _finite(lv.get("level"))})
        x_ticks = levels if len(levels) <= 12 else None
        vlines: list[VLine] = []
        extra: list[LegendItem] = []
        if mode == cap_mode:
            for key, short, dash in MARKERS:
                present = False
                for a in arms:
                    x = _cap(a.summary).get(key)
                    if _finite(x):
                        present = True
                        label = f"{a.label[:1].upper()} {short}" if compare else short
                        vlines.append(VLine(float(x), label, a.colour, dash))
                if present:
                    extra.append(LegendItem(key.replace("_", " "), "#5b6472", dash))
        if len(modes) > 1:
            parts.append(f"<h3>{esc(MODE_AXIS.get(mode, mode))}</h3>")
        parts.append('<div class="plots">')
        for title, metric, unit, q in PLOTS:
            series = []
            for a in arms:
                lvs = sorted((lv for lv in a.summary.get("levels", []) if str(lv.get("mode")) == mode
                              and _finite(lv.get("level"))), key=lambda lv: lv["level"])
                pts, tips = [], []
                for lv in lvs:
                    y = _q(lv, metric, q) if q else lv.get(metric)
                    if _finite(y):
                        pts.append((float(lv["level"]), float(y)))
                        tips.append(f"{_level_name(mode, lv['level'])}: {fmtm(y)} {unit}")
                series.append(Series(a.label, a.colour, pts, tips=tips))
            hl = []
            if q and f"{metric}_{q}" in slo and _finite(slo[f"{metric}_{q}"]):
                hl.append(HLine(float(slo[f"{metric}_{q}"]), f"SLO {metric}_{q} ≤ {fmt(slo[f'{metric}_{q}'])} ms"))
            parts.append(svg_chart(f"{title} vs {MODE_AXIS.get(mode, mode).split(' (')[0]}", series,
                                   x_label=MODE_AXIS.get(mode, mode), y_label=f"{title.split(' (')[0]} ({unit})",
                                   hlines=hl, vlines=vlines, x_ticks=x_ticks, legend_extra=extra))
        parts.append("</div>")
    return "\n".join(parts)


def _time_series(arms: Sequence[Arm]) -> str:
    """Server running/waiting (and KV usage) over each run, measured windows shaded, level starts dashed."""
    parts = []
    for a in arms:
        if a.run is None:
            continue
        try:
            rows = dedupe_sources(a.run.telemetry())
            windows = level_windows(a.run.levels())
        except (OSError, ValueError):
            continue
        running = telemetry_series(rows, "server.requests_running")
        waiting = telemetry_series(rows, "server.requests_waiting")
        parked = telemetry_series(rows, "server.requests_parked")
        links = telemetry_series(rows, "link.util")
        kv = {n: telemetry_series(rows, n) for n in ("server.kv_usage", "server.kv_usage_host")}
        kv = {n: s for n, s in kv.items() if s}
        if not (running or waiting or kv):
            continue
        bands = [Band(w["measure_start_s"], w["measure_end_s"], _level_name(w["mode"], w["level"])
                      + (f" #{w['repeat']}" if w["repeat"] else ""))
                 for w in windows if "measure_start_s" in w and "measure_end_s" in w]
        starts = [VLine(w["t_start_s"], "", "#8a94a3", "3,3") for w in windows if "t_start_s" in w]
        extra = [LegendItem("measured window", "#c9ced6", box=True), LegendItem("level start", "#8a94a3", "3,3")]
        charts = []
        if running or waiting:
            series = [Series("running", "#2a9d8f", running, markers=False),
                      Series("waiting", "#d1495b", waiting, dash="5,3", markers=False),
                      Series("parked in a lower tier", "#e9a23b", parked, dash="2,2", markers=False)]
            title = "running / waiting / parked" if parked else "running / waiting"
            charts.append(svg_chart(f"{a.label}: server requests {title}", [s for s in series if s.points],
                                    x_label="time since start (s)", y_label="requests", bands=bands,
                                    vlines=starts, legend_extra=extra, css_class="plot timeseries"))
        fractions = {n: s for n, s in kv.items() if max(v for _, v in s) <= 1.0001}
        for n, s in kv.items():  # a non-fraction gauge (bytes, blocks) gets its own axis
            if n not in fractions:
                charts.append(svg_chart(f"{a.label}: {n}", [Series(n, "#6a4c93", s, markers=False)],
                                        x_label="time since start (s)", y_label=n, bands=bands, vlines=starts,
                                        legend_extra=extra, css_class="plot timeseries"))
        if fractions:
            series = [Series({"server.kv_usage": "KV cache usage", "server.kv_usage_host": "host KV usage"}[n],
                             c, [(t, v * 100) for t, v in s], dash=d, markers=False)
                      for (n, s), (c, d) in zip(fractions.items(), (("#6a4c93", None), ("#8d6e63", "5,3")))]
            charts.append(svg_chart(f"{a.label}: KV cache usage", series, x_label="time since start (s)",
                                    y_label="usage (%)", bands=bands, vlines=starts, legend_extra=extra,
                                    css_class="plot timeseries"))
        if links:
            charts.append(svg_chart(f"{a.label}: busiest link utilisation", [Series(
                "link.util (max over links)", "#3d5a80", [(t, v * 100) for t, v in links], markers=False)],
                x_label="time since start (s)", y_label="utilisation (% of line rate)", bands=bands, vlines=starts,
                legend_extra=extra, css_class="plot timeseries"))
        parts.append(f"<h3>{esc(a.label)}</h3><div class=\"plots\">{''.join(charts)}</div>")
    if not parts:
        return '<p class="muted">No server telemetry in the run directories (no metrics endpoint was scraped).</p>'
    return "\n".join(parts)


NODE_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("GPU util mean", "gpu_util_mean", "pct"), ("GPU mem max", "gpu_mem_used_max_bytes", "gib"),
    ("KV usage mean", "kv_usage_mean", "pct"), ("running mean / max", "running", "pair"),
    ("waiting mean", "waiting_mean", "num"), ("net rx Gbps", "net_rx_gbps_mean", "num"),
    ("net tx Gbps", "net_tx_gbps_mean", "num"), ("busiest link", "link_util_max", "pct"))


def _node_cell(figs: dict[str, Any], key: str, kind: str) -> str:
    if kind == "pair":
        a, b = figs.get("running_mean"), figs.get("running_max")
        return "–" if a is None else f"{a:.1f} / {b:.0f}"
    v = figs.get(key)
    if v is None:
        return "–"
    if kind == "pct":
        return f"{v:.0%}"
    if kind == "gib":
        return f"{v / 2**30:.2f} GiB"
    return fmt(v, 3)


def _per_node(arms: Sequence[Arm]) -> str:
    """Per level and node: GPU, KV, queue and network figures side by side — one hot node can bound the cluster
    while the cluster average looks comfortable."""
    parts = []
    for a in arms:
        levels = [lv for lv in a.summary.get("levels") or [] if lv.get("nodes")]
        if not levels:
            continue
        head = "".join(f"<th>{esc(h)}</th>" for h, _, _ in NODE_COLUMNS)
        rows = []
        for lv in levels:
            hot = (lv.get("imbalance") or {}).get("hot")
            for node, figs in lv["nodes"].items():
                cls = ' class="hot"' if node == hot else ""
                cells = "".join(f'<td class="num">{esc(_node_cell(figs, k, kind))}</td>' for _, k, kind in NODE_COLUMNS)
                rows.append(f"<tr{cls}><td>{esc(_level_name(lv['mode'], lv['level']))}</td><td>{esc(node)}</td>"
                            f"{cells}</tr>")
        parts.append(f'<h3>{esc(a.label)}</h3><div class="scroll"><table class="raw nodes"><thead><tr><th>level</th>'
                     f"<th>node</th>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table></div>")
        charts = _node_charts(a)
        if charts:
            parts.append(f'<div class="plots">{charts}</div>')
    if not parts:
        return '<p class="muted">No per-node telemetry (give --metrics-url NODE=URL or --prometheus).</p>'
    return "\n".join(parts)


NODE_PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22")


def _node_charts(a: Arm) -> str:
    """GPU utilisation and network Gbps over time, one line per node, level windows shaded."""
    if a.run is None:
        return ""
    try:
        rows = a.run.telemetry()
        windows = level_windows(a.run.levels())
    except (OSError, ValueError):
        return ""
    rows = dedupe_sources(rows)
    names = nodes(rows)
    bands = [Band(w["measure_start_s"], w["measure_end_s"], _level_name(w["mode"], w["level"]))
             for w in windows if "measure_start_s" in w and "measure_end_s" in w]
    out = []
    for metric, title, y, scale in (("gpu.util", "GPU utilisation per node", "utilisation (%)", 100.0),
                                    ("net.rx_bytes_s", "network receive per node", "Gbps", 8 / 1e9),
                                    ("net.tx_bytes_s", "network transmit per node", "Gbps", 8 / 1e9)):
        lines = []
        for i, node in enumerate(names):
            pts = telemetry_series(rows, metric, node=node)
            if pts:
                lines.append(Series(node, NODE_PALETTE[i % len(NODE_PALETTE)], [(t, v * scale) for t, v in pts],
                                    markers=False))
        if lines:
            out.append(svg_chart(f"{a.label}: {title}", lines, x_label="time since start (s)", y_label=y,
                                 bands=bands, css_class="plot timeseries"))
    return "".join(out)


def _slo_cell(lv: dict[str, Any], has_slo: bool) -> str:
    if lv.get("slo_ok") is None:
        return "–"
    if lv.get("slo_ok"):
        return '<span class="pass">pass</span>'
    checks = ", ".join(str(c) for c in lv.get("failed_checks") or [])
    return f'<span class="fail">{"FAIL" if has_slo else "fail"}</span> {esc(checks)}'


def _raw_table(summary: dict[str, Any]) -> str:
    """Every level's numbers as measured: counts, throughput, goodput, latency percentiles, server gauges."""
    levels = summary.get("levels") or []
    if not levels:
        return '<p class="muted">No levels.</p>'
    head = ["level", "req", "ok", "err", "err rate", "out tok/s", "goodput tok/s", "TTFT p50/p95/p99 ms",
            "TPOT p50/p95/p99 ms", "ITL p95/p99 ms", "E2E p95 ms", "running max", "waiting mean",
            "in flight", "scaling eff.", "SLO / conditions"]
    out = ['<div class="scroll"><table class="raw"><thead><tr>'
           + "".join(f'<th{" class=num" if i not in (0, len(head) - 1) else ""}>{esc(h)}</th>'
                     for i, h in enumerate(head)) + "</tr></thead><tbody>"]
    has_slo = bool(summary.get("slo"))
    for lv in levels:
        trio = {m: " / ".join(fmtm(_q(lv, m, q)) for q in qs)
                for m, qs in (("ttft", ("p50", "p95", "p99")), ("tpot", ("p50", "p95", "p99")),
                              ("itl", ("p95", "p99")), ("e2e", ("p95",)))}
        name = _level_name(lv.get("mode"), lv.get("level"))
        if lv.get("achieved_rate") is not None:
            name += f" (got {fmt(lv['achieved_rate'])}/s)"
        err_rate = lv.get("error_rate")
        cells = [fmt(lv.get("requests")), fmt(lv.get("ok")), fmt(lv.get("errors")),
                 f"{err_rate:.1%}" if _finite(err_rate) else "–", fmtm(lv.get("output_tok_s")),
                 fmtm(lv.get("goodput_tok_s")), trio["ttft"], trio["tpot"], trio["itl"], trio["e2e"],
                 fmt(lv.get("server_running_max")), fmt(lv.get("server_waiting_mean")),
                 fmt((lv.get("littles_law") or {}).get("in_flight")), fmt(lv.get("scaling_efficiency"))]
        out.append(f"<tr><td>{esc(name)}</td>" + "".join(f'<td class="num">{esc(c)}</td>' for c in cells)
                   + f"<td>{_slo_cell(lv, has_slo)}</td></tr>")
    out.append("</tbody></table></div>")
    errs: dict[str, int] = defaultdict(int)
    for lv in levels:
        for k, v in (lv.get("error_classes") or {}).items():
            errs[str(k)] += int(v) if _finite(v) else 0
    if errs:
        out.append('<p class="muted">errors by class: ' + esc(", ".join(f"{k} {v}" for k, v in sorted(errs.items())))
                   + "</p>")
    return "\n".join(out)


def _findings(items: Iterable[Any]) -> list[str]:
    """Diagnosis entries ({arm, bound, evidence, direction}), other dicts, or plain strings — whatever is there."""
    out = []
    for d in items:
        if isinstance(d, dict) and ("bound" in d or "evidence" in d):
            arm = f'<span class="tag">{esc(d.get("arm"))}</span>' if d.get("arm") else ""
            text = f"{arm}bounded by <b>{esc(d.get('bound', '?'))}</b>"
            if d.get("evidence"):
                text += f" — {esc(d['evidence'])}"
            if d.get("direction"):
                text += f". → {esc(d['direction'])}"
            rest = {k: v for k, v in d.items() if k not in ("arm", "bound", "evidence", "direction")}
            if rest:
                text += " " + esc("; ".join(f"{k}: {_value_text(v)}" for k, v in rest.items()))
            out.append(f"<li>{text}</li>")
        elif isinstance(d, dict):
            out.append("<li>" + esc("; ".join(f"{k}: {_value_text(v)}" for k, v in d.items())) + "</li>")
        else:
            out.append(f"<li>{esc(d)}</li>")
    return out


def _fixed_table(result: dict[str, Any] | None, manifests: dict[str, dict[str, Any]]) -> str:
    """Key, control, treatment — differences red, variables under test blue, expected differences grey."""
    fv = (result or {}).get("fixed_variables") or {}
    under = set(fv.get("under_test") or [])
    allowed = {d.get("key") for d in fv.get("allowed_differences") or []}
    diffs = {d.get("key"): d for d in fv.get("differences") or []}
    fc = (manifests.get("control") or {}).get("fixed") or {}
    ft = (manifests.get("treatment") or {}).get("fixed") or {}
    note = ""
    if not fc and not ft:  # no run directories: only what the result lists
        for d in list(fv.get("allowed_differences") or []) + list(fv.get("differences") or []):
            fc.setdefault(d.get("key"), d.get("control"))
            ft.setdefault(d.get("key"), d.get("treatment"))
        note = '<p class="muted">Run directories not given: only the keys that differ are listed.</p>'
    keys = sorted({str(k) for k in fc} | {str(k) for k in ft} | under)
    if not keys:
        return '<p class="muted">No fixed variables recorded.</p>'
    rows = []
    for k in keys:
        a, b = fc.get(k), ft.get(k)
        if k in diffs:
            cls, tag = "diff", "DIFFERS"
        elif k in under:
            cls, tag = "under-test", "under test"
        elif k in allowed:
            cls, tag = "under-test", "allowed difference"
        elif k in NOT_FIXED:
            cls, tag = "expected", "expected to differ"
        elif a != b:
            cls, tag = "diff", "differs"
        else:
            cls, tag = "", ""
        rows.append(f'<tr class="{cls}"><td><code>{esc(k)}</code></td><td>{esc(_value_text(a))}</td>'
                    f"<td>{esc(_value_text(b))}</td><td>{esc(tag)}</td></tr>")
    verdict = ('<p class="pass">Same caliber: every fixed variable matches except those under test.</p>'
               if fv.get("equal", True) else
               '<p class="caution">Not the same caliber: fixed variables differ (red rows) — the verdict does not '
               "isolate the variable under test.</p>")
    return (verdict + note + '<table class="fixed"><thead><tr><th>key</th><th>control</th><th>treatment</th>'
            "<th></th></tr></thead><tbody>" + "".join(rows) + "</tbody></table>")


def _single_fixed_table(manifest: dict[str, Any]) -> str:
    fixed = manifest.get("fixed") or {}
    if not fixed:
        return '<p class="muted">No fixed variables recorded.</p>'
    under = set(manifest.get("under_test") or [])
    rows = [f'<tr class="{"under-test" if k in under else ""}"><td><code>{esc(k)}</code></td>'
            f"<td>{esc(_value_text(v))}</td><td>{'under test' if k in under else ''}</td></tr>"
            for k, v in sorted(fixed.items(), key=lambda kv: str(kv[0]))]
    return ('<table class="fixed"><thead><tr><th>key</th><th>value</th><th></th></tr></thead><tbody>'
            + "".join(rows) + "</tbody></table>")


def _arm_label(result: dict[str, Any], arm: str) -> str:
    name = (result.get(arm) or {}).get("arm")
    return arm if not name or name == arm else f"{arm} ({name})"


def _key_numbers(result: dict[str, Any], labels: dict[str, str]) -> str:
    """The three numbers per arm plus stress limit and what limited it; then the goodput difference and its noise."""
    c, t = result.get("control") or {}, result.get("treatment") or {}

    def res(a: dict[str, Any], summ_cap: dict[str, Any]) -> str:
        text = fmt(a.get("resident"))
        if summ_cap.get("resident_lower_bound"):
            text += "+ (lower bound)"
        return text + (f" ({a['resident_source']})" if a.get("resident_source") else "")

    caps = {arm: _cap(((result.get("summaries") or {}).get(arm)) or {}) for arm in ARMS}
    rows = [("resident requests", res(c, caps["control"]), res(t, caps["treatment"])),
            ("effective capacity (within SLO)", fmt(c.get("effective")), fmt(t.get("effective"))),
            ("goodput tok/s (best level)",
             f"{fmtm(c.get('goodput_tok_s'))} @ {fmt(c.get('goodput_level'))}",
             f"{fmtm(t.get('goodput_tok_s'))} @ {fmt(t.get('goodput_level'))}"),
            ("stress limit", fmt(c.get("stress_limit")), fmt(t.get("stress_limit"))),
            ("limited by", fmt(c.get("limited_by")), fmt(t.get("limited_by")))]
    body = "".join(f'<tr><th>{esc(k)}</th><td class="num">{esc(a)}</td><td class="num">{esc(b)}</td></tr>'
                   for k, a, b in rows)
    table = (f'<table class="keynums"><thead><tr><th></th><th class="num">{esc(labels["control"])}</th>'
             f'<th class="num">{esc(labels["treatment"])}</th></tr></thead><tbody>{body}</tbody></table>')
    g = result.get("goodput_gain") or {}
    lines = []
    if g:
        ci = g.get("ci95") or [None, None]
        noise = "beyond noise" if g.get("beyond_noise") else "inside the noise"
        lines.append(f"goodput Δ <b>{esc(_signed(g.get('delta_tok_s')))} tok/s</b>, 95% CI "
                     f"[{esc(_signed(ci[0]))}, {esc(_signed(ci[1]))}] — {esc(noise)}")
    eff = result.get("efficiency")
    if eff is not None:
        lines.append(f"efficiency {esc(fmt(eff))} <span class=\"muted\">(relative goodput gain per relative gain in "
                     "effective capacity; 1 = proportional)</span>")
    took = result.get("treatment_took_effect")
    lines.append("treatment took effect on the server: "
                 + esc({True: "yes (more requests running at the same level)", False: "NO sign of it",
                        None: "unknown (no server telemetry)"}.get(took, str(took))))
    if result.get("slo"):
        lines.append(f"SLO: {esc(format_slo(result['slo']))}")
    return table + "".join(f"<p>{x}</p>" for x in lines)


def _signed(v: Any) -> str:
    return f"{v:+,.1f}" if _finite(v) else "–"


def _per_level_compare(result: dict[str, Any], labels: dict[str, str]) -> str:
    rows = result.get("per_level") or []
    if not rows:
        return ""
    groups = ["out tok/s", "goodput tok/s", "Δ goodput 95% CI", "TTFT p95 ms", "TPOT p95 ms", "running max", "SLO"]
    head1 = '<tr><th rowspan="2">level</th>' + "".join(
        f'<th rowspan="2" class="num">{esc(g)}</th>' if g.startswith("Δ") else f'<th colspan="2">{esc(g)}</th>'
        for g in groups) + "</tr>"
    head2 = "<tr>" + "".join(f'<th class="num">{esc(labels[a])}</th>' for g in groups if not g.startswith("Δ")
                             for a in ARMS) + "</tr>"

    def pair(v: Any) -> list[Any]:
        return list(v) + [None] * (2 - len(v)) if isinstance(v, list) else [None, None]

    body = []
    for r in rows:
        ci = pair(r.get("goodput_delta_ci95"))
        cells = [*pair(r.get("output_tok_s")), *pair(r.get("goodput_tok_s"))]
        cells_txt = [fmtm(x) for x in cells] + [f"[{_signed(ci[0])}, {_signed(ci[1])}]"]
        cells_txt += [fmtm(x) for x in (*pair(r.get("ttft_p95_ms")), *pair(r.get("tpot_p95_ms")))]
        cells_txt += [fmt(x) for x in pair(r.get("server_running_max"))]
        slo = "".join(f"<td>{_slo_cell({'slo_ok': ok}, True)}</td>" for ok in pair(r.get("slo_ok")))
        body.append(f"<tr><td>{esc(_level_name(r.get('mode'), r.get('level')))}</td>"
                    + "".join(f'<td class="num">{esc(x)}</td>' for x in cells_txt) + slo + "</tr>")
    return ("<h3>Per-level comparison</h3><div class=\"scroll\"><table class=\"perlevel\"><thead>"
            + head1 + head2 + "</thead><tbody>" + "".join(body)
            + "</tbody></table></div>")


def _page(title: str, subtitle: str, body: Sequence[str]) -> str:
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
            "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'; "
            "img-src data:\">\n"
            f"<title>{esc(title)}</title>\n<style>{CSS}</style>\n</head>\n<body>\n<main>\n"
            f"<h1>{esc(title)}</h1>\n<p class=\"sub\">{subtitle}</p>\n" + "\n".join(body)
            + "\n<p class=\"muted\">Generated by kvcap. Self-contained: no network access needed.</p>\n"
            "</main>\n</body>\n</html>\n")


def _run_line(label: str, run: RunDir | None, manifest: dict[str, Any]) -> str:
    bits = [f"<b>{esc(label)}</b>"]
    if run is not None:
        bits.append(f"<code>{esc(run.dir)}</code>")
    models = (manifest.get("server") or {}).get("models") or [(manifest.get("fixed") or {}).get("model.name")]
    models = [m for m in models if m]
    if models:
        bits.append("model " + esc(", ".join(str(m) for m in models)))
    for k in ("source", "run_id"):
        if manifest.get(k):
            bits.append(f"{esc(k)} {esc(manifest[k])}")
    return " · ".join(bits)


# ---------------------------------------------------------------------------------------------------- entry points


def render_html(result: dict[str, Any], runs: dict[str, RunDir] | None = None, title: str = "kvcap report") -> str:
    """The compare report. ``result`` is what ``compare`` returns (or its saved JSON); ``runs`` — the two run
    directories keyed ``control``/``treatment`` — add time series and the full fixed-variable table."""
    rd = _coerce_runs(runs)
    summaries = _summaries(result, rd)
    manifests = {arm: (rd[arm].manifest if arm in rd else {}) for arm in ARMS}
    labels = {arm: _arm_label(result, arm) for arm in ARMS}
    arms = [Arm(arm, labels[arm], ARM_COLOURS[arm], summaries[arm], rd.get(arm)) for arm in ARMS]
    verdict = str(result.get("verdict", "unknown"))
    caveats = []
    if not (result.get("fixed_variables") or {}).get("equal", True):
        caveats.append("fixed variables differ between the arms — see the fixed-variable table")
    if result.get("treatment_took_effect") is False:
        caveats.append("no server-side sign that the treatment took effect")
    box = (f'<section class="verdict v-{esc(verdict)}"><div class="word">verdict: {esc(verdict)}</div>'
           f"<p>{esc(VERDICT_MEANING.get(verdict, 'Unknown verdict.'))}</p>"
           + "".join(f'<p class="caution">⚠ {esc(c)}</p>' for c in caveats) + "</section>")
    warnings = list(result.get("warnings") or [])
    findings = _findings(result.get("diagnosis") or [])
    for arm in ARMS:
        for w in (summaries[arm].get("client") or {}).get("warnings", []) or []:
            warnings.append(f"{arm}: {w}")
    notes = "".join(_findings(warnings))
    body = [
        box,
        '<h2 id="capacity">Capacity and goodput</h2>', _key_numbers(result, labels),
        '<h2 id="levels">Against load level</h2>',
        '<p class="muted">Markers: solid = effective capacity, dotted = resident, dashed = stress limit '
        "(C = control, T = treatment). Red dashed lines are SLO limits.</p>",
        _level_plots(arms, result.get("slo") or {}),
        '<h2 id="timeseries">Server over time</h2>', _time_series(arms),
        '<h2 id="nodes">Per node</h2>', _per_node(arms),
        '<h2 id="fixed">Fixed variables</h2>', _fixed_table(result, manifests),
        '<h2 id="diagnosis">Diagnosis and warnings</h2>',
        (f'<ul class="findings diagnosis">{"".join(findings)}</ul>' if findings
         else '<p class="muted">No diagnosis.</p>'),
        (f'<ul class="findings warnings">{notes}</ul>' if notes else '<p class="muted">No warnings.</p>'),
        '<h2 id="raw">Raw per-level results</h2>', _per_level_compare(result, labels),
        *(f"<h3>{esc(a.label)}</h3>{_raw_table(a.summary)}" for a in arms),
    ]
    sub = "<br>".join(_run_line(labels[arm], rd.get(arm), manifests[arm]) for arm in ARMS)
    return _page(title, sub, body)


def render_html_single(summary: dict[str, Any], run: RunDir | None = None, title: str = "kvcap report") -> str:
    """One run (``kvcap report DIR``): the same plots with one series, capacities instead of a verdict."""
    if run is not None and not isinstance(run, RunDir):
        run = RunDir(run)
    manifest = run.manifest if run is not None else {}
    label = str(summary.get("arm") or manifest.get("arm") or "run")
    arm = Arm("run", label, SINGLE_COLOUR, summary, run)
    cap = _cap(summary)
    levels = summary.get("levels") or []
    best = max((lv for lv in levels if _finite(lv.get("goodput_tok_s"))), key=lambda lv: lv["goodput_tok_s"],
               default=None)
    resident = fmt(cap.get("resident")) + ("+ (lower bound)" if cap.get("resident_lower_bound") else "")
    if cap.get("resident_source"):
        resident += f" ({cap['resident_source']})"
    rows = [("resident requests", resident), ("effective capacity (within SLO)", fmt(cap.get("effective"))),
            ("goodput tok/s (best level)",
             f"{fmtm(best['goodput_tok_s'])} @ {fmt(best['level'])}" if best else "–"),
            ("stress limit", fmt(cap.get("stress_limit"))), ("limited by", fmt(cap.get("limited_by")))]
    nums = ('<table class="keynums"><tbody>' + "".join(
        f'<tr><th>{esc(k)}</th><td class="num">{esc(v)}</td></tr>' for k, v in rows) + "</tbody></table>")
    if summary.get("slo"):
        nums += f"<p>SLO: {esc(format_slo(summary['slo']))}</p>"
    else:
        nums += '<p class="muted">No SLO given: effective capacity and goodput need one.</p>'
    warnings = list((summary.get("client") or {}).get("warnings") or [])
    if summary.get("interrupted"):
        warnings.append("interrupted: the summary covers the requests that finished")
    findings = _findings(summary.get("diagnosis") or [])
    notes = "".join(_findings(warnings))
    body = [
        '<h2 id="capacity">Capacity and goodput</h2>', nums,
        '<h2 id="levels">Against load level</h2>',
        '<p class="muted">Markers: solid = effective capacity, dotted = resident, dashed = stress limit. '
        "Red dashed lines are SLO limits.</p>",
        _level_plots([arm], summary.get("slo") or {}),
        '<h2 id="timeseries">Server over time</h2>', _time_series([arm]),
        '<h2 id="nodes">Per node</h2>', _per_node([arm]),
        '<h2 id="fixed">Fixed variables</h2>', _single_fixed_table(manifest),
        '<h2 id="diagnosis">Diagnosis and warnings</h2>',
        (f'<ul class="findings diagnosis">{"".join(findings)}</ul>' if findings
         else '<p class="muted">No diagnosis.</p>'),
        (f'<ul class="findings warnings">{notes}</ul>' if notes else '<p class="muted">No warnings.</p>'),
        '<h2 id="raw">Raw per-level results</h2>', _raw_table(summary),
    ]
    return _page(title, _run_line(label, run, manifest), body)


def write_html(path: str | Path, result: dict[str, Any], runs: dict[str, RunDir] | None = None,
               title: str = "kvcap report") -> Path:
    """Write the compare report; returns the path written."""
    p = Path(path)
    p.write_text(render_html(result, runs, title), encoding="utf-8")
    return p


def write_html_single(path: str | Path, summary: dict[str, Any], run: RunDir | None = None,
                      title: str = "kvcap report") -> Path:
    """Write the single-run report; returns the path written."""
    p = Path(path)
    p.write_text(render_html_single(summary, run, title), encoding="utf-8")
    return p
