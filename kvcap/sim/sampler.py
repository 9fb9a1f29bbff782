"""The simulated cluster's telemetry, as ``kvcap sim`` writes it: one sample of every replica, link and tier each
``SAMPLE_S`` of simulated time, written on change (a series' row only when its value moved).

Why apart from the load driver (``kvcap.sim.run``): what a simulated server exposes as metrics — which series,
their names and labels, counters turned into rates, the thinning that keeps a long run's telemetry proportional
to what changed — is its own job, read by nothing else of the run.

Prefix reuse is counted as vLLM's ``/metrics`` counts it (``vllm:prefix_cache_queries``/``_hits`` for HBM,
``vllm:external_prefix_cache_queries``/``_hits`` for the offload tier, in prompt tokens), per replica, from each
request as it completes (:class:`ReuseCounters`, shared with serve-sim): the figures equal the sums of the
records' ``input_tokens``, ``prefix_hit_tokens`` and ``tier_hit_tokens`` over the requests that succeeded.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from kvcap.analysis.telemetry import HOLD
from kvcap.rundir.store.column_file import TelemetryWriter
from kvcap.sim.engine import Simulation
from kvcap.sim.request import SimRequest
from kvcap.sim.rounding import round_to

SAMPLE_S = 1.0

HBM_REUSE = ("server.prefix_cache_queries_total", "server.prefix_cache_hits_total")
"""A replica's prompt tokens looked up in its HBM prefix cache and found there (vLLM's ``prefix_cache_*``, as the
telemetry catalog normalises them)."""
TIER_REUSE = ("server.offload_prefix_queries_total", "server.offload_prefix_hits_total")
"""A replica's prompt tokens looked up in its offload tier and loaded from it (``external_prefix_cache_*``)."""
LINK_BYTES = "link.bytes_total"
"""Bytes a tier link carried since the level began, per direction: ``out`` from the GPUs (swap-out, prefix
store), ``in`` back to them (swap-in, prefix load)."""


class ReuseCounters:
    """Per replica, cumulative prompt tokens looked up and found in HBM and in the offload tier.

    Counted when a request completes (vLLM counts at lookup): a request knows its hits from its admission, and
    counting at completion keeps the counters equal to the records' sums. A request that failed or was cancelled
    has no hit fields in its record and is not counted. Both lookups see the whole prompt, as vLLM's scheduler
    records its queries."""

    __slots__ = ("hits", "queries", "tier_hits", "tier_queries")

    def __init__(self, replicas: int) -> None:
        self.queries: list[int] = [0] * replicas
        self.hits: list[int] = [0] * replicas
        self.tier_queries: list[int] = [0] * replicas
        self.tier_hits: list[int] = [0] * replicas

    def count(self, req: SimRequest) -> None:
        i = req.replica
        if req.error is not None or req.out < req.max_out or i < 0:
            return
        self.queries[i] += req.prompt
        self.hits[i] += req.hit_hbm
        self.tier_queries[i] += req.prompt
        self.tier_hits[i] += req.hit_tier


def looks_up_prefixes(sim: Simulation) -> tuple[bool, bool]:
    """(some replica keeps an HBM prefix cache, some replica also looks prefixes up in an offload tier)."""
    hbm = [rep.cfg.prefix_caching and rep.cfg.hash_block_tokens > 0 for rep in sim.replicas]
    tier = [on and rep.tiers.prefix_tier() is not None for on, rep in zip(hbm, sim.replicas)]
    return any(hbm), any(tier)


