"""Audit a published capacity table (concurrency, output tok/s, TTFT…) against its own arithmetic.

Capacity claims usually arrive as a small table, and its numbers constrain each other. In a closed loop at
fixed concurrency C, aggregate output throughput T fixes each stream's rate T/C; with N output tokens per
request that fixes the response time E2E = N·C/T, and since E2E = TTFT + (N−1)·TPOT it fixes the mean TPOT
too, even when the table prints none. Little's law ties request rate, response time and concurrency;
successive levels give the scaling efficiency (the article's condition a); a memory plan says whether the
"VRAM-only" arm was VRAM-bound at all. Pure functions: the CLI reads the CSV with `read_table` and prints
what `audit_table` returns.
"""

from __future__ import annotations

import csv
import itertools
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcap.analysis.capacity import MIN_SCALING
from kvcap.errors import InputError
from kvcap.plan import PlanResult, round_up
from kvcap.units import DURATION_UNITS, parse_duration

REQUIRED = ("concurrency", "output_tok_s")
CONSISTENCY_TOLERANCE = 0.20
"""Two estimates of the same quantity that differ by more than this fraction are called inconsistent."""
SUBLINEAR_SCALING = 0.5
"""Below this (but above MIN_SCALING) throughput still grows, but much less than the load: a shared bottleneck."""
CONTROL_ARM = re.compile(r"control|vram|hbm|baseline|显存|对照", re.IGNORECASE)

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
                      r"(?:_(?P<s2>p\d{2}|mean|avg|median))?(?:_(?P<unit>ms|s|us))?(?:_(?P<s3>p\d{2}|mean|avg|median))?$")
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


@dataclass
class _Row:
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
        _parse_row(row, f"table {p}, row {n}")
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


