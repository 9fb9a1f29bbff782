"""Per-level statistics from request records (the same for ``bench`` and ``sim`` records).

Throughput counts the output tokens *received inside the measured window* (token arrival times rebuilt from
TTFT and ITLs), divided by the window: the steady state at the offered load, not diluted by warm-up or the
drain at the end. Latency percentiles use the requests that started inside the window.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

QUANTILES = {"p50": 50, "p90": 90, "p95": 95, "p99": 99}


def percentiles(values: np.ndarray | list[float]) -> dict[str, float | None]:
    arr = np.asarray([np.nan if v is None else v for v in values] if isinstance(values, list) else values, float)
    arr = arr[~np.isnan(arr)]
    if arr.size == 0:
        return {k: None for k in QUANTILES} | {"mean": None}
    qs = np.percentile(arr, list(QUANTILES.values()))
    out: dict[str, float | None] = {k: round(float(q), 3) for k, q in zip(QUANTILES, qs)}
    out["mean"] = round(float(arr.mean()), 3)
    return out


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


def level_key(rec: dict[str, Any]) -> tuple[str, float]:
    return (str(rec.get("mode", "concurrency")), float(rec.get("level", 0)))


def meets_request_slo(rec: dict[str, Any], slo: dict[str, float]) -> bool:
    """A request counts toward goodput if it succeeded and each of its own latencies is within the SLO's limit."""
    if not rec.get("ok"):
        return False
    for key, limit in slo.items():
        metric = key.split("_", 1)[0]
        if metric in ("ttft", "tpot", "e2e", "queue"):
            v = rec.get(f"{metric}_ms")
            if v is not None and v > limit:
                return False
    return True


class LevelArrays:
    """One level's records as numpy arrays (built once), so statistics are vectorised, not per-record loops."""

    def __init__(self, records: list[dict[str, Any]], slo: dict[str, float] | None = None):
        n = len(records)

        def col(key: str, default: float = np.nan) -> np.ndarray:
            return np.fromiter((default if (v := r.get(key)) is None else v for r in records), float, count=n)

        self.n = n
        self.start = col("start_s", 0.0)
        self.ttft = col("ttft_ms")
        self.e2e = col("e2e_ms")
        self.tpot = col("tpot_ms")
        self.end = col("end_s")
        self.end = np.where(np.isnan(self.end), np.where(np.isnan(self.e2e), self.start, self.start + self.e2e / 1e3),
                            self.end)
        self.out_tokens = col("output_tokens", 0.0)
        self.repeat = np.fromiter((int(r.get("repeat", 0)) for r in records), np.int64, count=n)
        self.ok = np.fromiter((bool(r.get("ok")) for r in records), bool, count=n)
        self.good = self.ok.copy()
        for key, limit in (slo or {}).items():
            metric = key.split("_", 1)[0]
            if metric in ("ttft", "tpot", "e2e", "queue"):
                v = col(f"{metric}_ms")
                self.good &= ~(v > limit)  # NaN (unknown) does not fail
        itls = [r.get("itl_ms") or () for r in records]
        lens = np.fromiter((len(x) for x in itls), np.int64, count=n)
        self.has_itl = lens > 0
        self.itl_owner = np.repeat(np.arange(n), lens)
        flat = np.fromiter((x for lst in itls for x in lst), float, count=int(lens.sum()))
        self.itl_flat = flat
        first = self.start + self.ttft / 1e3
        self.first = first
        if flat.size:
            csum = np.cumsum(flat)
            offsets = np.concatenate(([0], np.cumsum(lens)[:-1]))
            base = np.repeat(np.where(lens > 0, csum[np.maximum(offsets - 1, 0)] * (offsets > 0), 0.0), lens)
            self.token_times = first[self.itl_owner] + (csum - base) / 1e3  # tokens 2..N of requests with ITLs
        else:
            self.token_times = np.zeros(0)

    def tokens_in_window(self, t0: float, t1: float, mask: np.ndarray) -> int:
        """Output tokens (of the masked requests) that arrived within [t0, t1)."""
        has_first = mask & ~np.isnan(self.first)
        total = int(np.count_nonzero(has_first & self.has_itl & (self.first >= t0) & (self.first < t1)))
        if self.token_times.size:
            sel = mask[self.itl_owner]
            tt = self.token_times[sel]
            total += int(np.count_nonzero((tt >= t0) & (tt < t1)))
        # requests without ITLs: N tokens spread evenly from first token to end (closed form, no arrays per token)
        m = has_first & ~self.has_itl & (self.out_tokens > 0)
        if m.any():
            first, n = self.first[m], self.out_tokens[m]
            last = np.where(np.isnan(self.e2e[m]), first, self.start[m] + self.e2e[m] / 1e3)
            step = np.where(n > 1, (last - first) / np.maximum(n - 1, 1), np.inf)
            with np.errstate(invalid="ignore", divide="ignore"):
                k_lo = np.where(np.isinf(step), np.where(first >= t0, 0, n), np.ceil((t0 - first) / step))
                k_hi = np.where(np.isinf(step), np.where(first < t1, 0, -1), np.ceil((t1 - first) / step) - 1)
            k_lo, k_hi = np.clip(k_lo, 0, n), np.clip(k_hi, -1, n - 1)  # k_lo = n: every token came before t0
            total += int(np.maximum(k_hi - k_lo + 1, 0).sum())
        return total


