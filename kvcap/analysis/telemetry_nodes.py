"""Telemetry per node and per server: figures over each level window, and load that could be spread but is not.

Why apart from ``telemetry`` (series and their aggregation): these read the series by node and judge them — the
article's "60% of cluster memory used does not mean 40% more concurrency" is a per-node question.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kvcap.analysis.telemetry import NicParts, Series, Telemetry, how, merge_nic_parts, nic_best, telemetry_of

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


def nodes(rows: Telemetry | list[dict[str, Any]]) -> list[str]:
    return sorted(str(n) for n in telemetry_of(rows).label_values("node") if n is not None)


def node_figures(rows: Telemetry | list[dict[str, Any]], t0: float, t1: float) -> dict[str, dict[str, float]]:
    """Per node, over one window: GPU utilisation and memory, KV usage, running/waiting, network bytes/s (and
    Gbps), busiest link — the article's "60% of cluster memory used does not mean 40% more concurrency"."""
    return node_figures_per_window(rows, [(t0, t1)])[0]


def node_figures_per_window(rows: Telemetry | list[dict[str, Any]],
                            windows: list[tuple[float, float]]) -> list[dict[str, dict[str, float]]]:
    """:func:`node_figures` for each window, each node's series aggregated once and not kept (a long run's
    per-node series, kept, would make the summary's memory grow with the run)."""
    figures = NodeFigures(windows)
    figures.add(telemetry_of(rows))
    return figures.result()


def nic_utilisation(rows: Telemetry | list[dict[str, Any]]) -> float | None:
    """Busiest NIC direction as a fraction of its line rate (node exporter's ``net.speed_bytes_s``), per sample."""
    return telemetry_of(rows).nic_utilisation()


def servers(rows: Telemetry | list[dict[str, Any]]) -> int:
    """How many servers (replicas) report a running count — one per (node, replica) label pair; else the nodes."""
    tel = telemetry_of(rows)
    pairs = {(tel.meta[i][2].get("node"), tel.meta[i][2].get("replica"))
             for i in tel.by_name.get("server.requests_running", [])}
    return len(pairs) or len(nodes(tel)) or 1


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


class Stat:
    """Count, sum, extremes and first/last value of the samples seen, in time order."""

    def __init__(self) -> None:
        self.n, self.total, self.hi, self.lo = 0, 0.0, -math.inf, math.inf
        self.first = self.last = math.nan

    def add(self, v: np.ndarray) -> None:
        if v.size:
            if not self.n:
                self.first = float(v[0])
            self.n += v.size
            self.total += float(np.sum(v))
            self.hi, self.lo = max(self.hi, float(np.max(v))), min(self.lo, float(np.min(v)))
            self.last = float(v[-1])

    def of(self, stat: str) -> float:
        return {"mean": self.total / self.n if self.n else math.nan, "max": self.hi, "min": self.lo}[stat]


def cut(s: Series, lo: float, hi: float) -> Series:
    """The samples with lo ≤ t < hi (a slice's own)."""
    a, b = np.searchsorted(s.t, lo, "left"), np.searchsorted(s.t, hi, "left")
    return Series(s.t[a:b], s.v[a:b])


class NodeFigures:
    """Per window, per node: ``NODE_FIGURES`` and the busiest NIC's utilisation, fed slices in time order."""

    def __init__(self, windows: list[tuple[float, float]]):
        self.windows = windows
        self.stats: list[dict[str, dict[str, Stat]]] = [{} for _ in windows]
        self.nic: list[dict[str, NicParts]] = [{} for _ in windows]

    def add(self, tel: Telemetry, lo: float = -math.inf, hi: float = math.inf) -> None:
        top = np.nextafter(hi, -math.inf)  # a slice's last sample time at most (its end is the next one's)
        for node in nodes(tel):
            for name in dict.fromkeys(name for _, name, _ in NODE_FIGURES):
                s = cut(Series(*tel.aggregate(tel.selected(name, node), how(name))), lo, hi)
                for w, (t0, t1) in enumerate(self.windows):
                    self.stats[w].setdefault(node, {}).setdefault(name, Stat()).add(s.within(t0, t1).v)
            for w, (t0, t1) in enumerate(self.windows):
                parts = tel.nic_parts(node, max(t0, lo), min(t1, top))
                merge_nic_parts(self.nic[w].setdefault(node, ({}, {})), parts)

    def result(self) -> list[dict[str, dict[str, float]]]:
        out: list[dict[str, dict[str, float]]] = [{} for _ in self.windows]
        for w in range(len(self.windows)):
            for node in sorted(set(self.stats[w]) | set(self.nic[w])):
                stats = self.stats[w].get(node, {})
                f = {key: round(stats[name].of(stat), 4) for key, name, stat in NODE_FIGURES
                     if name in stats and stats[name].n}
                for d in ("rx", "tx"):
                    if f"net_{d}_bytes_s_mean" in f:
                        f[f"net_{d}_gbps_mean"] = round(f[f"net_{d}_bytes_s_mean"] * 8 / 1e9, 4)
                nic = nic_best(self.nic[w][node]) if node in self.nic[w] else None
                if nic is not None and "link_util_max" not in f:
                    f["link_util_max"] = nic
                if f:
                    out[w][node] = f
        return out
