"""An SSE client that times what a load generator would see, for the tests of the test server and its front end.

Every event is stamped with perf_counter when its network chunk arrives; :func:`truth_check` tells a broken
timing truth from a host too loaded to deliver it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
import pytest

from tests.servers import FakeServer, start_fake_server

TTFT_MS, ITL_MS = 50.0, 20.0
TOL_MS = 2.0


def arun(fn: Callable[..., Awaitable[None]]) -> Callable[..., None]:
    """Run an async test on a fresh loop (no pytest-asyncio needed); fixtures pass through."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        asyncio.run(asyncio.wait_for(fn(*args, **kwargs), timeout=30))
    return wrapper


def session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))


@dataclass
class Stream:
    """Everything one streaming request showed the client; times in seconds on perf_counter."""

    chat: bool
    t0: float
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    events: list[tuple[float, bytes]] = field(default_factory=list)  # (time, payload after "data: ")
    body: bytes = b""
    error: BaseException | None = None

    def objs(self) -> list[Any]:
        out = []
        for _, p in self.events:
            try:
                out.append(json.loads(p))
            except ValueError:
                out.append(None)
        return out

    def content(self) -> list[tuple[float, str, dict[str, Any]]]:
        """(time, text, choice) for events carrying generated text (a chat role chunk is not one)."""
        out = []
        for (t, _), obj in zip(self.events, self.objs()):
            if not isinstance(obj, dict) or not obj.get("choices"):
                continue
            ch = obj["choices"][0]
            text = (ch.get("delta") or {}).get("content") if self.chat else ch.get("text")
            if text:
                out.append((t, text, ch))
        return out

    @property
    def texts(self) -> list[str]:
        return [text for _, text, _ in self.content()]

    @property
    def n_tokens(self) -> int:
        return sum(len(t.split()) for t in self.texts)

    @property
    def ttft_ms(self) -> float:
        return (self.content()[0][0] - self.t0) * 1e3

    @property
    def gaps_ms(self) -> list[float]:
        times = [t for t, _, _ in self.content()]
        return [(b - a) * 1e3 for a, b in itertools.pairwise(times)]

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1][1] == b"[DONE]"

    @property
    def usage(self) -> dict[str, int] | None:
        for obj in self.objs():
            if isinstance(obj, dict) and obj.get("usage"):
                return obj["usage"]
        return None

    @property
    def finish_reasons(self) -> list[str | None]:
        return [ch.get("finish_reason") for _, _, ch in self.content()]


async def stream(s: aiohttp.ClientSession, url: str, *, chat: bool = False, max_events: int | None = None,
                 timeout: aiohttp.ClientTimeout | None = None, **body: Any) -> Stream:
    """POST one streaming request and record every SSE event with its arrival time; never raises."""
    payload: dict[str, Any] = {"stream": True, "max_tokens": 8, **body}
    if chat:
        payload.setdefault("messages", [{"role": "user", "content": "hello there"}])
    else:
        payload.setdefault("prompt", "hello there")
    path = "/v1/chat/completions" if chat else "/v1/completions"
    out = Stream(chat=chat, t0=time.perf_counter())
    try:
        async with s.post(url + path, json=payload, timeout=timeout) as r:
            out.status, out.headers = r.status, dict(r.headers)
            if r.status != 200 or not payload["stream"]:
                out.body = await r.read()
                return out
            buf = b""
            async for chunk in r.content.iter_any():
                now = time.perf_counter()
                buf += chunk
                while b"\n\n" in buf:
                    ev, buf = buf.split(b"\n\n", 1)
                    assert ev.startswith(b"data: "), ev
                    out.events.append((now, ev[6:]))
                    if max_events is not None and len(out.events) >= max_events:
                        return out
            out.body = buf
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        out.error = exc
    return out


def near(value: float, target: float, tol: float = TOL_MS) -> bool:
    return abs(value - target) <= tol


class LoopLag:
    """Worst event-loop lag of this (client) process while active: a starved client mis-times what it sees."""

    def __init__(self, period_s: float = 0.005) -> None:
        self.period_s, self.max_s = period_s, 0.0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(self.period_s)
            self.max_s = max(self.max_s, loop.time() - t - self.period_s)

    async def __aenter__(self) -> LoopLag:
        self._task = asyncio.ensure_future(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


T = TypeVar("T")
WAKE_MS = 1.0
"""Extra round-trip time of a request to an idle server (both processes asleep) above which the host cannot
deliver a 2 ms timing truth: each token crosses two such wake-ups (a VM whose idle vCPUs halt: 1–2.3 ms)."""


async def idle_wake_ms(url: str, idle_s: float = 0.05, n: int = 5) -> float:
    """Median extra time of a ``/health`` round trip after ``idle_s`` of quiet over one made right after another:
    what waking an idle server and client costs on this host."""
    async with session() as s:
        async def rtt() -> float:
            t = time.perf_counter()
            async with s.get(url + "/health") as r:
                await r.read()
            return time.perf_counter() - t

        await rtt()
        hot, cold = [], []
        for _ in range(n):
            hot.append(await rtt())
            await asyncio.sleep(idle_s)
            cold.append(await rtt())
    hot.sort()
    cold.sort()
    return (cold[n // 2] - hot[n // 2]) * 1e3


async def truth_check(srv: FakeServer, measure: Callable[[], Awaitable[T]], check: Callable[[T], None],
                      attempts: int = 3) -> T:
    """Measure, then check timing against truth. A failure on a healthy host fails the test at once; a failure
    while the host was starved (server timers > 5 ms late, this loop lagging > 5 ms, or idle processes taking
    over :data:`WAKE_MS` to wake) is retried, and if every attempt was starved the test is skipped: the truth
    was never delivered, so it cannot be judged."""
    why: list[str] = []
    for _ in range(attempts):
        before = srv.stats()["timer"]["late_over_5ms"]
        async with LoopLag() as lag:
            data = await measure()
        late = srv.stats()["timer"]["late_over_5ms"] - before
        try:
            check(data)
            return data
        except AssertionError:
            wake = await idle_wake_ms(srv.url) if late == 0 and lag.max_s <= 0.005 else 0.0
            if late == 0 and lag.max_s <= 0.005 and wake <= WAKE_MS:
                raise
            why.append(f"{late} server wake-ups > 5 ms late, client loop lag {lag.max_s * 1e3:.1f} ms, "
                       f"idle wake-up {wake:.2f} ms")
    pytest.skip("host too loaded to check timing truth: " + "; ".join(why))


@pytest.fixture(scope="module")
def fixed_srv() -> Iterator[FakeServer]:
    """One default server (ttft 50 ms, itl 20 ms) shared by the tests that do not read counters."""
    with start_fake_server(ttft="50ms", itl="20ms") as srv:
        yield srv
