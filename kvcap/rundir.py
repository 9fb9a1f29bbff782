"""Run directories: the one format ``bench`` and ``sim`` write and everything downstream reads.

``manifest.json`` (fixed variables, dotted keys), ``requests.jsonl`` (one record per finished request, appended
and flushed as each finishes), ``levels.jsonl`` (one line per level: its windows and achieved load),
``telemetry.jsonl`` (samples), ``summary.json``. Appending with a flush per record means a SIGKILL loses at most
the requests still in flight and a torn last line, which the readers skip.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import IO, Any

from kvcap.errors import InputError

MANIFEST = "manifest.json"
REQUESTS = "requests.jsonl"
LEVELS = "levels.jsonl"
TELEMETRY = "telemetry.jsonl"
SUMMARY = "summary.json"


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False, default=str)


class RunWriter:
    """Appends records as they finish; writes manifest and summary atomically."""

    def __init__(self, out: str | Path, overwrite: bool = False, append: bool = False):
        self.dir = Path(out)
        if (self.dir / REQUESTS).exists() and not (overwrite or append):
            raise InputError(f"{str(self.dir)!r} already holds a run: choose another --out (or --overwrite)")
        self.dir.mkdir(parents=True, exist_ok=True)
        if not append:
            for name in (MANIFEST, REQUESTS, LEVELS, TELEMETRY, SUMMARY):
                (self.dir / name).unlink(missing_ok=True)
        self._files: dict[str, IO[str]] = {}
        self.records = 0

    def _file(self, name: str) -> IO[str]:
        f = self._files.get(name)
        if f is None:
            f = open(self.dir / name, "a", encoding="utf-8")  # noqa: SIM115 - kept open for appends
            self._files[name] = f
        return f

    def _append(self, name: str, obj: dict[str, Any]) -> None:
        f = self._file(name)
        f.write(_dumps(obj) + "\n")
        f.flush()

    def record(self, rec: dict[str, Any]) -> None:
        self._append(REQUESTS, rec)
        self.records += 1

    def level(self, info: dict[str, Any]) -> None:
        self._append(LEVELS, info)

    def telemetry(self, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        f = self._file(TELEMETRY)
        f.write("".join(_dumps(r) + "\n" for r in rows))
        f.flush()

    def manifest(self, data: dict[str, Any]) -> None:
        write_json_atomic(self.dir / MANIFEST, data)

    def summary(self, data: dict[str, Any]) -> None:
        write_json_atomic(self.dir / SUMMARY, data)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, allow_nan=False, default=str) + "\n")
    os.replace(tmp, path)


try:  # a core dependency, but keep working without it
    import orjson

    _loads: Any = orjson.loads
    _LOAD_ERRORS: tuple[type[Exception], ...] = (orjson.JSONDecodeError, json.JSONDecodeError)
except ImportError:  # pragma: no cover - depends on the environment
    _loads = json.loads
    _LOAD_ERRORS = (json.JSONDecodeError,)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """All complete lines; a torn or corrupt line (a killed writer's last) is skipped."""
    if not path.exists():
        return []
    out: list[dict[str, Any]] = []
    with open(path, "rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                break
            try:
                out.append(_loads(line))
            except _LOAD_ERRORS:
                continue
    return out


class RunDir:
    """Read access to a run directory."""

    def __init__(self, path: str | Path):
        self.dir = Path(path)
        if not self.dir.is_dir():
            raise InputError(f"run directory {str(self.dir)!r} not found")
        if not (self.dir / MANIFEST).exists() and not (self.dir / REQUESTS).exists():
            raise InputError(f"{str(self.dir)!r} is not a kvcap run directory (no manifest.json or requests.jsonl)")

    @property
    def manifest(self) -> dict[str, Any]:
        p = self.dir / MANIFEST
        if not p.exists():
            return {}
        try:
            return json.loads(p.read_text())
        except json.JSONDecodeError:
            raise InputError(f"{str(p)!r} is not valid JSON") from None

    def records(self) -> list[dict[str, Any]]:
        return read_jsonl(self.dir / REQUESTS)

    def levels(self) -> list[dict[str, Any]]:
        return read_jsonl(self.dir / LEVELS)

    def telemetry(self) -> list[dict[str, Any]]:
        return read_jsonl(self.dir / TELEMETRY)

    @property
    def summary(self) -> dict[str, Any] | None:
        p = self.dir / SUMMARY
        return json.loads(p.read_text()) if p.exists() else None
