"""A published capacity table, read: CSV cells → typed values with their bounds, or an error naming row and column.

Tables come as people write them — 'Output tok/s', 'TTFT p95 (ms)', '250 ms', '>900', '140 (+44%)' — so this
module gives every column one spelling, every cell a number in one unit (latencies in ms) and keeps the
direction of a bound (">900" means at least 900) for the checks in `kvcap.audit.level_checks` to carry
through their arithmetic. It judges nothing.
"""

from __future__ import annotations

import csv
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcap.errors import InputError
from kvcap.units import DURATION_UNITS, parse_duration

REQUIRED = ("concurrency", "output_tok_s")

_ALIASES = {
    "streams": "concurrency", "concurrent_requests": "concurrency", "max_concurrency": "concurrency",
    "output_tokens_s": "output_tok_s", "output_tok_per_s": "output_tok_s", "output_tokens_per_s": "output_tok_s",
    "output_throughput": "output_tok_s", "throughput_tok_s": "output_tok_s", "tok_s": "output_tok_s",
    "output_token_s": "output_tok_s", "throughput": "output_tok_s",
    "req_s": "request_s", "requests_s": "request_s", "request_rate": "request_s", "rps": "request_s",
    "requests_per_s": "request_s", "request_throughput": "request_s",
    "mean_output_tokens": "output_tokens", "output_len": "output_tokens",
    "group": "arm", "variant": "arm", "notes": "note",
}
_LATENCY = re.compile(r"^(?:(?P<s1>p\d{2}|mean|avg|median)_)?(?P<metric>ttft|tpot|itl|e2e)"
                      r"(?:_(?P<s2>p\d{2}|mean|avg|median))?(?:_(?P<unit>ms|s|us))?"
                      r"(?:_(?P<s3>p\d{2}|mean|avg|median))?$")
_VALUE = re.compile(r"^(?P<op>>=|<=|>|<|≥|≤|~|≈)?\s*(?P<num>[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*"
                    r"(?P<unit>[a-zA-Zµ/_]*)$")
_RATE_UNITS = {"", "tok/s", "tokens/s", "token/s", "tok_s", "t/s"}
_REQ_UNITS = {"", "req/s", "/s", "rps", "requests/s"}
_COUNT_UNITS = {"", "tok", "tokens"}


@dataclass(frozen=True)
class Num:
    """A table value; ``bound`` is "lower" for ">900" (the true value is at least 900), "upper" for "<X"."""

    value: float
    bound: str | None = None
    raw: str = ""

    def text(self, fmt: str = "{:.4g}", exact: str = "") -> str:
        """'≥ 900' for a lower bound, '≤ …' for an upper one; ``exact`` prefixes a plain value (e.g. '≈ ')."""
        sign = {"lower": "≥ ", "upper": "≤ ", "unknown": "≈ "}.get(self.bound or "", exact)
        return sign + fmt.format(self.value)


def flip_bound(bound: str | None) -> str | None:
    """The direction of 1/x (or of −x) when x has this bound: a lower bound becomes an upper one."""
    return {"lower": "upper", "upper": "lower"}.get(bound or "", bound)


def combine_bounds(*bounds: str | None) -> str | None:
    """Direction of a result from the directions its inputs push it: none, one, or 'unknown' when they disagree."""
    got = {b for b in bounds if b}
    if not got:
        return None
    return got.pop() if len(got) == 1 else "unknown"


@dataclass
class TableRow:
    """One level of the table (an arm at a concurrency), typed."""

    where: str
    arm: str
    concurrency: float
    output_tok_s: Num
    latency: dict[str, dict[str, Num]] = field(default_factory=dict)
    """metric (ttft|tpot|e2e) → statistic ('' unlabelled, mean, p50, p95…) → value in ms."""
    output_tokens: float | None = None
    request_s: Num | None = None
    note: str = ""


def normalize_header(name: str) -> str:
    """'Output tok/s' → 'output_tok_s', 'TTFT p95 (ms)' → 'ttft_p95_ms': one spelling for every column."""
    s = re.sub(r"[^a-z0-9]+", "_", name.strip().lower().replace("/", "_")).strip("_")
    return _ALIASES.get(s, s)


