"""Binary column copies of a run's two big JSONL files, written beside them by ``kvcap sim``, read by the analysis
in their place while they still match.

Why: a long simulated run's ``requests.jsonl`` (per-token ITLs) and ``telemetry.jsonl`` are big and slow to parse,
while the analysis needs a dozen numbers per record, the ITLs and each series' samples. The simulator has them as
arrays as it writes (``RecordColumns``, the sampler), so it appends them to ``requests.columns`` and
``telemetry.columns`` too, and the analysis reads those in a fraction of the time (see benchmarks/README.md,
``sim_speed.py``). The JSONL files stay the record and the contract: a copy is trusted only while its JSONL is the
very file it was written beside — same size, modification time and digests of its first and last MiB, kept in the
copy's index (``<name>.columns.json``, written last). A killed run (no index), an edited or appended JSONL, or a
copy that did not keep the times is read from its JSONL, with the same figures (tests compare every summary key).

Layout: one ``.npy`` array after another (``numpy.save`` on one open file), a fixed list of arrays per chunk.
Request ITLs on the 1 µs grid both writers round to are stored as µs in the smallest unsigned integer type that
holds the chunk's (a quarter or half of float64's bytes; read back as the same floats), else as float64.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np

from kvcap.rundir import COLUMN_INDEX_SUFFIX, COLUMN_SUFFIX, write_json_atomic

FORMAT = 1
FIELDS = {**dict.fromkeys(("start", "ttft", "tpot", "e2e", "end", "out_tokens", "in_tokens", "queue", "send_delay"),
                          "f"),
          "repeat": "i", "ok": "b", "truncated": "b", "phase": "i", "error": "i", "cancelled": "b", "key": "i",
          "itl_len": "i", "itl": "fu"}
"""A chunk of request records' columns, as ``columns.extract`` makes them, in the order they are stored, with the
dtype kinds each may have (``itl`` alone has its own length)."""
_STORED = {"key": np.int32, "itl_len": np.int32}
"""Integer request columns stored narrower than they are used (read back as int64)."""
TELEMETRY_FIELDS = {"series": "i", "t": "f", "value": "f", "hold": "f"}
"""A chunk of telemetry rows: series id (in the index's ``series`` list), ``t_s``, ``value``, ``hold_s`` (NaN:
none)."""
_EDGE_BYTES = 1 << 20


class Damaged(ValueError):
    """A column file does not hold what its index says (the caller reads the JSONL instead)."""


def copy_paths(jsonl: Path) -> tuple[Path, Path]:
    """The column copy of ``jsonl`` and its index (``requests.jsonl`` → ``requests.columns``,
    ``requests.columns.json``)."""
    return jsonl.with_name(jsonl.stem + COLUMN_SUFFIX), jsonl.with_name(jsonl.stem + COLUMN_INDEX_SUFFIX)


def writable(jsonl: Path) -> bool:
    """Whether a copy of ``jsonl`` can be written beside it (a read-only run directory is read, never written)."""
    return jsonl.exists() and os.access(jsonl.parent, os.W_OK)


def fingerprint(jsonl: Path) -> dict[str, Any]:
    """What identifies a JSONL file as the one the columns were taken from, cheaply (not a full hash)."""
    st = jsonl.stat()
    with open(jsonl, "rb") as f:
        head = f.read(_EDGE_BYTES)
        f.seek(max(st.st_size - _EDGE_BYTES, 0))
        tail = f.read(_EDGE_BYTES)
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "head_sha256": hashlib.sha256(head).hexdigest(),
            "tail_sha256": hashlib.sha256(tail).hexdigest()}


class _Writer:
    """Appends chunks of arrays beside ``jsonl``; the index, which makes the copy count, at ``close`` (after the
    JSONL itself is closed)."""

    def __init__(self, jsonl: Path):
        self.jsonl = jsonl
        self.path, self.index_path = copy_paths(jsonl)
        self.f: IO[bytes] | None = None
        try:  # best effort from the start: a copy that cannot be opened is none
            self.index_path.unlink(missing_ok=True)
            self.f = open(self.path, "wb", buffering=1 << 20)  # noqa: SIM115 - appended to
        except OSError:
            self.f = None
        self.rows = self.chunks = 0
        self.crc = 0
        """CRC-32 of every array's data, in order (the reader checks the copy's bytes against it)."""

    def _append(self, arrays: Sequence[np.ndarray]) -> None:
        """A chunk; a copy that cannot be written (a full disk) is dropped, never the run or analysis writing it."""
        if self.f is None:
            return
        try:
            for a in arrays:
                a = np.ascontiguousarray(a)
                np.save(self.f, a, allow_pickle=False)
                self.crc = zlib.crc32(a.data.cast("B"), self.crc)
        except OSError:
            self.discard()
            return
        self.rows += int(arrays[0].size)
        self.chunks += 1

    def _close(self, index: dict[str, Any], expected_rows: int, taken_from: dict[str, Any] | None = None) -> None:
        """The index, only if the copy holds the ``expected_rows`` the JSONL got (an interrupted run may have
        written rows to one and not yet to the other: then the copy is deleted). ``taken_from``: the JSONL's
        fingerprint before it was read (a copy made by reading it), else taken now."""
        if self.f is None:
            return
        try:
            self.f.close()
            self.f = None
            if self.rows != expected_rows or not self.jsonl.exists():
                self.discard()
                return
            write_json_atomic(self.index_path, {"format": FORMAT, "rows": self.rows, "chunks": self.chunks,
                                                "bytes": self.path.stat().st_size, "crc32": self.crc, **index,
                                                "jsonl": taken_from or fingerprint(self.jsonl)})
        except OSError:
            self.discard()

    def discard(self) -> None:
        """No copy: the file (and any index) removed, further appends ignored."""
        if self.f is not None:
            with contextlib.suppress(OSError):
                self.f.close()
            self.f = None
        with contextlib.suppress(OSError):
            self.path.unlink(missing_ok=True)
            self.index_path.unlink(missing_ok=True)


def _matching(jsonl: Path) -> dict[str, Any] | None:
    """The index of ``jsonl``'s column copy if it is whole and was written against this very file, else None."""
    path, index_path = copy_paths(jsonl)
    try:
        index = json.loads(index_path.read_text())
        if index.get("format") != FORMAT or os.path.getsize(path) != index["bytes"]:
            return None
        if not all(isinstance(index[k], int) and index[k] >= 0 for k in ("rows", "chunks", "bytes", "crc32")):
            return None
        return index if index["jsonl"] == fingerprint(jsonl) else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _read_array(f: IO[bytes], end: int, kinds: str) -> np.ndarray:
    """The next ``.npy`` array of the copy, checked before anything is allocated: a 1-D array of one of the dtype
    ``kinds`` whose data lies within the file (``Damaged`` otherwise, whatever is wrong with the bytes)."""
    try:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        else:
            raise Damaged(f"npy version {version}")
    except Damaged:
        raise
    except Exception as exc:  # a damaged header can fail in many ways (numpy's own parser, tokenize, ...)
        raise Damaged(f"an array header: {exc}") from exc
    if fortran or len(shape) != 1 or dtype.hasobject or dtype.kind not in kinds:
        raise Damaged(f"an array of {dtype} and shape {shape}, not 1-D of kind {kinds}")
    if f.tell() + shape[0] * dtype.itemsize > end:
        raise Damaged("an array runs past the end of the file")
    a = np.fromfile(f, dtype=dtype, count=shape[0])
    if a.size != shape[0]:
        raise Damaged("an array is short")
    return a


