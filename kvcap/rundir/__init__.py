"""Run directories: the one format ``bench`` and ``sim`` write and everything downstream reads.

``manifest.json`` (fixed variables, dotted keys), ``requests.jsonl`` (one record per finished request, appended and
flushed as each finishes), ``levels.jsonl`` (one line per level: its windows and achieved load), ``telemetry.jsonl``
(samples), ``summary.json``. The contract is ``docs/run-directory.md``, generated from the models here
(``manifest``, ``levels``, ``summary``: ``python -m kvcap.rundir.doc``). Appending with a flush per record means a
SIGKILL loses at most the requests still in flight and a torn last line, which the readers skip.
"""

from __future__ import annotations

import gc
import json
import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from functools import cached_property
from pathlib import Path
from typing import IO, Any, TypedDict, TypeVar

from pydantic import BaseModel, ValidationError

from kvcap.errors import InputError
from kvcap.rundir.compare import Comparison
from kvcap.rundir.levels import LevelRow
from kvcap.rundir.manifest import Manifest, host_facts
from kvcap.rundir.model import RunModel
from kvcap.rundir.summary import Summary

M = TypeVar("M", bound=BaseModel)

__all__ = ["COLUMN_COPIES", "LEVELS", "MANIFEST", "RECORD_FIELDS", "REQUESTS", "REQUIRED_RECORD_FIELDS", "SUMMARY",
           "TELEMETRY", "LevelRow", "Manifest", "RecordTags", "RequestRecord", "RunDir", "RunWriter", "Summary",
           "host_facts", "iter_jsonl", "jsonl_chunks", "read_jsonl", "tpot_ms", "write_json_atomic"]

MANIFEST = "manifest.json"
REQUESTS = "requests.jsonl"
LEVELS = "levels.jsonl"
TELEMETRY = "telemetry.jsonl"
SUMMARY = "summary.json"
COLUMN_SUFFIX, COLUMN_INDEX_SUFFIX = ".columns", ".columns.json"
COLUMN_COPIES = tuple(Path(jsonl).stem + suffix for jsonl in (REQUESTS, TELEMETRY)
                      for suffix in (COLUMN_SUFFIX, COLUMN_INDEX_SUFFIX))
"""Binary copies of what the analysis reads from ``requests.jsonl`` and ``telemetry.jsonl``, and their indexes
(``rundir.store.column_file``): stale once those files change."""


# ---------------------------------------------------------------- the two schemas: one record, one manifest

class RecordTags(TypedDict):
    """Where a request belongs in the run: load model, level, repeat, warm-up or measured, which worker."""

    mode: str
    level: float
    repeat: int
    phase: str
    worker: int


class _RecordCore(RecordTags):
    """Fields every record carries, whoever wrote it (docs/run-directory.md)."""

    index: int
    start_s: float
    end_s: float | None
    send_delay_ms: float
    ok: bool
    error: str | None
    status: int | None
    input_tokens: int
    output_tokens: int
    requested_output_tokens: int
    tokens_source: str
    ttft_ms: float | None
    tpot_ms: float | None
    e2e_ms: float | None
    itl_ms: list[float]
    queue_ms: float | None
    finish_reason: str | None
    truncated: bool
    early_stop: bool
    retries: int
    group: int | None


class RequestRecord(_RecordCore, total=False):
    """One line of ``requests.jsonl``: ``bench`` (``loadgen.client``) and ``sim`` (``sim.run``) both build exactly
    this. A TypedDict, not a dataclass: records are the hot path (millions per run), and a dict costs nothing to
    turn into JSON; the schema is still one definition that both builders are typed against and tested on."""

    error_detail: str
    text: str
    replica: int
    preemptions: int
    recomputed_tokens: int
    parked_ms: float
    copy_ms: float
    prefix_hit_tokens: int
    tier_hit_tokens: int
    cached_tokens: int | None
    session: int
    turn: int


REQUIRED_RECORD_FIELDS: frozenset[str] = RequestRecord.__required_keys__
RECORD_FIELDS: frozenset[str] = RequestRecord.__required_keys__ | RequestRecord.__optional_keys__


def tpot_ms(ttft_ms: float | None, e2e_ms: float | None, output_tokens: int) -> float | None:
    """TPOT = (E2E − TTFT) / (output tokens − 1): the one definition, for every record builder."""
    if ttft_ms is None or e2e_ms is None or output_tokens <= 1:
        return None
    return (e2e_ms - ttft_ms) / (output_tokens - 1)


# ---------------------------------------------------------------- writing

def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False, default=str)


def _plain(obj: Any) -> Any:
    """What JSON cannot hold as is: a numpy array (or scalar) as its list (number), anything else as text."""
    tolist = getattr(obj, "tolist", None)
    return tolist() if tolist is not None else str(obj)


