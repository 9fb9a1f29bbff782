"""The offload tiers one replica may copy KV to, the links a copy to each crosses, and the rules by which prompt
prefixes are stored in them and found again (the engine's tier profile).

Why an object of its own: which tier a copy goes to (host RAM first: its node's, or its own with
``host_kv_scope: replica``; then the remote pool; a shared storage tier only for prefixes) and over which links
is fixed when the cluster is built; the cluster hands each replica its view, so the replica asks it instead of
asking the cluster, and the tiers' bytes stay shared where the tiers are.

Parking (a preempted or spilled request's decode KV) uses host and remote only, whatever the profile: the
storage tier holds prefixes, as the engines' shared stores do.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcap.sim.kv import BlockPool, Tier
from kvcap.sim.links import Link

TIER_PROFILES = ("default", "vllm_cpu", "lmcache", "hicache", "kvbm")
HICACHE_WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
LMCACHE_CHUNK_TOKENS = 256
"""LMCache's default ``chunk_size``: KV is stored and found in chunks of this many tokens."""


@dataclass(frozen=True)
class TierRules:
    """How an engine's connector stores prefixes in its tiers and finds them again.

    * ``default`` — kvcap's rule before profiles existed: full hash blocks go to the first tier (host, else
      remote) when a prefill completes, are looked up there after the HBM hit, and a hit is always loaded.
    * ``vllm_cpu`` — vLLM's native ``OffloadingConnector`` with its CPU backend (vllm
      ``distributed/kv_transfer/kv_connector/v1/offloading_connector.py`` and ``v1/kv_offload/lru_manager.py``,
      v0.11): every full block is stored as it is computed, the lookup starts after the GPU prefix hit and counts
      consecutive blocks, the hit is loaded before the prefill runs, the CPU pool evicts least recently used
      blocks and belongs to one engine instance (``kv_offloading_size``).
    * ``lmcache`` — LMCache's vLLM connector (LMCache v0.3, ``chunk_size`` 256, ``save_unfull_chunk`` off):
      KV is stored and found in whole chunks of 256 tokens (a partial chunk at the end of a prompt is not
      stored), written on prefill to every backend it has (local CPU, then local disk, then a remote server),
      looked up in that order from the prompt's first token; vLLM loads what lies beyond its own GPU hit.
    * ``hicache`` — SGLang's hierarchical radix cache (sglang ``srt/mem_cache/hiradix_cache.py``, v0.5): a
      device node reaches host memory under ``--hicache-write-policy``: ``write_through`` on its first use,
      ``write_through_selective`` once it has been used twice (the hit-count threshold), ``write_back`` only when
      the device evicts it; what reaches host is also backed up to the storage backend (L3), and a prefix
      fetched from L3 lands in host memory on its way to the device.
    * ``kvbm`` — NVIDIA Dynamo's KV block manager: write-through, every block written to host (G2) as it is
      computed and on to disk or object storage (G3/G4); a host pool smaller than the device pool therefore
      only ever holds blocks the device still has, and churns.

    Every profile but ``default`` loads a hit only where the copy costs less than computing those tokens."""

    name: str
    chunk_tokens: int
    """Stored and found in chunks of this many tokens (0: one hash block)."""
    from_start: bool
    """The lookup counts from the prompt's first block (LMCache), not from the end of the HBM hit."""
    host_only: bool
    """Only the host tier holds prefixes (vLLM's CPU backend)."""
    first_only: bool
    """Only the first tier and the storage tier hold prefixes (``default``)."""
    write_threshold: int
    """Uses of a block before it is written to the first tier (1: as computed; 0: on HBM eviction)."""
    promote: bool
    """A prefix loaded from a lower tier is kept in the first one too."""
    cheaper_only: bool
    """Load a hit only where the copy is cheaper than computing it."""


def tier_rules(profile: str, write_policy: str = "write_through") -> TierRules:
    """The rules of one profile (``hicache``: with its write policy)."""
    if profile == "default":
        return TierRules("default", 0, False, False, True, 1, False, False)
    if profile == "vllm_cpu":
        return TierRules("vllm_cpu", 0, False, True, False, 1, False, True)
    if profile == "lmcache":
        return TierRules("lmcache", LMCACHE_CHUNK_TOKENS, True, False, False, 1, False, True)
    if profile == "hicache":
        threshold = {"write_through": 1, "write_through_selective": 2, "write_back": 0}[write_policy]
        return TierRules("hicache", 0, False, False, False, threshold, True, True)
    if profile == "kvbm":
        return TierRules("kvbm", 0, False, False, False, 1, False, True)
    raise ValueError(f"unknown tier profile {profile!r}")