def _chunks(jsonl: Path, index: dict[str, Any], fields: dict[str, str],
            own_length: tuple[str, ...] = ()) -> Iterator[dict[str, np.ndarray]]:
    """Each stored chunk's arrays by name, all of one length but ``own_length``'s. ``Damaged`` (at the end, for
    the data's checksum) if the file is not what its index says."""
    path = copy_paths(jsonl)[0]
    rows, crc = 0, 0
    first = next(iter(fields))
    with open(path, "rb") as f:
        end = os.fstat(f.fileno()).st_size
        for _ in range(index["chunks"]):
            arrays = {}
            for name, kinds in fields.items():
                a = arrays[name] = _read_array(f, end, kinds)
                crc = zlib.crc32(a.data.cast("B"), crc)
            n = arrays[first].size
            if any(a.size != n for name, a in arrays.items() if name not in own_length):
                raise Damaged(f"{path}: a chunk's arrays disagree")
            rows += n
            yield arrays
        if rows != index["rows"] or f.read(1) or crc != index["crc32"]:
            raise Damaged(f"{path}: not the {index['rows']} rows its index describes")


# ---------------------------------------------------------------- request records

def _itl_stored(itl: np.ndarray) -> np.ndarray:
    """ITLs (ms) as µs integers when every one is on the 1 µs grid and that gives back the same floats, else as
    they are."""
    if itl.size == 0 or not np.isfinite(itl).all() or np.signbit(itl).any() or itl.max() >= 2**32 / 1e3:
        return itl.astype(np.float64, copy=False)
    us = np.rint(itl * 1e3)
    if not np.array_equal(us / 1e3, itl):
        return itl.astype(np.float64, copy=False)
    return us.astype(np.uint16 if us.max() < 2**16 else np.uint32)


