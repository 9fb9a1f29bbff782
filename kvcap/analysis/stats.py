"""Per-level statistics from request records (the same for ``bench`` and ``sim`` records).

Throughput counts the output tokens *received inside the measured window* (token arrival times rebuilt from
TTFT and ITLs), divided by the window: the steady state at the offered load, not diluted by warm-up or the
drain at the end. Latency percentiles use the requests that started inside the window.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvcap.analysis.columns import SLO_METRICS, LevelArrays, level_key
from kvcap.analysis.quantiles import QUANTILES, percentiles

__all__ = ["QUANTILES", "LevelArrays", "bootstrap_ci", "check_slo", "level_key", "meets_request_slo", "percentiles",
           "repeats_ci", "summarize_level", "tokens_in_window"]


def tokens_in_window(rec: dict[str, Any], t0: float, t1: float) -> int:
    """Output tokens of one request that arrived within [t0, t1) (run-relative seconds)."""
    ttft = rec.get("ttft_ms")
    if ttft is None:
        return 0
    first = rec["start_s"] + ttft / 1e3
    itl = rec.get("itl_ms")
    if itl:
        times = first + np.concatenate(([0.0], np.cumsum(itl))) / 1e3
        return int(np.count_nonzero((times >= t0) & (times < t1)))
    n = int(rec.get("output_tokens") or 0)
    if n <= 1 or rec.get("e2e_ms") is None:
        return n if t0 <= first < t1 else 0
    last = rec["start_s"] + rec["e2e_ms"] / 1e3
    times = np.linspace(first, last, n)
    return int(np.count_nonzero((times >= t0) & (times < t1)))


def meets_request_slo(rec: dict[str, Any], slo: dict[str, float]) -> bool:
    """A request counts toward goodput if it succeeded and each of its own latencies is within the SLO's limit."""
    if not rec.get("ok"):
        return False
    for key, limit in slo.items():
        metric = key.split("_", 1)[0]
        if metric in SLO_METRICS:
            v = rec.get(f"{metric}_ms")
            if v is not None and v > limit:
                return False
    return True


def summarize_level(records: LevelArrays | list[dict[str, Any]], windows: dict[int, tuple[float, float]],
                    slo: dict[str, float] | None = None) -> dict[str, Any]:
    """Statistics of one (mode, level) over its repeats. ``windows``: repeat → measured window (run seconds)."""
    a = records if isinstance(records, LevelArrays) else LevelArrays(records, slo, list(windows.values()))
    measured = a.measured
    cancelled = a.cancelled & measured
    judged = measured & ~cancelled
    ok = judged & a.ok
    good = a.meets(slo)
    failed = a.error[measured & ~a.ok & ~a.cancelled]
    codes, first, counts = np.unique(failed, return_index=True, return_counts=True)
    errors = {a.error_names[c]: n for _, c, n in sorted(zip(first.tolist(), codes.tolist(), counts.tolist()))}
    tok_s, req_s, good_s, inflight = [], [], [], []
    for rep in sorted(windows):
        t0, t1 = windows[rep]
        span = max(t1 - t0, 1e-9)
        mine = a.repeat == rep
        tok_s.append(a.tokens_in_window(t0, t1, mine) / span)
        good_s.append(a.tokens_in_window(t0, t1, mine & good) / span)
        ends = a.start + a.e2e / 1e3
        req_s.append(int(np.count_nonzero(mine & a.ok & (ends >= t0) & (ends < t1))) / span)
        busy = np.clip(np.minimum(a.end, t1) - np.maximum(a.start, t0), 0.0, None)
        inflight.append(float(busy[mine].sum()) / span)
    n_j, n_ok = int(judged.sum()), int(ok.sum())
    out: dict[str, Any] = {
        "requests": n_j, "ok": n_ok, "errors": n_j - n_ok, "cancelled": int(cancelled.sum()),
        "error_classes": errors,
        "output_tok_s": round(float(np.median(tok_s)), 3) if tok_s else 0.0,
        "request_s": round(float(np.median(req_s)), 4) if req_s else 0.0,
        "output_tok_s_repeats": [round(x, 3) for x in tok_s],
        "goodput_tok_s": round(float(np.median(good_s)), 3) if good_s else 0.0,
        "goodput_tok_s_repeats": [round(x, 3) for x in good_s],
        "in_flight_mean": round(float(np.median(inflight)), 3) if inflight else None,
        "error_rate": round((n_j - n_ok) / n_j, 6) if n_j else 0.0,
        "truncated": int(np.count_nonzero(a.truncated & ok)),
        "output_tokens_mean": round(float(a.out_tokens[ok].mean()), 2) if n_ok else None,
        "input_tokens_mean": round(float(a.in_tokens[ok].mean()), 2) if n_ok else None,
    }
    out["ttft_ms"] = percentiles(a.ttft[ok])
    out["tpot_ms"] = percentiles(a.tpot[ok])
    out["e2e_ms"] = percentiles(a.e2e[ok])
    out["itl_ms"] = a.itl_ok.percentiles()
    out["queue_ms"] = percentiles(a.queue[ok])
    out["send_delay_ms"] = percentiles(a.send_delay[measured])
    out["ci95"] = bootstrap_ci(a, ok, windows)
    out["ci95"]["output_tok_s"] = repeats_ci(tok_s)
    out["ci95"]["goodput_tok_s"] = repeats_ci(good_s)
    return out


def repeats_ci(values: list[float], n_boot: int = 1000, seed: int = 0) -> list[float] | None:
    """95% interval of the median over repeats (bootstrap over repeats); None with a single repeat."""
    if len(values) < 2:
        return None
    v = np.asarray(values, float)
    meds = np.median(v[np.random.default_rng(seed).integers(0, v.size, size=(n_boot, v.size))], axis=1)
    return [round(float(x), 3) for x in np.percentile(meds, [2.5, 97.5])]


def bootstrap_ci(a: LevelArrays, ok: np.ndarray, windows: dict[int, tuple[float, float]], n_boot: int = 200,
                 seed: int = 0) -> dict[str, list[float] | None]:
    """95% intervals for TTFT/TPOT p95 (requests resampled) and throughput (across repeats when there are ≥ 2)."""
    rng = np.random.default_rng(seed)
    out: dict[str, list[float] | None] = {}
    for name, values in (("ttft_p95_ms", a.ttft[ok]), ("tpot_p95_ms", a.tpot[ok])):
        v = values[~np.isnan(values)]
        if v.size < 5:
            out[name] = None
            continue
        if v.size > 2000:  # large samples: the order-statistic (binomial) interval, no resampling needed
            v = np.sort(v)
            half = 1.96 * np.sqrt(v.size * 0.95 * 0.05)
            lo, hi = int(np.floor(v.size * 0.95 - half)), int(np.ceil(v.size * 0.95 + half))
            out[name] = [round(float(v[max(lo, 0)]), 3), round(float(v[min(hi, v.size - 1)]), 3)]
            continue
        q = np.percentile(v[rng.integers(0, v.size, size=(n_boot, v.size))], 95, axis=1)
        out[name] = [round(float(x), 3) for x in np.percentile(q, [2.5, 97.5])]
    return out


def check_slo(level: dict[str, Any], slo: dict[str, float]) -> list[str]:
    """Names of the SLO items this level fails (missing data fails too: no evidence, no pass)."""
    failed = []
    for key, limit in slo.items():
        if key == "error_rate":
            if level["error_rate"] > limit:
                failed.append(key)
            continue
        metric, q = key.rsplit("_", 1)
        value = level.get(f"{metric}_ms", {}).get(q)
        if value is None or value > limit:
            failed.append(key)
    return failed
