"""From point rows to answers: which points meet the target, the recommendation, the Pareto front (effective
capacity vs cost), the ranking and each knob's effect. Pure functions over the rows of ``points.jsonl``.

- A point with no effective capacity (no level met the SLO) counts as 0.
- Without ``--target``, the target is the highest effective capacity any point reached.
- Recommended: the points that meet the target at the lowest cost; among equal costs, those that change the
  fewest grid keys from the baseline (a knob that buys nothing is not worth turning). Best effective first.
- Pareto: the points no other point beats on both axes (cost no higher and effective no lower, one strictly).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvcap.search.grid import Target

Row = dict[str, Any]


def effective_of(row: Row) -> float:
    v = row.get("effective")
    return float(v) if isinstance(v, (int, float)) else 0.0


def goodput_of(row: Row) -> float:
    v = row.get("goodput_tok_s")
    return float(v) if isinstance(v, (int, float)) else 0.0


def meets(row: Row, targets: Sequence[Target], rows: Sequence[Row]) -> bool:
    """Every target holds; with none, the point reaches the best effective capacity of ``rows``."""
    if targets:
        return all(t.holds(row) for t in targets)
    best = max((effective_of(r) for r in rows), default=0.0)
    return row.get("effective") is not None and effective_of(row) >= best


def changes(point: dict[str, Any], base: dict[str, Any]) -> int:
    """How many grid keys differ from the baseline."""
    return sum(1 for k, v in point.items() if base.get(k) != v)


def _best_first(row: Row) -> tuple[float, float, int]:
    return -effective_of(row), -goodput_of(row), int(row["index"])


def recommend(rows: Sequence[Row], base: dict[str, Any]) -> list[Row]:
    """The cheapest points with ``meets_target``, fewest changes from the baseline among equal costs."""
    ok = [r for r in rows if r.get("meets_target")]
    if not ok:
        return []
    cheapest = min(r["cost"] for r in ok)
    tied = [r for r in ok if r["cost"] == cheapest]
    fewest = min(changes(r["point"], base) for r in tied)
    return sorted((r for r in tied if changes(r["point"], base) == fewest), key=_best_first)


def pareto(rows: Sequence[Row]) -> list[Row]:
    """Non-dominated on (cost ↓, effective ↑), cheapest first."""
    def dominated(r: Row) -> bool:
        return any(o["cost"] <= r["cost"] and effective_of(o) >= effective_of(r)
                   and (o["cost"] < r["cost"] or effective_of(o) > effective_of(r)) for o in rows)
    return sorted((r for r in rows if not dominated(r)), key=lambda r: (r["cost"], *_best_first(r)))


def ranked(rows: Sequence[Row], recommended: Sequence[Row] = ()) -> list[Row]:
    """The table's order: the recommendation, then the other points meeting the target, then the rest; within
    each, cheapest first, then best effective capacity and goodput."""
    first = {r["index"] for r in recommended}
    return sorted(rows, key=lambda r: (r["index"] not in first, not r.get("meets_target"), r["cost"],
                                       *_best_first(r)))


def knob_effects(rows: Sequence[Row], grid: dict[str, list[Any]], base: dict[str, Any]) -> dict[str, list[Row]]:
    """Per grid key: its values with every other key at the baseline, and what each point measured there."""
    out: dict[str, list[Row]] = {}
    for key, values in grid.items():
        line = []
        for v in values:
            want = {**base, key: v}
            row = next((r for r in rows if r["point"] == want), None)
            line.append({"value": v, "index": row["index"] if row else None,
                         **{f: row.get(f) if row else None for f in ("effective", "resident", "goodput_tok_s")}})
        out[key] = line
    return out
