"""The inline-SVG chart primitives of ``kvcap.report.charts`` against values worked out by hand.

The reference chart is 624 × 324 px with one series from (0, 0) to (25, 100) and one legend row, chosen so the
pixel arithmetic is round:

- margins: left 66, right 18 → the plot is 540 px wide; top 34 (title, no marker strip), bottom
  324 − 56 − 18 (one legend row) = 250 → 216 px high;
- x range 0…25 padded by 4 % (1 unit) each side → −1…26, 27 units over 540 px = 20 px a unit, so sx(x) = 86 + 20x;
- y from 0 to 100 × 1.08 = 108 (above the last tick, 100), 216 px / 108 = 2 px a unit, so sy(y) = 250 − 2y.
"""

from __future__ import annotations

import re

import pytest

from kvcap.report.charts import (
    LEFT,
    MAX_POINTS,
    Band,
    Frame,
    HLine,
    LegendItem,
    Series,
    VLine,
    clip,
    fit_ranges,
    layout,
    legend_rows,
    marker_strip,
    nice_ticks,
    svg_chart,
    thin,
    tick_label,
)

REF = {"x_label": "x", "y_label": "y", "width": 624, "height": 324}


def ref_series(**kw) -> Series:
    return Series("a", "#123456", [(0, 0), (25, 100)], **{"markers": False, **kw})


def sx(x: float) -> float:
    """The reference chart's x pixel (a float, as the SVG writes it: ``86.0``)."""
    return 86.0 + 20 * x


def sy(y: float) -> float:
    return 250.0 - 2 * y


@pytest.mark.parametrize(("lo", "hi", "n", "ticks"), [
    (0, 97, 5, [0, 20, 40, 60, 80]),  # raw step 19.4 → 20
    (0, 1, 5, [0, 0.2, 0.4, 0.6, 0.8, 1.0]),  # raw 0.2 → 0.2, float drift rounded away (0.6, not 0.6000000000000001)
    (-3, 7, 4, [-2.5, 0, 2.5, 5]),  # raw 2.5 → 2.5; starts at the first multiple ≥ lo
    (5, 5, 5, [5, 6, 7, 8, 9, 10]),  # an empty range widens to [lo, 2·lo]
    (0, 108, 5, [0, 25, 50, 75, 100]),  # raw 21.6 → 25
])
def test_nice_ticks(lo, hi, n, ticks):
    assert nice_ticks(lo, hi, n) == ticks


def test_nice_ticks_of_non_finite_range_is_empty():
    assert nice_ticks(float("nan"), 1) == [] and nice_ticks(0, float("inf")) == []


def test_tick_label_and_clip():
    assert [tick_label(v) for v in (12345.0, 2.5, 0.01, 100.0)] == ["12,345", "2.5", "0.01", "100"]
    assert clip("abcdefghij", 40) == "abcd…"  # 40 px / 7.8 px per char → 5 chars, the last an ellipsis
    assert clip("abc", 40) == "abc" and clip("abcdefghij", 1) == "abc…"  # never under 4 chars


def test_layout_and_ranges_give_the_reference_frame():
    frame = layout(624, 324, strip=0, legend_row_count=1)
    assert (frame.top, frame.bottom, frame.height) == (34, 250, 324)
    frame, ticks = fit_ranges(frame, [0, 25], [0, 100])
    assert (frame.x0, frame.x1, frame.y0, frame.y1) == (-1, 26, 0, pytest.approx(108))
    assert ticks == [0, 25, 50, 75, 100]
    assert [frame.sx(x) for x in (-1, 0, 12.5, 25, 26)] == [66, 86, 336, 586, 606]
    assert [frame.sy(y) for y in (0, 50, 100, 108)] == [250, 150, 50, 34]


def test_legend_rows_and_marker_strip_grow_the_chart():
    frame = layout(624, 324, strip=22, legend_row_count=3)
    # two extra legend rows (18 px each) and the 22 px strip are added, the plot keeps its height
    assert (frame.top, frame.height, frame.bottom) == (34 + 22 + 4, 324 + 36 + 22, 324 + 36 + 22 - 56 - 54)
    assert layout(624, 100, 0, 1).height == 220  # never lower than 220 px


