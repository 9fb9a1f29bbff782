"""The output of ``kvcap search`` for people: the ranked terminal table and the search page (``search.html``:
the recommendation, the ranked table, the Pareto plot of effective capacity vs cost, one effect plot per knob).

Takes search.json's content and the point rows as plain data; the page is self-contained like every kvcap report.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvcap.report.charts import Series, VLine, svg_chart
from kvcap.report.console import make_console
from kvcap.report.format import esc, fmt, fmtm
from kvcap.report.html import _page

Row = dict[str, Any]
FRONT, OTHER, RESIDENT = "#e0661b", "#8a94a6", "#1f6fb4"
SCATTER = "0 100000"
"""A dash pattern that hides the line between points: the series draws as a scatter of its markers."""
COLUMNS = ("effective", "resident", "stress", "goodput tok/s", "limited by", "cost", "meets")


def short_key(key: str) -> str:
    return key.rsplit(".", 1)[-1]


def _marks(row: Row, search: dict[str, Any]) -> str:
    rec = {r["index"] for r in search.get("recommended") or []}
    front = {r["index"] for r in search.get("pareto") or []}
    return ("★" if row["index"] in rec else "") + ("P" if row["index"] in front else "")


def ranked_rows(search: dict[str, Any], rows: Sequence[Row]) -> list[Row]:
    by_index = {r["index"]: r for r in rows}
    return [by_index[i] for i in search.get("ranked") or [] if i in by_index]


def _cells(row: Row, keys: Sequence[str]) -> list[str]:
    return [*(str(row["point"].get(k)) for k in keys), fmt(row.get("effective")),
            fmt(row.get("resident")) + ("+" if row.get("resident_lower_bound") else ""), fmt(row.get("stress_limit")),
            fmtm(row.get("goodput_tok_s")), row.get("limited_by") or "–", fmt(row.get("cost")),
            "yes" if row.get("meets_target") else "no"]


def render_search(search: dict[str, Any], rows: Sequence[Row], console: Console | None = None) -> None:
    """The ranked table (★ recommended, P on the Pareto front), then the recommendation in words."""
    con = console or make_console()
    keys = list(search.get("grid") or {})
    t = Table(title=f"kvcap search: {search.get('finished')}/{search.get('points')} points, target "
                    f"{search.get('target_rule')}", title_justify="left")
    for col in ("#", *(short_key(k) for k in keys), *COLUMNS, ""):
        t.add_column(col, justify="right" if col in ("#", "effective", "resident", "stress", "goodput tok/s", "cost")
                     else "left")
    for rank, row in enumerate(ranked_rows(search, rows), 1):
        t.add_row(str(rank), *_cells(row, keys), _marks(row, search))
    con.print(t)
    con.print(recommendation_text(search))
    if search.get("interrupted"):
        con.print("[yellow]interrupted: the table covers the points that finished[/yellow]")


def point_text(point: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in point.items())


def recommendation_text(search: dict[str, Any]) -> str:
    rec = search.get("recommended") or []
    if not rec:
        return f"no point meets the target ({search.get('target_rule')})"
    return "recommended: " + "; ".join(f"{point_text(r['point'])} (effective {fmt(r.get('effective'))}, cost "
                                       f"{fmt(r.get('cost'))})" for r in rec)


# ---------------------------------------------------------------- the page

def pareto_chart(search: dict[str, Any], rows: Sequence[Row]) -> str:
    """Every point as a dot (effective vs cost), the front as a line through its points."""
    def tip(r: Row) -> str:
        return f"{point_text(r['point'])}: effective {fmt(r.get('effective'))}, cost {fmt(r.get('cost'))}"

    front = search.get("pareto") or []
    on_front = {r["index"] for r in front}
    others = [r for r in rows if r["index"] not in on_front]
    series = [Series("other points", OTHER, [(r["cost"], r.get("effective") or 0) for r in others], dash=SCATTER,
                     tips=[tip(r) for r in others]),
              Series("Pareto front", FRONT, [(r["cost"], r.get("effective") or 0) for r in front],
                     tips=[tip(r) for r in front])]
    return svg_chart("Effective capacity vs cost", series, x_label="cost", y_label="effective capacity (requests)")


def effect_chart(key: str, line: Sequence[Row], base: dict[str, Any]) -> str:
    """Effective and resident capacity over one key's values (x = the value's position), others at baseline."""
    xs = list(range(1, len(line) + 1))
    others = ", ".join(f"{short_key(k)}={v}" for k, v in base.items() if k != key) or "no other keys"
    series = [Series("effective", FRONT, [(x, p["effective"]) for x, p in zip(xs, line)]),
              Series("resident", RESIDENT, [(x, p["resident"]) for x, p in zip(xs, line)], dash="5,4")]
    marks = [VLine(x, str(p["value"]), OTHER, dash="2,3") for x, p in zip(xs, line)]
    return svg_chart(f"Effect of {key}", series, x_label=f"{key} (others at baseline: {others})",
                     y_label="requests", vlines=marks, x_ticks=xs)


def _table(search: dict[str, Any], rows: Sequence[Row]) -> str:
    keys = list(search.get("grid") or {})
    head = "".join(f"<th>{esc(h)}</th>" for h in ("#", *keys, *COLUMNS, "run"))
    body = []
    for rank, row in enumerate(ranked_rows(search, rows), 1):
        mark = _marks(row, search)
        cls = ' class="under-test"' if "★" in mark else ""
        cells = "".join(f"<td>{esc(c)}</td>" for c in (f"{rank} {mark}".strip(), *_cells(row, keys)))
        body.append(f"<tr{cls}>{cells}<td><code>{esc(row.get('run_dir'))}</code></td></tr>")
    return f'<div class="scroll"><table><tr>{head}</tr>\n' + "\n".join(body) + "</table></div>"


def render_search_html(search: dict[str, Any], rows: Sequence[Row], title: str = "kvcap search") -> str:
    base = search.get("baseline") or {}
    prices = search.get("prices") or {}
    rule = (f"cost = GPU count × {fmt(prices.get('gpu', 1.0))}"
            + "".join(f" + {fmt(p['cost'])} if {p['key']}={p['value']}" for p in prices.get("add") or []))
    body = [f"<h2>Recommendation</h2><p><b>{esc(recommendation_text(search))}</b></p>",
            f"<p class=\"muted\">Target: {esc(search.get('target_rule'))}. {esc(rule)}. Among equal costs the "
            "points that change the fewest keys from the baseline (the first value of each grid key). ★ recommended, "
            "P on the Pareto front.</p>"]
    if search.get("interrupted"):
        body.append('<p class="caution">Interrupted: these are the points that finished.</p>')
    body += ["<h2>Points, ranked</h2>", _table(search, rows),
             "<h2>Pareto front: effective capacity vs cost</h2>", f'<div class="plots">{pareto_chart(search, rows)}'
             "</div>", "<h2>Each knob's effect (the other keys at baseline)</h2>",
             '<div class="plots">' + "".join(effect_chart(k, line, base)
                                             for k, line in (search.get("effects") or {}).items()) + "</div>"]
    sub = (f"{esc(search.get('scenario'))} · {fmt(search.get('finished'))} of {fmt(search.get('points'))} points · "
           f"{esc(search.get('executor'))}")
    return _page(title, sub, body)


def write_search_html(path: str | Path, search: dict[str, Any], rows: Sequence[Row],
                      title: str = "kvcap search") -> None:
    Path(path).write_text(render_search_html(search, rows, title))
