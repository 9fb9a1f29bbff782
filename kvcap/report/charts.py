"""A small line-chart library that writes inline SVG, so the HTML report needs no script, font or CDN and opens
offline years later.

Pure: data classes in, SVG text out; it knows nothing of run directories or the analysis. Every label is
untrusted text and goes through :func:`esc`, inside ``<text>`` and ``<title>`` too. A chart is drawn in steps —
layout, shaded bands, axes and ticks, reference lines, vertical markers, data, legend — each its own function.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from kvcap.report.format import esc, fmt, is_finite

HALO = 'paint-order="stroke" stroke="#fff" stroke-width="3" stroke-linejoin="round"'
"""A white outline under labels drawn over data, so they stay readable where a line crosses them."""
MAX_POINTS = 2000
"""Time series are thinned to this many points per series: the plot stays small, the shape stays."""
LEFT, RIGHT = 66, 18
"""Plot margins (px): room for the y tick labels on the left, a little air on the right."""
LABEL_STRIP_TOP = 34
"""Where the plot (or the strip of marker labels above it) starts, below the title."""


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
    """A vertical marker at ``x`` (a capacity, a level start), its label in a strip above the plot."""

    x: float
    label: str
    colour: str
    dash: str | None = None


@dataclass
class HLine:
    """A horizontal reference line at ``y`` (an SLO limit), labelled at the right end."""

    y: float
    label: str
    colour: str = "#c62828"


@dataclass
class Band:
    """A shaded span of x (a measured window)."""

    x0: float
    x1: float
    label: str = ""


@dataclass
class LegendItem:
    """One legend entry: a line sample (dashed or not, with a dot if the series has markers) or a shaded box."""

    label: str
    colour: str
    dash: str | None = None
    marker: bool = False
    box: bool = False


@dataclass(frozen=True)
class Frame:
    """Where a chart's plot area lies (px) and which data range it shows; maps data to pixel coordinates."""

    width: int
    height: int
    top: int
    bottom: int
    x0: float = 0.0
    x1: float = 1.0
    y0: float = 0.0
    y1: float = 1.0

    def sx(self, x: float) -> float:
        return round(LEFT + (x - self.x0) / (self.x1 - self.x0) * (self.width - LEFT - RIGHT), 2)

    def sy(self, y: float) -> float:
        return round(self.bottom - (y - self.y0) / (self.y1 - self.y0) * (self.bottom - self.top), 2)


LegendRow = list[tuple[LegendItem, float]]


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
    ticks: list[float] = []
    v = start
    while v <= hi + 1e-9 * step and len(ticks) < 50:
        ticks.append(round(v, 10))
        v += step
    return ticks


def thin(points: list[tuple[float, float]], max_points: int = MAX_POINTS) -> list[tuple[float, float]]:
    """Every k-th point, k the smallest step that leaves at most ``max_points`` (the first point always stays)."""
    if len(points) > max_points:
        step = math.ceil(len(points) / max_points)
        points = points[::step]
    return points


def tick_label(v: float) -> str:
    """A tick value: thousands separated from 1,000 up, otherwise the shortest form (``2.5``, ``0.01``)."""
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:g}"


def clip(text: str, px: float, char_px: float = 7.8) -> str:
    """Shorten a label to about ``px`` pixels (an ellipsis at the end); the full text stays in the <title>."""
    n = max(int(px / char_px), 4)
    return text if len(text) <= n else text[: n - 1] + "…"


def legend_rows(items: Sequence[LegendItem], width: int) -> list[LegendRow]:
    """Legend items laid out left to right, wrapping to a new row where the next one would pass the right margin;
    each item with the x where it starts."""
    rows: list[LegendRow] = [[]]
    x_cursor: float = LEFT
    for it in items:
        w = 30 + 6.6 * len(it.label) + 14
        if x_cursor + w > width - RIGHT and rows[-1]:
            rows.append([])
            x_cursor = LEFT
        rows[-1].append((it, x_cursor))
        x_cursor += w
    return [r for r in rows if r]


def marker_strip(vlines: Sequence[VLine]) -> int:
    """Height (px) of the strip above the plot that holds marker labels: one 11 px row per label stacked at an x."""
    counts: dict[float, int] = defaultdict(int)
    for v in vlines:
        if v.label and is_finite(v.x):
            counts[v.x] += 1
    return 11 * max(counts.values(), default=0)


def layout(width: int, height: int, strip: int, legend_row_count: int) -> Frame:
    """The plot area: below the title and marker strip, above the x axis labels and the legend (which grow the
    chart rather than squeeze the plot)."""
    top = LABEL_STRIP_TOP + strip + (4 if strip else 0)
    legend_h = 18 * legend_row_count
    height = max(height, 220) + max(legend_h - 18, 0) + strip
    return Frame(width=width, height=height, top=top, bottom=height - 56 - legend_h)


