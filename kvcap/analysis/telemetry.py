"""Telemetry rows → series and per-node figures aligned with the level windows (pure functions).

Rows may come from several sources for the same metric (direct ``/metrics`` scraping *and* Prometheus, say):
per metric, the kind of source with the most rows is used, so nothing is counted twice. Across labels
(replicas, GPUs, devices) counts and byte rates are summed per sample time, ratios averaged, ``link.util``
maximised (the busiest link). Per node, network figures leave out the loopback device unless it is all there is.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import numpy as np

from kvcap.rundir import TELEMETRY, RunDir, gc_paused
from kvcap.rundir.store.column_file import Damaged, TelemetryWriter, fingerprint, stored_telemetry, writable

MEAN = {"gpu.util", "gpu.sm_active", "gpu.dram_active", "gpu.engine_active", "server.kv_usage",
        "server.kv_usage_host", "server.kv_tier_usage", "server.prefix_cache_hit_rate", "server.offload_hit_rate"}
MAX = {"link.util"}
LOOPBACK = ("lo", "lo0")
HOLD = "hold_s"
"""A row written on change (``kvcap sim``): its value holds every ``hold_s`` seconds until its series' next row."""


def how(name: str) -> str:
    return "mean" if name in MEAN else "max" if name in MAX else "sum"