class Sampler:
    """Telemetry of a running simulation, sampled per replica/link/tier each ``SAMPLE_S`` of simulated time.

    Written on change (``thin``): a series' row only when its value differs from its previous sample, marked
    ``hold_s`` (the value holds at each step until that series' next row), plus every series' first and last
    sample of the level (the last without ``hold_s``, so nothing is held across the gap to the next level).
    ``kvcap.analysis.telemetry.expand_held`` puts the rows back on the grid: readers see the same rows.

    The series (name and labels) are fixed for a level, so they are listed once; a sample is one list of
    values in that order, and a row (a dict) is built only for a value that is written.

    The prefix-reuse counters (:class:`ReuseCounters`) join the series when the level's first request to finish
    carries block hashes on a cluster that caches prefixes — so a workload that cannot reuse a prefix writes
    what it wrote before. They are counted from the simulation's ``on_finish`` (the sampler chains itself in
    front of it); they join with a zero row at the latest sample (nothing had finished by then), and their last
    row carries the level's final counts, so the last value of each equals the records' sum."""

    def __init__(self, sim: Simulation, offset: float, emit: Callable[[list[dict[str, Any]]], None],
                 tiers: tuple[str, ...], thin: bool = True, copy: TelemetryWriter | None = None):
        self.sim, self.offset, self.emit, self.thin = sim, offset, emit, thin
        self.copy = copy
        """Where the rows also go as arrays (``telemetry.columns``), in the order they are emitted."""
        self._last: list[int | float] | None = None
        """The latest sample's values, series by series (thin)."""
        self._last_ts = 0.0
        self._pending: list[tuple[float, int, int | float]] = []
        """The latest sample's changed values (t_s, series, value), held back until the next sample shows it was
        not the level's last."""
        self.next_t = 0.0
        self.rows = 0
        self.tiers = tiers
        self._busy = [0.0] * len(sim.replicas)
        self._moved = {id(link): 0.0 for link in sim.links.links}
        self._tx = {id(link): 0.0 for link in sim.links.links}
        used = {"host"} if "host" in tiers else set()
        if "remote" in tiers:
            used |= {"nic", "pool"}
        if "storage" in tiers:  # a shared store is reached over the nodes' NICs, capped by its read/write links
            used |= {"nic", "storage"}
        self.links = [link for link in sim.links.links if link.kind in used]
        self.series = self._series()
        """(name, labels) of every series, in the order :meth:`_values` gives their values."""
        self._copy_ids = copy.ids([("sim", name, labels) for name, labels in self.series]) if copy else []
        self.reuse = ReuseCounters(len(sim.replicas))
        self._hbm_lookup, self._tier_lookup = looks_up_prefixes(sim)
        self._reuse_on = False
        """The reuse counters are written (decided by the first request to finish)."""
        self._decided = not self._hbm_lookup
        self._fixed = len(self.series)
        """How many series :meth:`_values` gives; the reuse counters follow them once on."""
        self._held: list[tuple[float, int, int | float]] = []
        """The full grid's reuse rows of the latest sample, written at the next sample or the level's end."""
        self._chained = sim.on_finish
        sim.on_finish = self._finished

    def _series(self) -> list[tuple[str, dict[str, Any]]]:
        out: list[tuple[str, dict[str, Any]]] = []
        for rep in self.sim.replicas:
            lab = {"replica": f"r{rep.index}", "node": f"n{rep.cfg.node}"}
            names = ["server.requests_running", "server.requests_waiting"]
            names += ["server.requests_parked"] if self.tiers else []
            names += ["server.kv_usage", "server.preemptions_total", "server.prompt_tokens_total",
                      "server.generation_tokens_total", "gpu.util"]
            out += [(name, lab) for name in names]
        for link in self.links:
            lab = {"link": link.name, "kind": link.kind}
            if link.node is not None:
                lab["node"] = f"n{link.node}"
            out.append(("link.util", lab))
            if link.kind == "nic":
                out += [("net.tx_bytes_s", lab), ("net.rx_bytes_s", lab)]
        for name, group in self.sim.tiers.items():
            for i in range(len(group)):
                out.append(("server.kv_tier_usage", {"tier": name} | ({"node": f"n{i}"} if name == "host" else {})))
        for link in self.links:
            lab = {"link": link.name, "kind": link.kind}
            if link.node is not None:
                lab["node"] = f"n{link.node}"
            out += [(LINK_BYTES, lab | {"direction": "out"}), (LINK_BYTES, lab | {"direction": "in"})]
        return out

    def _reuse_series(self) -> list[tuple[str, dict[str, Any]]]:
        names = HBM_REUSE + TIER_REUSE if self._tier_lookup else HBM_REUSE
        return [(name, {"replica": f"r{rep.index}", "node": f"n{rep.cfg.node}"})
                for rep in self.sim.replicas for name in names]

    def _reuse_values(self) -> list[int | float]:
        r, tier = self.reuse, self._tier_lookup
        out: list[int | float] = []
        for i in range(len(self.sim.replicas)):
            out += [r.queries[i], r.hits[i], r.tier_queries[i], r.tier_hits[i]] if tier else [r.queries[i], r.hits[i]]
        return out

    def _finished(self, req: SimRequest, now: float) -> None:
        """The simulation's ``on_finish``: counts the request, then hands it on."""
        if not self._decided:
            self._decided = True
            if req.hashes:
                self._start_reuse()
        if self._reuse_on:
            self.reuse.count(req)
        if self._chained is not None:
            self._chained(req, now)

    def _start_reuse(self) -> None:
        """The reuse counters join the series: a zero row each at the latest sample (none before it finished)."""
        self._reuse_on = True
        added = self._reuse_series()
        first = len(self.series)
        self.series += added
        if self.copy is not None:
            self._copy_ids += self.copy.ids([("sim", name, labels) for name, labels in added])
        if self._last is None:
            return
        zeros: list[tuple[float, int, int | float]] = [(self._last_ts, first + k, 0) for k in range(len(added))]
        self._last += [0] * len(added)
        if self.thin:
            self._pending += zeros
        else:
            self._held = zeros

    def _values(self, t: float) -> list[int | float]:
        """Every series' value at ``t`` (counters as rates over the last ``SAMPLE_S``), in ``series`` order."""
        sim, tiers, first = self.sim, self.tiers, t <= 0
        values: list[int | float] = []
        add = values.append
        for rep in sim.replicas:
            add(len(rep.running))
            add(len(rep.waiting))
            if tiers:
                add(len(rep.parked) + rep.moving)
            add(round_to(rep.kv_usage(t), 5))
            add(rep.preemptions)
            add(rep.prompt_tokens)
            add(rep.generation_tokens)
            busy = rep.busy_at(t)
            add(0.0 if first else round_to(min(1.0, (busy - self._busy[rep.index]) / SAMPLE_S), 5))
            self._busy[rep.index] = busy
        if self.links:
            sim.links.advance(t)
            for link in self.links:
                moved, tx = link.moved_bytes - self._moved[id(link)], link.tx_bytes - self._tx[id(link)]
                self._moved[id(link)], self._tx[id(link)] = link.moved_bytes, link.tx_bytes
                add(0.0 if first else round_to(moved / SAMPLE_S / link.nominal_bytes_s, 5))
                if link.kind == "nic":
                    add(0.0 if first else round_to(tx / SAMPLE_S, 1))
                    add(0.0 if first else round_to((moved - tx) / SAMPLE_S, 1))
        for group in sim.tiers.values():
            for tier in group:
                add(round_to(tier.used / tier.capacity, 5) if tier.capacity else 0.0)
        for link in self.links:
            add(round_to(link.tx_bytes, 1))
            add(round_to(link.moved_bytes - link.tx_bytes, 1))
        if self._reuse_on:
            values += self._reuse_values()
        return values

    def _row(self, ts: float, i: int, value: int | float) -> dict[str, Any]:
        name, labels = self.series[i]
        return {"t_s": ts, "source": "sim", "name": name, "labels": labels, "value": value}

    def _emit(self, samples: list[tuple[float, int, int | float]], hold: float | None) -> None:
        """Rows for (t_s, series, value) samples, each marked held ``hold`` seconds when given."""
        if hold is None:
            rows = [self._row(ts, i, v) for ts, i, v in samples]
        else:
            rows = [self._row(ts, i, v) | {HOLD: hold} for ts, i, v in samples]
        self.rows += len(rows)
        self.emit(rows)
        if self.copy is not None and samples:
            h, ids = math.nan if hold is None else hold, self._copy_ids
            self.copy.add([(ids[i], ts, v, h) for ts, i, v in samples])

    def until(self, t: float) -> None:
        while self.next_t <= t:
            self.sample(self.next_t)
            self.next_t += SAMPLE_S

    def sample(self, t: float) -> None:
        ts = round_to(self.offset + t, 6)
        values = self._values(t)
        if not self.thin:
            fixed = self._fixed
            rows = [(ts, i, v) for i, v in enumerate(values)]
            self._emit(self._held + rows[:fixed], None)
            self._held = rows[fixed:]  # the reuse rows wait: the level's last one carries its final counts
            self._last, self._last_ts = values, ts
            return
        # the previous sample's changed rows (now known to hold); this sample's are kept pending
        prev, pending = self._last, self._pending
        self._pending = ([(ts, i, v) for i, v in enumerate(values)] if prev is None else
                         [(ts, i, v) for i, (v, p) in enumerate(zip(values, prev)) if p != v])
        self._last, self._last_ts = values, ts
        self._emit(pending, SAMPLE_S)

    def finish(self) -> None:
        """The level's last sample of every series, not held (thin; the full grid has written it already); the
        reuse counters' last rows carry the level's final counts (requests finish between samples)."""
        if self._last is None:
            return
        last = self._last[:self._fixed] + (self._reuse_values() if self._reuse_on else [])
        if self.thin:
            self._pending = []
            self._emit([(self._last_ts, i, v) for i, v in enumerate(last)], None)
        elif self._held:
            self._emit([(ts, i, last[i]) for ts, i, _ in self._held], None)
            self._held = []
