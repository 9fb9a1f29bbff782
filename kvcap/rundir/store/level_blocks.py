"""A level's records as blocks of columns: the earlier blocks of a long level wait on disk, so its analysis holds
one block at a time, however many records it has.

Why: a level held whole as columns, and the statistics' temporaries over it, make memory grow with the run (see
benchmarks/README.md, ``sim_speed.py``). The statistics (``stats.summarize_level``, ``capacity.stationarity``)
make two passes over the blocks instead: sums, counts and trend sums in the first, exact order statistics by
bucket in the second (``quantiles.OrderStats``: percentiles equal to numpy's over all the rows; a mean is the sum
of its blocks' sums, which can differ from ``np.mean`` over all the rows in its last bits). The blocks go to one
unnamed temporary file beside the run (``tempfile.TemporaryFile``: no name, so nothing is left behind, even by a
killed process), written once and read back a block at a time; a level under ``columns.BLOCK_ROWS`` rows never
touches it.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np

from kvcap.rundir.store.columns import Builder, LevelArrays
from kvcap.rundir.store.quantiles import ItlValues
from kvcap.rundir.store.tokens import Window


class Spill:
    """Blocks of columns appended to an unnamed temporary file (in ``near`` when it can be, else the system's, else
    none: kept in memory); each ``put`` returns where its block is, for ``get``."""

    def __init__(self, near: Path | None = None):
        self.near = near
        self._file: IO[bytes] | None = None
        self.in_memory = False
        """True when no temporary file could be made anywhere: blocks are then kept as they are."""

    def _open(self) -> IO[bytes] | None:
        if self._file is None and not self.in_memory:
            try:
                self._file = tempfile.TemporaryFile(dir=self.near)  # noqa: SIM115 (held for the level's life)
            except OSError:  # a read-only run directory: the system's temporary directory
                try:
                    self._file = tempfile.TemporaryFile()  # noqa: SIM115
                except OSError:  # nowhere to write: the blocks stay in memory
                    self.in_memory = True
        return self._file

    def put(self, arrays: dict[str, np.ndarray]) -> Any:
        f = self._open()
        if f is None:
            return arrays
        f.seek(0, 2)
        at = f.tell()
        for a in arrays.values():
            np.lib.format.write_array(f, np.ascontiguousarray(a), allow_pickle=False)
        return at, tuple(arrays)

    def get(self, where: Any) -> dict[str, np.ndarray]:
        if isinstance(where, dict):
            return dict(where)
        at, names = where
        f = self._open()
        assert f is not None
        f.seek(at)
        return {name: np.lib.format.read_array(f, allow_pickle=False) for name in names}


class Level:
    """One (mode, level)'s records: blocks of :class:`LevelArrays` in record order (``blocks``), and what the
    level has as a whole (its ITL sample, error names, row count)."""

    def __init__(self, spilled: list[tuple[int, Any]], spill: Spill | None, windows: tuple[Window, ...],
                 rest: LevelArrays, itl_ok: ItlValues, error_names: list[str]):
        self._spilled, self._spill, self._windows, self._rest = spilled, spill, windows, rest
        self.itl_ok, self.error_names = itl_ok, error_names
        self.n = sum(rows for rows, _ in spilled) + rest.n
        self.recounted: dict[Window, np.ndarray] = {}
        """Token counts per window of the whole level, from a second read (``column_reader._count_again``)."""

    @classmethod
    def built(cls, b: Builder, spill: Spill | None) -> Level:
        cols, win_tokens = b.rest()
        rest = LevelArrays.of_block(cols, win_tokens, b.error_names, b.itl_ok, b.itl_kept())
        return cls(b.spilled, spill, b.windows or (), rest, b.itl_ok, b.error_names)

    @classmethod
    def of(cls, arrays: LevelArrays) -> Level:
        """A level of one block held in memory."""
        return cls([], None, (), arrays, arrays.itl_ok, arrays.error_names)

    def blocks(self) -> Iterator[LevelArrays]:
        """The level's rows, a block at a time (only the one yielded is held)."""
        row = 0
        for rows, where in self._spilled:
            assert self._spill is not None
            arrays = self._spill.get(where)
            wins = {w: arrays.pop(f"w{i}") for i, w in enumerate(self._windows)}
            yield self._with_recounts(LevelArrays.of_block(arrays, wins, self.error_names, self.itl_ok), row)
            row += rows
        yield self._with_recounts(self._rest, row)

    def _with_recounts(self, block: LevelArrays, row: int) -> LevelArrays:
        for w, counts in self.recounted.items():
            block._win_tokens[w] = counts[row:row + block.n]
        return block

    def own_windows(self) -> dict[int, Window]:
        """Per repeat, the span of its measured requests' starts: the window of a level without a level line."""
        spans: dict[int, list[float]] = {}
        for block in self.blocks():
            for rep, (lo, hi) in block.own_windows().items():
                span = spans.setdefault(rep, [lo, hi])
                span[0], span[1] = min(span[0], lo), max(span[1], hi)
        return {rep: (lo, hi) for rep, (lo, hi) in sorted(spans.items())}


def as_level(records: Level | LevelArrays | list[dict[str, Any]], slo: dict[str, float] | None = None,
             windows: list[Window] | None = None) -> Level:
    """Records in any of the forms the statistics take, as a :class:`Level`."""
    if isinstance(records, Level):
        return records
    return Level.of(records if isinstance(records, LevelArrays) else LevelArrays(records, slo, windows))