try:  # a core dependency, but keep working without it
    import orjson

    _LINE_OPTS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS | orjson.OPT_APPEND_NEWLINE

    def _line(obj: Any) -> bytes:
        """One JSONL line, compact; numpy arrays (a record's ITLs) go in as they are, never as Python lists."""
        return orjson.dumps(obj, default=_plain, option=_LINE_OPTS)

    _loads: Any = orjson.loads
    _LOAD_ERRORS: tuple[type[Exception], ...] = (orjson.JSONDecodeError, json.JSONDecodeError)
except ImportError:  # pragma: no cover - depends on the environment
    def _line(obj: Any) -> bytes:
        return (json.dumps(obj, separators=(",", ":"), allow_nan=False, default=_plain) + "\n").encode()

    _loads = json.loads
    _LOAD_ERRORS = (json.JSONDecodeError,)


class RunWriter:
    """Appends records as they finish; writes manifest and summary atomically.

    ``flush_s``: how long appended lines may sit in the buffer (0: flushed line by line, what a live ``bench``
    wants; ``sim`` writes far faster than a disk flush per line, so it flushes at most this often — a killed
    run loses at most that much wall time of records)."""

    def __init__(self, out: str | Path, overwrite: bool = False, append: bool = False, flush_s: float = 0.0):
        self.dir = Path(out)
        self.check_destination(self.dir, overwrite, append)
        if not append:
            for name in (MANIFEST, REQUESTS, LEVELS, TELEMETRY, SUMMARY):
                (self.dir / name).unlink(missing_ok=True)
        for name in COLUMN_COPIES:  # a copy of files about to change (an append too) is stale
            (self.dir / name).unlink(missing_ok=True)
        self._files: dict[str, IO[bytes]] = {}
        self.records = self.telemetry_rows = 0
        self.flush_s = flush_s
        self._flushed = time.monotonic()

    @staticmethod
    def check_destination(out: Path, overwrite: bool = False, append: bool = False) -> None:
        """Fail on a bad ``--out`` (bad input) before anything else, without touching a run already there."""
        if (out / REQUESTS).exists() and not (overwrite or append):
            raise InputError(f"{str(out)!r} already holds a run: choose another --out (or --overwrite)")
        out.mkdir(parents=True, exist_ok=True)

    def _file(self, name: str) -> IO[bytes]:
        f = self._files.get(name)
        if f is None:
            f = open(self.dir / name, "ab", buffering=1 << 20)  # noqa: SIM115 - kept open for appends
            self._files[name] = f
        return f

    def _flush(self, f: IO[bytes]) -> None:
        if not self.flush_s:
            f.flush()
            return
        now = time.monotonic()
        if now - self._flushed >= self.flush_s:
            self._flushed = now
            for g in self._files.values():
                g.flush()

    def _append(self, name: str, obj: Mapping[str, Any]) -> None:
        f = self._file(name)
        f.write(_line(obj))
        self._flush(f)

    def record(self, rec: RequestRecord) -> None:
        self._append(REQUESTS, rec)
        self.records += 1

    def level(self, info: dict[str, Any]) -> None:
        f = self._file(LEVELS)
        f.write(_line(info))
        self.flush()

    def telemetry(self, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        f = self._file(TELEMETRY)
        f.write(b"".join(map(_line, rows)))
        self.telemetry_rows += len(rows)
        self._flush(f)

    def flush(self) -> None:
        """Everything appended so far on disk (at a level's end, whatever ``flush_s``)."""
        self._flushed = time.monotonic()
        for f in self._files.values():
            f.flush()

    def manifest(self, data: Manifest) -> None:
        write_json_atomic(self.dir / MANIFEST, data.to_json())

    def summary(self, data: Summary) -> None:
        write_json_atomic(self.dir / SUMMARY, data.to_json())

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


def write_json_atomic(path: Path, data: Any) -> None:
    """``data`` (a run model as its file holds it) as indented JSON, replacing ``path`` at once."""
    if isinstance(data, RunModel):
        data = data.to_json()
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, allow_nan=False, default=str) + "\n")
    os.replace(tmp, path)


@contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off while millions of parsed dicts (none of them cyclic) are made: its passes,
    triggered by the allocations alone, cost a large share of a big read and free nothing (see
    benchmarks/README.md, ``analysis_speed.py``)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


CHUNK_BYTES = 1 << 20
"""Bytes of a JSONL file parsed at once: its dicts are a streamed read's peak memory, and a larger chunk costs
memory without reading faster."""


