"""kvcap.loadgen.http: a response is de-framed the same however the network cuts it, and the pool keeps its size.

The response bytes are the fake server's own (read off a socket), fed to the parser cut at every position.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest

from kvcap.loadgen.client import ConnectionPolicy, Outcome, Target, stream_request, to_record
from kvcap.loadgen.http import ABORT, MORE, Exchange, Pool
from kvcap.workload.prompts import RequestSpec
from tests.servers import start_fake_server
from tests.waiting import until


def raw_response(port: int, body: dict) -> bytes:
    """One whole HTTP response as the server sent it (Connection: close, so it ends with the socket)."""
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


class Conn:
    """What an Exchange needs of its connection: a loop for its future, and where the connection goes after."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.released: list[bool] = []

    def release(self, reuse: bool) -> None:
        self.released.append(reuse)


def feed_in_pieces(raw: bytes, cut: int) -> tuple[int, bytes, list[bool]]:
    """Feed ``raw`` in two pieces cut at ``cut``; returns (status, de-framed body, releases)."""
    loop = asyncio.new_event_loop()
    try:
        conn = Conn(loop)
        got: list[bytes] = []
        status: list[int] = []
        ex = Exchange(conn, time.perf_counter, lambda st, h: status.append(st),  # type: ignore[arg-type]
                      lambda now, piece: got.append(piece) or MORE)
        for piece in (raw[:cut], raw[cut:]):
            if piece:
                ex.feed(piece)
        if not ex.waiter.done():
            ex.lost(None)
        assert ex.waiter.done() and ex.waiter.exception() is None
        return status[0], b"".join(got), conn.released
    finally:
        loop.close()


@pytest.mark.parametrize("body", [
    {"prompt": "a b c", "max_tokens": 5, "stream": True},   # chunked SSE
    {"prompt": "a b c", "max_tokens": 5, "stream": False},  # Content-Length JSON
])
def test_a_response_is_the_same_wherever_the_network_cuts_it(body):
    with start_fake_server(ttft="1ms", itl="1ms") as srv:
        raw = raw_response(srv.port, body)
    whole = feed_in_pieces(raw, len(raw))
    assert whole[0] == 200 and whole[1]
    if body["stream"]:
        assert whole[1].count(b"data: ") == 5 + 1 and whole[1].endswith(b"data: [DONE]\n\n")  # 5 tokens, [DONE]
    else:
        assert json.loads(whole[1])["usage"]["completion_tokens"] == 5
    for cut in range(1, len(raw)):
        assert feed_in_pieces(raw, cut)[:2] == whole[:2], cut


def test_an_aborted_exchange_drops_its_connection():
    with start_fake_server(ttft="1ms", itl="1ms") as srv:
        raw = raw_response(srv.port, {"prompt": "a", "max_tokens": 3, "stream": True})
    loop = asyncio.new_event_loop()
    try:
        conn = Conn(loop)
        ex = Exchange(conn, time.perf_counter, lambda st, h: None, lambda now, piece: ABORT)  # type: ignore[arg-type]
        ex.feed(raw)
        assert ex.waiter.done() and conn.released == [False]
    finally:
        loop.close()


def run_requests(url: str, n: int, pool: Pool, policy: ConnectionPolicy) -> list[dict]:
    async def main() -> list[dict]:
        recs = []
        for i in range(n):
            req = RequestSpec(i, "a b c", 3, 4)
            o = Outcome(t_sched=time.perf_counter())
            await stream_request(pool, Target(url=url), req, o, time.perf_counter, policy)
            recs.append(to_record(o, req, None, {"phase": "measure"}))  # type: ignore[typeddict-item]
            await asyncio.sleep(0.005)
        pool.close()
        return recs
    return asyncio.run(main())


def test_a_server_that_closes_after_each_response_costs_no_request():
    # llama.cpp says keep-alive and closes: every request still succeeds, on a connection opened for it
    with start_fake_server(ttft="1ms", itl="1ms", close_after_response=True) as srv:
        policy = ConnectionPolicy()
        recs = run_requests(srv.url, 10, Pool(), policy)
        opened = srv.stats()["connections_opened"] - 1
    assert all(r["ok"] for r in recs)
    assert opened == 10


def test_the_pool_replaces_a_dropped_connection_in_the_background():
    async def main(url: str) -> tuple[int, int]:
        async with Pool() as pool:
            await pool.prewarm(url, 2)
            conn = next(iter(pool.idle.values()))[0]
            conn.close()  # as a reset would
            await until(lambda: len(pool.idle[conn.key]) >= 2 and pool.opened >= 3, 5)
            return len(pool.idle[conn.key]), pool.opened

    with start_fake_server(ttft="1ms", itl="1ms") as srv:
        idle, opened = asyncio.run(main(srv.url))
    assert (idle, opened) == (2, 3)