def expand_held(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows written on change back on their regular grid, in the order a full grid is written (by time, then by
    each series' first appearance), so every figure — means over samples, sums across replicas — is unchanged.
    Rows without ``hold_s`` (real scrapes, old runs) pass through as they are. (``Telemetry`` does the expanding,
    as arrays; this is its row view.)"""
    if not any(HOLD in r for r in rows):
        return rows
    return Telemetry(rows).rows()


Key = tuple[Any, ...]
Points = list[tuple[float, float]]


class Telemetry:
    """A run's telemetry as series — one per (source, name, labels) — each its sample times and values as numpy
    arrays, rows written on change (``hold_s``) put back on their grid without a dict per grid point.

    Why: a long simulated run has a grid row per series per second; as dicts, expanded, scanned per name and
    again per node and level window, they would dominate the analysis (see benchmarks/README.md,
    ``sim_speed.py``). Rows are kept as written and put on the grid only when a series is aggregated; aggregates
    asked for by name (:meth:`arrays`) are cached, so a summary's per-level figures are window slices of series
    built once. Aggregation gives what adding the rows one by one gives, value for value: per sample time, values
    are added in series order (the order rows were first seen), so sums, means and maxima are the same floats."""

    def __init__(self, rows: Iterable[dict[str, Any]], dedupe: bool = False):
        ids: dict[Key, int] = {}
        seen: dict[Key, int] = {}  # labels in the order a writer gives them → series (sorting only on a miss)
        self.meta: list[tuple[str, str, dict[str, Any]]] = []
        """(source, name, labels) of each series."""
        cols: list[tuple[list[Any], list[Any], list[Any]]] = []
        done: list[list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = []  # each series' fields, converted so far
        with gc_paused():
            for n, r in enumerate(rows, 1):
                if not isinstance(r, dict):
                    continue  # a line that is JSON but not a row (damaged file): skipped, as damaged values are
                labels = r.get("labels")
                if not isinstance(labels, dict):
                    labels = {}
                source, name = r.get("source", ""), r.get("name", "")
                fast = (source, name, *labels.items())
                i = seen.get(fast)
                if i is None:  # a series is its source and name as text (what ``meta`` and a column copy keep)
                    key = (str(source), str(name), *sorted(labels.items()))
                    i = ids.get(key)
                    if i is None:
                        i = ids[key] = len(cols)
                        self.meta.append((str(source), str(name), labels))
                        cols.append(([], [], []))
                        done.append([])
                    seen[fast] = i
                t, v, h = cols[i]
                t.append(r.get("t_s"))
                v.append(r.get("value"))
                h.append(r.get(HOLD))
                if n % CONVERT_EVERY == 0:  # as floats in arrays, not Python objects: memory ∝ rows × 24 B
                    _convert(cols, done)
        _convert(cols, done)
        self._finish(done, dedupe)

    @classmethod
    def from_columns(cls, series: list[tuple[str, str, dict[str, Any]]], chunks: Iterable[dict[str, np.ndarray]],
                     dedupe: bool = False) -> Telemetry:
        """The same series from a column copy of the rows (``column_file.stored_telemetry``): ids in the order of
        first appearance and rows in the order written, as the rows would give them."""
        obj = cls.__new__(cls)
        obj.meta = []
        ids: dict[Key, int] = {}
        mine = np.full(len(series), -1, np.int64)  # the copy's series id → this one's
        done: list[list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = []
        with gc_paused():
            for arrays in chunks:
                sid = arrays["series"].astype(np.int64)
                unseen = sid[mine[sid] < 0]
                if unseen.size:
                    found, first = np.unique(unseen, return_index=True)
                    for g in found[np.argsort(first)].tolist():
                        source, name, labels = series[g]
                        key = (source, name, *sorted(labels.items()))
                        if key not in ids:
                            ids[key] = len(obj.meta)
                            obj.meta.append((source, name, labels))
                            done.append([])
                        mine[g] = ids[key]
                rid = mine[sid]
                order = np.argsort(rid, kind="stable")
                for rows in np.split(order, np.flatnonzero(np.diff(rid[order])) + 1):
                    if rows.size:
                        done[int(rid[rows[0]])].append((arrays["t"][rows], arrays["value"][rows],
                                                        arrays["hold"][rows]))
        obj._finish(done, dedupe)
        return obj

    @classmethod
    def from_series(cls, meta: list[tuple[str, str, dict[str, Any]]],
                    raw: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> Telemetry:
        """Series given whole, in order: each one's (source, name, labels) and its rows' times, values and
        ``hold_s`` (``telemetry_slices``' time slices)."""
        obj = cls.__new__(cls)
        obj.meta = list(meta)
        obj._finish([[r] for r in raw], dedupe=False)
        return obj

    def _finish(self, done: list[list[tuple[np.ndarray, np.ndarray, np.ndarray]]], dedupe: bool) -> None:
        self.raw: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = [
            tuple(np.concatenate([p[k] for p in parts]) for k in range(3)) for parts in done]  # type: ignore[misc]
        """Each series' rows as read: times, values, ``hold_s`` (NaN: none). Put back on the grid only when asked
        (:meth:`grid`), so memory follows the rows written, not the run's length in grid points."""
        self.by_name: dict[str, list[int]] = defaultdict(list)
        for i, (_, name, _) in enumerate(self.meta):
            self.by_name[name].append(i)
        if dedupe:
            self._keep_busiest_source()
        self._cache: dict[tuple[str, str, str | None], tuple[np.ndarray, np.ndarray]] = {}

    def grid(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Series ``i``'s (times, values) with held values repeated on their grid (built anew on each call)."""
        return _held_on_grid(*self.raw[i])

    def _keep_busiest_source(self) -> None:
        """Per metric name, only the series of the source kind (``metrics``, ``prometheus``, ``sim``) with the most
        rows on the grid: the same metric scraped two ways is not counted twice."""
        for name, idx in self.by_name.items():
            kinds = {self.meta[i][0].split(":", 1)[0] for i in idx}
            if len(kinds) < 2:
                continue  # one kind: nothing to choose (and no grid to count)
            counts: dict[str, int] = defaultdict(int)
            for i in idx:
                counts[self.meta[i][0].split(":", 1)[0]] += self.grid(i)[0].size
            best = max(counts, key=lambda k: counts[k])
            self.by_name[name] = [i for i in idx if self.meta[i][0].split(":", 1)[0] == best]

    def __len__(self) -> int:
        return sum(self.grid(i)[0].size for idx in self.by_name.values() for i in idx)

    def rows(self) -> list[dict[str, Any]]:
        """The kept series back as rows (time order, then series order): what ``expand_held`` gives."""
        out = [(t, i, {"t_s": t, "source": self.meta[i][0], "name": self.meta[i][1], "labels": self.meta[i][2],
                       "value": v})
               for idx in self.by_name.values() for i in idx
               for t, v in zip(*(a.tolist() for a in self.grid(i)))]
        out.sort(key=lambda x: (x[0], x[1]))
        return [r for _, _, r in out]

    def label_values(self, label: str) -> set[Any]:
        """Every value the kept series give ``label`` (None where a series has none)."""
        return {self.meta[i][2].get(label) for idx in self.by_name.values() for i in idx}

    def selected(self, name: str, node: str | None = None) -> list[int]:
        """The series of ``name`` (one node's), in series order; network series without loopback unless it is
        all there is."""
        idx = self._of_node(name, node)
        if name.startswith("net.") and {self.meta[i][2].get("device") for i in idx} - set(LOOPBACK):
            idx = [i for i in idx if self.meta[i][2].get("device") not in LOOPBACK]
        return idx

    def arrays(self, name: str, agg: str | None = None, node: str | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(times, values): one value per sample time, aggregated over the other labels (cached)."""
        key = (name, agg or how(name), node)
        if key not in self._cache:
            idx = self.selected(name, node)
            self._cache[key] = self.aggregate(idx, key[1])
        return self._cache[key]

    def aggregate(self, idx: list[int], agg: str) -> tuple[np.ndarray, np.ndarray]:
        """(times, values) of series ``idx`` on their grid, aggregated per sample time (not cached)."""
        grids = [self.grid(i) for i in idx]
        return _aggregate([t for t, _ in grids], [v for _, v in grids], agg)

    def nic_utilisation(self, node: str | None = None, t0: float = -math.inf, t1: float = math.inf) -> float | None:
        """Busiest NIC direction as a fraction of its line rate (node exporter's ``net.speed_bytes_s``), per sample,
        over [t0, t1]."""
        return nic_best(self.nic_parts(node, t0, t1))

    def nic_parts(self, node: str | None, t0: float, t1: float) -> NicParts:
        """What :meth:`nic_utilisation` takes from [t0, t1], as parts that add up over slices of time
        (:func:`merge_nic_parts`): per speed series its device and last positive sample, per rx/tx series its
        device and peak (NaN if a sample is)."""
        speeds: dict[int, tuple[Any, float]] = {}
        for i in self._of_node("net.speed_bytes_s", node):
            t, v = self.grid(i)
            v = v[_window(t, t0, t1)]
            v = v[v > 0]
            if v.size:
                speeds[i] = (self.meta[i][2].get("device"), float(v[-1]))
        peaks: dict[tuple[int, int], tuple[Any, float]] = {}
        for k, name in enumerate(("net.rx_bytes_s", "net.tx_bytes_s")):
            for i in self._of_node(name, node):
                t, v = self.grid(i)
                v = v[_window(t, t0, t1)]
                if v.size:
                    peaks[(k, i)] = (self.meta[i][2].get("device"), float(np.max(v)))
        return speeds, peaks

    def _of_node(self, name: str, node: str | None) -> list[int]:
        """The kept series of ``name``, or of ``name`` on one node."""
        idx = self.by_name.get(name, [])
        return idx if node is None else [i for i in idx if self.meta[i][2].get("node") == node]


NicParts = tuple[dict[int, tuple[Any, float]], dict[tuple[int, int], tuple[Any, float]]]
"""``Telemetry.nic_parts``: speeds (series → device, last positive sample) and peaks ((rx 0 / tx 1, series) →
device, peak)."""


def merge_nic_parts(into: NicParts, later: NicParts) -> None:
    """``later`` (a later slice of time) into ``into``: a series' last speed is its latest, its peak the larger."""
    into[0].update(later[0])
    for key, (dev, peak) in later[1].items():
        before = into[1].get(key)
        if before is not None and not math.isnan(before[1]) and not math.isnan(peak):
            peak = max(peak, before[1])
        elif before is not None:
            peak = math.nan
        into[1][key] = (dev, peak)


def nic_best(parts: NicParts) -> float | None:
    """The busiest direction's peak over its NIC's line rate: each device's rate its speed series' last positive
    sample (the last series in order that has one); rx series first, then tx, each in series order (the first
    ratio found stands against a NaN). A peak over a rate is the peak of the ratios (division by a positive
    number keeps the order)."""
    speed = {dev: x for _, (dev, x) in sorted(parts[0].items())}
    best = None
    for key in sorted(parts[1]):
        dev, peak = parts[1][key]
        if dev in speed:
            u = peak / speed[dev]
            best = u if best is None or u > best else best
    return None if best is None else round(best, 4)


CONVERT_EVERY = 65_536
"""Rows read between conversions of the fields gathered so far into arrays."""


def _convert(cols: list[tuple[list[Any], list[Any], list[Any]]],
             done: list[list[tuple[np.ndarray, np.ndarray, np.ndarray]]]) -> None:
    """Each series' gathered fields as float arrays, the lists emptied for the next rows."""
    for (t, v, h), parts in zip(cols, done):
        if t:
            parts.append((_floats(t), _floats(v), _floats(h)))
            t.clear()
            v.clear()
            h.clear()


def _floats(raw: list[Any]) -> np.ndarray:
    """A field's values as floats; absent or damaged ones NaN (the row is skipped where the field is needed)."""
    try:
        return np.asarray(raw, float)  # None → NaN
    except (TypeError, ValueError):
        return np.fromiter(map(_number, raw), float, count=len(raw))


def _number(x: Any) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def _window(t: np.ndarray, t0: float, t1: float) -> np.ndarray:
    """Samples within [t0, t1]; all of them (times unknown too) for an unbounded window."""
    if t0 == -math.inf and t1 == math.inf:
        return np.ones(t.size, bool)
    return (t >= t0) & (t <= t1)


def round_us(x: np.ndarray) -> np.ndarray:
    """``round(v, 6)`` of every value, as Python rounds (the sampler's grid times are Python-rounded), at numpy's
    speed: ``rint(v·10⁶) / 10⁶`` is the same float wherever v·10⁶ lies clear of a half (the product's error is a few
    ulps; then both pick one integer, and dividing it by 10⁶ is the nearest float to the decimal, as Python's is);
    the values within a few ulps of a half go through Python's ``round`` (grid times sit near whole µs, so ~none)."""
    y = x * 1e6
    out = np.rint(y) / 1e6
    near = np.flatnonzero(np.abs(np.abs(y - np.floor(y)) - 0.5) <= 8 * np.spacing(np.abs(y)) + 1e-12)
    if near.size:
        out[near] = np.fromiter(map(round, x[near].tolist(), repeat(6)), float, count=near.size)
    return out


def _held_on_grid(t: np.ndarray, v: np.ndarray, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One series' rows with each held value repeated every ``hold_s`` (at ``round(t + k·hold_s, 6)``, as the
    sampler rounds) until the series' next row; rows without ``hold_s`` as they are."""
    held = np.flatnonzero(np.isfinite(h[:-1]) & (h[:-1] > 0)) if t.size > 1 else np.zeros(0, np.int64)
    if held.size == 0:
        return t, v
    steps = h[held]
    # how many grid points fit before the next row: a bound, then cut where round(t + k·step, 6) < next
    n = np.ceil((t[held + 1] - t[held]) / steps).astype(np.int64) + 1
    owner = np.repeat(held, n)
    k = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n) + 1
    grid = round_us(t[owner] + k * np.repeat(steps, n))
    keep = grid < t[owner + 1]
    owner, grid = owner[keep], grid[keep]
    times = np.concatenate((t, grid))
    order = np.argsort(times, kind="stable")  # a series' times are distinct: grid points fall between its rows
    return times[order], np.concatenate((v, v[owner]))[order]


def _aggregate(ts: list[np.ndarray], vs: list[np.ndarray], agg: str) -> tuple[np.ndarray, np.ndarray]:
    """Per sample time, the series' values summed, averaged or maximised — added in series order, as a sum over
    a list of them would (the same floats)."""
    if not ts:
        return np.zeros(0), np.zeros(0)
    t, v = np.concatenate(ts), np.concatenate(vs)
    ok = np.isfinite(t) & np.isfinite(v)
    t, v = t[ok], v[ok]
    times, inv = np.unique(t, return_inverse=True)
    if agg == "max":
        out = np.full(times.size, -np.inf)
        np.maximum.at(out, inv, v)
        return times, out
    out = np.zeros(times.size)
    np.add.at(out, inv, v)  # in index order: each time's values in series order
    if agg == "sum":
        return times, out
    return times, out / np.bincount(inv, minlength=times.size)


def telemetry_of(rows: Telemetry | list[dict[str, Any]]) -> Telemetry:
    """Rows as they are (no source kind dropped), or a ``Telemetry`` already built."""
    return rows if isinstance(rows, Telemetry) else Telemetry(rows)


def dedupe_sources(rows: Iterable[dict[str, Any]]) -> Telemetry:
    """The run's telemetry with, per metric name, only the rows of the source kind (``metrics``, ``prometheus``,
    ``sim``) with most rows (counted on the grid: rows written on change are expanded first)."""
    return Telemetry(rows, dedupe=True)


def read_telemetry(run: RunDir, write_copy: bool = False) -> Telemetry:
    """``dedupe_sources`` of the run's telemetry: from its column copy when that matches ``telemetry.jsonl``
    (``column_file``), else from the rows — ``write_copy``: and the copy written from them, for the next reader."""
    path = run.dir / TELEMETRY
    stored = stored_telemetry(path)
    if stored is not None:
        try:
            return Telemetry.from_columns(*stored, dedupe=True)
        except Damaged:
            pass
    if not (write_copy and writable(path)):
        return dedupe_sources(run.iter_telemetry())
    taken_from = fingerprint(path)
    telemetry = dedupe_sources(run.iter_telemetry())
    copy = TelemetryWriter(path)  # best effort (a full disk leaves no copy, not a failed analysis)
    try:
        _copy_rows(copy, telemetry)
    except BaseException:
        copy.discard()
        raise
    copy.close(copy.rows, taken_from)
    return telemetry


def _copy_rows(copy: TelemetryWriter, telemetry: Telemetry) -> None:
    """The rows into a column copy that reads back as the same series (ids, rows and values): in time order where
    that keeps every series' rows in order and the series in order of first appearance (so a long run's copy is
    read a time slice at a time: ``telemetry_slices``), else series by series."""
    ids = copy.ids(telemetry.meta)
    sid = np.concatenate([np.full(t.size, i, np.int64) for i, (t, _, _) in zip(ids, telemetry.raw)]) \
        if ids else np.zeros(0, np.int64)
    t, v, h = (np.concatenate([raw[k] for raw in telemetry.raw]) if ids else np.zeros(0) for k in range(3))
    order = np.argsort(t, kind="stable")
    firsts = np.unique(sid[order], return_index=True)[1] if sid.size else np.zeros(0, np.int64)
    if np.isfinite(t).all() and all(np.all(np.diff(raw[0]) >= 0) for raw in telemetry.raw) \
            and np.all(np.diff(firsts) > 0) and ids == sorted(ids):
        copy.add_rows(sid[order], t[order], v[order], h[order])
        return
    for i, (ts, vs, hs) in zip(ids, telemetry.raw):  # series in id order, each one's rows in order
        copy.add_series(i, ts, vs, hs)


def series(rows: Telemetry | list[dict[str, Any]], name: str, agg: str | None = None,
           node: str | None = None) -> Points:
    """One value per sample time for ``name`` (optionally one node's), aggregated over the other labels."""
    t, v = telemetry_of(rows).arrays(name, agg, node)
    return list(zip(t.tolist(), v.tolist()))


@dataclass(frozen=True, slots=True)
class Series:
    """An aggregated series as arrays (times ascending, one value each): what the summary slices per level window.
    Why not :data:`Points`: a tuple per sample time costs far more memory than two arrays on a long run."""

    t: np.ndarray
    v: np.ndarray

    def __len__(self) -> int:
        return int(self.t.size)

    def within(self, t0: float, t1: float) -> Series:
        """The samples with t0 ≤ t ≤ t1."""
        lo, hi = np.searchsorted(self.t, t0, "left"), np.searchsorted(self.t, t1, "right")
        return Series(self.t[lo:hi], self.v[lo:hi])

    def plus(self, other: Series) -> Series:
        """Values added per sample time over the union of both series' times (this series' value first)."""
        times, inv = np.unique(np.concatenate((self.t, other.t)), return_inverse=True)
        out = np.zeros(times.size)
        np.add.at(out, inv, np.concatenate((self.v, other.v)))
        return Series(times, out)


def series_of(rows: Telemetry | list[dict[str, Any]], name: str) -> Series:
    """:func:`series` as arrays."""
    return Series(*telemetry_of(rows).arrays(name))


def points(s: Series | Points) -> tuple[np.ndarray, np.ndarray]:
    """(times, values) of a series given either way."""
    if isinstance(s, Series):
        return s.t, s.v
    a = np.asarray(s, float).reshape(-1, 2)
    return a[:, 0], a[:, 1]