def fit_ranges(frame: Frame, xs: Sequence[float], ys: Sequence[float]) -> tuple[Frame, list[float]]:
    """The frame with its data ranges — x over the data with 4 % air, y from 0 (or below, if data is) to 8 % above
    the largest value, stretched to the last round tick — and the y ticks."""
    x0, x1 = min(xs), max(xs)
    if x1 <= x0:
        x0, x1 = x0 - 1, x1 + 1
    pad = (x1 - x0) * 0.04
    y1 = max(ys) * 1.08 if max(ys) > 0 else 1.0
    y0 = min(0.0, min(ys))
    ticks_y = nice_ticks(y0, y1)
    if ticks_y:
        y1 = max(y1, ticks_y[-1])
    return replace(frame, x0=x0 - pad, x1=x1 + pad, y0=y0, y1=y1), ticks_y


def svg_open(title: str, frame: Frame, css_class: str) -> list[str]:
    """The <svg> element with its accessible name, <title> tooltip and the visible (clipped) title."""
    return [f'<svg class="{esc(css_class)}" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {frame.width} '
            f'{frame.height}" role="img" aria-label="{esc(title)}">', f"<title>{esc(title)}</title>",
            f'<text x="{LEFT}" y="20" font-size="14" font-weight="600" fill="#1d2330">'
            f"{esc(clip(title, frame.width - LEFT))}</text>"]


def no_data(frame: Frame) -> str:
    """The placeholder drawn (and the svg closed) when nothing plottable came."""
    return (f'<text x="{frame.width / 2}" y="{(frame.top + frame.bottom) / 2}" text-anchor="middle" fill="#5b6472" '
            f'font-size="13">no data</text></svg>')


def bands_svg(frame: Frame, bands: Sequence[Band]) -> list[str]:
    """Shaded spans, drawn first so everything else lies on top; each label at the span's top left."""
    out = []
    for b in bands:
        out.append(f'<rect x="{frame.sx(b.x0)}" y="{frame.top}" width="{max(frame.sx(b.x1) - frame.sx(b.x0), 0.5)}" '
                   f'height="{frame.bottom - frame.top}" fill="#1d2330" fill-opacity="0.06"/>')
        if b.label:
            out.append(f'<text x="{frame.sx(b.x0) + 3}" y="{frame.top + 11}" font-size="10" fill="#5b6472">'
                       f"{esc(b.label)}</text>")
    return out


def axes_svg(frame: Frame, ticks_y: Sequence[float], x_ticks: Sequence[float] | None, x_label: str,
             y_label: str) -> list[str]:
    """Horizontal grid lines with y tick labels, x ticks (given, or round ones) inside the range, both axes and
    their labels."""
    f, right_edge = frame, frame.width - RIGHT
    out = []
    for t in ticks_y:
        out.append(f'<line x1="{LEFT}" x2="{right_edge}" y1="{f.sy(t)}" y2="{f.sy(t)}" stroke="#eceff3"/>')
        out.append(f'<text x="{LEFT - 6}" y="{f.sy(t) + 4}" font-size="11" text-anchor="end" fill="#5b6472">'
                   f"{esc(tick_label(t))}</text>")
    tx = [t for t in (x_ticks if x_ticks is not None else nice_ticks(f.x0, f.x1, 6)) if f.x0 <= t <= f.x1]
    for t in tx:
        out.append(f'<line x1="{f.sx(t)}" x2="{f.sx(t)}" y1="{f.bottom}" y2="{f.bottom + 4}" stroke="#5b6472"/>')
        out.append(f'<text x="{f.sx(t)}" y="{f.bottom + 17}" font-size="11" text-anchor="middle" fill="#5b6472">'
                   f"{esc(tick_label(t))}</text>")
    out.append(f'<line x1="{LEFT}" x2="{right_edge}" y1="{f.bottom}" y2="{f.bottom}" stroke="#5b6472"/>')
    out.append(f'<line x1="{LEFT}" x2="{LEFT}" y1="{f.top}" y2="{f.bottom}" stroke="#5b6472"/>')
    out.append(f'<text x="{(LEFT + right_edge) / 2}" y="{f.bottom + 34}" font-size="12" text-anchor="middle" '
               f'fill="#1d2330">{esc(x_label)}</text>')
    out.append(f'<text transform="translate(16 {(f.top + f.bottom) / 2}) rotate(-90)" font-size="12" '
               f'text-anchor="middle" fill="#1d2330">{esc(y_label)}</text>')
    return out


def hlines_svg(frame: Frame, hlines: Sequence[HLine]) -> list[str]:
    """Dashed reference lines across the plot, each labelled at its right end."""
    right_edge = frame.width - RIGHT
    out = []
    for h in hlines:
        if not is_finite(h.y):
            continue
        y = frame.sy(h.y)
        out.append(f'<line class="slo-line" x1="{LEFT}" x2="{right_edge}" y1="{y}" y2="{y}" '
                   f'stroke="{esc(h.colour)}" stroke-width="1.5" stroke-dasharray="6,4"><title>{esc(h.label)}</title>'
                   f"</line>")
        out.append(f'<text x="{right_edge - 4}" y="{y - 4}" font-size="10.5" text-anchor="end" '
                   f'fill="{esc(h.colour)}" {HALO}>{esc(h.label)}</text>')
    return out


