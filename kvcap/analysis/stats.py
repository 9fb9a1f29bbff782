"""Per-level statistics from request records (the same for ``bench`` and ``sim`` records).

Throughput counts the output tokens *received inside the measured window* (token arrival times rebuilt from
TTFT and ITLs), divided by the window: the steady state at the offered load, not diluted by warm-up or the
drain at the end. Latency percentiles use the requests that started inside the window.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvcap.rundir.store.columns import SLO_METRICS, LevelArrays, level_key
from kvcap.rundir.store.level_blocks import Level, as_level
from kvcap.rundir.store.quantiles import QUANTILES, OrderStats, percentiles

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


_SAMPLES = ("ttft", "tpot", "e2e", "queue")
"""The latencies whose percentiles are taken over the judged ok requests (``send_delay``'s over every measured one)."""
BOOT_EXACT_MAX = 2000
"""Up to this many values the p95's interval resamples them; past it, the order-statistic interval (exact ranks)."""


def summarize_level(records: Level | LevelArrays | list[dict[str, Any]], windows: dict[int, tuple[float, float]],
                    slo: dict[str, float] | None = None) -> dict[str, Any]:
    """Statistics of one (mode, level) over its repeats. ``windows``: repeat → measured window (run seconds).

    Two passes over the level's blocks (``level_blocks``): counts, sums and the samples' buckets, then the exact
    values at the ranks the percentiles ask for — in memory bounded by a block. Counts, percentiles and
    intervals are those of all the rows at once; a float sum (a mean, the time in flight) is the sum of its
    blocks' sums, the same float for a level of one block and within the last bits otherwise."""
    level = as_level(records, slo, list(windows.values()))
    reps = sorted(windows)
    tokens, good_tokens, done = dict.fromkeys(reps, 0), dict.fromkeys(reps, 0), dict.fromkeys(reps, 0)
    busy = dict.fromkeys(reps, 0.0)
    count = dict.fromkeys(("judged", "ok", "cancelled", "truncated"), 0)
    out_sum = in_sum = 0.0
    errors: dict[int, list[int]] = {}  # error code → [its first record, its count]
    samples = {name: OrderStats(BOOT_EXACT_MAX + 1 if name in ("ttft", "tpot") else 0)
               for name in (*_SAMPLES, "send_delay")}
    seen = 0
    for a in level.blocks():
        cancelled = a.cancelled & a.measured
        judged = a.measured & ~cancelled
        ok = judged & a.ok
        good = a.meets(slo)
        failed = np.flatnonzero(a.measured & ~a.ok & ~a.cancelled)
        codes, first, counts = np.unique(a.error[failed], return_index=True, return_counts=True)
        for code, at, n in zip(codes.tolist(), failed[first].tolist(), counts.tolist()):
            errors.setdefault(code, [seen + at, 0])[1] += n
        ends = a.start + a.e2e / 1e3
        for rep in reps:
            t0, t1 = windows[rep]
            mine = a.repeat == rep
            tokens[rep] += a.tokens_in_window(t0, t1, mine)
            good_tokens[rep] += a.tokens_in_window(t0, t1, mine & good)
            done[rep] += int(np.count_nonzero(mine & a.ok & (ends >= t0) & (ends < t1)))
            busy[rep] += float(np.clip(np.minimum(a.end, t1) - np.maximum(a.start, t0), 0.0, None)[mine].sum())
        for name, mask in (("judged", judged), ("ok", ok), ("cancelled", cancelled),
                           ("truncated", a.truncated & ok)):
            count[name] += int(mask.sum())
        out_sum += float(a.out_tokens[ok].sum())
        in_sum += float(a.in_tokens[ok].sum())
        for name in _SAMPLES:
            samples[name].add(getattr(a, name)[ok])
        samples["send_delay"].add(a.send_delay[a.measured])
        seen += a.n
    for sample in samples.values():
        sample.ask_percentiles()
    for name in ("ttft", "tpot"):
        samples[name].ask(_p95_interval_ranks(samples[name].n))
    for a in level.blocks():
        ok = a.measured & ~a.cancelled & a.ok
        for name in _SAMPLES:
            samples[name].collect(getattr(a, name)[ok])
        samples["send_delay"].collect(a.send_delay[a.measured])
    spans = {rep: max(windows[rep][1] - windows[rep][0], 1e-9) for rep in reps}
    tok_s = [tokens[rep] / spans[rep] for rep in reps]
    good_s = [good_tokens[rep] / spans[rep] for rep in reps]
    req_s = [done[rep] / spans[rep] for rep in reps]
    inflight = [busy[rep] / spans[rep] for rep in reps]
    n_j, n_ok = count["judged"], count["ok"]
    out: dict[str, Any] = {
        "requests": n_j, "ok": n_ok, "errors": n_j - n_ok, "cancelled": count["cancelled"],
        "error_classes": {level.error_names[code]: n for code, (_, n) in sorted(errors.items(), key=lambda e: e[1][0])},
        "output_tok_s": round(float(np.median(tok_s)), 3) if tok_s else 0.0,
        "request_s": round(float(np.median(req_s)), 4) if req_s else 0.0,
        "output_tok_s_repeats": [round(x, 3) for x in tok_s],
        "goodput_tok_s": round(float(np.median(good_s)), 3) if good_s else 0.0,
        "goodput_tok_s_repeats": [round(x, 3) for x in good_s],
        "in_flight_mean": round(float(np.median(inflight)), 3) if inflight else None,
        "error_rate": round((n_j - n_ok) / n_j, 6) if n_j else 0.0,
        "truncated": count["truncated"],
        "output_tokens_mean": round(out_sum / n_ok, 2) if n_ok else None,
        "input_tokens_mean": round(in_sum / n_ok, 2) if n_ok else None,
    }
    out["ttft_ms"] = samples["ttft"].percentiles()
    out["tpot_ms"] = samples["tpot"].percentiles()
    out["e2e_ms"] = samples["e2e"].percentiles()
    out["itl_ms"] = level.itl_ok.percentiles()
    out["queue_ms"] = samples["queue"].percentiles()
    out["send_delay_ms"] = samples["send_delay"].percentiles()
    out["ci95"] = _p95_intervals(samples["ttft"], samples["tpot"])
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
    """95% intervals for TTFT/TPOT p95 of the ``ok`` requests (``summarize_level``'s, for arrays in hand)."""
    samples = []
    for values in (a.ttft[ok], a.tpot[ok]):
        s = OrderStats(BOOT_EXACT_MAX + 1)
        s.add(values)
        s.ask(_p95_interval_ranks(s.n))
        s.collect(values)
        samples.append(s)
    return _p95_intervals(samples[0], samples[1], n_boot=n_boot, seed=seed)


def _p95_interval_ranks(n: int) -> np.ndarray:
    """The ranks (0-based) of the order-statistic 95% interval of a p95 over ``n`` values: n·0.95 ∓ 1.96·√(n·0.95·0.05)
    (binomial), clipped to the sample; none up to ``BOOT_EXACT_MAX`` (resampled instead)."""
    if n <= BOOT_EXACT_MAX:
        return np.zeros(0, np.int64)
    half = 1.96 * np.sqrt(n * 0.95 * 0.05)
    lo, hi = int(np.floor(n * 0.95 - half)), int(np.ceil(n * 0.95 + half))
    return np.array([max(lo, 0), min(hi, n - 1)], np.int64)


def _p95_intervals(ttft: OrderStats, tpot: OrderStats, n_boot: int = 200,
                   seed: int = 0) -> dict[str, list[float] | None]:
    """95% intervals for TTFT/TPOT p95: requests resampled (a fixed seed) up to ``BOOT_EXACT_MAX`` values, the
    order-statistic (binomial) interval past it, no resampling needed."""
    rng = np.random.default_rng(seed)
    out: dict[str, list[float] | None] = {}
    for name, sample in (("ttft_p95_ms", ttft), ("tpot_p95_ms", tpot)):
        if sample.n < 5:
            out[name] = None
        elif sample.n > BOOT_EXACT_MAX:
            out[name] = [round(float(x), 3) for x in sample.value_at(_p95_interval_ranks(sample.n))]
        else:
            v = sample.first_values()
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