DEFAULT_RULES = tier_rules("default")


class ReplicaTiers:
    """One replica's tiers in the order a copy tries them, with the links of each (host: its PCIe link; remote:
    its node's NICs, capped by the pool's links; storage: its node's NICs, capped by the store's read or write
    bandwidth), and the profile's prefix rules."""

    __slots__ = (
        "enabled",
        "hits",
        "host",
        "host_link",
        "load_plan",
        "nic_links",
        "order",
        "pool_links",
        "prefix_order",
        "remote",
        "rules",
        "storage",
        "storage_read",
        "storage_write",
        "unwritten",
    )

    def __init__(self, host: Tier | None, remote: Tier | None, host_link: Link | None,
                 nic_links: tuple[Link, ...], pool_links: tuple[Link, ...]) -> None:
        self.host, self.remote = host, remote
        self.host_link, self.nic_links, self.pool_links = host_link, nic_links, pool_links
        self.order = [t for t in (host, remote) if t is not None]
        self.enabled = bool(self.order)
        self.rules = DEFAULT_RULES
        self.storage: Tier | None = None
        self.storage_read: tuple[Link, ...] = ()
        self.storage_write: tuple[Link, ...] = ()
        self.prefix_order: list[Tier] = self.order[:1]
        """Where prefixes are stored and looked up, in lookup order."""
        self.load_plan: list[tuple[Tier, int]] = []
        """The last lookup's hit, tier by tier in prompt order: (tier, tokens) — what ``load_prefix`` copies."""
        self.hits: dict[int, int] = {}
        """``write_through_selective``: uses of each block not yet written to the first tier."""
        self.unwritten: dict[int, None] = {}
        """``write_back``: blocks this replica computed that reach the first tier once HBM evicts them."""

    def configure(self, rules: TierRules, storage: Tier | None = None, storage_read: tuple[Link, ...] = (),
                  storage_write: tuple[Link, ...] = ()) -> None:
        """Set the profile and the shared storage tier (the cluster calls this once, before any request)."""
        self.rules = rules
        self.storage, self.storage_read, self.storage_write = storage, storage_read, storage_write
        if rules.host_only:
            order: list[Tier] = [self.host] if self.host is not None else []
        elif rules.first_only:
            order = self.order[:1]
        else:
            order = list(self.order)
        if storage is not None and not rules.host_only:
            order.append(storage)
        self.prefix_order = order

    @property
    def plain(self) -> bool:
        """Today's rule and no storage tier: the replica takes its original path, so outputs stay as they were."""
        return self.rules is DEFAULT_RULES and self.storage is None

    def by_name(self, name: str | None) -> Tier | None:
        if name == "host":
            return self.host
        if name == "remote":
            return self.remote
        if name == "storage":
            return self.storage
        return None

    def room_for(self, nbytes: float, name: str | None = None,
                 reserve: bool = True) -> tuple[Tier | None, list[Link], list[Link]]:
        """The tier (``name``, else the first in order) with room for ``nbytes`` (taken when ``reserve``), and the
        links a copy to it crosses: (lanes, caps)."""
        for tier in ([self.by_name(name)] if name else self.order):
            if tier is None:
                continue
            if reserve and not tier.reserve(nbytes):
                continue
            lanes, caps = self.links_to(tier, reading=not reserve)
            return tier, lanes, caps
        return None, [], []

    def links_to(self, tier: Tier, reading: bool = False) -> tuple[list[Link], list[Link]]:
        """(lanes, caps) of a copy to ``tier`` (``reading``: from it)."""
        if tier is self.host:
            assert self.host_link is not None
            return [self.host_link], []
        if tier is self.storage and tier is not None:
            return list(self.nic_links), list(self.storage_read if reading else self.storage_write)
        return list(self.nic_links), list(self.pool_links)

    def prefix_tier(self) -> Tier | None:
        """Where prefixes are stored and looked up first."""
        return self.prefix_order[0] if self.prefix_order else None

    @property
    def prefix_enabled(self) -> bool:
        return bool(self.prefix_order)

    # ------------------------------------------------------------------ the profile's rules
    def chunk_blocks(self, hash_block_tokens: int) -> int:
        """Hash blocks per stored unit (a chunk holds whole blocks; at least one)."""
        chunk = self.rules.chunk_tokens
        return max(1, chunk // hash_block_tokens) if chunk else 1

    def lookup(self, hashes: tuple[int, ...], start: int, hash_block_tokens: int) -> list[tuple[Tier, int]]:
        """The tiers' hit after the first ``start`` blocks (held in HBM) of ``hashes`` (the prompt's full blocks):
        (tier, blocks) runs in prompt order, each unit found in the first tier in lookup order that holds it, up
        to the first unit none holds. A unit is keyed by its last block's hash id (ids are prefix-chained)."""
        cb = self.chunk_blocks(hash_block_tokens)
        first = 0 if self.rules.from_start else start
        runs: list[tuple[Tier, int]] = []
        i = first
        while i + cb <= len(hashes):
            key = hashes[i + cb - 1]
            found: Tier | None = None
            for tier in self.prefix_order:
                if tier.hit(key):
                    found = tier
                    break
            if found is None:
                break
            lo = max(i, start)
            n = i + cb - lo
            if n > 0:
                if runs and runs[-1][0] is found:
                    runs[-1] = (found, runs[-1][1] + n)
                else:
                    runs.append((found, n))
            i += cb
        return runs

    def store(self, full: tuple[int, ...], hbm: BlockPool, block_bytes: float) -> list[tuple[Tier, int]]:
        """A prefill of a prompt with these full blocks completed: what the profile writes now, as (tier, new
        units) — the caller copies their bytes out. ``hbm`` tells a write-back profile what HBM has evicted."""
        cb = self.chunk_blocks(hbm.hash_block_tokens) if hbm.hash_block_tokens else 1
        unit = block_bytes * cb
        keys = [full[i + cb - 1] for i in range(0, len(full) - cb + 1, cb)]
        written: dict[int, int] = {}
        first = self.prefix_tier()
        threshold = self.rules.write_threshold
        if threshold == 0:  # write-back: what HBM no longer holds reaches the first tier now
            to_first = [h for h in self.unwritten if h not in hbm.prefix_ref]
            for h in to_first:
                del self.unwritten[h]
            for h in keys:
                self.unwritten[h] = None
        elif threshold > 1:  # selective write-through: a block's uses counted until it is written
            to_first = []
            for h in keys:
                if first is not None and h in first.prefix:
                    first.hit(h)
                    continue
                uses = self.hits.get(h, 0) + 1
                if uses >= threshold:
                    self.hits.pop(h, None)
                    to_first.append(h)
                else:
                    self.hits[h] = uses
        else:
            to_first = keys
        for tier in self.prefix_order:
            chosen = to_first if (tier is first or self.rules.promote) else keys
            new = 0
            for h in chosen:
                if tier.store_prefix(h, unit):
                    new += 1
            if new:
                written[id(tier)] = new
        return [(t, written[id(t)]) for t in self.prefix_order if id(t) in written]

    def promote(self, runs: list[tuple[Tier, int]], hashes: tuple[int, ...], start: int,
                block_bytes: float) -> None:
        """A profile that fetches lower-tier hits through host memory keeps them there (hicache's L3 prefetch)."""
        first = self.prefix_tier()
        if not self.rules.promote or first is None:
            return
        i = start
        for tier, n in runs:
            if tier is not first:
                for h in hashes[i: i + n]:
                    first.store_prefix(h, block_bytes)
            i += n

    def load_seconds(self, tier: Tier, nbytes: float) -> float:
        """What copying ``nbytes`` from ``tier`` would take now: bytes over the bandwidth each of its links would
        give one more copy (its achievable bandwidth shared with the copies in flight), plus the latency."""
        lanes, caps = self.links_to(tier, reading=True)
        if not lanes:
            return 0.0
        rate = min(link.bytes_s / (len(link.active) + 1) for link in lanes) * len(lanes)
        for link in caps:
            rate = min(rate, link.bytes_s / (len(link.active) + 1))
        latency = max(link.latency_s for link in lanes + caps)
        return nbytes / rate + latency if rate > 0 else float("inf")
