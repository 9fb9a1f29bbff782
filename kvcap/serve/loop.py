"""Event-loop helpers for timing-exact serving: deadline sleeps that record their lateness, a sub-millisecond
epoll selector, and a raised descriptor limit.

Why: a server whose tokens must leave on schedule (the test engines' timing truths) needs timers that fire on
time, and a way to tell a broken schedule from a starved host — ``/stats`` reports :data:`TIMERS` for that.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import selectors
from dataclasses import dataclass


@dataclass
class TimerStats:
    """How late timed sends woke up. The truths hold only while the host keeps up; tests read this (``timer`` in
    /stats) to tell a broken schedule from a starved machine."""

    wakeups: int = 0
    late_over_1ms: int = 0
    late_over_5ms: int = 0
    max_late_s: float = 0.0

    def record(self, late: float) -> None:
        self.wakeups += 1
        if late > 0.001:
            self.late_over_1ms += 1
            if late > 0.005:
                self.late_over_5ms += 1
        if late > self.max_late_s:
            self.max_late_s = late

    def as_dict(self) -> dict[str, float]:
        return {"wakeups": self.wakeups, "late_over_1ms": self.late_over_1ms, "late_over_5ms": self.late_over_5ms,
                "max_late_ms": round(self.max_late_s * 1e3, 3)}


TIMERS = TimerStats()
"""Process-wide: one server per process is the intended use."""


def _release(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


async def sleep_until(loop: asyncio.AbstractEventLoop, when: float, record: bool = True) -> bool:
    """Sleep to an absolute ``loop.time()`` deadline; returns False (without yielding) if it has passed.

    ``record``: count the wake-up's lateness (also when already past due) in :data:`TIMERS`."""
    now = loop.time()
    if when <= now:
        if record:
            TIMERS.record(now - when)
        return False
    fut = loop.create_future()
    handle = loop.call_at(when, _release, fut)
    try:
        await fut
    finally:
        handle.cancel()
    if record:
        TIMERS.record(loop.time() - when)
    return True


class PreciseEpollSelector(selectors.EpollSelector):
    """epoll waits whole milliseconds and asyncio rounds *up*, so timers fire up to 1 ms late. Rounding down
    instead wakes the loop up to 1 ms early; it then polls without blocking until the deadline. That costs a
    little CPU when idle and buys timers that fire at their deadline, which the timing truths need."""

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is not None and timeout > 0:
            timeout = max(0.0, (math.floor(timeout * 1e3) - 1e-6) * 1e-3)
        return super().select(timeout)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A selector loop with :class:`PreciseEpollSelector` where epoll exists, else asyncio's default."""
    if hasattr(selectors, "EpollSelector"):
        return asyncio.SelectorEventLoop(PreciseEpollSelector())
    return asyncio.new_event_loop()


def raise_fd_limit() -> None:
    """Thousands of streams need thousands of descriptors: lift the soft limit to the hard one."""
    with contextlib.suppress(ImportError, ValueError, OSError):
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or hard > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 65536, hard))
