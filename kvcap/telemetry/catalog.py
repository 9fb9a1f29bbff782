"""One vocabulary for server, GPU and host metrics, whatever the engine: raw Prometheus name → normalised name.

The mapping is data (``catalog.yaml``): each raw name's normalised name, unit, type, scale into that unit, and
whether its per-second rate is what we keep. The raw name stays in ``labels.raw`` of every telemetry row, so
nothing is lost by normalising. :func:`counter_rates` turns counter samples into rates across resets.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from importlib import resources

import yaml


@dataclass(frozen=True)
class Entry:
    raw: str
    engine: str
    name: str
    unit: str
    type: str
    scale: float = 1.0
    rate: bool = False


@cache
def _load() -> tuple[dict[str, Entry], dict[str, str]]:
    data = yaml.safe_load((resources.files("kvcap.telemetry") / "catalog.yaml").read_text())
    entries: dict[str, Entry] = {}
    prefixes: dict[str, str] = {}
    for engine, spec in data["engines"].items():
        prefixes[engine] = spec["prefix"]
        for raw, e in spec["metrics"].items():
            entries[raw] = Entry(raw=raw, engine=engine, name=e["name"], unit=e["unit"], type=e["type"],
                                 scale=float(e.get("scale", 1.0)), rate=bool(e.get("rate", False)))
    return entries, prefixes


def entry(raw: str) -> Entry | None:
    """The catalog entry of a raw sample name (counter ``_total`` suffixes tolerated either way), or None."""
    entries, _ = _load()
    hit = entries.get(raw)
    if hit is None and raw.endswith("_total"):
        hit = entries.get(raw[: -len("_total")])
    if hit is None:
        hit = entries.get(raw + "_total")
    return hit


def normalise(raw: str) -> str | None:
    """Normalised name for a raw sample name, or None if unknown."""
    e = entry(raw)
    return e.name if e is not None else None


def known_raw_names() -> list[str]:
    return sorted(_load()[0])


def detect_engine(raw_names: Iterable[str]) -> str | None:
    """The engine/exporter whose name prefix most of a page's names carry (None: nothing known)."""
    _, prefixes = _load()
    counts = dict.fromkeys(prefixes, 0)
    for name in raw_names:
        for engine, prefix in prefixes.items():
            if name.startswith(prefix):
                counts[engine] += 1
    best = max(counts, key=lambda k: counts[k])
    return best if counts[best] else None


def counter_rates(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Per-second rates between successive counter samples ``(t, value)``; a drop is a reset (the counter
    restarted from zero), so the increase over that interval is the new value itself, as Prometheus' rate()."""
    return [(t1, counter_increase(v0, v1) / (t1 - t0)) for (t0, v0), (t1, v1) in itertools.pairwise(points)
            if t1 > t0]


def counter_increase(previous: float, current: float) -> float:
    """How much a counter grew between two samples; a drop means it was reset to zero in between."""
    return current - previous if current >= previous else current
