"""The checks `kvcap audit` makes on each level of a table by itself: implied TPOT, latency vs SLO, Little's law.

In a closed loop at fixed concurrency C, aggregate output throughput T fixes each stream's rate T/C; with N
output tokens per request that fixes E2E = N·C/T, and since E2E = TTFT + (N−1)·TPOT it fixes the mean TPOT
too, even when the table prints none. Each check appends findings (dicts: level, arm, check, severity,
message, numbers) and fills the level's derived numbers; checks across levels live in `kvcap.audit.across_levels`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvcap.analysis.slo import SloItem, judge_statistic, percentile_limits, percentile_number
from kvcap.audit.table import Num, TableRow, combine_bounds, flip_bound

CONSISTENCY_TOLERANCE = 0.20
"""Two estimates of the same quantity that differ by more than this fraction are called inconsistent."""

Finding = dict[str, Any]


# --- shared by every check -----------------------------------------------------------------------------------

def rounded(x: float | None, nd: int = 4) -> float | None:
    """A number as findings carry it: rounded to ``nd`` decimals, None kept."""
    return None if x is None else round(float(x), nd)


def level_value(x: float) -> int | float:
    """A concurrency as the table means it: 8, not 8.0."""
    return int(x) if float(x).is_integer() else x


def level_label(arm: str, c: float) -> str:
    """'control @ 8' for a level of an arm, '8 streams' for a table without arms."""
    return f"{arm} @ {level_value(c):g}" if arm else f"{level_value(c):g} streams"


def finding(row: TableRow, check: str, severity: str, message: str, **numbers: Any) -> Finding:
    """One finding about one level; ``severity`` is 'error' (the level fails), 'warn' or 'info'."""
    return {"level": level_value(row.concurrency), "arm": row.arm or None, "check": check, "severity": severity,
            "message": message, **numbers}


def _pick_mean(values: dict[str, Num]) -> tuple[str, Num] | None:
    """The value closest to a mean: the mean, an unlabelled value, the median, else the lowest percentile."""
    for s in ("mean", "", "p50"):
        if s in values:
            return s, values[s]
    pcts = sorted((p, s) for s in values if (p := percentile_number(s)) is not None)
    return (pcts[0][1], values[pcts[0][1]]) if pcts else None


# --- one level -----------------------------------------------------------------------------------------------

def audit_level(row: TableRow, output_tokens: int | None, slo: dict[str, float],
                findings: list[Finding]) -> dict[str, Any]:
    """Checks 1 (implied TPOT), 2 (Little's law) and 4 (latency vs SLO) for one row; returns its derived numbers."""
    c, t = row.concurrency, row.output_tok_s
    per_stream = t.value / c
    lv = _level_figures(row, per_stream)
    n, n_src = _output_length(row, output_tokens, lv, findings)
    ttft = _pick_mean(row.latency.get("ttft", {}))
    tpot_limits = percentile_limits(slo, "tpot")
    if n is None:
        findings.append(finding(row, "implied_tpot", "info",
                                f"{level_label(row.arm, c)}: {t.value:g} tok/s = {per_stream:.2f} tok/s per stream; "
                                "give --output-tokens to derive E2E and TPOT from it",
                                per_stream_tok_s=rounded(per_stream)))
    elif n > 1:
        _implied_tpot(row, lv, n, n_src, per_stream, ttft, slo, findings)
    _table_latency_slo(row, lv, slo, findings)
    if n is not None:
        _littles_law(row, lv, n, n_src, ttft, tpot_limits, findings)
    return lv


def _level_figures(row: TableRow, per_stream: float) -> dict[str, Any]:
    """The level's numbers as the table gives them, plus the per-stream rate."""
    t = row.output_tok_s
    lv: dict[str, Any] = {"level": level_value(row.concurrency), "arm": row.arm, "output_tok_s": t.value,
                          "output_tok_s_bound": t.bound, "per_stream_tok_s": rounded(per_stream),
                          "ms_per_token": rounded(1e3 / per_stream)}
    for metric, vals in row.latency.items():
        for stat, v in vals.items():
            key = f"{metric}_{stat}_ms" if stat else f"{metric}_ms"
            lv[key] = v.value
            if v.bound:
                lv[key + "_bound"] = v.bound
    if row.note:
        lv["note"] = row.note
    return lv


def _output_length(row: TableRow, output_tokens: int | None, lv: dict[str, Any],
                   findings: list[Finding]) -> tuple[float | None, str | None]:
    """The output length per request and where it came from: a measured mean beats a given figure (maybe a cap)."""
    t = row.output_tok_s
    n, n_src = None, None
    if row.output_tokens is not None:
        n, n_src = row.output_tokens, "table"
    elif row.request_s is not None:
        n, n_src = t.value / row.request_s.value, "request_s"
    elif output_tokens is not None:
        n, n_src = float(output_tokens), "given"
    lv["output_tokens"], lv["output_tokens_source"] = rounded(n, 2), n_src
    if row.request_s is not None and output_tokens is not None and row.output_tokens is None:
        mean_n = t.value / row.request_s.value
        if abs(mean_n / output_tokens - 1) > CONSISTENCY_TOLERANCE:
            findings.append(finding(
                row, "output_length", "warn",
                f"{t.value:g} tok/s ÷ {row.request_s.value:g} req/s = {mean_n:.0f} output tokens per request, not "
                f"{output_tokens}: the given length is not the mean (a cap?); the audit uses {mean_n:.0f}",
                mean_output_tokens=rounded(mean_n, 2), given_output_tokens=output_tokens))
    return n, n_src


# --- check 1: the TPOT the throughput implies ----------------------------------------------------------------

@dataclass
class _ImpliedTpot:
    """One level's E2E = N·(ms per token) and TPOT = (E2E − TTFT)/(N − 1), with the directions of their bounds."""

    n: float
    n_src: str | None
    per_stream: float
    ms_tok: float
    e2e_ms: float
    ttft_ms: float
    ttft_bound: str | None
    tpot: float
    tpot_bound: str | None
    notes: list[str] = field(default_factory=list)


def _mean_ttft(ttft: tuple[str, Num] | None) -> tuple[float, str | None, str | None, list[str]]:
    """The TTFT to take from E2E, its own bound, the way it pushes the TPOT, and notes on how it was read."""
    if ttft is None:
        return 0.0, None, "upper", ["no TTFT in the table: TTFT taken as 0, so TPOT is an upper bound"]
    notes = []
    t_stat, tv = ttft
    push = flip_bound(tv.bound)
    if (p := percentile_number(t_stat)) is not None and p >= 90:
        push = combine_bounds(push, "lower")
        notes.append(f"TTFT {t_stat} used for the mean TTFT: the mean is lower, so the true TPOT is higher")
    elif t_stat == "p50":
        notes.append("TTFT median used for the mean TTFT")
    if tv.bound == "lower":
        notes.append(f"TTFT {tv.raw!r} is a lower bound, so this TPOT is an upper bound")
    return tv.value, tv.bound, push, notes


def _derive_tpot(row: TableRow, n: float, n_src: str | None, per_stream: float,
                 ttft: tuple[str, Num] | None) -> _ImpliedTpot:
    ms_tok = 1e3 / per_stream
    e2e_ms = n * ms_tok
    t_ms, t_bound, ttft_push, notes = _mean_ttft(ttft)
    tpot = (e2e_ms - t_ms) / (n - 1)
    return _ImpliedTpot(n=n, n_src=n_src, per_stream=per_stream, ms_tok=ms_tok, e2e_ms=e2e_ms, ttft_ms=t_ms,
                        ttft_bound=t_bound, tpot=tpot,
                        tpot_bound=combine_bounds(flip_bound(row.output_tok_s.bound), ttft_push), notes=notes)


def _implied_tpot(row: TableRow, lv: dict[str, Any], n: float, n_src: str | None, per_stream: float,
                  ttft: tuple[str, Num] | None, slo: dict[str, float], findings: list[Finding]) -> None:
    """Check 1: E2E = N / (T/C); TPOT = (E2E − TTFT)/(N − 1); against the table's TPOT and the SLO."""
    c, t = row.concurrency, row.output_tok_s
    d = _derive_tpot(row, n, n_src, per_stream, ttft)
    lv.update(implied_e2e_s=rounded(d.e2e_ms / 1e3), implied_e2e_bound=flip_bound(t.bound),
              implied_tpot_ms=rounded(d.tpot), implied_tpot_bound=d.tpot_bound)
    head = (f"{level_label(row.arm, c)}: {t.value:g} tok/s ÷ {level_value(c):g} = {per_stream:.3g} tok/s per stream "
            f"({d.ms_tok:.1f} ms per token); {n:.0f} output tokens take ≈ {d.e2e_ms / 1e3:.2f} s end to end, so with "
            f"TTFT {Num(d.ttft_ms, d.ttft_bound).text('{:g}')} ms the mean TPOT "
            f"{Num(d.tpot, d.tpot_bound).text('{:.1f}', '≈ ')} ms (E2E = TTFT + {n - 1:.0f}·TPOT)")
    nums: dict[str, Any] = {"per_stream_tok_s": rounded(per_stream), "ms_per_token": rounded(d.ms_tok),
                            "output_tokens": rounded(n, 2), "implied_e2e_s": rounded(d.e2e_ms / 1e3),
                            "ttft_ms": d.ttft_ms, "implied_tpot_ms": rounded(d.tpot),
                            "implied_tpot_bound": d.tpot_bound}
    if d.tpot <= 0:
        findings.append(finding(row, "implied_tpot", "error",
                                head + f": TTFT {d.ttft_ms:g} ms exceeds the whole implied E2E — the table's "
                                "throughput and TTFT contradict each other", **nums))
        return
    severity, verdict = "info", ""
    if percentile_limits(slo, "tpot"):
        severity, verdict = _tpot_slo_verdict(row, d, slo, nums, lv)
    elif n_src == "given":
        d.notes.append(f"{n:.0f} output tokens assumed per request; if that is a cap the mean is smaller and so is "
                       "the TPOT")
    msg = head + (" " + verdict if verdict else "") + ("" if not d.notes else f" [{'; '.join(d.notes)}]")
    findings.append(finding(row, "implied_tpot", severity, msg, **nums))
    _tpot_consistency(row, d, findings)


def _length_advice(nmax: int | None, nmax_bound: str | None) -> str:
    """What output length would meet the TPOT limit at this per-stream rate."""
    if nmax is None:
        return "any output length meets it at this per-stream rate"
    if nmax < 2:
        return "no output length meets it at this per-stream rate and TTFT"
    return (f"a mean output ≤ {nmax} tokens would meet it at this throughput"
            + {"lower": " (a lower bound: the limit is at least this)",
               "upper": " (an upper bound: the limit is at most this)"}.get(nmax_bound or "", ""))


def _tpot_slo_verdict(row: TableRow, d: _ImpliedTpot, slo: dict[str, float], nums: dict[str, Any],
                      lv: dict[str, Any]) -> tuple[str, str]:
    """Severity and sentence for the implied TPOT against the tightest TPOT limit; adds what would meet it."""
    c, t, n = row.concurrency, row.output_tok_s, d.n
    key, slo_stat, limit = min(percentile_limits(slo, "tpot"), key=lambda x: x[2])
    verdict, _ = judge_statistic(d.tpot, d.tpot_bound, "mean", slo_stat, limit)
    nmax, nmax_bound = _max_output_for_slo(d.ms_tok, d.ttft_ms, limit, combine_bounds(d.ttft_bound, t.bound))
    required = c * n / ((d.ttft_ms + (n - 1) * limit) / 1e3)
    nums.update(slo_key=key, slo_limit_ms=limit, max_mean_output_tokens_for_slo=nmax,
                max_mean_output_tokens_bound=nmax_bound, required_output_tok_s_for_slo=rounded(required, 2))
    lv.update(max_mean_output_tokens_for_slo=nmax, required_output_tok_s_for_slo=rounded(required, 2))
    need = _length_advice(nmax, nmax_bound)
    cap = " (if that is a cap, the mean may be smaller)" if d.n_src == "given" else ""
    if verdict == "fail":
        return "error", (f"> {key} {limit:g} ms: the mean alone is over the {slo_stat} limit, so the {slo_stat} "
                         f"is too (unless a few extreme outliers inflate the mean). With {n:.0f} output tokens"
                         f"{cap}, {need}; at {n:.0f} tokens it needs ≥ {required:.1f} tok/s at "
                         f"{level_value(c):g} streams")
    if verdict == "unknown" and d.tpot_bound in (None, "upper") and d.tpot <= limit:
        return "info", (f"≤ {key} {limit:g} ms as a mean; the {slo_stat} is not known from the throughput and "
                        "may still exceed it")
    if verdict == "unknown":
        needed_ttft = max(0.0, d.e2e_ms - (n - 1) * limit)
        text = (f"vs {key} {limit:g} ms: cannot tell from these bounds; TPOT would meet it only if TTFT "
                f"≥ {needed_ttft / 1e3:.2f} s; {need}")
        nums["ttft_ms_needed_for_tpot_slo"] = rounded(needed_ttft, 1)
        ttft_limits = percentile_limits(slo, "ttft")
        if ttft_limits and needed_ttft > min(x[2] for x in ttft_limits):
            text += (f" — but a TTFT that long breaks {min(ttft_limits, key=lambda x: x[2])[0]}: "
                     "the level cannot meet both")
        return "warn", text
    return "info", f"≤ {key} {limit:g} ms"


def _tpot_consistency(row: TableRow, d: _ImpliedTpot, findings: list[Finding]) -> None:
    """The table's own TPOT against the one its throughput implies."""
    table_tpot = _pick_mean(row.latency.get("tpot", {}))
    if table_tpot is None:
        return
    stat, tv = table_tpot
    diff = tv.value / d.tpot - 1
    sev = "warn" if abs(diff) > CONSISTENCY_TOLERANCE and not (tv.bound or d.tpot_bound) else "info"
    what = "inconsistent" if sev == "warn" else "consistent" if abs(diff) <= CONSISTENCY_TOLERANCE else "bounds only"
    findings.append(finding(
        row, "tpot_consistency", sev,
        f"{level_label(row.arm, row.concurrency)}: table TPOT{' ' + stat if stat else ''} {tv.text('{:g}')} ms vs "
        f"{d.tpot:.1f} ms implied by the throughput ({diff:+.0%}): {what}"
        + (" — either the throughput or the TPOT is misreported, or streams idled between requests"
           if sev == "warn" and diff < 0 else ""),
        table_tpot_ms=tv.value, implied_tpot_ms=rounded(d.tpot), relative_difference=rounded(diff)))


def _max_output_for_slo(ms_tok: float, ttft_ms: float, limit: float,
                        in_bound: str | None) -> tuple[int | None, str | None]:
    """Largest mean N with (N·ms_tok − TTFT)/(N − 1) ≤ limit: N ≤ (TTFT − limit)/(ms_tok − limit).

    Shorter outputs spread the TTFT over fewer tokens, so the same per-stream rate implies a smaller TPOT.
    None when the per-stream time per token is already within the limit (any length meets it).
    """
    if ms_tok <= limit:
        return None, None
    nmax = (ttft_ms - limit) / (ms_tok - limit)
    bound = "lower" if in_bound == "lower" else "upper" if in_bound == "upper" else None
    return max(0, math.floor(nmax + 1e-9)), bound


# --- check 4: the table's own latencies against the SLO ------------------------------------------------------

def _table_latency_slo(row: TableRow, lv: dict[str, Any], slo: dict[str, float], findings: list[Finding]) -> None:
    """Check 4: the table's own TTFT / TPOT / E2E against each SLO key on that metric (">900" is ≥ 900)."""
    for metric in ("ttft", "tpot", "e2e"):
        values = row.latency.get(metric, {})
        for key, slo_stat, limit in percentile_limits(slo, metric):
            if not values:
                continue
            stat = slo_stat if slo_stat in values else "" if "" in values else None
            if stat is None:  # the most decisive statistic the table has
                cands = [(s, judge_statistic(v.value, v.bound, s, slo_stat, limit)) for s, v in values.items()]
                stat = next((s for s, (v, _) in cands if v != "unknown"), cands[0][0])
            v = values[stat]
            verdict, note = judge_statistic(v.value, v.bound, stat, slo_stat, limit)
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
            findings.append(finding(
                row, f"{metric}_slo", sev,
                f"{level_label(row.arm, row.concurrency)}: {label} {v.text('{:g}')} ms {rel} {key} {limit:g} ms"
                + (f" ({'; '.join(extra)})" if extra else ""),
                value_ms=v.value, value_bound=v.bound, statistic=stat or None, slo_key=key, slo_limit_ms=limit))
            lv[f"{metric}_slo_ok"] = {"pass": True, "fail": False}.get(verdict)


# --- check 2: Little's law -----------------------------------------------------------------------------------

def _littles_e2e(row: TableRow, n: float, t_ms: float) -> tuple[float, str]:
    """The response time to multiply the request rate by: the table's E2E, else TTFT + (N−1)·TPOT, else N·C/T."""
    e2e_pick = _pick_mean(row.latency.get("e2e", {}))
    tpot_pick = _pick_mean(row.latency.get("tpot", {}))
    if e2e_pick is not None:
        return e2e_pick[1].value, f"the table's E2E{' ' + e2e_pick[0] if e2e_pick[0] else ''}"
    if tpot_pick is not None and n > 1:
        return t_ms + (n - 1) * tpot_pick[1].value, "TTFT + (N−1)·TPOT from the table"
    return n * row.concurrency / row.output_tok_s.value * 1e3, "E2E implied by the throughput"


def _littles_law(row: TableRow, lv: dict[str, Any], n: float, n_src: str | None, ttft: tuple[str, Num] | None,
                 tpot_limits: list[SloItem], findings: list[Finding]) -> None:
    """Check 2: in flight = request rate × response time should equal the fixed concurrency.

    With E2E implied from the throughput it does by construction (an identity, reported as such); it tests
    something only with a measured request rate or E2E, or the table's TPOT. At the SLO's TPOT it also says
    how many requests the table's request rate keeps in flight within the SLO.
    """
    c, t = row.concurrency, row.output_tok_s
    lam = row.request_s.value if row.request_s is not None else t.value / n
    lam_src = "measured request_s" if row.request_s is not None else f"{t.value:g} tok/s ÷ {n:.0f} tokens"
    t_ms = ttft[1].value if ttft else 0.0
    e2e_ms, e2e_src = _littles_e2e(row, n, t_ms)
    in_flight = lam * e2e_ms / 1e3
    ratio = in_flight / c
    identity = e2e_src.startswith("E2E implied") and (row.request_s is None or n_src == "request_s")
    nums: dict[str, Any] = {"request_s": rounded(lam), "request_s_source": lam_src, "e2e_s": rounded(e2e_ms / 1e3),
                            "e2e_source": e2e_src, "in_flight": rounded(in_flight, 3), "little_ratio": rounded(ratio)}
    lv.update(request_s=rounded(lam), in_flight=rounded(in_flight, 3), little_ratio=rounded(ratio))
    msg = (f"{level_label(row.arm, c)}: {lam:.4g} req/s ({lam_src}) × {e2e_ms / 1e3:.2f} s ({e2e_src}) = "
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
        msg += _in_flight_within_slo(row, lv, nums, n, lam, ttft, tpot_limits)
    findings.append(finding(row, "littles_law", sev, msg, **nums))


def _in_flight_within_slo(row: TableRow, lv: dict[str, Any], nums: dict[str, Any], n: float, lam: float,
                          ttft: tuple[str, Num] | None, tpot_limits: list[SloItem]) -> str:
    """How many requests this request rate keeps in flight if each took TTFT + (N−1)·(the SLO's TPOT)."""
    c = row.concurrency
    t_ms = ttft[1].value if ttft else 0.0
    key, _, limit = min(tpot_limits, key=lambda x: x[2])
    e2e_slo = t_ms + (n - 1) * limit
    within = lam * e2e_slo / 1e3
    wb = ttft[1].bound if ttft else "lower"
    nums.update(in_flight_within_slo=rounded(within, 3), in_flight_within_slo_bound=wb,
                e2e_at_slo_s=rounded(e2e_slo / 1e3))
    lv["in_flight_within_slo"] = rounded(within, 3)
    return (f". At {key} {limit:g} ms a request takes {Num(e2e_slo / 1e3, wb).text('{:.2f}')} s, so this request "
            f"rate keeps {Num(within, wb).text('{:.1f}')} in flight"
            + (f": {level_value(c):g} streams each take longer than the SLO allows" if within < c and wb != "lower"
               else ""))
