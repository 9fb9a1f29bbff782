"""Request records as per-level numpy columns: the arrays the statistics are vectorised over
(:class:`LevelArrays`), how a chunk of records becomes columns (``extract``), and how a level's columns grow as
chunks arrive (``Builder``), a block at a time when the level is long. Reading a file into them is
``column_reader``'s; a level as blocks is ``level_blocks``'.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from itertools import chain, repeat
from operator import itemgetter
from typing import Any, Protocol

import numpy as np

from kvcap.rundir.store.quantiles import ITL_EXACT_MAX, ItlValues
from kvcap.rundir.store.tokens import Window, count_tokens, itls_of

Key = tuple[str, float]
SLO_METRICS = ("ttft", "tpot", "e2e", "queue")
"""The per-request latencies an SLO item can limit (``<metric>_ms``)."""
_FLOATS = {"start": ("start_s", 0.0), "ttft": ("ttft_ms", np.nan), "tpot": ("tpot_ms", np.nan),
           "e2e": ("e2e_ms", np.nan), "end": ("end_s", np.nan), "out_tokens": ("output_tokens", 0.0),
           "in_tokens": ("input_tokens", 0.0), "queue": ("queue_ms", np.nan),
           "send_delay": ("send_delay_ms", np.nan)}
_PHASE_MEASURE, _PHASE_MISSING, _PHASE_OTHER = 0, 1, 2


def level_key(rec: dict[str, Any]) -> Key:
    return (str(rec.get("mode", "concurrency")), float(rec.get("level", 0)))


class LevelArrays:
    """One level's records as numpy columns, so statistics are vectorised, not per-record loops.

    ``LevelArrays(records, slo)`` builds them from dicts (one chunk); ``read_columns`` streams a file into them.
    ``windows`` are the measured windows whose token counts are taken as the ITLs go by (any other window needs
    the ITLs, which are then kept)."""

    def __init__(self, records: Iterable[dict[str, Any]] = (), slo: dict[str, float] | None = None,
                 windows: Sequence[Window] | None = None):
        b = Builder(tuple(windows) if windows is not None else None)
        errors = error_codes()
        b.add(extract(list(records), level_codes(), errors), None)
        b.error_names = list(errors.ids)
        cols, win_tokens = b.rest()
        self._take(cols, win_tokens, b.error_names, b.itl_ok, b.itl_kept())

    @classmethod
    def of_block(cls, cols: dict[str, np.ndarray], win_tokens: dict[Window, np.ndarray], error_names: list[str],
                 itl_ok: ItlValues, itl: tuple[np.ndarray, np.ndarray] | None = None) -> LevelArrays:
        """A block of a level's rows (``level_blocks.Level``), from a builder's columns."""
        obj = cls.__new__(cls)
        obj._take(cols, win_tokens, error_names, itl_ok, itl)
        return obj

    def _take(self, cols: dict[str, np.ndarray], win_tokens: dict[Window, np.ndarray], error_names: list[str],
              itl_ok: ItlValues, itl: tuple[np.ndarray, np.ndarray] | None) -> None:
        self.n = int(cols["start"].size)
        self.start, self.ttft, self.tpot, self.e2e = cols["start"], cols["ttft"], cols["tpot"], cols["e2e"]
        self.out_tokens, self.in_tokens = cols["out_tokens"], cols["in_tokens"]
        self.queue, self.send_delay = cols["queue"], cols["send_delay"]
        end = cols["end"]
        self.end = np.where(np.isnan(end), np.where(np.isnan(self.e2e), self.start, self.start + self.e2e / 1e3), end)
        self.repeat, self.error = cols["repeat"], cols["error"]
        self.ok, self.truncated, self.has_itl = cols["ok"], cols["truncated"], cols["has_itl"]
        phase = cols["phase"]
        self.measured = phase != _PHASE_OTHER  # a record without a phase counts as measured
        self.explicit_measure = phase == _PHASE_MEASURE
        self.cancelled = cols["cancelled"]
        self.error_names = error_names
        self.first = self.start + self.ttft / 1e3
        self.itl_ok = itl_ok
        self._win_tokens = dict(win_tokens)
        self._request_tokens: dict[Window, np.ndarray] = {}
        self._itl = itl

    def meets(self, slo: dict[str, float] | None) -> np.ndarray:
        """Requests that succeeded with each of their own latencies within the SLO (unknown does not fail)."""
        good: np.ndarray = self.ok.copy()
        cols = {"ttft": self.ttft, "tpot": self.tpot, "e2e": self.e2e, "queue": self.queue}
        for key, limit in (slo or {}).items():
            metric = key.split("_", 1)[0]
            if metric in SLO_METRICS:
                good &= ~(cols[metric] > limit)
        return good

    def window_tokens(self, t0: float, t1: float) -> np.ndarray:
        """Per request: its ITL-timed output tokens (the first included) that arrived within [t0, t1)."""
        if (t0, t1) not in self._win_tokens:
            if self._itl is None:
                raise ValueError(f"window {(t0, t1)} was not counted and the ITLs were not kept")
            flat, lens = self._itl
            self._win_tokens[(t0, t1)] = count_tokens(self.first, flat, lens, [(t0, t1)])[0]
        tokens: np.ndarray = self._win_tokens[(t0, t1)]
        return tokens

    def request_tokens(self, t0: float, t1: float) -> np.ndarray:
        """Per request: its output tokens that arrived within [t0, t1) — ITL-timed, or for a request without ITLs
        its N tokens spread evenly from first token to end (closed form, no arrays per token). Cached per window."""
        if (t0, t1) in self._request_tokens:
            return self._request_tokens[(t0, t1)]
        counts = self.window_tokens(t0, t1).astype(np.int64)
        m = ~np.isnan(self.first) & ~self.has_itl & (self.out_tokens > 0)
        if m.any():
            first, n = self.first[m], self.out_tokens[m]
            last = np.where(np.isnan(self.e2e[m]), first, self.start[m] + self.e2e[m] / 1e3)
            step = np.where(n > 1, (last - first) / np.maximum(n - 1, 1), np.inf)
            instant = ~(step > 0) | np.isinf(step)  # one token, or all at one time (no end: a cancelled request)
            with np.errstate(invalid="ignore", divide="ignore"):
                k_lo = np.where(instant, np.where(first >= t0, 0, n), np.ceil((t0 - first) / step))
                k_hi = np.where(instant, np.where(first < t1, n - 1, -1), np.ceil((t1 - first) / step) - 1)
            k_lo, k_hi = np.clip(k_lo, 0, n), np.clip(k_hi, -1, n - 1)  # k_lo = n: every token came before t0
            counts[m] = np.maximum(k_hi - k_lo + 1, 0).astype(np.int64)
        self._request_tokens[(t0, t1)] = counts
        return counts

    def tokens_in_window(self, t0: float, t1: float, mask: np.ndarray) -> int:
        """Output tokens (of the masked requests) that arrived within [t0, t1)."""
        return int(self.request_tokens(t0, t1)[mask].sum())

    def own_windows(self) -> dict[int, Window]:
        """Per repeat, the span of its measured requests' starts: the window of a level without a level line."""
        windows: dict[int, Window] = {}
        for rep in np.unique(self.repeat).tolist():
            starts = self.start[self.explicit_measure & (self.repeat == rep)]
            if starts.size:
                windows[int(rep)] = (float(starts.min()), float(starts.max()) + 1e-9)
        return windows