class ColumnWriter(_Writer):
    """``requests.columns``: records' columns (``extract``'s) as the run writes them, stored in chunks of at least
    ``min_rows`` records (a megabyte of JSONL holds far fewer, and a small chunk's 18 array headers cost more to
    read back than its data)."""

    def __init__(self, jsonl: Path, min_rows: int = 4096):
        super().__init__(jsonl)
        self.min_rows = min_rows
        self._pending: list[dict[str, np.ndarray]] = []
        self.appended = 0
        """Records appended so far, stored or not yet."""

    def append(self, cols: dict[str, np.ndarray]) -> None:
        self._pending.append(cols)
        self.appended += int(cols["start"].size)
        if self.appended - self.rows >= self.min_rows:
            self._store()

    def _store(self) -> None:
        if self._pending:
            parts, self._pending = self._pending, []
            cols = parts[0] if len(parts) == 1 else {name: np.concatenate([p[name] for p in parts]) for name in FIELDS}
            self._append([_itl_stored(cols[name]) if name == "itl" else
                          cols[name].astype(_STORED[name]) if name in _STORED else cols[name] for name in FIELDS])

    def close(self, keys: list[tuple[str, float]], errors: list[str], records: int,
              taken_from: dict[str, Any] | None = None) -> None:
        """``keys``: the (mode, level) of each level code, in code order; ``errors``: the error names likewise;
        ``records``: how many the JSONL got (the index is written only if the copy has them all)."""
        self._store()
        self._close({"keys": [[mode, level] for mode, level in keys], "errors": errors}, records, taken_from)

    def discard(self) -> None:
        self._pending = []
        super().discard()


class StoredColumns:
    """A request column copy whose index matches ``requests.jsonl``: its level keys, error names and chunks."""

    def __init__(self, jsonl: Path, index: dict[str, Any]):
        self.jsonl, self.index = jsonl, index
        self.keys = [(str(mode), float(level)) for mode, level in index["keys"]]
        self.errors = [str(e) for e in index["errors"]]

    def chunks(self) -> Iterator[dict[str, np.ndarray]]:
        """Each chunk's columns with the dtypes ``extract`` gives (plus ``itl_us``: the ITLs as stored, when in µs);
        ``Damaged`` if the file falls short."""
        for cols in _chunks(self.jsonl, self.index, FIELDS, own_length=("itl",)):
            n = cols["start"].size
            lens = cols["itl_len"].astype(np.int64)
            codes_ok = not n or (cols["key"].min() >= 0 and cols["key"].max() < len(self.keys)
                                 and cols["error"].min() >= 0 and cols["error"].max() < len(self.errors))
            if not codes_ok or (n and lens.min() < 0) or cols["itl"].size != int(lens.sum()):
                raise Damaged(f"{self.jsonl}: a chunk's columns disagree with its index")
            for name in _STORED:
                cols[name] = cols[name].astype(np.int64)
            itl = cols["itl"]
            if itl.dtype.kind == "u":
                cols["itl"], cols["itl_us"] = itl / 1e3, itl
            yield cols


def stored_columns(jsonl: Path) -> StoredColumns | None:
    """The request column copy beside ``jsonl`` if it matches this very file, else None."""
    index = _matching(jsonl)
    try:
        return StoredColumns(jsonl, index) if index is not None else None
    except (KeyError, TypeError, ValueError):
        return None


# ---------------------------------------------------------------- telemetry rows

Series = tuple[str, str, dict[str, Any]]
"""(source, name, labels) of one telemetry series."""


