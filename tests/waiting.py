"""Waiting in a test for something to happen: poll the condition until a deadline, never sleep a guessed time
(a guess long enough on a quiet machine is too short on a loaded one, and too long everywhere else)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

POLL_S = 0.02


def wait_until(condition: Callable[[], object], timeout_s: float = 30.0, every_s: float = POLL_S) -> bool:
    """True as soon as ``condition()`` is; False if it still is not after ``timeout_s`` (the caller asserts)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(every_s)
    return True


async def until(condition: Callable[[], object], timeout_s: float = 30.0, every_s: float = POLL_S) -> bool:
    """``wait_until`` for a coroutine: the event loop keeps running (and seeing closes, say) between checks."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(every_s)
    return True
