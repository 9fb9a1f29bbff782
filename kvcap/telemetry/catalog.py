"""One vocabulary for server, GPU and host metrics, whatever the engine: raw Prometheus name → normalised name.

The mapping is data (``catalog.yaml``): each raw name's normalised name, unit, type, scale into that unit, and
whether its per-second rate is what we keep. A raw name written ``name{label="value"}`` maps only the series whose
``label`` has that value (a labelled counter whose series mean different things: vLLM's prompt tokens by source).
The raw name stays in ``labels.raw`` of every telemetry row, so nothing is lost by normalising.
:func:`counter_rates` turns counter samples into rates across resets.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Mapping
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


_LABELLED = re.compile(r'^(?P<name>[^{]+)\{(?P<label>\w+)="(?P<value>[^"]*)"\}$')
"""A catalog key that maps one label value of a raw name: ``name{label="value"}``."""


@dataclass(frozen=True)
class Catalog:
    """``catalog.yaml`` read once: the entries by raw name, the label-value rules, each engine's name prefix."""

    entries: dict[str, Entry]
    """Raw name → entry, whatever the series' labels."""
    labelled: dict[str, list[tuple[str, str, Entry]]]
    """Raw name → (label, value, entry): the entry of the series whose ``label`` has ``value``."""
    prefixes: dict[str, str]


@cache
def _load() -> Catalog:
    data = yaml.safe_load((resources.files("kvcap.telemetry") / "catalog.yaml").read_text())
    cat = Catalog({}, {}, {})
    for engine, spec in data["engines"].items():
        cat.prefixes[engine] = spec["prefix"]
        for raw, e in spec["metrics"].items():
            m = _LABELLED.match(raw)
            name = m["name"] if m else raw
            item = Entry(raw=raw, engine=engine, name=e["name"], unit=e["unit"], type=e["type"],
                         scale=float(e.get("scale", 1.0)), rate=bool(e.get("rate", False)))
            if m:
                cat.labelled.setdefault(name, []).append((m["label"], m["value"], item))
            else:
                cat.entries[raw] = item
    return cat


def _spellings(raw: str) -> tuple[str, ...]:
    """A counter's name as given, then with its ``_total`` suffix dropped or added."""
    return (raw, raw[: -len("_total")]) if raw.endswith("_total") else (raw, raw + "_total")


def entry(raw: str, labels: Mapping[str, str] | None = None) -> Entry | None:
    """The catalog entry of a raw sample name with its ``labels`` (counter ``_total`` suffixes tolerated either
    way), or None: a name mapped whatever its labels first, else the label value its series carries."""
    cat = _load()
    for name in _spellings(raw):
        hit = cat.entries.get(name)
        if hit is not None:
            return hit
    if labels:
        for name in _spellings(raw):
            for label, value, hit in cat.labelled.get(name, ()):
                if labels.get(label) == value:
                    return hit
    return None


def normalise(raw: str, labels: Mapping[str, str] | None = None) -> str | None:
    """Normalised name for a raw sample name (with its labels), or None if unknown."""
    e = entry(raw, labels)
    return e.name if e is not None else None


def known_raw_names() -> list[str]:
    cat = _load()
    return sorted({*cat.entries, *cat.labelled})


def detect_engine(raw_names: Iterable[str]) -> str | None:
    """The engine/exporter whose name prefix most of a page's names carry (None: nothing known)."""
    prefixes = _load().prefixes
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
