"""What ``kvcap search`` is asked: the grid (``--grid KEY=V1,V2``), the target (``--target effective>=N``) and
the prices (``--price KEY=VALUE=COST``), parsed and checked once before any point runs. Pure functions.

A grid value is read as YAML, exactly as ``--set KEY=VALUE`` reads it (``fp8`` a string, ``4`` a number,
``[8,16]`` a list), so a grid point is a set of ``--set`` overrides. Commas inside ``[…]``/``{…}`` or quotes do
not split values.

Cost of a point = its GPU count (``cluster.nodes × cluster.gpus_per_node``) × the GPU price (``--price gpu=COST``,
default 1) + the COST of every ``--price KEY=VALUE=COST`` whose KEY takes that VALUE at the point.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass
from typing import Any

from kvcap.errors import InputError
from kvcap.specs.scenario import parse_set

METRICS = {"effective": "effective", "goodput": "goodput_tok_s"}
"""Target names → the point-row field they test (the analysis' effective capacity; compare's best goodput)."""
_TARGET = re.compile(r"^\s*(\w+)\s*>=\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*$")


@dataclass(frozen=True)
class Target:
    """``metric >= value`` on a point's row."""

    metric: str
    value: float

    @property
    def field(self) -> str:
        return METRICS[self.metric]

    @property
    def text(self) -> str:
        return f"{self.metric}>={self.value:g}"

    def holds(self, row: dict[str, Any]) -> bool:
        v = row.get(self.field)
        return isinstance(v, (int, float)) and v >= self.value


@dataclass(frozen=True)
class Prices:
    """The cost rule: per-GPU price plus (key, value) → added cost."""

    gpu: float = 1.0
    extra: tuple[tuple[str, Any, float], ...] = ()

    def cost(self, point: dict[str, Any], gpus: int) -> float:
        return round(gpus * self.gpu + sum(c for k, v, c in self.extra if point.get(k) == v), 9)

    def as_json(self) -> dict[str, Any]:
        return {"gpu": self.gpu, "add": [{"key": k, "value": v, "cost": c} for k, v, c in self.extra],
                "rule": "GPU count × gpu + the cost of each KEY=VALUE the point takes"}


def split_values(text: str) -> list[str]:
    """``"a,[1,2],'x,y'"`` → ``["a", "[1,2]", "'x,y'"]``: commas split only outside brackets and quotes."""
    out, cur, depth, quote = [], [], 0, ""
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append("".join(cur))
            cur = []
            continue
        cur.append(ch)
    out.append("".join(cur))
    return [v.strip() for v in out]


def yaml_value(key: str, raw: str) -> Any:
    """A value as ``--set`` reads it."""
    return parse_set([f"{key}={raw}"])[key]


def parse_grid(items: list[str] | None) -> dict[str, list[Any]]:
    """``["model.kv_dtype=fp16,fp8", …]`` → {key: [values]}, keys in the order given."""
    if not items:
        raise InputError("give at least one --grid KEY=V1,V2")
    grid: dict[str, list[Any]] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise InputError(f"--grid expects KEY=V1,V2,…, got {item!r}")
        if key in grid:
            raise InputError(f"--grid {key} given twice: list all its values in one --grid")
        raws = split_values(raw)
        if any(not r for r in raws):
            raise InputError(f"--grid {key} has an empty value in {raw!r}")
        values = [yaml_value(key, r) for r in raws]
        if len({repr(v) for v in values}) != len(values):
            raise InputError(f"--grid {key} repeats a value: {raw!r}")
        grid[key] = values
    return grid


def expand(grid: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """Every combination, the first key varying slowest (the grid order of points.jsonl)."""
    keys = list(grid)
    return [dict(zip(keys, combo)) for combo in itertools.product(*grid.values())]


def baseline(grid: dict[str, list[Any]]) -> dict[str, Any]:
    """The first value of every key: what the per-knob effects hold the other keys at."""
    return {k: v[0] for k, v in grid.items()}


def parse_targets(items: list[str] | None) -> list[Target]:
    """``["effective>=96", "goodput>=2000"]`` → targets that must all hold."""
    out = []
    for item in items or []:
        for part in (p for p in item.split(",") if p.strip()):
            m = _TARGET.match(part)
            if not m or m.group(1) not in METRICS:
                raise InputError(f"--target expects effective>=N or goodput>=X (tok/s), got {part.strip()!r}")
            out.append(Target(m.group(1), float(m.group(2))))
    return out


def parse_prices(items: list[str] | None, grid: dict[str, list[Any]]) -> Prices:
    """``["gpu=2.5", "serving.kv_offload=remote=1.5"]`` → the cost rule. KEY must be a --grid key and VALUE one of
    its values (a typo would otherwise silently cost nothing)."""
    gpu, extra = 1.0, []
    for item in items or []:
        head, sep, cost_text = item.rpartition("=")
        cost = _cost(cost_text, item) if sep else None
        if cost is None or not head:
            raise InputError(f"--price expects KEY=VALUE=COST or gpu=COST, got {item!r}")
        if head.strip() == "gpu":
            gpu = cost
            continue
        key, sep, raw = head.partition("=")
        key = key.strip()
        if not sep or not raw.strip():
            raise InputError(f"--price expects KEY=VALUE=COST or gpu=COST, got {item!r}")
        if key not in grid:
            raise InputError(f"--price {key}: not a --grid key (grid keys: {', '.join(grid)})")
        value = yaml_value(key, raw.strip())
        if value not in grid[key]:
            raise InputError(f"--price {key}={raw.strip()}: not one of its grid values "
                             f"({', '.join(str(v) for v in grid[key])})")
        extra.append((key, value, cost))
    return Prices(gpu, tuple(extra))


def _cost(text: str, item: str) -> float | None:
    try:
        cost = float(text)
    except ValueError:
        return None
    if not math.isfinite(cost) or cost < 0:
        raise InputError(f"--price cost must be a finite number >= 0, got {item!r}")
    return cost


def point_name(index: int, point: dict[str, Any]) -> str:
    """A folder name for a point: its index, then each key's last part and value, filesystem-safe."""
    parts = [f"{k.rsplit('.', 1)[-1]}={v}" for k, v in point.items()]
    return re.sub(r"[^A-Za-z0-9.=+_-]+", "-", f"{index:03d}_" + "_".join(parts))[:120]
