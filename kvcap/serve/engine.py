"""What the front end needs from the engine behind it, as a :class:`typing.Protocol`.

Why: the same HTTP front end serves the batching test engine (``kvcap.testing``) and the simulator in real time
(``kvcap serve-sim``); this is the whole contract between them. An engine hands out one opaque handle per
request, says when that request holds ``n`` tokens, and reports its load for ``/stats`` and its metric families
for ``/metrics``. An engine with a prefix cache also implements :class:`PrefixCachingEngine`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

from kvcap.serve.metrics import MetricFamily, RequestCounters

HandleT = TypeVar("HandleT")


@dataclass(frozen=True)
class EngineLoad:
    """The engine's side of ``/stats``: requests running and waiting now, the most it has held of each, and (for
    an engine that runs in steps) how many steps it ran and how often it restarted its clock (``None``: no such
    notion)."""

    running: int
    waiting: int
    max_running: int
    max_waiting: int
    steps: int | None = None
    resyncs: int | None = None


@dataclass
class Occupancy:
    """Running and waiting counts with their high-water marks; mutated only on the event loop."""

    running: int = 0
    waiting: int = 0
    max_running: int = 0
    max_waiting: int = 0

    def set_running(self, n: int) -> None:
        self.running = n
        self.max_running = max(self.max_running, n)

    def set_waiting(self, n: int) -> None:
        self.waiting = n
        self.max_waiting = max(self.max_waiting, n)

    def load(self, steps: int | None = None, resyncs: int | None = None) -> EngineLoad:
        return EngineLoad(self.running, self.waiting, self.max_running, self.max_waiting, steps, resyncs)


class TokenSlot:
    """A building block for engine handles: the tokens one request holds so far, and the front end's wait for
    more. The engine calls :meth:`deliver` (or :meth:`wake` when the request ends early); :meth:`wait_for`
    implements :meth:`Engine.wait`."""

    __slots__ = ("produced", "waiter", "want")

    def __init__(self) -> None:
        self.produced = 0
        self.want = 0
        self.waiter: asyncio.Future[None] | None = None

    def ended(self) -> bool:
        """True once no more tokens will come, whatever ``produced`` says (engines that can fail override it)."""
        return False

    def deliver(self, produced: int) -> None:
        """The request now holds ``produced`` tokens: wake the waiter if that is what it waits for."""
        self.produced = produced
        w = self.waiter
        if w is not None and produced >= self.want and not w.done():
            w.set_result(None)

    def wake(self) -> None:
        """Wake the waiter however many tokens it holds (the request ended)."""
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def wait_for(self, n: int) -> bool:
        """Until ``n`` tokens are held (or :meth:`ended`); True if it had to wait."""
        if self.produced >= n:
            return False
        loop = asyncio.get_running_loop()
        while self.produced < n:
            if self.ended():
                return True
            self.want = n
            self.waiter = loop.create_future()
            await self.waiter
        return True


@runtime_checkable
class Engine(Protocol[HandleT]):
    """A token source for the front end; every method is called on the event loop (``isinstance`` checks that
    the methods exist)."""

    def start(self) -> None:
        """Called once the app starts, on the running loop."""

    async def stop(self) -> None:
        """Called at app cleanup; stops any background task."""

    def submit(self, t_arrival: float, prompt_tokens: int, n_out: int) -> HandleT:
        """A new request that arrived at loop time ``t_arrival`` and will take ``n_out`` tokens."""
        ...

    async def wait(self, handle: HandleT, n: int) -> bool:
        """Return once the request holds ``n`` tokens (or can get no more); True if it had to wait."""
        ...

    def release(self, handle: HandleT) -> None:
        """The front end is done with the request: finished, faulted, or its client left (then drop it)."""

    def load(self) -> EngineLoad:
        """Running/waiting now and their high-water marks, for ``/stats``."""
        ...

    def metric_families(self, served: RequestCounters, started_wall: float) -> list[MetricFamily]:
        """What ``/metrics`` shows; ``served`` are the front end's counters, ``started_wall`` the app's start
        (Unix seconds), for engines that expose ``*_created`` series."""
        ...


AnyEngine = Engine[Any]


@runtime_checkable
class PrefixCachingEngine(Protocol[HandleT]):
    """An engine that may keep a prefix cache: what the front end needs besides :class:`Engine` to feed it the
    prompt's block hashes (:func:`kvcap.workload.blocks.prompt_block_hashes`) and report the tokens it found."""

    @property
    def prefix_block_tokens(self) -> int | None:
        """Tokens per cache block, or None when this engine keeps no prefix cache (then nothing is hashed)."""
        ...

    def submit_blocks(self, t_arrival: float, prompt_tokens: int, n_out: int, block_hashes: Sequence[int]) -> HandleT:
        """:meth:`Engine.submit` with the chained hashes of the prompt's full blocks."""
        ...

    def cached_tokens(self, handle: HandleT) -> int:
        """Prompt tokens the request found in the cache (0 until the engine looked them up)."""
        ...
