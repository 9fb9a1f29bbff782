"""Per-level columns built from a run's records as it writes them, for the summary the run closes with.

Why: ``kvcap sim`` writes ``requests.jsonl`` and then summarises it; parsing back the file it has just written
(per-token ITLs as millions of JSON floats) was a quarter of the whole command at 100,000 requests. The records
are in hand as they are written, so their columns can be taken then. The summary is still built by the one
analysis path (``build_summary`` over :class:`~kvcap.analysis.columns.LevelArrays`); only where the columns come
from differs, and a test compares every key of the summary both ways.

The one thing that cannot be done as records go by is counting each record's tokens inside its level's
measured window, whose end is fixed only when the level ends. Token times rise within a record, so a record
needs its token times only if it crosses an edge: the window's start is known when the level starts, and its
end is bounded from below while the level runs (:meth:`LiveColumns.add`'s ``end_at_least``). A record that
ended before that bound is settled; only the few still unsettled when the window is fixed keep their ITLs until
then. Anything unexpected (a window other than the one announced, negative ITLs, a level never closed) makes
:meth:`LiveColumns.reader` fall back to reading the file.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from kvcap.analysis.column_file import ColumnWriter
from kvcap.analysis.columns import EDGE_MARGIN_S as MARGIN_S
from kvcap.analysis.columns import (
    Key,
    LevelArrays,
    Window,
    _Builder,
    _count_each_token,
    _error_codes,
    _extract,
    _level_codes,
    itls_of,
    last_token_times,
    read_columns,
)


def tokens_before(first: np.ndarray, flat: np.ndarray, lens: np.ndarray, t: float) -> np.ndarray:
    """Per record (each with ITLs and a first token): its tokens before ``t``, counted token by token as the file's
    path counts them (the same floats)."""
    return _count_each_token(first, flat, lens, [(-math.inf, t)], np.ones(lens.size, bool))[0]


def _join(parts: list[np.ndarray], dtype: Any) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


class _Unsettled:
    """Records of the open level still within reach of its window's end: their index, token times and ITLs."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.idx: list[np.ndarray] = []
        self.first: list[np.ndarray] = []
        self.last: list[np.ndarray] = []
        self.lens: list[np.ndarray] = []
        self.flat: list[np.ndarray] = []

    def add(self, idx: np.ndarray, first: np.ndarray, last: np.ndarray, lens: np.ndarray, flat: np.ndarray) -> None:
        if idx.size:
            self.idx.append(idx)
            self.first.append(first)
            self.last.append(last)
            self.lens.append(lens)
            self.flat.append(flat)

    def joined(self) -> tuple[np.ndarray, ...]:
        if not self.idx:
            return np.zeros(0, np.int64), np.zeros(0), np.zeros(0), np.zeros(0, np.int64), np.zeros(0)
        return tuple(np.concatenate(parts) for parts in (self.idx, self.first, self.last, self.lens, self.flat))

    def settle(self, bound: float) -> None:
        """Drop the records that ended before ``bound`` (the window's end is at least that: none of their tokens
        is past it)."""
        if not self.idx:
            return
        idx, first, last, lens, flat = self.joined()
        rows = np.flatnonzero(~(last + MARGIN_S < bound))
        self.clear()
        self.add(idx[rows], first[rows], last[rows], lens[rows], itls_of(flat, lens, rows))


class _LiveLevel(_Builder):
    """One (mode, level)'s columns, with each record's tokens before its window and after it."""

    def __init__(self) -> None:
        super().__init__(windows=())
        self.n = 0
        self.before: list[np.ndarray] = []
        self.first: list[np.ndarray] = []
        self.last: list[np.ndarray] = []
        self.total: list[np.ndarray] = []
        self.repeats: list[np.ndarray] = []
        self.after: dict[int, int] = {}
        self.unsettled = _Unsettled()
        self.settled_at = -math.inf
        """The bound the unsettled records were last settled against (settling again is useful only past it)."""
        self.windows_by_repeat: dict[int, Window] = {}


