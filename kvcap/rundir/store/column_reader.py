"""Request records → per-level columns (``level_blocks.Level``), read from ``requests.jsonl`` in chunks or from
its binary column copy.

Why: the analysis needs a dozen numbers per record, not a dict per record kept alive for the whole run (dicts and
per-token ITL lists make memory grow with the run; see benchmarks/README.md, ``analysis_speed.py``). The file is parsed
a megabyte at a time (one ``orjson`` call per chunk), each chunk's fields go into per-(mode, level) column builders, and
the chunk's dicts are dropped. Per-token ITLs are never kept per record: a record's tokens inside each measured window
of its level (known beforehand from ``levels.jsonl``) are counted as the chunk is read, and the ITLs of the judged ok
requests, needed for the ITL percentiles, are kept as floats up to ``ITL_EXACT_MAX`` per level, then as exact counts per
distinct value on the 1 µs grid both writers round to (``quantiles``). A level's columns past ``BLOCK_ROWS`` rows wait
on disk in blocks, so memory stays bounded in the number of records too. Only a level without a line in ``levels.jsonl``
(a killed run's last) keeps its ITLs until its window is known from its records (up to ``KEEP_ITL_MAX``; past it, or
once it spills, its tokens are counted by a second read). The figures are the same whether a file is read in one chunk
or many, in one block or many (tests compare every key of ``summary.json``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kvcap.rundir import CHUNK_BYTES, gc_paused, jsonl_chunks
from kvcap.rundir.store.column_file import ColumnWriter, Damaged, fingerprint, stored_columns, writable
from kvcap.rundir.store.columns import BLOCK_ROWS, Builder, Column, Key, error_codes, extract, level_codes
from kvcap.rundir.store.level_blocks import Level, Spill
from kvcap.rundir.store.quantiles import ITL_EXACT_MAX
from kvcap.rundir.store.tokens import Window, count_tokens, itls_of

Reader = Callable[[Path, dict[Key, dict[int, Window]]], dict[Key, Level]]
"""Records → per-level columns, given the measured windows known up front (``read_columns``)."""


def columns_of(chunks: Iterable[list[dict[str, Any]]], windows: dict[Key, dict[int, Window]],
               itl_exact_max: int = ITL_EXACT_MAX) -> dict[Key, Level]:
    """Per (mode, level): its records' columns. ``windows``: the measured windows known up front, per repeat."""
    keys, errors = level_codes(), error_codes()
    extracted = (extract(recs, keys, errors) for recs in chunks if recs)
    return _levels(extracted, windows, keys.ids, errors.ids, itl_exact_max)


KEEP_ITL_MAX = 4_000_000
"""ITL values (32 MB) a level without a line in ``levels.jsonl`` (a killed run's last) keeps while it is read, to
count its tokens in the window its records give; past it the records are read a second time instead, so the
analysis of a killed run stays bounded in memory too."""


def _levels(extracted: Iterable[dict[str, Any]], windows: dict[Key, dict[int, Window]], key_ids: dict[Key, int],
            error_ids: dict[str, int], itl_exact_max: int,
            again: Callable[[], Iterable[dict[str, Any]]] | None = None,
            spill: Spill | None = None, block_rows: int = BLOCK_ROWS) -> dict[Key, Level]:
    """Chunks of columns (``extract``'s) into one builder per level, made on its first record; ``key_ids`` and
    ``error_ids`` give the chunks' codes (filled as the chunks are made, when they come from records).
    ``again``: the same chunks once more, with the same codes (without it, a level without windows keeps its
    ITLs whatever their number); ``spill``: where a level's blocks of ``block_rows`` rows wait (with ``again``
    only: a spilled level without windows is recounted)."""
    builders: dict[int, Builder] = {}
    keep = KEEP_ITL_MAX if again is not None else math.inf
    with gc_paused():
        for cols in extracted:
            ids = np.unique(cols["key"])
            for kid in ids.tolist():
                if kid not in builders:
                    key = next(k for k, v in key_ids.items() if v == kid)
                    builders[kid] = Builder(tuple(windows[key].values()) if key in windows else None, itl_exact_max,
                                             keep, spill if again is not None else None, block_rows)
                builders[kid].add(cols, None if ids.size == 1 else np.flatnonzero(cols["key"] == kid))
    names = list(error_ids)
    out = {}
    for key, kid in key_ids.items():
        if kid in builders:  # (a level announced but without a record has no columns, as in the file)
            builders[kid].error_names = names
            out[key] = Level.built(builders[kid], spill)
    recount = {kid: key for key, kid in key_ids.items() if kid in builders and builders[kid].recount}
    if recount and again is not None:
        _count_again(out, recount, again())
    return out


def _count_again(out: dict[Key, Level], recount: dict[int, Key], extracted: Iterable[dict[str, Any]]) -> None:
    """The second read: each recounted level's tokens inside the windows its records give (``own_windows``, the
    ones the summary asks for), counted as the first read counts known windows."""
    wins = {kid: tuple(out[key].own_windows().values()) for kid, key in recount.items()}
    counts = {kid: [Column(np.int64) for _ in wins[kid]] for kid in recount}
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
                for acc, count in zip(counts[kid], count_tokens(start + ttft / 1e3, flat, lens, wins[kid])):
                    acc.extend(count)
    for kid, key in recount.items():  # (records appended since the first read are not the level's: left out)
        tokens = {w: acc.done()[:out[key].n] for w, acc in zip(wins[kid], counts[kid])}
        if any(t.size != out[key].n for t in tokens.values()):
            raise ValueError("requests.jsonl lost records while it was read")
        out[key].recounted = tokens


def read_columns(path: Path, windows: dict[Key, dict[int, Window]], chunk_bytes: int = CHUNK_BYTES,
                 itl_exact_max: int = ITL_EXACT_MAX, write_copy: bool = False,
                 block_rows: int = BLOCK_ROWS) -> dict[Key, Level]:
    """``requests.jsonl`` streamed into per-level columns (no dict per record kept): from the binary copy of its
    columns beside it when that is whole and taken from this very file (``column_file``), else parsed —
    ``write_copy``: and the copy written as it is parsed, for the next reader."""
    if not path.exists():
        return {}
    stored = stored_columns(path)
    if stored is not None:
        try:
            return _levels(stored.chunks(), windows, {k: i for i, k in enumerate(stored.keys)},
                           {e: i for i, e in enumerate(stored.errors)}, itl_exact_max, stored.chunks,
                           Spill(path.parent), block_rows)
        except Damaged:
            pass
    keys, errors = level_codes(), error_codes()

    def parsed() -> Iterator[dict[str, Any]]:
        return (extract(recs, keys, errors) for recs in jsonl_chunks(path, chunk_bytes) if recs)

    if not (write_copy and writable(path)):
        return _levels(parsed(), windows, keys.ids, errors.ids, itl_exact_max, parsed, Spill(path.parent), block_rows)
    taken_from = fingerprint(path)
    sink = ColumnWriter(path)

    def copied() -> Iterator[dict[str, Any]]:
        for cols in parsed():
            sink.append(cols)
            yield cols

    try:
        out = _levels(copied(), windows, keys.ids, errors.ids, itl_exact_max, parsed, Spill(path.parent), block_rows)
    except BaseException:
        sink.discard()
        raise
    sink.close(list(keys.ids), list(errors.ids), sink.appended, taken_from)
    return out
