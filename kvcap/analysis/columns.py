"""Request records as per-level numpy columns, read from ``requests.jsonl`` in chunks.

Why: the analysis needs a dozen numbers per record, not a dict per record kept alive for the whole run (a
million records held as dicts took ~1 GB, and per-token ITL lists several more). The file is parsed a megabyte at a
time (one ``orjson`` call per chunk), each chunk's fields go into per-(mode, level) column builders, and the
chunk's dicts are dropped. Per-token ITLs are never kept per record: a record's tokens inside each measured
window of its level (known beforehand from ``levels.jsonl``) are counted as the chunk is read, and the ITLs of
the judged ok requests, needed for the ITL percentiles, are kept as floats up to ``ITL_EXACT_MAX`` per level,
then as exact counts per distinct value on the 1 µs grid both writers round to (``quantiles``), so memory stays
bounded in the number of tokens. Only a level without a line in ``levels.jsonl`` (a killed run's last) keeps its
ITLs until its window is known from its records. The figures are the same whether a file is read in one chunk
or many (the test compares them on every key of ``summary.json``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import chain, repeat
from operator import itemgetter
from pathlib import Path
from typing import Any

import numpy as np

from kvcap.analysis.column_file import ColumnWriter, Damaged, fingerprint, stored_columns, writable
from kvcap.analysis.quantiles import ITL_EXACT_MAX, ItlValues
from kvcap.rundir import CHUNK_BYTES, gc_paused, jsonl_chunks

Key = tuple[str, float]
Window = tuple[float, float]
Reader = Callable[[Path, dict[Key, dict[int, Window]]], dict[Key, "LevelArrays"]]
"""Records → per-level columns, given the measured windows known up front (``read_columns``)."""
SLO_METRICS = ("ttft", "tpot", "e2e", "queue")
"""The per-request latencies an SLO item can limit (``<metric>_ms``)."""
EDGE_MARGIN_S = 1e-6
"""A record whose last token is this close to a window's edge is counted token by token (its last token time is
summed in another order than the running sums, and window bounds are rounded to the µs)."""
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
        b = _Builder(tuple(windows) if windows is not None else None)
        errors = _error_codes()
        b.add(_extract(list(records), _level_codes(), errors), None)
        b.error_names = list(errors.ids)
        self._adopt(b)
        self.good = self.meets(slo)

    @classmethod
    def _built(cls, b: _Builder) -> LevelArrays:
        obj = cls.__new__(cls)
        obj._adopt(b)
        obj.good = obj.ok.copy()
        return obj

    def _adopt(self, b: _Builder) -> None:
        cols = b.columns()
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
        self.error_names = b.error_names
        self.first = self.start + self.ttft / 1e3
        self.itl_ok = b.itl_ok
        self._win_tokens = b.win_tokens
        self._request_tokens: dict[Window, np.ndarray] = {}
        self._itl = b.itl_kept()

    def meets(self, slo: dict[str, float] | None) -> np.ndarray:
        """Requests that succeeded with each of their own latencies within the SLO (unknown does not fail)."""
        good = self.ok.copy()
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
            self._win_tokens[(t0, t1)] = _count_tokens(self.first, flat, lens, [(t0, t1)])[0]
        return self._win_tokens[(t0, t1)]

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


def _extract(recs: list[dict[str, Any]], keys: Codes, errors: Codes) -> dict[str, Any]:
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
    if n and isinstance(itls[0], np.ndarray):  # records in hand (``LiveColumns``): the engine's vectors
        cols["itl"] = np.concatenate(itls).astype(float, copy=False)
    else:
        cols["itl"] = np.fromiter(chain.from_iterable(itls), float, count=int(lens.sum()))
    cols["key"] = np.fromiter(map(keys.__getitem__, tags), np.int64, count=n)
    return cols


def _level_codes() -> Codes:
    return Codes(lambda raw: (str(raw[0]), float(raw[1])))


def _error_codes() -> Codes:
    return Codes(str)


def _segmented_cumsum(flat: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Each record's running sum of its own ITLs, exactly as ``np.cumsum`` of that record's list alone (rows of
    one length are stacked and summed along the row, so no sum carries over from the records before it)."""
    out = np.empty_like(flat)
    offsets = np.concatenate(([0], np.cumsum(lens)[:-1])).astype(np.int64)
    for length in np.unique(lens[lens > 0]).tolist():
        rows = np.flatnonzero(lens == length)
        idx = offsets[rows][:, None] + np.arange(length)
        out[idx] = np.cumsum(flat[idx], axis=1)
    return out


