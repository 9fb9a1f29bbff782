"""Links that KV moves over (PCIe to host RAM, a node's NIC to the remote pool), shared by concurrent transfers.

Why processor sharing: a NIC or a PCIe link moving several KV copies at once gives each a share of its
bandwidth, so a transfer's time depends on what else is in flight — the contention the article warns about
("one hot node can saturate while others idle"). A transfer takes ``bytes / rate + latency``; its rate is
re-computed whenever a transfer on one of its links starts or ends.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(eq=False)
class Link:
    """One direction-agnostic pipe: ``bytes_s`` is what it achieves (nominal × efficiency)."""

    name: str
    kind: str
    """``host`` (PCIe of one replica's GPUs), ``nic`` (one node's NIC) or ``pool`` (the remote pool's own limit)."""
    nominal_bytes_s: float
    bytes_s: float
    latency_s: float
    node: int | None = None
    active: dict[Transfer, None] = field(default_factory=dict)
    """Transfers on the link, in the order they started (a dict, not a set: iteration order must not depend on
    memory addresses, or the same seed would give different runs)."""
    moved_bytes: float = 0.0
    tx_bytes: float = 0.0
    """Bytes sent from the GPU side (swap-out, prefix store); ``moved_bytes - tx_bytes`` came back (swap-in)."""


@dataclass(eq=False)
class Transfer:
    """A KV copy. ``lanes``: links it is spread over in parallel (a replica over several NICs); ``caps``: links
    it also crosses in series (the pool). Rate = lanes × min(each link's bandwidth / its active transfers)."""

    nbytes: float
    lanes: list[Link]
    caps: list[Link]
    outbound: bool
    on_done: Callable[[float], None]
    remaining: float = 0.0
    rate: float = 0.0
    latency_s: float = 0.0

    def links(self) -> list[Link]:
        return self.lanes + self.caps


class LinkSet:
    """All links of a cluster and the transfers on them; the simulator asks for the next completion time."""

    def __init__(self) -> None:
        self.links: list[Link] = []
        self.transfers: dict[Transfer, None] = {}  # insertion-ordered: runs are reproducible
        self.t = 0.0

    def add(self, link: Link) -> Link:
        self.links.append(link)
        return link

    def advance(self, t: float) -> None:
        """Move every transfer forward to time ``t`` at its current rate."""
        dt = t - self.t
        if dt > 0:
            for tr in self.transfers:
                moved = min(tr.remaining, tr.rate * dt)
                tr.remaining -= moved
                per_lane = moved / len(tr.lanes)
                for link in tr.lanes:
                    link.moved_bytes += per_lane
                    if tr.outbound:
                        link.tx_bytes += per_lane
                for link in tr.caps:
                    link.moved_bytes += moved
                    if tr.outbound:
                        link.tx_bytes += moved
        self.t = max(self.t, t)

    def start(self, t: float, nbytes: float, lanes: list[Link], caps: list[Link], outbound: bool,
              on_done: Callable[[float], None]) -> Transfer:
        self.advance(t)
        tr = Transfer(nbytes=nbytes, lanes=lanes, caps=caps, outbound=outbound, on_done=on_done,
                      remaining=max(nbytes, 0.0), latency_s=max(link.latency_s for link in lanes + caps))
        self.transfers[tr] = None
        for link in tr.links():
            link.active[tr] = None
        self._rerate(tr.links())
        return tr

    def _rerate(self, touched: list[Link]) -> None:
        seen: dict[Transfer, None] = {}
        for link in touched:
            seen.update(link.active)
        for tr in seen:
            share = min(link.bytes_s / len(link.active) for link in tr.links())
            tr.rate = share * len(tr.lanes) if not tr.caps else min(
                min(link.bytes_s / len(link.active) for link in tr.lanes) * len(tr.lanes),
                min(link.bytes_s / len(link.active) for link in tr.caps))

    def next_done(self) -> tuple[float, Transfer] | None:
        """(time the first transfer's bytes are through, that transfer), at current rates."""
        best: tuple[float, Transfer] | None = None
        for tr in self.transfers:
            when = self.t + (tr.remaining / tr.rate if tr.rate > 0 else float("inf"))
            if best is None or when < best[0]:
                best = (when, tr)
        return best

    def finish(self, tr: Transfer) -> None:
        """Take a transfer whose bytes are through off its links (its ``on_done`` runs after its latency)."""
        tr.remaining = 0.0
        self.transfers.pop(tr, None)
        for link in tr.links():
            link.active.pop(tr, None)
        self._rerate(tr.links())
