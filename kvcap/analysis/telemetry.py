"""Telemetry rows → series and per-node figures aligned with the level windows (pure functions).

Rows may come from several sources for the same metric (direct ``/metrics`` scraping *and* Prometheus, say):
per metric, the kind of source with the most rows is used, so nothing is counted twice. Across labels
(replicas, GPUs, devices) counts and byte rates are summed per sample time, ratios averaged, ``link.util``
maximised (the busiest link). Per node, network figures leave out the loopback device unless it is all there is.
"""

from __future__ import annotations

import gc
import math
from collections import defaultdict
from typing import Any

import numpy as np

MEAN = {"gpu.util", "gpu.sm_active", "gpu.dram_active", "gpu.engine_active", "server.kv_usage",
        "server.kv_usage_host", "server.kv_tier_usage", "server.prefix_cache_hit_rate", "server.offload_hit_rate"}
MAX = {"link.util"}
LOOPBACK = ("lo", "lo0")
HOLD = "hold_s"
"""A row written on change (``kvcap sim``): its value holds every ``hold_s`` seconds until its series' next row."""


def how(name: str) -> str:
    return "mean" if name in MEAN else "max" if name in MAX else "sum"


def expand_held(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows written on change back on their regular grid, in the order a full grid is written (by time, then by
    each series' first appearance), so every figure — means over samples, sums across replicas — is unchanged.
    Rows without ``hold_s`` (real scrapes, old runs) pass through as they are."""
    if not any(HOLD in r for r in rows):
        return rows
    enabled = gc.isenabled()
    gc.disable()  # a million fresh dicts, none cyclic: the collector's passes would double the time
    try:
        return _expand(rows)
    finally:
        if enabled:
            gc.enable()


def _expand(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    order: dict[tuple[Any, ...], int] = {}
    held: dict[tuple[Any, ...], tuple[dict[str, Any], float]] = {}
    out: list[tuple[float, int, dict[str, Any]]] = []
    for r in rows:
        key = (r.get("source"), r.get("name"), *sorted((r.get("labels") or {}).items()))
        i = order.setdefault(key, len(order))
        t = float(r["t_s"])
        if key in held:
            prev, step = held.pop(key)
            t0, k = float(prev["t_s"]), 1
            while (ts := round(t0 + k * step, 6)) < t:
                out.append((ts, i, {**prev, "t_s": ts}))
                k += 1
        clean = {k: v for k, v in r.items() if k != HOLD}
        out.append((t, i, clean))
        if HOLD in r:
            held[key] = clean, float(r[HOLD])
    out.sort()  # (time, series) is unique per row, so the rows themselves are never compared
    return [r for _, _, r in out]


class Rows(list):
    """Telemetry rows with an index by metric name, built on first use: ``series`` is called for dozens of names
    per run, and scanning every row for each name cost more than the rest of the telemetry analysis. Treat it as
    read-only once an index was built."""

    _by_name: dict[str, list[dict[str, Any]]] | None = None

    def named(self, name: str) -> list[dict[str, Any]]:
        if self._by_name is None:
            index: dict[str, list[dict[str, Any]]] = defaultdict(list)
            for r in self:
                index[r.get("name", "")].append(r)
            self._by_name = dict(index)
        return self._by_name.get(name, [])


def dedupe_sources(rows: list[dict[str, Any]]) -> Rows:
    """Keep, per metric name, only the rows of the source kind (``metrics``, ``prometheus``, ``sim``) with most rows
    (counted on the grid: rows written on change are expanded first, ``expand_held``)."""
    rows = expand_held(rows)
    counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for r in rows:
        counts[r.get("name", "")][str(r.get("source", "")).split(":", 1)[0]] += 1
    keep = {name: max(kinds, key=lambda k: kinds[k]) for name, kinds in counts.items()}
    return Rows(r for r in rows if str(r.get("source", "")).split(":", 1)[0] == keep.get(r.get("name", "")))


def _skip_loopback(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Network rows without the loopback device, unless loopback is the only device."""
    devices = {r["labels"].get("device") for r in rows}
    if devices - set(LOOPBACK):
        return [r for r in rows if r["labels"].get("device") not in LOOPBACK]
    return rows


def series(rows: list[dict[str, Any]], name: str, agg: str | None = None,
           node: str | None = None) -> list[tuple[float, float]]:
    """One value per sample time for ``name`` (optionally one node's), aggregated over the other labels."""
    named = rows.named(name) if isinstance(rows, Rows) else [r for r in rows if r.get("name") == name]
    mine = named if node is None else [r for r in named if r["labels"].get("node") == node]
    if name.startswith("net."):
        mine = _skip_loopback(mine)
    acc: dict[float, list[float]] = defaultdict(list)
    for r in mine:
        try:
            t, v = float(r["t_s"]), float(r["value"])
        except (KeyError, TypeError, ValueError):
            continue  # a damaged row is skipped, not fatal
        if math.isfinite(t) and math.isfinite(v):
            acc[t].append(v)
    agg = agg or how(name)
    fn = {"sum": sum, "max": max}.get(agg, lambda v: sum(v) / len(v))
    return sorted((t, float(fn(v))) for t, v in acc.items())


def add(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    acc: dict[float, float] = defaultdict(float)
    for t, v in a + b:
        acc[t] += v
    return sorted(acc.items())


def within(s: list[tuple[float, float]], t0: float, t1: float) -> list[tuple[float, float]]:
    return [(t, v) for t, v in s if t0 <= t <= t1]


NODE_FIGURES: tuple[tuple[str, str, str], ...] = (
    ("gpu_util_mean", "gpu.util", "mean"),
    ("gpu_util_max", "gpu.util", "max"),
    ("gpu_mem_used_max_bytes", "gpu.mem_used_bytes", "max"),
    ("kv_usage_mean", "server.kv_usage", "mean"),
    ("kv_usage_max", "server.kv_usage", "max"),
    ("running_mean", "server.requests_running", "mean"),
    ("running_max", "server.requests_running", "max"),
    ("waiting_mean", "server.requests_waiting", "mean"),
    ("net_rx_bytes_s_mean", "net.rx_bytes_s", "mean"),
    ("net_tx_bytes_s_mean", "net.tx_bytes_s", "mean"),
    ("net_rx_bytes_s_max", "net.rx_bytes_s", "max"),
    ("net_tx_bytes_s_max", "net.tx_bytes_s", "max"),
    ("link_util_max", "link.util", "max"),
    ("host_mem_available_min_bytes", "host.mem_available_bytes", "min"),
)


def nodes(rows: list[dict[str, Any]]) -> list[str]:
    return sorted({str(r["labels"]["node"]) for r in rows if r.get("labels", {}).get("node") is not None})


def node_figures(rows: list[dict[str, Any]], t0: float, t1: float) -> dict[str, dict[str, float]]:
    """Per node, over one window: GPU utilisation and memory, KV usage, running/waiting, network bytes/s (and
    Gbps), busiest link — the article's "60% of cluster memory used does not mean 40% more concurrency"."""
    out: dict[str, dict[str, float]] = {}
    by_node: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        node = r.get("labels", {}).get("node")
        if node is not None and t0 <= float(r["t_s"]) <= t1:
            by_node[str(node)].append(r)
    for node, mine in sorted(by_node.items()):
        figs: dict[str, float] = {}
        for key, name, stat in NODE_FIGURES:
            vals = [v for _, v in series(mine, name)]
            if not vals:
                continue
            fn = {"mean": np.mean, "max": np.max, "min": np.min}[stat]
            figs[key] = round(float(fn(vals)), 4)
        for d in ("rx", "tx"):
            if f"net_{d}_bytes_s_mean" in figs:
                figs[f"net_{d}_gbps_mean"] = round(figs[f"net_{d}_bytes_s_mean"] * 8 / 1e9, 4)
        nic = nic_utilisation(mine)
        if nic is not None and "link_util_max" not in figs:
            figs["link_util_max"] = nic
        if figs:
            out[node] = figs
    return out


def nic_utilisation(rows: list[dict[str, Any]]) -> float | None:
    """Busiest NIC direction as a fraction of its line rate (node exporter's ``net.speed_bytes_s``), per sample."""
    speed = {r["labels"].get("device"): float(r["value"]) for r in rows
             if r.get("name") == "net.speed_bytes_s" and float(r["value"]) > 0}
    if not speed:
        return None
    best = None
    for r in rows:
        dev = r["labels"].get("device")
        if r.get("name") in ("net.rx_bytes_s", "net.tx_bytes_s") and dev in speed:
            u = float(r["value"]) / speed[dev]
            best = u if best is None or u > best else best
    return None if best is None else round(best, 4)


def servers(rows: list[dict[str, Any]]) -> int:
    """How many servers (replicas) report a running count — one per (node, replica) label pair; else the nodes."""
    pairs = {(r.get("labels", {}).get("node"), r.get("labels", {}).get("replica")) for r in rows
             if r.get("name") == "server.requests_running"}
    return len(pairs) or len(nodes(rows)) or 1


WAITING = 0.5
"""Mean requests waiting on a node from which they count as queued there."""


def imbalance(per_node: dict[str, dict[str, float]], key: str = "gpu_util_mean", hot: float = 0.8,
              ratio: float = 2.0, *, in_flight: float | None = None, replicas: int | None = None,
              kv_full: float = 0.9) -> dict[str, Any] | None:
    """Load that could be spread over the nodes is not: the busiest node then bounds the cluster.

    Fewer requests in flight than replicas leave replicas idle by design, so nothing is found then (``in_flight``
    is the level's load; None: unknown). Where the servers report what each node holds (running + waiting), that
    decides: requests wait on one node while another has none waiting and KV room, or — with at least one
    request per replica held — a node holds less than 1/``ratio`` of its fair share (the total over the nodes).
    Without those counts, GPU utilisation: one node busy (≥ ``hot``) while another does less than 1/``ratio`` of it
    (a single request can keep a GPU busy, so utilisation is the weaker signal).
    """
    n_replicas = replicas or len(per_node)
    if len(per_node) < 2 or (in_flight is not None and in_flight < n_replicas):
        return None
    held = {n: f["running_mean"] + f.get("waiting_mean", 0.0) for n, f in per_node.items() if "running_mean" in f}
    if len(held) >= 2:
        found = _queued_beside_room(per_node, held, kv_full) or _under_share(held, ratio, n_replicas)
        return found | {"in_flight": in_flight, "replicas": n_replicas} if found else None
    vals = {n: f[key] for n, f in per_node.items() if key in f}
    if len(vals) < 2:
        return None
    top, low = max(vals, key=vals.__getitem__), min(vals, key=vals.__getitem__)
    if vals[top] >= hot and vals[low] * ratio <= vals[top]:
        return {"metric": key, "hot": top, "hot_value": vals[top], "cold": low, "cold_value": vals[low]}
    return None


def _queued_beside_room(per_node: dict[str, dict[str, float]], held: dict[str, float],
                        kv_full: float) -> dict[str, Any] | None:
    """Requests wait on one node while another, holding fewer, has none waiting and KV room to take them."""
    waiting = {n: per_node[n].get("waiting_mean", 0.0) for n in held}
    top = max(waiting, key=waiting.__getitem__)
    room = [n for n in held if waiting[n] < WAITING and held[n] < held[top]
            and per_node[n].get("kv_usage_max", 0.0) < kv_full]
    if waiting[top] < WAITING or not room:
        return None
    low = min(room, key=held.__getitem__)
    return {"metric": "waiting_mean", "hot": top, "hot_value": waiting[top], "cold": low, "cold_value": waiting[low],
            "cold_kv_usage_max": per_node[low].get("kv_usage_max")}


def _under_share(held: dict[str, float], ratio: float, n_replicas: int) -> dict[str, Any] | None:
    """With at least one request per replica held, a node holds under 1/``ratio`` of its fair share."""
    total = sum(held.values())
    fair = total / len(held)
    top, low = max(held, key=held.__getitem__), min(held, key=held.__getitem__)
    if total < n_replicas or held[low] * ratio >= fair:
        return None
    return {"metric": "requests_held", "hot": top, "hot_value": round(held[top], 3), "cold": low,
            "cold_value": round(held[low], 3), "fair_share": round(fair, 3)}