def _count_tokens(first: np.ndarray, flat: np.ndarray, lens: np.ndarray, windows: Sequence[Window]) -> list[np.ndarray]:
    """Per window, per record: tokens at first and at first + each running ITL sum (ms) within [t0, t1); 0 for a
    record without ITLs (its tokens are spread by the closed form instead) or without a first token.

    Token times rise within a record (ITLs ≥ 0), so a record whose first and last tokens both lie inside a window
    (a margin of 1 µs on the last, which is summed in another order) has all of them inside, and one wholly before
    or after has none: only the few records across a window's edge need their token times. Negative ITLs (a
    damaged file) take every record's times."""
    has = (lens > 0) & ~np.isnan(first)
    if flat.size and flat.min() < 0:
        return _count_each_token(first, flat, lens, windows, has)
    last = last_token_times(first, flat, lens)
    out = []
    edge = np.zeros(lens.size, bool)
    for t0, t1 in windows:
        inside = has & (first >= t0) & (last + EDGE_MARGIN_S < t1)
        outside = (first >= t1) | (last + EDGE_MARGIN_S < t0)
        out.append(np.where(inside, lens + 1, 0).astype(np.int64))
        edge |= has & ~inside & ~outside  # across an edge (or a sum that is not finite)
    if edge.any():
        rows = np.flatnonzero(edge)
        exact = _count_each_token(first[rows], itls_of(flat, lens, rows), lens[rows], windows, has[rows])
        for count, part in zip(out, exact):
            count[rows] = part
    return out