def test_fit_ranges_single_x_and_negative_y():
    frame, ticks = fit_ranges(Frame(624, 324, 34, 250), [5, 5], [-10, 0])
    assert (frame.x0, frame.x1) == (pytest.approx(3.92), pytest.approx(6.08))  # 4…6 padded by 0.08
    assert (frame.y0, frame.y1) == (-10, 1.0)  # max ≤ 0 → the top is 1
    assert ticks == [-10, -7.5, -5, -2.5, 0]  # 11 units / 5 = 2.2 → a 2.5 step


def test_series_maps_points_to_pixels():
    svg = svg_chart("t", [ref_series()], **REF)
    assert f'<polyline class="series" points="{sx(0)},{sy(0)} {sx(25)},{sy(100)}"' in svg
    assert 'points="86.0,250.0 586.0,50.0"' in svg and "<circle" not in svg
    # y grid at the round ticks, x ticks at 0, 5, …, 25
    assert re.findall(r'<line x1="66" x2="606" y1="([\d.]+)"', svg) == ["250.0", "200.0", "150.0", "100.0", "50.0",
                                                                       "250"]
    assert [float(x) for x in re.findall(r'<text x="([\d.]+)" y="267"', svg)] == [sx(x) for x in range(0, 30, 5)]
    assert svg.startswith('<svg class="plot" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 624 324"')
    assert svg.endswith("</svg>")


def test_non_finite_points_are_skipped():
    svg = svg_chart("t", [Series("a", "#123456", [(0, 0), (5, float("nan")), (None, 3), (25, 100)],
                                 tips=["first", "bad", "bad", "last"])], **REF)
    assert 'points="86.0,250.0 586.0,50.0"' in svg
    # one marker per finite point, with the series' own tooltip
    assert re.findall(r'<circle cx="([\d.]+)" cy="([\d.]+)" r="3.2"', svg) == [("86.0", "250.0"), ("586.0", "50.0")]
    assert "<title>a: first</title>" in svg and "<title>a: last</title>" in svg and "a: bad" not in svg


def test_markers_without_matching_tips_show_x_and_y():
    svg = svg_chart("t", [ref_series(markers=True, tips=["only one"])], **REF)
    assert "<title>a: 0 → 0</title>" in svg and "<title>a: 25 → 100</title>" in svg


def test_hline_lands_at_its_value():
    svg = svg_chart("t", [ref_series()], hlines=[HLine(50, "SLO ≤ 50 ms")], **REF)
    assert (f'<line class="slo-line" x1="66" x2="606" y1="{sy(50)}" y2="{sy(50)}" stroke="#c62828" '
            'stroke-width="1.5" stroke-dasharray="6,4"><title>SLO ≤ 50 ms</title></line>') in svg
    assert f'<text x="602" y="{sy(50) - 4}" font-size="10.5" text-anchor="end"' in svg  # labelled at the right end
    assert '<text class="legend" x="' in svg and ">SLO ≤ 50 ms</text>" in svg  # and in the legend


def test_hline_above_the_data_raises_the_axis():
    svg = svg_chart("t", [ref_series()], hlines=[HLine(200, "cap")], **REF)
    # y now runs to 200 × 1.08 = 216 (ticks 0…200 by 50): 1 px a unit, the line at 250 − 200, the data's top at 150
    assert 'class="slo-line" x1="66" x2="606" y1="50.0" y2="50.0"' in svg
    assert 'points="86.0,250.0 586.0,150.0"' in svg and ">200</text>" in svg


def test_vline_lands_at_its_x_and_labels_stack():
    svg = svg_chart("t", [ref_series()], vlines=[VLine(12.5, "eff", "#00f"), VLine(12.5, "res", "#0f0", "2,3"),
                                                 VLine(25, "stress", "#f00")], **REF)
    # two labels at one x: a 22 px strip above the plot (top 34 + 22 + 4 = 60), the chart 22 px taller
    assert 'viewBox="0 0 624 346"' in svg
    assert '<line class="marker" x1="336.0" x2="336.0" y1="60" y2="272" stroke="#00f"' in svg
    assert 'stroke-opacity="0.85" stroke-dasharray="2,3"><title>res = 12.5</title>' in svg
    assert re.search(r'<text x="339.0" y="43" font-size="10" fill="#00f" [^>]*>eff</text>', svg)
    assert re.search(r'<text x="339.0" y="54" font-size="10" fill="#0f0" [^>]*>res</text>', svg)
    # near the right edge the label is right-aligned, to the left of the line
    assert re.search(r'<text x="583.0" y="43" font-size="10" text-anchor="end" fill="#f00" [^>]*>stress</text>', svg)