class TelemetryWriter(_Writer):
    """``telemetry.columns``: rows as (series, t_s, value, hold_s) arrays, series listed once in the index."""

    def __init__(self, jsonl: Path, chunk: int = 1 << 16):
        super().__init__(jsonl)
        self.series: list[Series] = []
        self._ids: dict[str, int] = {}
        self.chunk = chunk
        self._rows: list[tuple[int, float, float, float]] = []
        self.span = [math.nan, -math.inf, True]
        """First and last time written, and whether every time came in order (``telemetry_slices`` reads slices
        of a copy in time order without a first read to find out)."""

    def _track(self, t: np.ndarray) -> None:
        if t.size:
            first, last, in_order = self.span
            in_order = bool(in_order and np.isfinite(t).all() and t[0] >= last and not np.any(np.diff(t) < 0))
            self.span = [float(t[0]) if math.isnan(first) else first, float(t[-1]), in_order]

    def ids(self, series: Sequence[Series]) -> list[int]:
        """Each series' id in this copy (a series seen before, by source, name and labels, keeps its id)."""
        out = []
        for s in series:
            key = json.dumps([s[0], s[1], sorted(s[2].items())])
            if key not in self._ids:
                self._ids[key] = len(self.series)
                self.series.append(s)
            out.append(self._ids[key])
        return out

    def add(self, rows: list[tuple[int, float, float, float]]) -> None:
        """Rows as (series id, t_s, value, hold_s or NaN), in the order they are written to the JSONL."""
        self._rows += rows
        if len(self._rows) >= self.chunk:
            self.flush()

    def flush(self) -> None:
        if self._rows:
            table = np.array(self._rows, dtype=float).reshape(-1, 4)
            self._rows = []
            self._track(table[:, 1])
            self._append([table[:, 0].astype(np.int32), *(np.ascontiguousarray(table[:, k]) for k in (1, 2, 3))])

    def add_series(self, series_id: int, t: np.ndarray, value: np.ndarray, hold: np.ndarray) -> None:
        """One series' rows at once (a copy made from rows already read)."""
        self.add_rows(np.full(t.size, series_id, np.int32), t, value, hold)

    def add_rows(self, series_id: np.ndarray, t: np.ndarray, value: np.ndarray, hold: np.ndarray) -> None:
        """Rows given as arrays, stored in chunks of ``chunk`` rows."""
        self.flush()
        for at in range(0, t.size, self.chunk):
            part = slice(at, at + self.chunk)
            self._track(t[part])
            self._append([series_id[part].astype(np.int32), t[part], value[part], hold[part]])

    def close(self, rows: int, taken_from: dict[str, Any] | None = None) -> None:
        """``rows``: how many the JSONL got (the index is written only if the copy has them all)."""
        self.flush()
        first, last, in_order = self.span
        self._close({"series": [[src, name, labels] for src, name, labels in self.series],
                     "t_first": None if math.isnan(first) else first, "t_last": None if math.isnan(first) else last,
                     "in_order": in_order}, rows, taken_from)


def telemetry_span(jsonl: Path) -> tuple[float, float, bool] | None:
    """The first and last times of the telemetry copy beside ``jsonl`` and whether they all came in order, as its
    index says (None: no matching copy, or one written before the index said)."""
    index = _matching(jsonl)
    try:
        if index is None or index.get("t_first") is None:
            return None
        return float(index["t_first"]), float(index["t_last"]), bool(index["in_order"])
    except (KeyError, TypeError, ValueError):
        return None


def stored_telemetry(jsonl: Path) -> tuple[list[Series], Iterator[dict[str, np.ndarray]]] | None:
    """The telemetry column copy beside ``jsonl`` if it matches this very file: its series and its chunks (each
    row's series an index into them; ``Damaged`` from the chunks if the file falls short)."""
    index = _matching(jsonl)
    if index is None:
        return None
    try:
        series = [(str(src), str(name), dict(labels)) for src, name, labels in index["series"]]
    except (KeyError, TypeError, ValueError):
        return None

    def chunks() -> Iterator[dict[str, np.ndarray]]:
        for arrays in _chunks(jsonl, index, TELEMETRY_FIELDS):
            ids = arrays["series"]
            if ids.size and (ids.min() < 0 or ids.max() >= len(series)):
                raise Damaged(f"{jsonl}: a row's series is not in the index")
            yield arrays

    return series, chunks()