def vlines_svg(frame: Frame, vlines: Sequence[VLine]) -> list[str]:
    """Vertical markers over the plot height; labels stacked in the strip above (one row per label at the same x),
    right-aligned near the right edge so they stay inside."""
    stacked: dict[float, int] = defaultdict(int)
    out = []
    for v in vlines:
        if not is_finite(v.x):
            continue
        k = stacked[v.x]
        stacked[v.x] += bool(v.label)
        x = frame.sx(v.x)
        dash = f' stroke-dasharray="{esc(v.dash)}"' if v.dash else ""
        out.append(f'<line class="marker" x1="{x}" x2="{x}" y1="{frame.top}" y2="{frame.bottom}" '
                   f'stroke="{esc(v.colour)}" stroke-width="1.3" stroke-opacity="0.85"{dash}>'
                   f"<title>{esc(v.label)} = {esc(fmt(v.x))}</title></line>")
        if v.label:
            at_right = x > frame.width - RIGHT - 60
            anchor = ' text-anchor="end"' if at_right else ""
            out.append(f'<text x="{x + (-3 if at_right else 3)}" y="{LABEL_STRIP_TOP + 9 + 11 * k}" font-size="10"'
                       f'{anchor} fill="{esc(v.colour)}" {HALO}>{esc(v.label)}</text>')
    return out


def series_svg(frame: Frame, series: Sequence[Series]) -> list[str]:
    """Each series as a polyline over its finite points, plus a dot per point with its tooltip if it has markers
    (the series' own tips when there is one per point, else ``x → y``)."""
    out = []
    for s in series:
        good = [(x, y) for x, y in s.points if is_finite(x) and is_finite(y)]
        if not good:
            continue
        dash = f' stroke-dasharray="{esc(s.dash)}"' if s.dash else ""
        path = " ".join(f"{frame.sx(x)},{frame.sy(y)}" for x, y in good)
        out.append(f'<polyline class="series" points="{path}" fill="none" stroke="{esc(s.colour)}" '
                   f'stroke-width="2"{dash}><title>{esc(s.name)}</title></polyline>')
        if s.markers:
            tips = s.tips if len(s.tips) == len(s.points) else [""] * len(s.points)
            for (x, y), tip in zip(s.points, tips):
                if is_finite(x) and is_finite(y):
                    out.append(f'<circle cx="{frame.sx(x)}" cy="{frame.sy(y)}" r="3.2" fill="{esc(s.colour)}">'
                               f"<title>{esc(s.name)}: {esc(tip or f'{fmt(x)} → {fmt(y)}')}</title></circle>")
    return out


def legend_svg(frame: Frame, rows: Sequence[LegendRow]) -> list[str]:
    """The legend rows below the x axis label: a line (or box) sample, a dot for marked series, the label."""
    out = []
    for i, row in enumerate(rows):
        y = frame.bottom + 52 + 18 * i
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
    return out


def svg_chart(title: str, series: Sequence[Series], *, x_label: str, y_label: str,
              hlines: Sequence[HLine] = (), vlines: Sequence[VLine] = (), bands: Sequence[Band] = (),
              x_ticks: Sequence[float] | None = None, legend_extra: Sequence[LegendItem] = (),
              width: int = 560, height: int = 320, css_class: str = "plot") -> str:
    """A line chart as inline SVG, y from 0: reference lines (SLO), markers (capacities) and shaded bands
    (measured windows) drawn under the data. No external anything, so it renders offline and in any browser."""
    pts = [p for s in series for p in s.points if is_finite(p[0]) and is_finite(p[1])]
    xs = [p[0] for p in pts] + [v.x for v in vlines if is_finite(v.x)]
    xs += [b for band in bands for b in (band.x0, band.x1)]
    ys = [p[1] for p in pts] + [h.y for h in hlines if is_finite(h.y)]
    # legend first: its rows decide the height
    items = [LegendItem(s.name, s.colour, s.dash, s.markers) for s in series]
    items += [LegendItem(h.label, h.colour, "6,4") for h in hlines] + list(legend_extra)
    rows = legend_rows(items, width)
    frame = layout(width, height, marker_strip(vlines), len(rows))
    out = svg_open(title, frame, css_class)
    if not pts:
        out.append(no_data(frame))
        return "\n".join(out)
    frame, ticks_y = fit_ranges(frame, xs, ys)
    out += bands_svg(frame, bands)
    out += axes_svg(frame, ticks_y, x_ticks, x_label, y_label)
    out += hlines_svg(frame, hlines)
    out += vlines_svg(frame, vlines)
    out += series_svg(frame, series)
    out += legend_svg(frame, rows)
    out.append("</svg>")
    return "\n".join(out)