def read_table(path: str | Path) -> list[dict[str, str]]:
    """Rows of a CSV table with normalized column names, validated so that bad cells fail here, with a line."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"table {p}: no such file")
    try:
        text = p.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"table {p}: cannot read it ({e.__class__.__name__}: {e})") from None
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    if not lines:
        raise InputError(f"table {p}: empty (need a header with {', '.join(REQUIRED)} and one row per level)")
    reader = csv.reader(lines)
    header = [normalize_header(h) for h in next(reader)]
    missing = [c for c in REQUIRED if c not in header]
    if missing:
        raise InputError(f"table {p}: missing required column(s) {', '.join(missing)} "
                         f"(found: {', '.join(h for h in header if h) or 'none'})")
    rows: list[dict[str, str]] = []
    for n, cells in enumerate(reader, start=2):
        if len(cells) > len(header) and any(c.strip() for c in cells[len(header):]):
            raise InputError(f"table {p}, row {n}: {len(cells)} cells but the header has {len(header)} columns")
        row = {h: c.strip() for h, c in zip(header, cells) if h and c.strip()}
        parse_row(row, f"table {p}, row {n}")
        rows.append(row)
    if not rows:
        raise InputError(f"table {p}: a header but no rows")
    return rows


def _parse_value(raw: Any, column: str, where: str, kind: str) -> Num:
    """Number with an optional bound prefix (">900") and unit; a trailing "(+44%)" annotation is dropped."""
    if isinstance(raw, bool):
        raise InputError(f"{where}: column {column}: {raw!r} is not a number")
    if isinstance(raw, (int, float)):
        if not math.isfinite(raw):
            raise InputError(f"{where}: column {column}: {raw!r} is not a finite number")
        return Num(float(raw), None, str(raw))
    text = re.sub(r"\s*[(（].*[)）]\s*$", "", str(raw).strip())
    m = _VALUE.match(text.replace(",", "") if re.fullmatch(r"[\d,.]+", text) else text)
    if not m:
        raise InputError(f"{where}: column {column}: {str(raw)!r} is not a number "
                         "(use e.g. 250, 250ms or >900 for a lower bound)")
    op, num, unit = m.group("op") or "", float(m.group("num")), m.group("unit")
    bound = "lower" if op in (">", ">=", "≥") else "upper" if op in ("<", "<=", "≤") else None
    if kind.startswith("time:"):
        header_unit = kind.split(":", 1)[1]
        if unit and unit not in DURATION_UNITS:
            raise InputError(f"{where}: column {column}: unknown unit {unit!r} in {str(raw)!r} (use ms or s)")
        value = parse_duration(f"{num}{unit}", f"{where}: column {column}", bare_unit=header_unit) * 1e3
    else:
        allowed = {"rate": _RATE_UNITS, "req": _REQ_UNITS}.get(kind, _COUNT_UNITS)
        if unit.lower() not in allowed:
            raise InputError(f"{where}: column {column}: unexpected unit {unit!r} in {str(raw)!r}")
        value = num
    return Num(value, bound, str(raw))


def _stat(*labels: str | None) -> str:
    for s in labels:
        if s:
            return {"median": "p50", "avg": "mean"}.get(s, s)
    return ""


def parse_row(row: dict[str, Any], where: str) -> TableRow:
    """One table row → typed values; InputError names the row and the column."""
    row = {normalize_header(str(k)): v for k, v in row.items() if k is not None and v is not None and str(v).strip()}
    missing = [c for c in REQUIRED if c not in row]
    if missing:
        raise InputError(f"{where}: missing required column(s) {', '.join(missing)}")
    conc = _parse_value(row["concurrency"], "concurrency", where, "count")
    if conc.bound or conc.value <= 0:
        raise InputError(f"{where}: column concurrency: {conc.raw!r} must be a positive number without a bound")
    tput = _parse_value(row["output_tok_s"], "output_tok_s", where, "rate")
    if tput.value <= 0:
        raise InputError(f"{where}: column output_tok_s: {tput.raw!r} must be positive")
    out = TableRow(where=where, arm=str(row.get("arm", "")).strip(), concurrency=conc.value, output_tok_s=tput,
                   note=str(row.get("note", "")).strip())
    for col, raw in row.items():
        m = _LATENCY.match(col)
        if not m:
            continue
        metric = "tpot" if m.group("metric") == "itl" else m.group("metric")
        unit = m.group("unit") or "ms"
        v = _parse_value(raw, col, where, f"time:{unit}")
        out.latency.setdefault(metric, {})[_stat(m.group("s1"), m.group("s2"), m.group("s3"))] = v
    if "output_tokens" in row:
        n = _parse_value(row["output_tokens"], "output_tokens", where, "count")
        if n.value < 1:
            raise InputError(f"{where}: column output_tokens: {n.raw!r} must be at least 1")
        out.output_tokens = n.value
    if "request_s" in row:
        out.request_s = _parse_value(row["request_s"], "request_s", where, "req")
        if out.request_s.value <= 0:
            raise InputError(f"{where}: column request_s: {out.request_s.raw!r} must be positive")
    return out
