"""Per-level statistics from request records (the same for ``bench`` and ``sim`` records).

Throughput counts the output tokens *received inside the measured window* (token arrival times rebuilt from
TTFT and ITLs), divided by the window: the steady state at the offered load, not diluted by warm-up or the
drain at the end. Latency percentiles use the requests that started inside the window.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

from kvcap.analysis.slo import METRICS

QUANTILES = {"p50": 50, "p90": 90, "p95": 95, "p99": 99}


def percentiles(values: np.ndarray | list[float]) -> dict[str, float | None]:
    arr = np.asarray([v for v in values if v is not None], dtype=float)
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


def _end(rec: dict[str, Any]) -> float:
    """When a request ended (run-relative s): recorded end, else start + E2E, else its start."""
    if rec.get("end_s") is not None:
        return float(rec["end_s"])
    if rec.get("e2e_ms") is not None:
        return rec["start_s"] + rec["e2e_ms"] / 1e3
    return float(rec["start_s"])


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


def summarize_level(records: list[dict[str, Any]], windows: list[tuple[float, float]],
                    all_records: list[dict[str, Any]] | None = None,
                    slo: dict[str, float] | None = None) -> dict[str, Any]:
    """Statistics of one (mode, level) over its repeats. ``windows`` are the measured windows, one per repeat."""
    measured = [r for r in records if r.get("phase", "measure") == "measure"]
    cancelled = [r for r in measured if r.get("error") == "cancelled"]
    judged = [r for r in measured if r.get("error") != "cancelled"]
    ok = [r for r in judged if r.get("ok")]
    errors: dict[str, int] = defaultdict(int)
    for r in judged:
        if not r.get("ok"):
            errors[str(r.get("error"))] += 1
    per_repeat_tok_s: list[float] = []
    per_repeat_req_s: list[float] = []
    per_repeat_good: list[float] = []
    per_repeat_inflight: list[float] = []
    pool = all_records if all_records is not None else records
    for rep, (t0, t1) in enumerate(windows):
        span = max(t1 - t0, 1e-9)
        rep_recs = [r for r in pool if int(r.get("repeat", 0)) == rep]
        toks = sum(tokens_in_window(r, t0, t1) for r in rep_recs)
        done = sum(1 for r in rep_recs if r.get("ok") and r.get("e2e_ms") is not None
                   and t0 <= r["start_s"] + r["e2e_ms"] / 1e3 < t1)
        good = sum(tokens_in_window(r, t0, t1) for r in rep_recs if meets_request_slo(r, slo or {}))
        busy = sum(max(0.0, min(_end(r), t1) - max(r["start_s"], t0)) for r in rep_recs)
        per_repeat_inflight.append(busy / span)
        per_repeat_tok_s.append(toks / span)
        per_repeat_req_s.append(done / span)
        per_repeat_good.append(good / span)
    out: dict[str, Any] = {
        "requests": len(judged), "ok": len(ok), "errors": len(judged) - len(ok), "cancelled": len(cancelled),
        "error_classes": dict(errors),
        "output_tok_s": round(float(np.median(per_repeat_tok_s)), 3) if per_repeat_tok_s else 0.0,
        "request_s": round(float(np.median(per_repeat_req_s)), 4) if per_repeat_req_s else 0.0,
        "output_tok_s_repeats": [round(x, 3) for x in per_repeat_tok_s],
        "goodput_tok_s": round(float(np.median(per_repeat_good)), 3) if per_repeat_good else 0.0,
        "in_flight_mean": round(float(np.median(per_repeat_inflight)), 3) if per_repeat_inflight else None,
        "goodput_tok_s_repeats": [round(x, 3) for x in per_repeat_good],
        "error_rate": round((len(judged) - len(ok)) / len(judged), 6) if judged else 0.0,
        "truncated": sum(1 for r in ok if r.get("truncated")),
        "output_tokens_mean": round(float(np.mean([r["output_tokens"] for r in ok])), 2) if ok else None,
        "input_tokens_mean": round(float(np.mean([r["input_tokens"] for r in ok])), 2) if ok else None,
    }
    for metric in METRICS:
        key = f"{metric}_ms"
        if metric == "itl":
            vals = [x for r in ok for x in (r.get("itl_ms") or ())]
        else:
            vals = [r.get(key) for r in ok]
        out[key] = percentiles(vals)
    out["send_delay_ms"] = percentiles([r.get("send_delay_ms") for r in measured])
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