class Codes(dict):  # type: ignore[type-arg]
    """Raw value → a small int, values equal after ``norm`` sharing one, in order of first appearance (over the
    whole file): a chunk's values map to codes at C speed, ``__missing__`` runs once per new raw value."""

    def __init__(self, norm: Callable[[Any], Any]):
        super().__init__()
        self.norm = norm
        self.ids: dict[Any, int] = {}

    def __missing__(self, raw: Any) -> int:
        code = self[raw] = self.ids.setdefault(self.norm(raw), len(self.ids))
        return code


_NUMERIC = (*(field for field, _ in _FLOATS.values()), "repeat", "ok", "truncated")
_numbers, _tags = itemgetter(*_NUMERIC), itemgetter("mode", "level")
_phase, _error, _itl = itemgetter("phase"), itemgetter("error"), itemgetter("itl_ms")
_MISSING = object()
_PHASES = {"measure": _PHASE_MEASURE, _MISSING: _PHASE_MISSING}


def _fields(recs: list[dict[str, Any]]) -> tuple[list[Any], ...]:
    """The fields the analysis reads, per record: by ``itemgetter`` (C speed) when every record has them all, as
    ``bench`` and ``sim`` records do; otherwise one by one, with each field's default."""
    try:
        return (list(map(_numbers, recs)), list(map(_tags, recs)), list(map(_phase, recs)),
                list(map(_error, recs)), list(map(_itl, recs)))
    except (KeyError, TypeError):
        recs[:] = [r for r in recs if isinstance(r, dict)]  # a line that is JSON but not a record is skipped
        return ([tuple(r.get(f, 0 if f == "repeat" else None) for f in _NUMERIC) for r in recs],
                [(r.get("mode", "concurrency"), r.get("level", 0)) for r in recs],
                [r.get("phase", _MISSING) for r in recs], [r.get("error") for r in recs],
                [r.get("itl_ms") for r in recs])