def _parse_row(row: dict[str, Any], where: str) -> _Row:
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
    out = _Row(where=where, arm=str(row.get("arm", "")).strip(), concurrency=conc.value, output_tok_s=tput,
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


# --- small helpers ------------------------------------------------------------------------------------------

def _flip(bound: str | None) -> str | None:
    return {"lower": "upper", "upper": "lower"}.get(bound or "", bound)


def _combine(*bounds: str | None) -> str | None:
    """Direction of a result from the directions its inputs push it: none, one, or 'unknown' when they disagree."""
    got = {b for b in bounds if b}
    if not got:
        return None
    return got.pop() if len(got) == 1 else "unknown"


def _pct(stat: str) -> int | None:
    return int(stat[1:]) if re.fullmatch(r"p\d{2}", stat) else None


def _judge(value: Num, stat: str, slo_stat: str, limit: float) -> tuple[str, str]:
    """'pass' | 'fail' | 'unknown' for a table statistic against an SLO on (maybe) another statistic.

    A lower percentile (or the mean, against p90 and above) already over the limit means the SLO's percentile
    is over it too; a higher percentile under the limit means it passes; anything else cannot be decided.
    """
    if stat == slo_stat:
        rel, note = "same", ""
    elif stat == "":
        rel, note = "same", f"unlabelled, read as the {slo_stat}"
    else:
        mine, theirs = _pct(stat), _pct(slo_stat)
        if stat == "mean":
            rel = "below" if theirs is not None and theirs >= 90 else "unknown"
        elif mine is not None and theirs is not None:
            rel = "below" if mine < theirs else "above"
        else:
            rel = "unknown"
        note = f"the table gives the {stat}, the SLO is on the {slo_stat}"
    if value.value > limit:
        ok = value.bound in (None, "lower") and rel in ("same", "below")
        return ("fail" if ok else "unknown"), note
    ok = value.bound in (None, "upper") and rel in ("same", "above")
    return ("pass" if ok else "unknown"), note


def _slo_items(slo: dict[str, float], metric: str) -> list[tuple[str, str, float]]:
    out = []
    for key, limit in slo.items():
        m = re.fullmatch(r"(ttft|tpot|itl|e2e|queue)_(p\d{2})", key)
        if m and ("tpot" if m.group(1) == "itl" else m.group(1)) == metric:
            out.append((key, m.group(2), float(limit)))
    return out


def _pick_mean(values: dict[str, Num]) -> tuple[str, Num] | None:
    """The value closest to a mean: the mean, an unlabelled value, the median, else the lowest percentile."""
    for s in ("mean", "", "p50"):
        if s in values:
            return s, values[s]
    pcts = sorted((p, s) for s in values if (p := _pct(s)) is not None)
    return (pcts[0][1], values[pcts[0][1]]) if pcts else None


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(float(x), nd)


def _lv(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x


def _fmt_level(arm: str, c: float) -> str:
    return f"{arm} @ {_lv(c):g}" if arm else f"{_lv(c):g} streams"


# --- the audit ----------------------------------------------------------------------------------------------

def audit_table(rows: list[dict[str, Any]], *, output_tokens: int | None, input_tokens: int | None = None,
                slo: dict[str, float] | None = None, plan: PlanResult | None = None,
                claimed_effective: float | None = None) -> dict[str, Any]:
    """Findings per level and check, the derived numbers per level, and the effective capacity they support.

    ``output_tokens`` is the output length per request (the article's "max 256": a cap, so the mean may be
    smaller; each finding says what follows if it is); a table column output_tokens or request_s overrides it
    per row. ``slo`` as from `kvcap.analysis.slo.parse_slo` (ms). ``plan`` a `kvcap.plan.PlanResult` for the
    same model, cluster and lengths. ``claimed_effective`` the capacity the table's source claims.
    """
    if not rows:
        raise InputError("table has no rows")
    if output_tokens is not None and output_tokens < 1:
        raise InputError(f"--output-tokens must be at least 1, got {output_tokens}")
    parsed = [_parse_row(r, f"row {i}") for i, r in enumerate(rows, start=1)]
    seen: set[tuple[str, float]] = set()
    for r in parsed:
        if (r.arm, r.concurrency) in seen:
            raise InputError(f"{r.where}: a second row for {_fmt_level(r.arm, r.concurrency)}: aggregate repeats "
                             "(e.g. their median) into one row per arm and level")
        seen.add((r.arm, r.concurrency))
    slo = dict(slo or {})
    findings: list[dict[str, Any]] = []
    assumptions: list[str] = []
    levels = [_audit_level(r, output_tokens, slo, findings) for r in parsed]
    sequences = _sequences(parsed)
    by_key = {(lv["arm"], lv["level"]): lv for lv in levels}
    for seq in sequences:
        _scaling(seq, by_key, findings)
    if plan is not None:
        _vram_check(parsed, plan, input_tokens, output_tokens, findings)
    _note_assumptions(parsed, output_tokens, slo, assumptions)
    effective = _effective(sequences, findings, claimed_effective, slo)
    findings.append(effective.pop("_finding"))
    for lv in levels:
        errs = [f["check"] for f in findings if f["level"] == lv["level"] and f["arm"] == (lv["arm"] or None)
                and f["severity"] == "error"]
        lv["failed_checks"] = list(dict.fromkeys(errs))
        lv["passes"] = not errs
    findings.sort(key=lambda f: (f["level"] is None, f["level"] or 0))
    return {"findings": findings, "levels": levels, "effective": effective,
            "summary": _summary(levels, effective, findings, slo), "assumptions": assumptions,
            "inputs": {"output_tokens": output_tokens, "input_tokens": input_tokens, "slo": slo,
                       "claimed_effective": claimed_effective, "plan_model": plan.model if plan else None}}


def _finding(row: _Row, check: str, severity: str, message: str, **numbers: Any) -> dict[str, Any]:
    return {"level": _lv(row.concurrency), "arm": row.arm or None, "check": check, "severity": severity,
            "message": message, **numbers}


def _audit_level(row: _Row, output_tokens: int | None, slo: dict[str, float],
                 findings: list[dict[str, Any]]) -> dict[str, Any]:
    """Checks 1 (implied TPOT), 2 (Little's law) and 4 (latency vs SLO) for one row; returns its derived numbers."""
    c, t = row.concurrency, row.output_tok_s
    per_stream = t.value / c
    lv: dict[str, Any] = {"level": _lv(c), "arm": row.arm, "output_tok_s": t.value,
                          "output_tok_s_bound": t.bound, "per_stream_tok_s": _r(per_stream),
                          "ms_per_token": _r(1e3 / per_stream)}
    for metric, vals in row.latency.items():
        for stat, v in vals.items():
            key = f"{metric}_{stat}_ms" if stat else f"{metric}_ms"
            lv[key] = v.value
            if v.bound:
                lv[key + "_bound"] = v.bound
    if row.note:
        lv["note"] = row.note

    # the output length: a measured mean beats a given figure (which may be a cap)
    n, n_src = None, None
    if row.output_tokens is not None:
        n, n_src = row.output_tokens, "table"
    elif row.request_s is not None:
        n, n_src = t.value / row.request_s.value, "request_s"
    elif output_tokens is not None:
        n, n_src = float(output_tokens), "given"
    lv["output_tokens"], lv["output_tokens_source"] = _r(n, 2), n_src
    if row.request_s is not None and output_tokens is not None and row.output_tokens is None:
        mean_n = t.value / row.request_s.value
        if abs(mean_n / output_tokens - 1) > CONSISTENCY_TOLERANCE:
            findings.append(_finding(
                row, "output_length", "warn",
                f"{t.value:g} tok/s ÷ {row.request_s.value:g} req/s = {mean_n:.0f} output tokens per request, not "
                f"{output_tokens}: the given length is not the mean (a cap?); the audit uses {mean_n:.0f}",
                mean_output_tokens=_r(mean_n, 2), given_output_tokens=output_tokens))

    ttft = _pick_mean(row.latency.get("ttft", {}))
    tpot_limits = _slo_items(slo, "tpot")
    if n is None:
        findings.append(_finding(row, "implied_tpot", "info",
                                 f"{_fmt_level(row.arm, c)}: {t.value:g} tok/s = {per_stream:.2f} tok/s per stream; "
                                 "give --output-tokens to derive E2E and TPOT from it",
                                 per_stream_tok_s=_r(per_stream)))
    elif n > 1:
        _implied_tpot(row, lv, n, n_src, per_stream, ttft, slo, findings)
    _table_latency_slo(row, lv, slo, findings)
    if n is not None:
        _littles_law(row, lv, n, n_src, ttft, tpot_limits, findings)
    return lv


def _implied_tpot(row: _Row, lv: dict[str, Any], n: float, n_src: str | None, per_stream: float,
                  ttft: tuple[str, Num] | None, slo: dict[str, float], findings: list[dict[str, Any]]) -> None:
    """Check 1: E2E = N / (T/C); TPOT = (E2E − TTFT)/(N − 1); against the table's TPOT and the SLO."""
    c, t = row.concurrency, row.output_tok_s
    tpot_limits = _slo_items(slo, "tpot")
    ms_tok = 1e3 / per_stream
    e2e_ms = n * ms_tok
    e2e_bound = _flip(t.bound)
    notes: list[str] = []
    if ttft is None:
        t_stat, t_ms, t_bound, ttft_push = "", 0.0, None, "upper"
        notes.append("no TTFT in the table: TTFT taken as 0, so TPOT is an upper bound")
    else:
        t_stat, tv = ttft
        t_ms, t_bound = tv.value, tv.bound
        ttft_push = _flip(tv.bound)
        if (p := _pct(t_stat)) is not None and p >= 90:
            ttft_push = _combine(ttft_push, "lower")
            notes.append(f"TTFT {t_stat} used for the mean TTFT: the mean is lower, so the true TPOT is higher")
        elif t_stat == "p50":
            notes.append("TTFT median used for the mean TTFT")
        if tv.bound == "lower":
            notes.append(f"TTFT {tv.raw!r} is a lower bound, so this TPOT is an upper bound")
    tpot = (e2e_ms - t_ms) / (n - 1)
    tpot_bound = _combine(_flip(t.bound), ttft_push)
    lv.update(implied_e2e_s=_r(e2e_ms / 1e3), implied_e2e_bound=e2e_bound, implied_tpot_ms=_r(tpot),
              implied_tpot_bound=tpot_bound)
    head = (f"{_fmt_level(row.arm, c)}: {t.value:g} tok/s ÷ {_lv(c):g} = {per_stream:.3g} tok/s per stream "
            f"({ms_tok:.1f} ms per token); {n:.0f} output tokens take ≈ {e2e_ms / 1e3:.2f} s end to end, so with "
            f"TTFT {Num(t_ms, t_bound).text('{:g}')} ms the mean TPOT {Num(tpot, tpot_bound).text('{:.1f}', '≈ ')} ms "
            f"(E2E = TTFT + {n - 1:.0f}·TPOT)")
    nums: dict[str, Any] = {"per_stream_tok_s": _r(per_stream), "ms_per_token": _r(ms_tok),
                            "output_tokens": _r(n, 2), "implied_e2e_s": _r(e2e_ms / 1e3), "ttft_ms": t_ms,
                            "implied_tpot_ms": _r(tpot), "implied_tpot_bound": tpot_bound}
    if tpot <= 0:
        findings.append(_finding(row, "implied_tpot", "error",
                                 head + f": TTFT {t_ms:g} ms exceeds the whole implied E2E — the table's "
                                 "throughput and TTFT contradict each other", **nums))
        return
    severity, verdicts = "info", []
    if tpot_limits:
        key, slo_stat, limit = min(tpot_limits, key=lambda x: x[2])
        verdict, _ = _judge(Num(tpot, tpot_bound), "mean", slo_stat, limit)
        nmax, nmax_bound = _max_output_for_slo(ms_tok, t_ms, limit, _combine(t_bound, t.bound))
        required = c * n / ((t_ms + (n - 1) * limit) / 1e3)
        nums.update(slo_key=key, slo_limit_ms=limit, max_mean_output_tokens_for_slo=nmax,
                    max_mean_output_tokens_bound=nmax_bound, required_output_tok_s_for_slo=_r(required, 2))
        lv.update(max_mean_output_tokens_for_slo=nmax, required_output_tok_s_for_slo=_r(required, 2))
        if nmax is None:
            need = "any output length meets it at this per-stream rate"
        elif nmax < 2:
            need = "no output length meets it at this per-stream rate and TTFT"
        else:
            need = (f"a mean output ≤ {nmax} tokens would meet it at this throughput"
                    + {"lower": " (a lower bound: the limit is at least this)",
                       "upper": " (an upper bound: the limit is at most this)"}.get(nmax_bound or "", ""))
        cap = " (if that is a cap, the mean may be smaller)" if n_src == "given" else ""
        if verdict == "fail":
            severity = "error"
            verdicts.append(f"> {key} {limit:g} ms: the mean alone is over the {slo_stat} limit, so the {slo_stat} "
                            f"is too (unless a few extreme outliers inflate the mean). With {n:.0f} output tokens"
                            f"{cap}, {need}; at {n:.0f} tokens it needs ≥ {required:.1f} tok/s at {_lv(c):g} streams")
        elif verdict == "unknown" and tpot_bound in (None, "upper") and tpot <= limit:
            verdicts.append(f"≤ {key} {limit:g} ms as a mean; the {slo_stat} is not known from the throughput and "
                            "may still exceed it")
        elif verdict == "unknown":
            severity = "warn"
            needed_ttft = max(0.0, e2e_ms - (n - 1) * limit)
            verdicts.append(f"vs {key} {limit:g} ms: cannot tell from these bounds; TPOT would meet it only if TTFT "
                            f"≥ {needed_ttft / 1e3:.2f} s; {need}")
            nums["ttft_ms_needed_for_tpot_slo"] = _r(needed_ttft, 1)
            ttft_limits = _slo_items(slo, "ttft")
            if ttft_limits and needed_ttft > min(x[2] for x in ttft_limits):
                verdicts[-1] += (f" — but a TTFT that long breaks {min(ttft_limits, key=lambda x: x[2])[0]}: "
                                 "the level cannot meet both")
        else:
            verdicts.append(f"≤ {key} {limit:g} ms")
    if n_src == "given" and not tpot_limits:
        notes.append(f"{n:.0f} output tokens assumed per request; if that is a cap the mean is smaller and so is "
                     "the TPOT")
    msg = head + (" " + "; ".join(verdicts) if verdicts else "") + ("" if not notes else f" [{'; '.join(notes)}]")
    findings.append(_finding(row, "implied_tpot", severity, msg, **nums))

    table_tpot = _pick_mean(row.latency.get("tpot", {}))
    if table_tpot is not None:
        stat, tv = table_tpot
        diff = tv.value / tpot - 1
        sev = "warn" if abs(diff) > CONSISTENCY_TOLERANCE and not (tv.bound or tpot_bound) else "info"
        what = "inconsistent" if sev == "warn" else "consistent" if abs(diff) <= CONSISTENCY_TOLERANCE else "bounds only"
        findings.append(_finding(
            row, "tpot_consistency", sev,
            f"{_fmt_level(row.arm, c)}: table TPOT{' ' + stat if stat else ''} {tv.text('{:g}')} ms vs "
            f"{tpot:.1f} ms implied by the throughput ({diff:+.0%}): {what}"
            + (" — either the throughput or the TPOT is misreported, or streams idled between requests"
               if sev == "warn" and diff < 0 else ""),
            table_tpot_ms=tv.value, implied_tpot_ms=_r(tpot), relative_difference=_r(diff)))


def _max_output_for_slo(ms_tok: float, ttft_ms: float, limit: float, in_bound: str | None) -> tuple[int | None, str | None]:
    """Largest mean N with (N·ms_tok − TTFT)/(N − 1) ≤ limit: N ≤ (TTFT − limit)/(ms_tok − limit).

    Shorter outputs spread the TTFT over fewer tokens, so the same per-stream rate implies a smaller TPOT.
    None when the per-stream time per token is already within the limit (any length meets it).
    """
    if ms_tok <= limit:
        return None, None
    nmax = (ttft_ms - limit) / (ms_tok - limit)
    bound = "lower" if in_bound == "lower" else "upper" if in_bound == "upper" else None
    return max(0, math.floor(nmax + 1e-9)), bound


def _table_latency_slo(row: _Row, lv: dict[str, Any], slo: dict[str, float], findings: list[dict[str, Any]]) -> None:
    """Check 4: the table's own TTFT / TPOT / E2E against each SLO key on that metric (">900" is ≥ 900)."""
    for metric in ("ttft", "tpot", "e2e"):
        values = row.latency.get(metric, {})
        for key, slo_stat, limit in _slo_items(slo, metric):
            if not values:
                continue
            stat = slo_stat if slo_stat in values else "" if "" in values else None
            if stat is None:  # the most decisive statistic the table has
                cands = [(s, _judge(v, s, slo_stat, limit)) for s, v in values.items()]
                stat = next((s for s, (v, _) in cands if v != "unknown"), cands[0][0])
            v = values[stat]
            verdict, note = _judge(v, stat, slo_stat, limit)
            sev = {"fail": "error", "unknown": "warn", "pass": "info"}[verdict]
            label = f"{metric.upper()}{' ' + stat if stat else ''}"
            rel = {"fail": ">", "pass": "≤", "unknown": "vs"}[verdict]
            extra = []
            if note:
                extra.append(note)
            if v.bound == "lower":
                extra.append(f"{v.raw!r} is a lower bound")
            if verdict == "unknown":
                extra.append("cannot tell")
            findings.append(_finding(
                row, f"{metric}_slo", sev,
                f"{_fmt_level(row.arm, row.concurrency)}: {label} {v.text('{:g}')} ms {rel} {key} {limit:g} ms"
                + (f" ({'; '.join(extra)})" if extra else ""),
                value_ms=v.value, value_bound=v.bound, statistic=stat or None, slo_key=key, slo_limit_ms=limit))
            lv[f"{metric}_slo_ok"] = {"pass": True, "fail": False}.get(verdict)


def _littles_law(row: _Row, lv: dict[str, Any], n: float, n_src: str | None, ttft: tuple[str, Num] | None,
                 tpot_limits: list[tuple[str, str, float]], findings: list[dict[str, Any]]) -> None:
    """Check 2: in flight = request rate × response time should equal the fixed concurrency.

    With E2E implied from the throughput it does by construction (an identity, reported as such); it tests
    something only with a measured request rate or E2E, or the table's TPOT. At the SLO's TPOT it also says
    how many requests the table's request rate keeps in flight within the SLO.
    """
    c, t = row.concurrency, row.output_tok_s
    lam_implied = t.value / n
    lam = row.request_s.value if row.request_s is not None else lam_implied
    lam_src = "measured request_s" if row.request_s is not None else f"{t.value:g} tok/s ÷ {n:.0f} tokens"
    e2e_vals = row.latency.get("e2e", {})
    e2e_pick = _pick_mean(e2e_vals)
    tpot_pick = _pick_mean(row.latency.get("tpot", {}))
    t_ms = ttft[1].value if ttft else 0.0
    if e2e_pick is not None:
        e2e_ms, e2e_src = e2e_pick[1].value, f"the table's E2E{' ' + e2e_pick[0] if e2e_pick[0] else ''}"
    elif tpot_pick is not None and n > 1:
        e2e_ms = t_ms + (n - 1) * tpot_pick[1].value
        e2e_src = "TTFT + (N−1)·TPOT from the table"
    else:
        e2e_ms, e2e_src = n * c / t.value * 1e3, "E2E implied by the throughput"
    in_flight = lam * e2e_ms / 1e3
    ratio = in_flight / c
    identity = e2e_src.startswith("E2E implied") and (row.request_s is None or n_src == "request_s")
    nums: dict[str, Any] = {"request_s": _r(lam), "request_s_source": lam_src, "e2e_s": _r(e2e_ms / 1e3),
                            "e2e_source": e2e_src, "in_flight": _r(in_flight, 3), "little_ratio": _r(ratio)}
    lv.update(request_s=_r(lam), in_flight=_r(in_flight, 3), little_ratio=_r(ratio))
    msg = (f"{_fmt_level(row.arm, c)}: {lam:.4g} req/s ({lam_src}) × {e2e_ms / 1e3:.2f} s ({e2e_src}) = "
           f"{in_flight:.2f} in flight, {ratio:.2f}× the concurrency")
    if identity:
        sev = "info"
        msg += " — an identity here (E2E was derived from the same throughput), so it checks nothing by itself"
    elif abs(ratio - 1) > CONSISTENCY_TOLERANCE:
        sev = "warn"
        msg += (": fewer in flight than the concurrency — streams idled (think time, gaps, errors) or the "
                "latency is understated" if ratio < 1 else
                ": more in flight than the concurrency allows — the throughput or the latency is overstated "
                "(or the latency is a high percentile, not the mean)")
    else:
        sev = "info"
        msg += ": consistent"
    if tpot_limits and n > 1:
        key, _, limit = min(tpot_limits, key=lambda x: x[2])
        e2e_slo = t_ms + (n - 1) * limit
        within = lam * e2e_slo / 1e3
        wb = ttft[1].bound if ttft else "lower"
        nums.update(in_flight_within_slo=_r(within, 3), in_flight_within_slo_bound=wb, e2e_at_slo_s=_r(e2e_slo / 1e3))
        lv["in_flight_within_slo"] = _r(within, 3)
        msg += (f". At {key} {limit:g} ms a request takes {Num(e2e_slo / 1e3, wb).text('{:.2f}')} s, so this request "
                f"rate keeps {Num(within, wb).text('{:.1f}')} in flight"
                + (f": {_lv(c):g} streams each take longer than the SLO allows" if within < c and wb != "lower"
                   else ""))
    findings.append(_finding(row, "littles_law", sev, msg, **nums))


def _sequences(rows: list[_Row]) -> list[list[_Row]]:
    """Levels to compare for scaling: one per arm when arms share levels (a real A/B), else the whole table."""
    arms: dict[str, set[float]] = {}
    for r in rows:
        arms.setdefault(r.arm, set()).add(r.concurrency)
    shared = len(arms) > 1 and any(a & b for i, a in enumerate(arms.values())
                                   for b in list(arms.values())[i + 1:])
    if shared:
        return [sorted((r for r in rows if r.arm == a), key=lambda r: r.concurrency) for a in arms]
    return [sorted(rows, key=lambda r: r.concurrency)]


def _scaling(seq: list[_Row], by_key: dict[tuple[str, Any], dict[str, Any]], findings: list[dict[str, Any]]) -> None:
    """Check 3: (Δthroughput %)/(Δconcurrency %) between successive levels; < MIN_SCALING fails condition (a)."""
    for a, b in itertools.pairwise(seq):
        gain = b.output_tok_s.value / a.output_tok_s.value - 1
        prop = b.concurrency / a.concurrency - 1
        eff = gain / prop
        marginal = (b.output_tok_s.value - a.output_tok_s.value) / (b.concurrency - a.concurrency)
        bound = _combine(b.output_tok_s.bound, _flip(a.output_tok_s.bound))
        by_key[(b.arm, _lv(b.concurrency))]["scaling_efficiency"] = _r(eff)
        step = f"{_lv(a.concurrency):g} → {_lv(b.concurrency):g}"
        msg = (f"{step}: throughput {a.output_tok_s.value:g} → {b.output_tok_s.value:g} tok/s ({gain:+.1%}) for "
               f"{prop:+.0%} concurrency: efficiency {Num(eff, bound).text('{:.3f}')}; each added stream adds "
               f"{marginal:.2f} tok/s against {a.output_tok_s.value / a.concurrency:.2f} per stream before")
        if eff < MIN_SCALING:
            sev = "error"
            msg += f" — throughput no longer grows (< {MIN_SCALING:g}): condition (a) fails, a stress limit"
        elif eff < SUBLINEAR_SCALING:
            sev = "warn"
            msg += " — sub-linear: the streams share a saturating resource (compute, memory bandwidth, link)"
        else:
            sev = "info"
        if a.arm != b.arm:
            msg += f" [crosses arms: {a.arm or '?'} → {b.arm or '?'}, so the step mixes the arm change with the load]"
        findings.append(_finding(b, "scaling", sev, msg, from_level=_lv(a.concurrency), scaling_efficiency=_r(eff),
                                 throughput_gain=_r(gain), concurrency_gain=_r(prop),
                                 marginal_tok_s_per_stream=_r(marginal), bound=bound))


def _model_context(name: str) -> int | None:
    try:
        from kvcap.specs.model import load_model
        return load_model(name).max_position_embeddings or None
    except (InputError, OSError, ValueError):
        return None


def _vram_check(rows: list[_Row], plan: PlanResult, input_tokens: int | None, output_tokens: int | None,
                findings: list[dict[str, Any]]) -> None:
    """Check 5: was the "VRAM-only" control actually VRAM-bound? The plan says how many requests HBM holds."""
    hbm = plan.resident_requests.get("hbm", 0)
    per_gpu = plan.resident_requests_per_gpu.get("hbm", hbm / max(plan.gpus, 1))
    ctrl = [r for r in rows if r.arm and CONTROL_ARM.search(r.arm)]
    top = max(r.concurrency for r in rows)
    anchor = max(ctrl, key=lambda r: r.concurrency) if ctrl else max(rows, key=lambda r: r.concurrency)
    cc = anchor.concurrency
    mismatch = []
    if input_tokens is not None and input_tokens != plan.input_tokens:
        mismatch.append(f"input {input_tokens} vs the plan's {plan.input_tokens}")
    if output_tokens is not None and output_tokens != plan.output_tokens:
        mismatch.append(f"output {output_tokens} vs the plan's {plan.output_tokens}")
    per_replica = math.ceil(cc / plan.replicas)
    linear = plan.kv_bytes_per_request == round_up(plan.tokens_per_request, plan.block_size) * plan.kv_bytes_per_token
    bound_tokens = None
    if per_replica <= plan.max_num_seqs:
        bound_tokens = plan.kv_tokens_per_gpu // per_replica // plan.block_size * plan.block_size
    ctx = _model_context(plan.model)
    nums: dict[str, Any] = {
        "model": plan.model, "attention": plan.attention_kind, "gpu": plan.gpu, "gpus": plan.gpus,
        "tokens_per_request": plan.tokens_per_request, "kv_bytes_per_request": plan.kv_bytes_per_request,
        "usable_kv_bytes_per_gpu": plan.usable_kv_bytes_per_gpu, "hbm_requests": hbm,
        "hbm_requests_per_gpu": _r(per_gpu, 2), "control_concurrency": _lv(cc), "max_concurrency": _lv(top),
        "vram_bound_above_tokens": bound_tokens, "model_context": ctx}
    head = (f"plan: {plan.model} ({plan.attention_kind}, {plan.kv_bytes_per_token / 1024:.0f} KiB of KV per token) "
            f"on {plan.gpus}× {plan.gpu}: {plan.usable_kv_bytes_per_gpu / 2**30:.2f} GiB of KV per GPU holds "
            f"{hbm} requests of {plan.tokens_per_request} tokens ({per_gpu:g} per GPU, "
            f"{plan.kv_bytes_per_request / 2**20:.0f} MiB each)")
    where = f"the {anchor.arm} arm stops at {_lv(cc):g}" if ctrl else f"the table's largest level is {_lv(cc):g}"
    if cc < hbm:
        sev = "warn"
        msg = (f"{head}; {where} ({cc / plan.gpus:g} per GPU): the control was not VRAM-bound — "
               f"HBM had room for {hbm - cc:g} more")
        if top <= hbm:
            msg += (f", and every level up to {_lv(top):g} fits in HBM too, so the spill-over arm had nothing to "
                    "spill: its gain or loss is not the memory's")
        if bound_tokens is not None:
            msg += (f". At {_lv(cc):g} streams HBM becomes the limit only above ≈ {bound_tokens:,} tokens per "
                    f"request{'' if linear else ' (full-attention estimate)'}")
            if ctx and bound_tokens > ctx:
                msg += f", beyond this model's {ctx:,}-token context: it cannot be VRAM-bound here"
    else:
        sev = "info"
        msg = (f"{head}; {where} ({cc / plan.gpus:g} per GPU): consistent with a VRAM-bound control "
               "(HBM is full at or below this level)")
    if mismatch:
        msg += f" [the plan's lengths differ from the table's: {', '.join(mismatch)}]"
    findings.append(_finding(anchor, "vram_bound", sev, msg, **nums))


def _effective(sequences: list[list[_Row]], findings: list[dict[str, Any]], claimed: float | None,
               slo: dict[str, float]) -> dict[str, Any]:
    """Check 6: the largest level that passes every check, counting up from the lowest (as `capacities` does)."""

    def errors(r: _Row, skip: tuple[str, ...] = ()) -> list[str]:
        return [f["check"] for f in findings if f["level"] == _lv(r.concurrency) and f["arm"] == (r.arm or None)
                and f["severity"] == "error" and f["check"] not in skip]

    def walk(seq: list[_Row], skip: tuple[str, ...] = ()) -> tuple[float | None, list[str], float | None]:
        eff = None
        for r in seq:
            errs = errors(r, skip)
            if errs:
                return eff, list(dict.fromkeys(errs)), r.concurrency
            eff = r.concurrency
        return eff, [], None

    by_arm: dict[str, Any] = {}
    best, limited_by, first_fail = None, [], None
    best_wo = None
    for seq in sequences:
        eff, lim, fail_at = walk(seq)
        eff_wo, _, _ = walk(seq, ("implied_tpot",))
        if len(sequences) > 1:
            by_arm[seq[0].arm] = None if eff is None else _lv(eff)
        if (eff is not None and (best is None or eff > best)) or (best is None and first_fail is None):
            best, limited_by, first_fail = eff, lim, fail_at
        if eff_wo is not None and (best_wo is None or eff_wo > best_wo):
            best_wo = eff_wo
    stress = max(r.concurrency for seq in sequences for r in seq)
    out: dict[str, Any] = {"level": None if best is None else _lv(best), "by_arm": by_arm or None,
                           "stress_limit": _lv(stress), "limited_by": limited_by,
                           "first_failing_level": None if first_fail is None else _lv(first_fail),
                           "without_implied_tpot": None if best_wo is None else _lv(best_wo),
                           "claimed": claimed, "slo": slo}
    eff_txt = "none — no level" if best is None else f"{_lv(best):g}"
    msg = f"effective capacity by the table's own numbers{' under the SLO' if slo else ''}: {eff_txt}"
    if best is None:
        msg += " passes every check"
    if first_fail is not None:
        msg += f" (first failure at {_lv(first_fail):g}: {', '.join(limited_by)})"
    if best_wo != best:
        msg += (f"; taking the table's latencies at face value and ignoring the TPOT its throughput implies, "
                f"it would be {'none' if best_wo is None else f'{_lv(best_wo):g}'}")
    sev = "info"
    if claimed is not None:
        if best is not None and claimed <= best:
            msg += f"; the claim of {claimed:g} is supported"
        else:
            sev = "error"
            msg += (f"; the claim of {claimed:g} is not supported by the table's own numbers"
                    + (" (it follows from TTFT alone)" if best_wo is not None and claimed <= best_wo else ""))
    msg += f"; stress limit {_lv(stress):g}"
    out["_finding"] = {"level": None, "arm": None, "check": "effective_capacity", "severity": sev, "message": msg,
                       "effective": out["level"], "without_implied_tpot": out["without_implied_tpot"],
                       "claimed": claimed, "stress_limit": out["stress_limit"]}
    out["message"] = msg
    return out


def _note_assumptions(rows: list[_Row], output_tokens: int | None, slo: dict[str, float],
                      assumptions: list[str]) -> None:
    assumptions.append("closed loop: each of the C streams always has a request in flight, so T = C·N/E2E; "
                       "idle streams would make the true E2E and TPOT smaller")
    if output_tokens is not None:
        assumptions.append(f"{output_tokens} output tokens per request (where the table gives no length or rate); "
                           "if it is a cap the mean is smaller: see max_mean_output_tokens_for_slo")
    if any("" in r.latency.get("ttft", {}) for r in rows):
        assumptions.append("unlabelled TTFT is read as the mean in E2E = TTFT + (N−1)·TPOT and as the SLO's "
                           "percentile against the SLO; either reading only makes a failure firmer")
    if any(v.bound for r in rows for vals in r.latency.values() for v in vals.values()):
        assumptions.append("a value like '>900' is a lower bound: it fails an SLO it exceeds, and what is derived "
                           "from it is marked as a bound")
    unchecked = [k for k in slo if not re.fullmatch(r"(ttft|tpot|itl|e2e)_p\d{2}", k)]
    if unchecked:
        assumptions.append(f"SLO keys not checkable from a table: {', '.join(unchecked)}")


def _summary(levels: list[dict[str, Any]], effective: dict[str, Any], findings: list[dict[str, Any]],
             slo: dict[str, float]) -> str:
    parts = []
    for lv in levels:
        bits = [f"{lv['per_stream_tok_s']:.3g} tok/s/stream"]
        if lv.get("implied_tpot_ms") is not None:
            bits.append(f"TPOT {Num(lv['implied_tpot_ms'], lv.get('implied_tpot_bound')).text('{:.1f}', '≈ ')} ms")
        if lv.get("scaling_efficiency") is not None:
            bits.append(f"scaling {lv['scaling_efficiency']:.2f}")
        bits.append("ok" if lv["passes"] else "fails " + ",".join(lv["failed_checks"]))
        parts.append(f"{lv['level']:g}{' (' + lv['arm'] + ')' if lv['arm'] else ''}: {', '.join(bits)}")
    n_err = sum(f["severity"] == "error" for f in findings)
    n_warn = sum(f["severity"] == "warn" for f in findings)
    return (f"{len(levels)} levels — " + "; ".join(parts) + f". {effective['message']}. "
            f"{n_err} errors, {n_warn} warnings" + ("" if slo else " (no SLO given)"))
