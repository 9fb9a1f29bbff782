"""The kinds of event on the cluster's heap, and the hooks a replica calls on the cluster it runs in.

Why a module below both: a replica times its steps onto the heap, starts KV copies over the links and hands
finished requests back through these few hooks, which the event loop (:class:`kvcap.sim.engine.Simulation`)
implements; with them here the replica needs nothing from the engine, so neither imports the other back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from kvcap.sim.links import Link
from kvcap.sim.request import SimRequest

EventKind = Literal["step", "arrival", "link", "copied", "call"]
"""``step``: a replica's step or decode span ends (stale versions are skipped); ``arrival``: route and enqueue a
request; ``link``: the next transfer's bytes are through; ``copied``: its latency later, the copy's callback;
``call``: a driver's callback."""


class ClusterHooks:
    """What a replica asks of its cluster; every method is the event loop's to implement."""

    max_span: int | None
    """Longest decode span in steps (1 when serving in real time, so every token is an event)."""
    on_tokens: Callable[[SimRequest], None] | None
    """Called with a request each time it gets new tokens (serve-sim streams them)."""

    def push(self, t: float, kind: EventKind, obj: Any, version: int = 0) -> None:
        """An event of ``kind`` about ``obj`` at ``t`` (ties in push order)."""
        raise NotImplementedError

    def start_copy(self, now: float, nbytes: float, lanes: list[Link], caps: list[Link], outbound: bool,
                   on_done: Callable[[float], None]) -> None:
        """Put a KV copy on its links; ``on_done`` runs when it is through."""
        raise NotImplementedError

    def arrival_due(self, t: float) -> bool:
        """An arrival is due at or before ``t`` and not yet processed."""
        raise NotImplementedError

    def may_route_to(self, index: int) -> bool:
        """Whether a request arriving now could go to replica ``index``."""
        raise NotImplementedError

    def finish(self, req: SimRequest, now: float) -> None:
        """``req`` is done (served, refused or cut off) at ``now``."""
        raise NotImplementedError