def extract(recs: list[dict[str, Any]], keys: Codes, errors: Codes) -> dict[str, Any]:
    """One chunk's records as columns (all levels together), its ITLs flat, and each record's level id."""
    numbers, tags, phases, errs, itls = _fields(recs)
    n = len(recs)
    table = np.array(numbers, dtype=float).reshape(n, len(_NUMERIC))  # None → NaN
    cols: dict[str, Any] = {}
    for i, (name, (_, default)) in enumerate(_FLOATS.items()):
        col = np.ascontiguousarray(table[:, i])
        if not np.isnan(default):
            col[np.isnan(col)] = default
        cols[name] = col
    rep, ok, trunc = (table[:, len(_FLOATS) + i] for i in range(3))
    cols["repeat"] = np.where(np.isnan(rep), 0, rep).astype(np.int64)  # null: repeat 0, as when absent
    cols["ok"] = (ok != 0) & ~np.isnan(ok)
    cols["truncated"] = (trunc != 0) & ~np.isnan(trunc)
    cols["phase"] = np.fromiter(map(_PHASES.get, phases, repeat(_PHASE_OTHER, n)), np.int8, count=n)
    cols["error"] = np.fromiter(map(errors.__getitem__, errs), np.int32, count=n)
    cols["cancelled"] = cols["error"] == errors.ids.get("cancelled", -1)
    try:
        lens = np.fromiter(map(len, itls), np.int64, count=n)
    except TypeError:  # a null itl_ms
        itls = [x or () for x in itls]
        lens = np.fromiter(map(len, itls), np.int64, count=n)
    cols["itl_len"] = lens
    if n and isinstance(itls[0], np.ndarray):  # records in hand (``RecordColumns``): the engine's vectors
        cols["itl"] = np.concatenate(itls).astype(float, copy=False)
    else:
        cols["itl"] = np.fromiter(chain.from_iterable(itls), float, count=int(lens.sum()))
    cols["key"] = np.fromiter(map(keys.__getitem__, tags), np.int64, count=n)
    return cols


def level_codes() -> Codes:
    return Codes(lambda raw: (str(raw[0]), float(raw[1])))


def error_codes() -> Codes:
    return Codes(str)


class Column:
    """One growing column, doubled when full: a long level is a few large allocations, each handed back to the
    system when replaced, not thousands of chunk-sized pieces that stay in the heap after a final concatenate
    (pieces and result together: twice the level's columns)."""

    def __init__(self, dtype: Any):
        self.arr: np.ndarray = np.empty(4096, dtype)
        self.n = 0

    def extend(self, values: np.ndarray) -> None:
        end = self.n + values.size
        if end > self.arr.size:
            grown = np.empty(max(2 * self.arr.size, end), self.arr.dtype)
            grown[:self.n] = self.arr[:self.n]
            self.arr = grown
        self.arr[self.n:end] = values
        self.n = end

    def done(self) -> np.ndarray:
        out: np.ndarray = self.arr[:self.n].copy()
        self.arr = np.empty(0, self.arr.dtype)
        return out

    def front(self, k: int) -> np.ndarray:
        """The first ``k`` values, taken out (the rest move to the front)."""
        out: np.ndarray = self.arr[:k].copy()
        rest = self.n - k
        self.arr[:rest] = self.arr[k:self.n]
        self.n = rest
        return out


BLOCK_ROWS = 1 << 15
"""Rows per block of a level read from a file: a longer level's earlier blocks wait on disk (``level_blocks``), so
its analysis holds two blocks (~6 MB) at most, however many records it has."""


class Spill(Protocol):
    """Where a builder puts a level's full blocks (``level_blocks.Spill``)."""

    def put(self, arrays: dict[str, np.ndarray]) -> Any: ...