def summarize_level(records: list[dict[str, Any]], windows: dict[int, tuple[float, float]],
                    slo: dict[str, float] | None = None) -> dict[str, Any]:
    """Statistics of one (mode, level) over its repeats. ``windows``: repeat → measured window (run seconds)."""
    a = LevelArrays(records, slo)
    measured = np.fromiter((r.get("phase", "measure") == "measure" for r in records), bool, count=a.n)
    cancelled = np.fromiter((r.get("error") == "cancelled" for r in records), bool, count=a.n) & measured
    judged = measured & ~cancelled
    ok = judged & a.ok
    errors: dict[str, int] = defaultdict(int)
    for r in records:
        if r.get("phase", "measure") == "measure" and not r.get("ok") and r.get("error") != "cancelled":
            errors[str(r.get("error"))] += 1
    tok_s, req_s, good_s, inflight = [], [], [], []
    for rep in sorted(windows):
        t0, t1 = windows[rep]
        span = max(t1 - t0, 1e-9)
        mine = a.repeat == rep
        tok_s.append(a.tokens_in_window(t0, t1, mine) / span)
        good_s.append(a.tokens_in_window(t0, t1, mine & a.good) / span)
        ends = a.start + a.e2e / 1e3
        req_s.append(int(np.count_nonzero(mine & a.ok & (ends >= t0) & (ends < t1))) / span)
        busy = np.clip(np.minimum(a.end, t1) - np.maximum(a.start, t0), 0.0, None)
        inflight.append(float(busy[mine].sum()) / span)
    n_j, n_ok = int(judged.sum()), int(ok.sum())
    out: dict[str, Any] = {
        "requests": n_j, "ok": n_ok, "errors": n_j - n_ok, "cancelled": int(cancelled.sum()),
        "error_classes": dict(errors),
        "output_tok_s": round(float(np.median(tok_s)), 3) if tok_s else 0.0,
        "request_s": round(float(np.median(req_s)), 4) if req_s else 0.0,
        "output_tok_s_repeats": [round(x, 3) for x in tok_s],
        "goodput_tok_s": round(float(np.median(good_s)), 3) if good_s else 0.0,
        "goodput_tok_s_repeats": [round(x, 3) for x in good_s],
        "in_flight_mean": round(float(np.median(inflight)), 3) if inflight else None,
        "error_rate": round((n_j - n_ok) / n_j, 6) if n_j else 0.0,
        "truncated": sum(1 for r, k in zip(records, ok) if k and r.get("truncated")),
        "output_tokens_mean": round(float(a.out_tokens[ok].mean()), 2) if n_ok else None,
        "input_tokens_mean": round(float(np.mean([r.get("input_tokens") or 0 for r, k in zip(records, ok) if k])), 2)
        if n_ok else None,
    }
    out["ttft_ms"] = percentiles(a.ttft[ok])
    out["tpot_ms"] = percentiles(a.tpot[ok])
    out["e2e_ms"] = percentiles(a.e2e[ok])
    out["itl_ms"] = percentiles(a.itl_flat[ok[a.itl_owner]] if a.itl_flat.size else np.zeros(0))
    queue = np.fromiter((np.nan if r.get("queue_ms") is None else r["queue_ms"] for r in records), float, count=a.n)
    out["queue_ms"] = percentiles(queue[ok])
    delay = np.fromiter((np.nan if r.get("send_delay_ms") is None else r["send_delay_ms"] for r in records), float,
                        count=a.n)
    out["send_delay_ms"] = percentiles(delay[measured])
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