def jsonl_chunks(path: Path, size: int = CHUNK_BYTES) -> Iterator[list[dict[str, Any]]]:
    """The file's complete lines as dicts, a chunk at a time (what a chunk's dicts take is the reader's peak, not
    the file's); a torn last line or a corrupt line is skipped, as ``read_jsonl`` skips it."""
    with open(path, "rb") as f:
        tail = b""
        while True:
            block = f.read(size)
            if not block:
                return  # what is left in tail has no newline: a torn last line
            block = tail + block
            cut = block.rfind(b"\n")
            if cut < 0:
                tail = block
                continue
            tail = block[cut + 1:]
            body = block[:cut]
            try:  # one parse per chunk: the lines as one JSON array (a raw newline only ever ends a record)
                recs = _loads(b"[" + body.replace(b"\n", b",") + b"]")
                if len(recs) != body.count(b"\n") + 1:  # a line holding two values is not a line's record
                    raise ValueError("not one value per line")
            except ValueError:  # (JSON errors are ValueErrors) a corrupt or empty line: this chunk line by line
                recs = []
                for ln in body.split(b"\n"):
                    try:
                        recs.append(_loads(ln))
                    except _LOAD_ERRORS:
                        continue
            yield recs


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """All complete lines; a torn or corrupt line (a killed writer's last) is skipped."""
    if not path.exists():
        return []
    with gc_paused():
        return [r for chunk in jsonl_chunks(path) for r in chunk]


def iter_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """``read_jsonl``'s rows one at a time, a chunk in memory at once."""
    if path.exists():
        for chunk in jsonl_chunks(path):
            yield from chunk


# ---------------------------------------------------------------- reading

class RunDir:
    """Read access to a run directory."""

    def __init__(self, path: str | Path):
        self.dir = Path(path)
        if not self.dir.is_dir():
            raise InputError(f"run directory {str(self.dir)!r} not found")
        if not (self.dir / MANIFEST).exists() and not (self.dir / REQUESTS).exists():
            raise InputError(f"{str(self.dir)!r} is not a kvcap run directory (no manifest.json or requests.jsonl)")

    @cached_property
    def manifest(self) -> Manifest | None:
        """``manifest.json`` (read once); None when the run has none (a killed run's requests alone)."""
        p = self.dir / MANIFEST
        if not p.exists():
            return None
        return read_model(p, Manifest, "a kvcap manifest")

    @property
    def slo(self) -> dict[str, float]:
        """The SLO the run was recorded with ({} without a manifest)."""
        return dict(self.manifest.slo) if self.manifest is not None else {}

    def records(self) -> list[dict[str, Any]]:
        return read_jsonl(self.dir / REQUESTS)

    def levels(self) -> list[LevelRow]:
        """``levels.jsonl``'s lines (a torn last line skipped)."""
        p = self.dir / LEVELS
        try:
            return [LevelRow.model_validate(row) for row in read_jsonl(p)]
        except ValidationError as exc:
            raise InputError(f"{str(p)!r}: a line is not a kvcap level line: {_first_error(exc)}") from None

    def telemetry(self) -> list[dict[str, Any]]:
        return read_jsonl(self.dir / TELEMETRY)

    def iter_telemetry(self) -> Iterator[dict[str, Any]]:
        """The telemetry rows streamed (a million-request run has millions)."""
        return iter_jsonl(self.dir / TELEMETRY)

    @property
    def summary(self) -> Summary | None:
        """``summary.json`` (read each time: ``analyze`` rewrites it); None before the run was analysed."""
        p = self.dir / SUMMARY
        if not p.exists():
            return None
        return read_model(p, Summary, "a kvcap summary")


def read_comparison(path: str | Path) -> Comparison:
    """A saved ``compare.json`` (``kvcap compare --json``, ``kvcap ab``): the comparison without the arms'
    summaries (a report rebuilds them from the run directories, or in part from ``per_level``)."""
    return read_model(Path(path), Comparison, "a kvcap comparison")


def read_model(p: Path, model: type[M], what: str) -> M:
    """One JSON file of a run directory as its model; an unreadable, malformed or foreign file is one InputError
    line saying which file and, for a foreign one, the first key that does not fit (``what``: what it should be)."""
    try:
        return model.model_validate(json.loads(p.read_text()))
    except OSError as exc:
        raise InputError(f"cannot read {str(p)!r}: {exc.strerror}") from None
    except json.JSONDecodeError:
        raise InputError(f"{str(p)!r} is not valid JSON") from None
    except ValidationError as exc:
        raise InputError(f"{str(p)!r} is not {what}: {_first_error(exc)}") from None


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    return f"{'.'.join(str(x) for x in err['loc']) or '(top level)'}: {err['msg']}"