def itls_of(flat: np.ndarray, lens: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The ITLs of records ``rows`` (in that order) out of their chunk's flat array (``lens`` per record)."""
    starts = np.cumsum(lens) - lens
    return flat[np.repeat(starts[rows], lens[rows]) + _ranks(lens[rows])]


def last_token_times(first: np.ndarray, flat: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Each record's last token time: its first plus its ITLs (ms) summed (in another order than the running
    sums of :func:`_count_each_token`: within ``EDGE_MARGIN_S`` of them)."""
    total = np.zeros(lens.size)
    some = lens > 0
    if flat.size:
        total[some] = np.add.reduceat(flat, (np.cumsum(lens) - lens)[some])
    return first + total / 1e3


def _count_each_token(first: np.ndarray, flat: np.ndarray, lens: np.ndarray, windows: Sequence[Window],
                      has: np.ndarray) -> list[np.ndarray]:
    """``_count_tokens`` from every token's time."""
    owner = np.repeat(np.arange(lens.size), lens)
    times = first[owner] + _segmented_cumsum(flat, lens) / 1e3  # tokens 2..N (NaN first → never inside)
    out = []
    for t0, t1 in windows:
        count = (has & (first >= t0) & (first < t1)).astype(np.int64)
        inside = (times >= t0) & (times < t1)
        count += np.bincount(owner[inside], minlength=lens.size)
        out.append(count)
    return out


class _Column:
    """One growing column, doubled when full: a long level is a few large allocations, each handed back to the
    system when replaced, not thousands of chunk-sized pieces that stay in the heap after a final concatenate
    (which held a 10M-record run at twice its columns)."""

    def __init__(self, dtype: Any):
        self.arr = np.empty(4096, dtype)
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
        out, self.arr = self.arr[:self.n].copy(), np.empty(0, self.arr.dtype)
        return out


class _Builder:
    """One level's columns as chunks arrive; its token counts for the windows known up front."""

    def __init__(self, windows: tuple[Window, ...] | None, itl_exact_max: int = ITL_EXACT_MAX,
                 keep_itl_max: float = math.inf):
        self.windows = windows
        self.parts: dict[str, _Column] = {}
        self.win_parts = [_Column(np.int32) for _ in windows or ()]
        self.itl_parts: list[tuple[np.ndarray, np.ndarray]] = []  # kept only when the windows are not known
        self.itl_ok = ItlValues(itl_exact_max)
        self.error_names: list[str] = []
        self.keep_itl_max = keep_itl_max
        """ITL values kept for windows not known up front, at most; past it none are (``recount``)."""
        self.kept = 0
        self.recount = False
        """True: the level's windows, once known, need a second read of its records to count their tokens."""

    def add(self, cols: dict[str, Any], rows: np.ndarray | None) -> None:
        """Append the chunk's rows of this level (``rows`` None: the whole chunk is this level's)."""
        take = (lambda a: a) if rows is None else (lambda a: a[rows])
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
                self.parts[k] = _Column(v.dtype)
            self.parts[k].extend(v)
        first = mine["start"] + mine["ttft"] / 1e3
        if self.windows is None and not self.recount:
            self.itl_parts.append((flat, lens))
            self.kept += flat.size
            if self.kept > self.keep_itl_max:
                self.itl_parts, self.recount = [], True
        elif self.windows:
            for acc, count in zip(self.win_parts, _count_tokens(first, flat, lens, self.windows)):
                acc.extend(count)
        ok = (mine["phase"] != _PHASE_OTHER) & ~mine["cancelled"] & mine["ok"]
        self.itl_ok.add((flat if us is None else us)[np.repeat(ok, lens)])

    def columns(self) -> dict[str, np.ndarray]:
        cols = {k: v.done() for k, v in self.parts.items()}
        self.parts = {}
        if not cols:
            cols = {name: np.zeros(0) for name in _FLOATS} | {
                "repeat": np.zeros(0, np.int64), "error": np.zeros(0, np.int32), "phase": np.zeros(0, np.int8),
                **{k: np.zeros(0, bool) for k in ("ok", "truncated", "cancelled", "has_itl")}}
        self.win_tokens = {w: p.done() for w, p in zip(self.windows or (), self.win_parts)}
        return cols

    def itl_kept(self) -> tuple[np.ndarray, np.ndarray] | None:
        if self.windows is not None or self.recount:
            return None
        if not self.itl_parts:
            return np.zeros(0), np.zeros(0, np.int64)
        return np.concatenate([f for f, _ in self.itl_parts]), np.concatenate([n for _, n in self.itl_parts])


def _ranks(lens: np.ndarray) -> np.ndarray:
    """0, 1, …, len−1 for each length in turn (the position of each value inside its record)."""
    total = int(lens.sum())
    starts = np.repeat(np.cumsum(lens) - lens, lens)
    return np.arange(total) - starts


def columns_of(chunks: Iterable[list[dict[str, Any]]], windows: dict[Key, dict[int, Window]],
               itl_exact_max: int = ITL_EXACT_MAX) -> dict[Key, LevelArrays]:
    """Per (mode, level): its records' columns. ``windows``: the measured windows known up front, per repeat."""
    keys, errors = _level_codes(), _error_codes()
    extracted = (_extract(recs, keys, errors) for recs in chunks if recs)
    return _levels(extracted, windows, keys.ids, errors.ids, itl_exact_max)


KEEP_ITL_MAX = 4_000_000
"""ITL values (32 MB) a level without a line in ``levels.jsonl`` (a killed run's last) keeps while it is read, to
count its tokens in the window its records give; past it the records are read a second time instead, so the
analysis of a killed run stays bounded in memory too."""


def _levels(extracted: Iterable[dict[str, Any]], windows: dict[Key, dict[int, Window]], key_ids: dict[Key, int],
            error_ids: dict[str, int], itl_exact_max: int,
            again: Callable[[], Iterable[dict[str, Any]]] | None = None) -> dict[Key, LevelArrays]:
    """Chunks of columns (``_extract``'s) into one builder per level, made on its first record; ``key_ids`` and
    ``error_ids`` give the chunks' codes (filled as the chunks are made, when they come from records).
    ``again``: the same chunks once more, with the same codes (without it, a level without windows keeps its
    ITLs whatever their number)."""
    builders: dict[int, _Builder] = {}
    keep = KEEP_ITL_MAX if again is not None else math.inf
    with gc_paused():
        for cols in extracted:
            ids = np.unique(cols["key"])
            for kid in ids.tolist():
                if kid not in builders:
                    key = next(k for k, v in key_ids.items() if v == kid)
                    builders[kid] = _Builder(tuple(windows[key].values()) if key in windows else None, itl_exact_max,
                                             keep)
                builders[kid].add(cols, None if ids.size == 1 else np.flatnonzero(cols["key"] == kid))
    names = list(error_ids)
    out = {}
    for key, kid in key_ids.items():
        if kid in builders:  # (a level announced but without a record has no columns, as in the file)
            builders[kid].error_names = names
            out[key] = LevelArrays._built(builders[kid])
    recount = {kid: key for key, kid in key_ids.items() if kid in builders and builders[kid].recount}
    if recount and again is not None:
        _count_again(out, recount, again())
    return out


def _count_again(out: dict[Key, LevelArrays], recount: dict[int, Key], extracted: Iterable[dict[str, Any]]) -> None:
    """The second read: each recounted level's tokens inside the windows its records give (``own_windows``, the
    ones the summary asks for), counted as the first read counts known windows."""
    wins = {kid: tuple(out[key].own_windows().values()) for kid, key in recount.items()}
    counts = {kid: [_Column(np.int64) for _ in wins[kid]] for kid in recount}
    with gc_paused():
        for cols in extracted:
            ids = np.unique(cols["key"])
            for kid in ids.tolist():
                if kid not in recount or not wins[kid]:
                    continue
                rows = None if ids.size == 1 else np.flatnonzero(cols["key"] == kid)
                all_lens = cols["itl_len"]
                lens = all_lens if rows is None else all_lens[rows]
                flat = cols["itl"] if rows is None else (itls_of(cols["itl"], all_lens, rows) if lens.sum()
                                                         else np.zeros(0))
                start, ttft = (cols["start"], cols["ttft"]) if rows is None else (cols["start"][rows],
                                                                                  cols["ttft"][rows])
                for acc, count in zip(counts[kid], _count_tokens(start + ttft / 1e3, flat, lens, wins[kid])):
                    acc.extend(count)
    for kid, key in recount.items():  # (records appended since the first read are not the level's: left out)
        tokens = {w: acc.done()[:out[key].n] for w, acc in zip(wins[kid], counts[kid])}
        if any(t.size != out[key].n for t in tokens.values()):
            raise ValueError("requests.jsonl lost records while it was read")
        out[key]._win_tokens = tokens


def read_columns(path: Path, windows: dict[Key, dict[int, Window]], chunk_bytes: int = CHUNK_BYTES,
                 itl_exact_max: int = ITL_EXACT_MAX, write_copy: bool = False) -> dict[Key, LevelArrays]:
    """``requests.jsonl`` streamed into per-level columns (no dict per record kept): from the binary copy of its
    columns beside it when that is whole and taken from this very file (``column_file``), else parsed —
    ``write_copy``: and the copy written as it is parsed, for the next reader."""
    if not path.exists():
        return {}
    stored = stored_columns(path)
    if stored is not None:
        try:
            return _levels(stored.chunks(), windows, {k: i for i, k in enumerate(stored.keys)},
                           {e: i for i, e in enumerate(stored.errors)}, itl_exact_max, again=stored.chunks)
        except Damaged:
            pass
    keys, errors = _level_codes(), _error_codes()

    def parsed() -> Iterator[dict[str, Any]]:
        return (_extract(recs, keys, errors) for recs in jsonl_chunks(path, chunk_bytes) if recs)

    if not (write_copy and writable(path)):
        return _levels(parsed(), windows, keys.ids, errors.ids, itl_exact_max, again=parsed)
    taken_from = fingerprint(path)
    sink = ColumnWriter(path)

    def copied() -> Iterator[dict[str, Any]]:
        for cols in parsed():
            sink.append(cols)
            yield cols

    try:
        out = _levels(copied(), windows, keys.ids, errors.ids, itl_exact_max, again=parsed)
    except BaseException:
        sink.discard()
        raise
    sink.close(list(keys.ids), list(errors.ids), sink.rows, taken_from)
    return out