class Builder:
    """One level's columns as chunks arrive; its token counts for the windows known up front. With a ``spill``,
    each ``block_rows`` rows (counted exactly, whatever the chunks: the figures must not depend on how a file was
    chunked) go to it as a block."""

    def __init__(self, windows: tuple[Window, ...] | None, itl_exact_max: int = ITL_EXACT_MAX,
                 keep_itl_max: float = math.inf, spill: Spill | None = None, block_rows: int = BLOCK_ROWS):
        self.windows = windows
        self.parts: dict[str, Column] = {}
        self.win_parts = [Column(np.int32) for _ in windows or ()]
        self.itl_parts: list[tuple[np.ndarray, np.ndarray]] = []  # kept only when the windows are not known
        self.itl_ok = ItlValues(itl_exact_max)
        self.error_names: list[str] = []
        self.keep_itl_max = keep_itl_max
        """ITL values kept for windows not known up front, at most; past it none are (``recount``)."""
        self.kept = 0
        self.recount = False
        """True: the level's windows, once known, need a second read of its records to count their tokens."""
        self.spill, self.block_rows = spill, block_rows
        self.spilled: list[tuple[int, Any]] = []
        """(rows, where the spill put them) of each block written, in order."""

    def add(self, cols: dict[str, Any], rows: np.ndarray | None) -> None:
        """Append the chunk's rows of this level (``rows`` None: the whole chunk is this level's)."""
        def take(a: np.ndarray) -> np.ndarray:
            return a if rows is None else a[rows]

        mine = {k: take(v) for k, v in cols.items() if k not in ("itl", "itl_us", "key")}
        lens = mine.pop("itl_len")
        us = cols.get("itl_us")  # the same ITLs in µs (a column file's), for the percentiles' counts
        if rows is None:
            flat = cols["itl"]
        else:  # this level's ITLs out of the chunk's flat array
            flat = itls_of(cols["itl"], cols["itl_len"], rows) if lens.sum() else np.zeros(0)
            us = itls_of(us, cols["itl_len"], rows) if us is not None and lens.sum() else None
        mine["has_itl"] = lens > 0
        for k, v in mine.items():
            if k not in self.parts:
                self.parts[k] = Column(v.dtype)
            self.parts[k].extend(v)
        first = mine["start"] + mine["ttft"] / 1e3
        if self.windows is None and not self.recount:
            self.itl_parts.append((flat, lens))
            self.kept += flat.size
            if self.kept > self.keep_itl_max:
                self.itl_parts, self.recount = [], True
        elif self.windows:
            for acc, count in zip(self.win_parts, count_tokens(first, flat, lens, self.windows)):
                acc.extend(count)
        ok = (mine["phase"] != _PHASE_OTHER) & ~mine["cancelled"] & mine["ok"]
        self.itl_ok.add((flat if us is None else us)[np.repeat(ok, lens)])
        while self.spill is not None and self.parts["start"].n >= self.block_rows:
            self._spill_block()

    def _spill_block(self) -> None:
        """The first ``block_rows`` rows to the spill. A level without its windows stops keeping ITLs: its tokens
        are counted by a second read (``recount``), whose counts the blocks then take by row."""
        k = self.block_rows
        arrays = {name: col.front(k) for name, col in self.parts.items()}
        arrays.update({f"w{i}": col.front(k) for i, col in enumerate(self.win_parts)})
        self.spilled.append((k, self.spill.put(arrays) if self.spill is not None else None))
        if self.windows is None:
            self.itl_parts, self.recount = [], True

    def rest(self) -> tuple[dict[str, np.ndarray], dict[Window, np.ndarray]]:
        """The rows not spilled: their columns and their token counts per known window (the builder is done)."""
        cols = {k: v.done() for k, v in self.parts.items()}
        self.parts = {}
        if not cols:
            cols = {name: np.zeros(0) for name in _FLOATS} | {
                "repeat": np.zeros(0, np.int64), "error": np.zeros(0, np.int32), "phase": np.zeros(0, np.int8),
                **{k: np.zeros(0, bool) for k in ("ok", "truncated", "cancelled", "has_itl")}}
        return cols, {w: p.done() for w, p in zip(self.windows or (), self.win_parts)}

    def itl_kept(self) -> tuple[np.ndarray, np.ndarray] | None:
        if self.windows is not None or self.recount:
            return None
        if not self.itl_parts:
            return np.zeros(0), np.zeros(0, np.int64)
        return np.concatenate([f for f, _ in self.itl_parts]), np.concatenate([n for _, n in self.itl_parts])