def test_unlabelled_vlines_take_no_strip():
    assert marker_strip([VLine(1, "", "#000"), VLine(1, "", "#000")]) == 0
    assert marker_strip([VLine(1, "a", "#000"), VLine(1, "b", "#000"), VLine(2, "c", "#000")]) == 22
    assert marker_strip([VLine(float("nan"), "a", "#000")]) == 0


def test_band_spans_its_x_range_over_the_plot_height():
    svg = svg_chart("t", [ref_series()], bands=[Band(5, 10, "c=4"), Band(20, 20)], **REF)
    assert f'<rect x="{sx(5)}" y="34" width="{sx(10) - sx(5)}" height="216" fill="#1d2330" fill-opacity="0.06"/>' in svg
    assert f'<text x="{sx(5) + 3}" y="45" font-size="10" fill="#5b6472">c=4</text>' in svg
    assert f'<rect x="{sx(20)}" y="34" width="0.5" height="216"' in svg  # an empty span stays visible
    assert svg.index("<rect") < svg.index("<polyline")  # under the data


def test_legend_holds_every_item_and_wraps():
    items = [LegendItem("abc", "#000")] * 4
    rows = legend_rows(items, width=300)
    # each item 30 + 6.6 × 3 + 14 = 63.8 px: three fit before 300 − 18, the fourth wraps
    assert [[x for _, x in row] for row in rows] == [[LEFT, pytest.approx(129.8), pytest.approx(193.6)], [LEFT]]
    assert legend_rows([], 300) == []
    svg = svg_chart("t", [ref_series(), Series("b", "#654321", [(1, 1)], dash="5,3")], hlines=[HLine(10, "limit")],
                    legend_extra=[LegendItem("window", "#ccc", box=True), LegendItem("start", "#888", "3,3")], **REF)
    assert re.findall(r'<text class="legend"[^>]*>([^<]*)</text>', svg) == ["a", "b", "limit", "window", "start"]
    assert '<rect x="' in svg and 'width="22" height="11" fill="#1d2330" fill-opacity="0.1"/>' in svg  # the box
    assert 'stroke="#654321" stroke-width="2" stroke-dasharray="5,3"/>' in svg  # a dashed sample for b
    assert '<circle cx="' in svg and 'r="3" fill="#654321"/>' in svg  # b has markers: a dot on its sample


def test_title_and_labels_are_escaped():
    svg = svg_chart("<&> title", [Series("s<b>", "#000", [(0, 1)])], x_label="x<", y_label="y&",
                    hlines=[HLine(1, "<h>")], vlines=[VLine(0, "<v>", "#000")], bands=[Band(0, 1, "<band>")],
                    legend_extra=[LegendItem("<e>", "#000")])
    assert 'aria-label="&lt;&amp;&gt; title"' in svg and "<title>&lt;&amp;&gt; title</title>" in svg
    for raw in ("<&>", "s<b>", "x<", "y&<", "<h>", "<v>", "<band>", "<e>"):
        assert raw not in svg, raw
    assert ">&lt;band&gt;</text>" in svg and ">&lt;e&gt;</text>" in svg


def test_no_data():
    svg = svg_chart("empty", [Series("a", "#000", [(float("nan"), 1)])], x_label="x", y_label="y")
    assert "no data" in svg and "<polyline" not in svg and svg.endswith("</svg>")
    assert '<text x="280.0" y="' in svg  # centred across the default 560 px


def test_thinning():
    pts = [(float(i), float(i)) for i in range(2 * MAX_POINTS + 1)]  # 4001 points → every 3rd
    thinned = thin(pts)
    assert len(thinned) == 1334 <= MAX_POINTS
    assert thinned[0] == pts[0] and thinned[1] == pts[3] and thinned[-1] == pts[3999]
    odd = pts[:MAX_POINTS + 1]  # 2001 points → every 2nd, which ends on the last
    assert thin(odd)[0] == odd[0] and thin(odd)[-1] == odd[-1] and len(thin(odd)) == 1001
    short = pts[:MAX_POINTS]
    assert thin(short) == short  # at the limit: untouched
    assert thin(pts, max_points=2) == [pts[0], pts[2001]]
