"""What a level leaves cached for the next when levels run back to back on one server (``workload.unique_prefix``
false: prompts recur across levels, as inference-perf's stages or ``bench --no-unique-prefix`` send them).

Why apart from the level run: every level is simulated on a fresh cluster, which is right when prompts never
recur across levels (``bench`` makes them unique per level by default); when they do, a real server starts each
level with the prefixes the previous one left in HBM and in its tiers, and its router with what it learnt.
This copies exactly that — the prefix blocks (not requests: the level ended, so nothing runs or waits) — from the
old cluster to the new one, in LRU order.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kvcap.sim.engine import Simulation
from kvcap.sim.kv import FREED


@dataclass
class CachedPrefixes:
    """The prefix caches of one cluster at a level's end, oldest entry first."""

    hbm: list[list[tuple[int, int]]] = field(default_factory=list)
    """Per replica: (hash id, blocks) of each cached prefix block."""
    tiers: dict[str, list[list[tuple[int, float]]]] = field(default_factory=dict)
    """Per tier kind (``host``, ``remote``), per tier: (hash id, bytes) of each stored prefix block."""
    router: list[tuple[list[int], list[int] | None]] = field(default_factory=list)
    """prefix_aware routing, per replica: the hash ids its GPU and tier indexes hold."""
    cold_order: list[int] = field(default_factory=list)


def cached_prefixes(sim: Simulation) -> CachedPrefixes:
    """What ``sim`` holds cached now; prefixes still referenced (by requests cancelled at the level's end) count
    as the most recently used."""
    out = CachedPrefixes()
    for rep in sim.replicas:
        pool = rep.hbm
        held = [(h, pool.hash_blocks) for h, ref in pool.prefix_ref.items() if ref > 0]
        out.hbm.append([(h, b) for h, b in pool.prefix_lru.items() if h < FREED] + held)
    out.tiers = {kind: [list(t.prefix.items()) for t in tiers] for kind, tiers in sim.tiers.items()}
    router = sim.prefix_router
    if router is not None:
        out.router = [(list(g.lru), list(t.lru) if t is not None else None) for g, t in zip(router.gpu, router.tier)]
        out.cold_order = list(router.cold_order)
    return out


def restore(sim: Simulation, cached: CachedPrefixes) -> None:
    """Load ``cached`` into a fresh ``sim`` of the same scenario (same replicas, tiers and pool sizes)."""
    for rep, entries in zip(sim.replicas, cached.hbm):
        pool = rep.hbm
        for h, blocks in entries:
            if pool.used + blocks > pool.capacity:
                break
            pool.prefix_ref[h] = 0
            pool.prefix_lru[h] = blocks
            pool.used += blocks
            pool.cached_blocks += blocks
    for kind, tiers in sim.tiers.items():
        for tier, entries in zip(tiers, cached.tiers.get(kind, [])):
            for h, nbytes in entries:
                tier.store_prefix(h, nbytes)
    router = sim.prefix_router
    if router is not None and cached.router:
        for g, t, (g_ids, t_ids) in zip(router.gpu, router.tier, cached.router):
            g.lru = OrderedDict.fromkeys(g_ids)
            if t is not None and t_ids is not None:
                t.lru = OrderedDict.fromkeys(t_ids)
        router.cold_order = list(cached.cold_order)


@dataclass
class CarriedCaches:
    """Levels run back to back on one server (``workload.unique_prefix`` false): what the last level left."""

    left: CachedPrefixes | None = None
