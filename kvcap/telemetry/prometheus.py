"""``--prometheus URL``: what the operators' Prometheus already scraped during the run — DCGM exporter, node
exporter, the engines' own series — fetched with ``query_range`` over the run window (step ≈ 1 s) and turned
into the same telemetry rows as direct scraping (normalised names, run-relative time, ``node`` labels).

Why range queries after the run rather than polling: Prometheus keeps the samples at their own scrape times,
per target, so nothing depends on the client's timing; one query for every known name keeps it cheap.
Counters the catalog marks as rates are differenced here (across resets), not with PromQL's ``rate()``, so
direct scraping and Prometheus give the same numbers.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections import defaultdict
from typing import Any

from kvcap.errors import InputError
from kvcap.telemetry.catalog import counter_rates, detect_engine, entry, known_raw_names

MAX_POINTS = 11_000
"""Prometheus refuses a range query of more than 11,000 points per series: longer runs are fetched in pieces."""


def query_range(base: str, query: str, start: float, end: float, step: float,
                timeout: float = 30.0) -> list[dict[str, Any]]:
    """``/api/v1/query_range`` → the result matrix (one ``{metric, values}`` per series)."""
    out: list[dict[str, Any]] = []
    t = start
    while t < end:
        stop = min(end, t + step * (MAX_POINTS - 1))
        qs = urllib.parse.urlencode({"query": query, "start": f"{t:.3f}", "end": f"{stop:.3f}", "step": f"{step:g}"})
        url = base.rstrip("/") + "/api/v1/query_range?" + qs
        try:
            with urllib.request.urlopen(url, timeout=timeout) as r:
                body = json.load(r)
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:200]
            raise InputError(f"Prometheus at {base} refused the query ({exc.code}): {detail}") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise InputError(f"cannot query Prometheus at {base}: {exc}") from None
        if body.get("status") != "success":
            raise InputError(f"Prometheus at {base}: {body.get('error', 'query failed')}")
        out.extend(body["data"]["result"])
        t = stop + step
    return out


def selector(names: list[str] | None = None) -> str:
    """One PromQL selector for every catalog name (with and without the ``_total`` suffix)."""
    names = names or known_raw_names()
    alts = sorted({n for raw in names for n in (raw, raw + "_total", raw.removesuffix("_total"))})
    return '{__name__=~"' + "|".join(alts) + '"}'


def node_of(metric: dict[str, str]) -> str:
    """Which machine a series describes: DCGM's ``Hostname``, else the ``node`` label, else the instance's host."""
    for key in ("Hostname", "node", "nodename"):
        if metric.get(key):
            return metric[key]
    instance = metric.get("instance", "")
    return instance.rsplit(":", 1)[0] if instance.count(":") == 1 else instance


def rows_from_matrix(result: list[dict[str, Any]], epoch_at_origin: float, source: str) -> list[dict[str, Any]]:
    """Telemetry rows from a query_range matrix: scaled values, counters turned into rates where the catalog
    says so, time = epoch − ``epoch_at_origin`` (the run's t_s)."""
    by_job: dict[str, list[str]] = defaultdict(list)
    for series in result:
        m = series.get("metric", {})
        by_job[m.get("instance", "") + "|" + m.get("job", "")].append(m.get("__name__", ""))
    engines = {k: detect_engine(v) for k, v in by_job.items()}
    rows: list[dict[str, Any]] = []
    for series in result:
        m = dict(series.get("metric", {}))
        raw = m.pop("__name__", "")
        e = entry(raw, m)
        if e is None:
            continue
        points = [(float(t), float(v) * e.scale) for t, v in series.get("values", [])]
        if e.rate:
            points = counter_rates(points)
        engine = engines.get(m.get("instance", "") + "|" + m.get("job", ""))
        labels = {**m, "raw": raw, "node": node_of(m)}
        if engine:
            labels["engine"] = engine
        for t, v in points:
            if v != v:  # NaN (a stale marker)
                continue
            rows.append({"t_s": round(t - epoch_at_origin, 4), "source": source, "name": e.name,
                         "labels": labels, "value": round(v, 6)})
    rows.sort(key=lambda r: r["t_s"])
    return rows


def fetch(base: str, start_epoch: float, end_epoch: float, epoch_at_origin: float,
          step: float = 1.0) -> list[dict[str, Any]]:
    """Every known series Prometheus holds for the run window, as telemetry rows."""
    result = query_range(base, selector(), start_epoch, end_epoch, step)
    return rows_from_matrix(result, epoch_at_origin, source=f"prometheus:{base}")
