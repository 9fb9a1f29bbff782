"""The offload tiers one replica may copy KV to, and the links a copy to each crosses.

Why an object of its own: which tier a copy goes to (host RAM first: its node's, or its own with
``host_kv_scope: replica``; then the remote pool) and over which links is fixed when the cluster is built;
the cluster hands each replica its view, so the replica asks it instead of asking the cluster, and the tiers'
bytes stay shared where the tiers are.
"""

from __future__ import annotations

from kvcap.sim.kv import Tier
from kvcap.sim.links import Link


class ReplicaTiers:
    """One replica's tiers in the order a copy tries them, with the links of each (host: its PCIe link; remote:
    its node's NICs, capped by the pool's links)."""

    __slots__ = ("enabled", "host", "host_link", "nic_links", "order", "pool_links", "remote")

    def __init__(self, host: Tier | None, remote: Tier | None, host_link: Link | None,
                 nic_links: tuple[Link, ...], pool_links: tuple[Link, ...]) -> None:
        self.host, self.remote = host, remote
        self.host_link, self.nic_links, self.pool_links = host_link, nic_links, pool_links
        self.order = [t for t in (host, remote) if t is not None]
        self.enabled = bool(self.order)

    def by_name(self, name: str | None) -> Tier | None:
        if name == "host":
            return self.host
        if name == "remote":
            return self.remote
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
            lanes, caps = self.links_to(tier)
            return tier, lanes, caps
        return None, [], []

    def links_to(self, tier: Tier) -> tuple[list[Link], list[Link]]:
        """(lanes, caps) of a copy to or from ``tier``."""
        if tier is self.host:
            assert self.host_link is not None
            return [self.host_link], []
        return list(self.nic_links), list(self.pool_links)

    def prefix_tier(self) -> Tier | None:
        """Where prefixes are stored and looked up: the first tier in order."""
        return self.order[0] if self.order else None