class LiveColumns:
    """Records → per-level columns as a run writes them (see the module docstring); ``reader`` hands them to
    ``build_summary`` in place of re-reading ``requests.jsonl``."""

    def __init__(self, chunk: int = 4096, sink: ColumnWriter | None = None):
        self.keys, self.errors = _level_codes(), _error_codes()
        self.chunk = chunk
        self.sink = sink
        """Where each chunk's columns are also written (``requests.columns``), whatever becomes of them here."""
        self.records = 0
        """Records taken into columns (and the sink) so far."""
        self.buf: list[dict[str, Any]] = []
        self.levels: dict[int, _LiveLevel] = {}
        self.open_key: tuple[int, int] | None = None
        """(level id, repeat) of the level running now."""
        self.t0 = 0.0
        self.bound = -math.inf
        self.ok = True
        """False once something made the columns unusable (the summary then reads the file)."""

    # ------------------------------------------------------------------ the run's side
    def open(self, key: Key, repeat: int, t0: float) -> None:
        """A level (one repeat) starts; its measured window starts at ``t0`` (as ``levels.jsonl`` will say)."""
        self.flush()
        if self.open_key is not None:
            self.ok = False  # the previous one was never closed
        kid = self.keys[key]
        self.levels.setdefault(kid, _LiveLevel())
        self.open_key, self.t0, self.bound = (kid, repeat), t0, t0

    def add(self, rec: dict[str, Any], end_at_least: float) -> None:
        """A record, as written; ``end_at_least``: the open level's window will end no earlier than this."""
        self.buf.append(rec)
        self.bound = max(self.bound, end_at_least)
        if len(self.buf) >= self.chunk:
            self.flush()

    def close(self, window: Window) -> None:
        """The open level's measured window, as ``levels.jsonl`` has it: its last records are counted."""
        self.flush()
        if self.open_key is None:
            self.ok = False
            return
        kid, repeat = self.open_key
        self.open_key = None
        level = self.levels[kid]
        t0, t1 = window
        if t0 != self.t0 or repeat in level.windows_by_repeat:
            self.ok = False
            return
        idx, first, last, lens, flat = level.unsettled.joined()
        if idx.size:
            after = np.where(first >= t1, lens + 1, 0)
            edge = np.flatnonzero((first < t1) & ~(last + MARGIN_S < t1))
            if edge.size:
                after[edge] = lens[edge] + 1 - tokens_before(first[edge], itls_of(flat, lens, edge), lens[edge], t1)
            level.after.update(zip(idx.tolist(), after.tolist()))
        level.unsettled = _Unsettled()
        level.windows_by_repeat[repeat] = window  # last: an interrupted close leaves the window unknown (fallback)

    def flush(self) -> None:
        """The buffered records into their level's columns (they all belong to the open level)."""
        if not self.buf:
            return
        recs, self.buf = self.buf, []
        cols = _extract(recs, self.keys, self.errors)
        if self.sink is not None:
            self.sink.append(cols)
        self.records += len(recs)
        if self.open_key is None:
            self.ok = False
            return
        kid, repeat = self.open_key
        if np.any(cols["key"] != kid) or np.any(cols["repeat"] != repeat) or (cols["itl"].size and
                                                                             cols["itl"].min() < 0):
            self.ok = False
            return
        level = self.levels[kid]
        level.add(cols, None)
        lens, flat = cols["itl_len"], cols["itl"]
        first = cols["start"] + cols["ttft"] / 1e3
        has = (lens > 0) & ~np.isnan(first)
        last = last_token_times(first, flat, lens)
        n_tokens = np.where(has, lens + 1, 0)
        t0 = self.t0
        before = np.where(last + MARGIN_S < t0, n_tokens, 0)
        edge = np.flatnonzero(has & (first < t0) & ~(last + MARGIN_S < t0))
        if edge.size:
            before[edge] = tokens_before(first[edge], itls_of(flat, lens, edge), lens[edge], t0)
        for name, values in (("before", before), ("first", first), ("last", last), ("total", n_tokens),
                             ("repeats", cols["repeat"])):
            getattr(level, name).append(values)
        near = np.flatnonzero(has & ~(last + MARGIN_S < self.bound))
        if level.settled_at < self.bound:  # the bound moved: earlier records may be settled now
            level.unsettled.settle(self.bound)
            level.settled_at = self.bound
        level.unsettled.add(level.n + near, first[near], last[near], lens[near], itls_of(flat, lens, near))
        level.n += lens.size

    def close_file(self, written: int) -> None:
        """The last records into the column file, and its index written (after ``requests.jsonl`` is closed) if
        these columns have every one of the ``written`` records (an interrupt between the file and here loses
        some: then neither the columns nor the file's copy are used)."""
        self.flush()
        if self.records != written:
            self.ok = False
        if self.sink is not None:
            self.sink.close(list(self.keys.ids), list(self.errors.ids), written)

    # ------------------------------------------------------------------ the summary's side
    def reader(self, path: Path, windows: dict[Key, dict[int, Window]]) -> dict[Key, LevelArrays]:
        """``build_summary``'s reader: these columns where they are complete and their windows are the ones asked
        for, else ``read_columns`` on the file."""
        self.flush()
        if not self.ok or self.open_key is not None or any(kid not in self.levels for kid in self.keys.ids.values()):
            return read_columns(path, windows)
        mine = {key: self.levels[kid].windows_by_repeat for key, kid in self.keys.ids.items()}
        if mine != windows:
            return read_columns(path, windows)
        out: dict[Key, LevelArrays] = {}
        names = list(self.errors.ids)
        for key, kid in self.keys.ids.items():
            level = self.levels[kid]
            level.error_names = names
            counts = self._window_counts(level)
            if counts is None:
                return read_columns(path, windows)
            arrays = LevelArrays._built(level)
            arrays._win_tokens = counts
            out[key] = arrays
        return out

    @staticmethod
    def _window_counts(level: _LiveLevel) -> dict[Window, np.ndarray] | None:
        """Per window of the level (one per repeat), each record's tokens inside it; None if a record of another
        repeat reaches into a window (levels follow each other in time, so none should)."""
        before, total = _join(level.before, np.int64), _join(level.total, np.int64)
        first, last, repeats = _join(level.first, float), _join(level.last, float), _join(level.repeats, np.int64)
        after = np.zeros(total.size, np.int64)
        if level.after:
            after[np.fromiter(level.after, np.int64)] = np.fromiter(level.after.values(), np.int64)
        has = total > 0
        out: dict[Window, np.ndarray] = {}
        for repeat, (t0, t1) in level.windows_by_repeat.items():
            mine = repeats == repeat
            others = has & ~mine
            if np.any(others & (first < t1) & ~(last + MARGIN_S < t0)):
                return None
            out[(t0, t1)] = np.where(mine, total - before - after, 0)
        return out
