"""Trace replay input: Mooncake JSONL, Azure/Splitwise CSV, kvcap JSONL → rows of arrival and lengths.

Mooncake's ``hash_ids`` name 512-token prefix blocks; prompts built from them share text exactly where the
trace shares blocks, so a real server's prefix cache (or KV offload) sees the reuse the trace recorded.
"""

from __future__ import annotations

import csv
import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from kvcap.errors import InputError


@dataclass(frozen=True)
class TraceRow:
    arrival_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()


def read_trace(path: str, limit: int | None = None) -> list[TraceRow]:
    p = Path(path)
    if not p.is_file():
        raise InputError(f"trace {path!r} not found")
    rows: list[TraceRow] = []
    if _inner_suffix(p) == ".csv":
        with _open_text(p) as f:
            reader = csv.DictReader(f)
            cols = set(reader.fieldnames or ())
            t_col = "arrived_at" if "arrived_at" in cols else "TIMESTAMP" if "TIMESTAMP" in cols else None
            i_col = "num_prefill_tokens" if "num_prefill_tokens" in cols else "ContextTokens"
            o_col = "num_decode_tokens" if "num_decode_tokens" in cols else "GeneratedTokens"
            if t_col is None or i_col not in cols or o_col not in cols:
                raise InputError(f"trace {path!r}: CSV needs arrived_at|TIMESTAMP, num_prefill_tokens|ContextTokens "
                                 "and num_decode_tokens|GeneratedTokens columns")
            t0 = None
            for n, row in enumerate(reader, 2):
                try:
                    t_raw = row[t_col]
                    t = float(t_raw) if t_col == "arrived_at" else _azure_time(t_raw)
                    t0 = t if t0 is None else t0
                    rows.append(TraceRow(t - t0, max(1, int(float(row[i_col]))), max(1, int(float(row[o_col])))))
                except (ValueError, TypeError):
                    raise InputError(f"trace {path!r} line {n}: cannot read {row!r}") from None
                if limit and len(rows) >= limit:
                    break
    else:
        with _open_text(p) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    d = json.loads(line)
                    if "timestamp" in d:  # Mooncake: ms
                        rows.append(TraceRow(float(d["timestamp"]) / 1e3, int(d["input_length"]),
                                             int(d["output_length"]), tuple(d.get("hash_ids") or ())))
                    else:
                        rows.append(TraceRow(float(d["arrival_s"]), int(d["input_tokens"]), int(d["output_tokens"])))
                except (ValueError, KeyError, TypeError):
                    raise InputError(f"trace {path!r} line {n}: expected Mooncake (timestamp, input_length, "
                                     "output_length) or kvcap (arrival_s, input_tokens, output_tokens) "
                                     "fields") from None
                if limit and len(rows) >= limit:
                    break
    if not rows:
        raise InputError(f"trace {path!r} holds no requests")
    rows.sort(key=lambda r: r.arrival_s)
    t0 = rows[0].arrival_s
    return [TraceRow(r.arrival_s - t0, max(1, r.input_tokens), max(1, r.output_tokens), r.hash_ids) for r in rows]


def _inner_suffix(p: Path) -> str:
    """``trace.csv.gz`` → ``.csv``: a gzipped trace is read as what it holds."""
    suffixes = [x.lower() for x in p.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes.pop()
    return suffixes[-1] if suffixes else ""


def _open_text(p: Path) -> IO[str]:
    if p.suffix.lower() == ".gz":
        return gzip.open(p, "rt", newline="")
    return open(p, newline="")


def _azure_time(text: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(text.strip().replace(" ", "T")[:26]).timestamp()

