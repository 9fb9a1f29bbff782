"""A minimal HTTP/1.1 client for timed streaming requests: one ``asyncio.Protocol`` per pooled connection.

Why not aiohttp on this path: on Python < 3.12 aiohttp writes a request body from a task of its own, so the bytes
leave only after every callback already queued on the loop has run — in a burst of closed-loop users that is someone
else's work counted into each TTFT (see benchmarks/README.md, ``client_overhead.py``). Here the request is written
synchronously right after the send time is read, and each received network chunk is timestamped in ``data_received``
— the earliest point Python sees it — and handed on without a task switch per chunk. Only what a load generator
needs: ``http`` and ``https``, keep-alive pooling, chunked / Content-Length / close-delimited bodies, a total and a
stall timeout.

A connection goes back to the pool only when its response was read to the end and neither side asked to close.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from urllib.parse import urlsplit

from kvcap import __version__

log = logging.getLogger(__name__)

MAX_HEAD = 1 << 16
MORE, DRAIN, ABORT = 0, 1, 2
"""What ``on_body`` answers: keep feeding; the caller is done, read the rest so the connection can be reused;
the caller is done, drop the connection."""
DRAIN_LIMIT_S = 1.0
"""How long a response may go on after the caller is done before its connection is dropped instead."""


class HttpError(Exception):
    """The exchange failed below HTTP semantics (connect, reset, broken framing): the ``connection`` class."""


class StaleConnection(HttpError):
    """A reused pooled connection died before any byte of the response: the server never saw the request, so a
    retry on a fresh connection is safe."""


@dataclass(frozen=True)
class Endpoint:
    """A URL split once: where to connect, what to put in the request line and the Host header."""

    scheme: str
    host: str
    port: int
    path: bytes
    host_header: str

    @property
    def key(self) -> tuple[str, str, int]:
        return self.scheme, self.host, self.port


@lru_cache(maxsize=64)
def endpoint(url: str) -> Endpoint:
    u = urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    port = u.port or (443 if u.scheme == "https" else 80)
    shown = f"[{u.hostname}]" if ":" in u.hostname else u.hostname
    default = port == (443 if u.scheme == "https" else 80)
    path = (u.path or "/") + (f"?{u.query}" if u.query else "")
    return Endpoint(u.scheme, u.hostname, port, path.encode(), shown if default else f"{shown}:{port}")


def request_head(ep: Endpoint, headers: dict[str, str], content_length: int, close: bool) -> bytes:
    """The request line and headers of a POST (a pure function: cached per target by the caller)."""
    lines = [b"POST " + ep.path + b" HTTP/1.1", f"Host: {ep.host_header}".encode(),
             f"User-Agent: kvcap/{__version__}".encode(), f"Content-Length: {content_length}".encode(),
             b"Connection: close" if close else b"Connection: keep-alive"]
    skip = {"host", "content-length", "connection", "transfer-encoding"}
    lines += [f"{k}: {v}".encode() for k, v in headers.items() if k.lower() not in skip]
    return b"\r\n".join(lines) + b"\r\n\r\n"


class Exchange:
    """One request's response as it arrives: head parsing, body de-framing, completion.

    ``on_head(status, headers)`` is called once; ``on_body(now, piece)`` for each de-framed body piece, answering
    MORE, DRAIN or ABORT. ``keep_alive`` False (the request said ``Connection: close``) never pools the
    connection."""

    __slots__ = ("_buf", "_chunk_left", "_done", "_drain_timer", "_draining", "_length_left", "_state", "clock",
                 "conn", "got_bytes", "keep_alive", "last", "on_body", "on_head", "status", "waiter")

    def __init__(self, conn: Connection, clock: Callable[[], float], on_head: Callable[[int, dict[str, str]], None],
                 on_body: Callable[[float, bytes], int], keep_alive: bool = True) -> None:
        self.conn, self.clock, self.on_head, self.on_body = conn, clock, on_head, on_body
        self.waiter: asyncio.Future[None] = conn.loop.create_future()
        self._buf = b""
        self._state = "head"  # head | chunk_size | chunk_data | chunk_crlf | trailer | length | close | done
        self._chunk_left = 0
        self._length_left = 0
        self._done = False
        self._draining = False
        self._drain_timer: asyncio.TimerHandle | None = None
        self.status = 0
        self.keep_alive = keep_alive
        self.got_bytes = False
        self.last = clock()

    # ------------------------------------------------------------------------------------------ feeding
    def feed(self, data: bytes) -> None:
        now = self.clock()  # once per received chunk, before any parsing
        self.last = now
        self.got_bytes = True
        if self._done:
            return
        if self._buf:
            data, self._buf = self._buf + data, b""
        try:
            if self._state == "head":
                data = self._head(data)
                if data is None:
                    return
            if self._state == "length":
                self._length(now, data)
            elif self._state == "close":
                if data and self._piece(now, data) != MORE:
                    self.finish(reuse=False)
            else:
                self._chunked(now, data)
        except HttpError as exc:
            self.fail(exc)

    def _head(self, data: bytes) -> bytes | None:
        """Parse the status line and headers; returns the bytes after them, or None while incomplete."""
        while True:
            end = data.find(b"\r\n\r\n")
            if end < 0:
                if len(data) > MAX_HEAD:
                    raise HttpError("response head too large")
                self._buf = data
                return None
            head, data = data[:end].decode("latin-1"), data[end + 4:]
            first, *rest = head.split("\r\n")
            parts = first.split(" ", 2)
            if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
                raise HttpError(f"bad status line {first[:80]!r}")
            status = int(parts[1])
            if 100 <= status < 200:
                continue  # 100 Continue and friends: the real head follows
            headers: dict[str, str] = {}
            for line in rest:
                name, sep, value = line.partition(":")
                if sep:
                    headers[name.strip().lower()] = value.strip()
            self.status = status
            conn_hdr = headers.get("connection", "").lower()
            self.keep_alive = self.keep_alive and "close" not in conn_hdr and (
                parts[0] != "HTTP/1.0" or "keep-alive" in conn_hdr)
            if "chunked" in headers.get("transfer-encoding", "").lower():
                self._state = "chunk_size"
            elif "content-length" in headers:
                try:
                    self._length_left = int(headers["content-length"])
                except ValueError:
                    raise HttpError(f"bad Content-Length {headers['content-length']!r}") from None
                self._state = "length"
            elif status in (204, 304):
                self._length_left, self._state = 0, "length"
            else:
                self._state, self.keep_alive = "close", False
            self.on_head(status, headers)
            if self._done:
                return None
            return data

    def _piece(self, now: float, piece: bytes) -> int:
        """Hand one body piece on (unless the caller is done); ABORT ends the exchange here."""
        if self._draining:
            return DRAIN
        answer = self.on_body(now, piece)
        if answer == ABORT:
            self.finish(reuse=False)
        elif answer == DRAIN:
            self._draining = True
            if self._state != "close":
                self._drain_timer = self.conn.loop.call_later(DRAIN_LIMIT_S, self.finish, False)
        return answer

    def _length(self, now: float, data: bytes) -> None:
        if len(data) >= self._length_left:
            piece, self._length_left = data[:self._length_left], 0
            if (not piece or self._piece(now, piece) != ABORT) and not self._done:
                self.finish(reuse=True)
            return
        self._length_left -= len(data)
        if data:
            self._piece(now, data)

    def _chunked(self, now: float, data: bytes) -> None:
        pos, n = 0, len(data)
        while pos < n and not self._done:
            state = self._state
            if state == "chunk_data":
                take = min(self._chunk_left, n - pos)
                piece = data[pos:pos + take]
                pos += take
                self._chunk_left -= take
                if self._chunk_left == 0:
                    self._state = "chunk_crlf"
                if self._piece(now, piece) == ABORT:
                    return
                continue
            if state == "chunk_crlf":
                if n - pos < 2:
                    break
                if data[pos:pos + 2] != b"\r\n":
                    raise HttpError("bad chunk framing")
                pos += 2
                self._state = "chunk_size"
                continue
            cut = data.find(b"\r\n", pos)
            if cut < 0:
                if n - pos > 4096:
                    raise HttpError("chunk size line too long")
                break
            line = data[pos:cut]
            pos = cut + 2
            if state == "trailer":
                if not line:
                    self.finish(reuse=True)
                    return
                continue
            try:
                size = int(line.split(b";", 1)[0], 16)
            except ValueError:
                raise HttpError(f"bad chunk size {line[:40]!r}") from None
            if size == 0:
                self._state = "trailer"
            else:
                self._chunk_left, self._state = size, "chunk_data"
        if pos < n and not self._done:
            self._buf = data[pos:]

    # ------------------------------------------------------------------------------------------ ending
    def finish(self, reuse: bool) -> None:
        """The response is over (read to its end if ``reuse``); the connection goes back or is closed."""
        if self._done:
            return
        self._done = True
        self._state = "done"
        if self._drain_timer is not None:
            self._drain_timer.cancel()
        self.conn.release(reuse and self.keep_alive)
        if not self.waiter.done():
            self.waiter.set_result(None)

    def fail(self, exc: BaseException) -> None:
        if self._done:
            return
        if self._draining:  # the caller already has its answer: only the connection is lost
            self.finish(reuse=False)
            return
        self._done = True
        if self._drain_timer is not None:
            self._drain_timer.cancel()
        self.conn.release(False)
        if not self.waiter.done():
            self.waiter.set_exception(exc)

    def lost(self, exc: BaseException | None) -> None:
        """The connection closed under us: a close-delimited body ends here; anything else is cut short."""
        if self._done:
            return
        if self._state == "close":
            self.finish(reuse=False)
            return
        detail = f": {type(exc).__name__}: {exc}" if exc is not None else ""
        if not self.got_bytes and self.conn.reused:
            self.fail(StaleConnection(f"pooled connection closed before the response{detail}"))
        else:
            where = "before the response head" if self._state == "head" else "in the middle of the response"
            self.fail(HttpError(f"server closed the connection {where}{detail}"))


class Connection(asyncio.Protocol):
    """One TCP (or TLS) connection; feeds whatever arrives to its current exchange."""

    def __init__(self, pool: Pool, key: tuple[str, str, int]) -> None:
        self.pool, self.key = pool, key
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.exchange: Exchange | None = None
        self.closed = False
        self.reused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        ex = self.exchange
        if ex is None:  # bytes nobody asked for: this connection cannot be trusted any more
            self.close()
            return
        ex.feed(data)

    def eof_received(self) -> bool:
        self._lost(None)
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost(exc)

    def _lost(self, exc: BaseException | None) -> None:
        ex, self.exchange = self.exchange, None
        if ex is not None:
            ex.lost(exc)
        self._gone()

    def _gone(self) -> None:
        if not self.closed:
            self.closed = True
            self.pool.dropped(self)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.abort()
        self._gone()

    def release(self, reuse: bool) -> None:
        self.exchange = None
        if reuse and not self.closed and not self.pool.closed:
            self.pool.put(self)
        else:
            self.close()


class Pool:
    """Keep-alive connections per (scheme, host, port), the idle ones most recently used first.

    After :meth:`prewarm` the pool holds its size: a connection that is dropped (a reset, a request abandoned
    mid-stream, a server that closes after each response) is replaced in the background, so the failure of one
    request never makes the next one on that stream pay a connect."""

    def __init__(self) -> None:
        self.idle: dict[tuple[str, str, int], list[Connection]] = {}
        self.live: dict[tuple[str, str, int], set[Connection]] = {}
        self.want: dict[tuple[str, str, int], int] = {}
        self.endpoints: dict[tuple[str, str, int], Endpoint] = {}
        self.opened = 0
        self.closed = False
        self._ssl: ssl.SSLContext | None = None
        self._refills: dict[tuple[str, str, int], set[asyncio.Task[None]]] = {}

    def put(self, conn: Connection) -> None:
        self.idle.setdefault(conn.key, []).append(conn)

    def dropped(self, conn: Connection) -> None:
        """A connection closed (either side): forget it, and replace it if the pool is below its size."""
        idle = self.idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)
        live = self.live.get(conn.key)
        if live is not None:
            live.discard(conn)
        refills = self._refills.setdefault(conn.key, set())
        if self.closed or len(live or ()) + len(refills) >= self.want.get(conn.key, 0):
            return
        task = asyncio.get_running_loop().create_task(self._refill(self.endpoints[conn.key]))
        refills.add(task)
        task.add_done_callback(refills.discard)

    async def _refill(self, ep: Endpoint) -> None:
        try:
            conn = await self.open(ep, 10.0)
        except HttpError as exc:  # the next request meets (and classifies) whatever is wrong
            log.debug("pool refill to %s failed: %s", ep.key, exc)
            return
        if self.closed:
            conn.close()
        else:
            self.put(conn)

    def take(self, ep: Endpoint) -> Connection | None:
        idle = self.idle.get(ep.key)
        while idle:
            conn = idle.pop()
            if not conn.closed and conn.transport is not None and not conn.transport.is_closing():
                conn.reused = True
                return conn
        return None

    async def open(self, ep: Endpoint, timeout_s: float | None) -> Connection:
        loop = asyncio.get_running_loop()
        if ep.scheme == "https" and self._ssl is None:
            self._ssl = ssl.create_default_context()
        tls = self._ssl if ep.scheme == "https" else None
        try:
            _, conn = await asyncio.wait_for(loop.create_connection(
                lambda: Connection(self, ep.key), ep.host, ep.port, ssl=tls,
                server_hostname=ep.host if tls else None), timeout_s)
        except (OSError, ssl.SSLError, asyncio.TimeoutError) as exc:
            raise HttpError(f"cannot connect to {ep.host}:{ep.port}: {type(exc).__name__}: {exc}") from exc
        self.opened += 1
        self.endpoints.setdefault(ep.key, ep)
        self.live.setdefault(ep.key, set()).add(conn)
        return conn

    async def prewarm(self, url: str, n: int, timeout_s: float | None = 10.0) -> int:
        """Open connections until ``n`` are idle for ``url``'s host (before a measured window, so no request pays
        a connect) and keep the pool at that size; returns how many it opened. Failures are left for the
        requests to meet and classify."""
        ep = endpoint(url)
        self.want[ep.key] = max(self.want.get(ep.key, 0), n)
        have = sum(1 for c in self.idle.get(ep.key, ()) if not c.closed)
        results = await asyncio.gather(*(self.open(ep, timeout_s) for _ in range(max(0, n - have))),
                                       return_exceptions=True)
        opened = [c for c in results if isinstance(c, Connection)]
        for c in opened:
            self.put(c)
        return len(opened)

    def close(self) -> None:
        self.closed = True
        for refills in self._refills.values():
            for task in refills:
                task.cancel()
        for live in self.live.values():
            for conn in list(live):
                conn.close()
        self.idle.clear()

    async def __aenter__(self) -> Pool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
        await asyncio.sleep(0)  # let the transports' close callbacks run


async def exchange(pool: Pool, ep: Endpoint, head: bytes, body: bytes, clock: Callable[[], float],
                   on_sent: Callable[[float], None], on_head: Callable[[int, dict[str, str]], None],
                   on_body: Callable[[float, bytes], int], total_s: float | None, stall_s: float | None,
                   keep_alive: bool = True, fresh: bool = False) -> None:
    """Send one request on a pooled (or new) connection and feed its response; returns when the response is over.

    Raises :class:`StaleConnection` (retry-safe), :class:`HttpError`, ``asyncio.TimeoutError`` (total or stall
    timeout: the connection is dropped) or CancelledError (likewise). ``fresh``: never a pooled connection (a
    retry after a stale one)."""
    loop = asyncio.get_running_loop()
    conn = None if fresh else pool.take(ep)
    if conn is None:
        conn = await pool.open(ep, total_s)
        conn.reused = False
    ex = Exchange(conn, clock, on_head, on_body, keep_alive)
    conn.exchange = ex
    t = clock()
    on_sent(t)
    ex.last = t
    assert conn.transport is not None
    conn.transport.write(head + body)  # synchronously: the bytes leave now, not after the loop's queue
    timer: asyncio.TimerHandle | None = None
    fired: list[str] = []
    deadline = None if total_s is None else loop.time() + total_s

    def check() -> None:
        nonlocal timer
        now = loop.time()
        if deadline is not None and now >= deadline:
            fired.append(f"no complete response within {total_s:g} s")
        elif stall_s is not None and clock() - ex.last >= stall_s:
            fired.append(f"nothing received for {stall_s:g} s")
        if fired:
            ex.fail(asyncio.TimeoutError(fired[0]))
            return
        timer = loop.call_at(next_check(), check)

    def next_check() -> float:
        at = deadline if deadline is not None else float("inf")
        if stall_s is not None:
            at = min(at, loop.time() + max(0.0, stall_s - (clock() - ex.last)))
        return at

    if deadline is not None or stall_s is not None:
        timer = loop.call_at(next_check(), check)
    try:
        await ex.waiter
    except asyncio.CancelledError:
        ex.fail(HttpError("cancelled"))  # drops the connection mid-response
        raise
    finally:
        if timer is not None:
            timer.cancel()
