"""The column copy of ``requests.jsonl`` (``requests.columns``) taken from a run's records as it writes them.

Why: the records are in hand as they are written, so their columns cost one ``extract`` per chunk of them, where
parsing the JSONL back (per-token ITLs as millions of JSON floats) was a large part of a long ``kvcap sim`` (see
benchmarks/README.md, ``sim_speed.py``). The
run's closing summary then reads the copy like any later ``analyze`` does — one path, a level's blocks at a time,
in memory that does not grow with the run (``column_reader``).
"""

from __future__ import annotations

from typing import Any

from kvcap.rundir.store.column_file import ColumnWriter
from kvcap.rundir.store.columns import error_codes, extract, level_codes


class RecordColumns:
    """Records → chunks of columns → ``sink``; its index is written at ``close_file`` if it has every record the
    JSONL got (an interrupt between the two loses some: the copy is then never used)."""

    def __init__(self, sink: ColumnWriter, chunk: int = 4096):
        self.sink, self.chunk = sink, chunk
        self.keys, self.errors = level_codes(), error_codes()
        self.buf: list[dict[str, Any]] = []

    def add(self, rec: dict[str, Any]) -> None:
        self.buf.append(rec)
        if len(self.buf) >= self.chunk:
            self.flush()

    def flush(self) -> None:
        if self.buf:
            recs, self.buf = self.buf, []
            self.sink.append(extract(recs, self.keys, self.errors))

    def close_file(self, written: int) -> None:
        """The last records into the column file, and its index written (after ``requests.jsonl`` is closed)."""
        self.flush()
        self.sink.close(list(self.keys.ids), list(self.errors.ids), written)
