"""kvcap's own share of a measured latency, against the fake server's known timing and a bare stdlib client.

Closed-loop users of a deterministic server end their requests together, so whatever each does between two
requests (building the record, writing it, building the next prompt) lands on the loop in a burst. A request's
latency must not include the others' share of that burst: its bytes have to leave when its clock starts.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import time
from typing import Any

import pytest

from kvcap.loadgen.client import Target
from kvcap.loadgen.http import Pool
from kvcap.loadgen.runner import Runner, make_session
from kvcap.specs.lengths import parse_length
from kvcap.workload.loadplan import LoadPlan
from kvcap.workload.prompts import PromptFactory
from tests.conftest import ROOT
from tests.servers import start_fake_server
from tests.waiting import until

TTFT_MS = 50.0


def burn(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class Sink:
    """Keeps the records; with ``queued_work_s`` each record also queues that much loop work (what the other
    users of a burst — their records, their next prompts — put on the loop while this one sends)."""

    def __init__(self, queued_work_s: float = 0.0) -> None:
        self.queued_work_s = queued_work_s
        self.records: list[dict[str, Any]] = []

    def record(self, rec: dict[str, Any]) -> None:
        self.records.append(rec)
        if self.queued_work_s:
            asyncio.get_running_loop().call_soon(burn, self.queued_work_s)

    def level(self, info: dict[str, Any]) -> None:
        pass


def closed_loop(url: str, streams: int, output_tokens: int, seconds: float, sink: Any) -> list[dict[str, Any]]:
    """The real Runner, closed loop, in this process; returns the measured records."""
    plan = LoadPlan(mode="concurrency", levels=(float(streams),), warmup_s=0.3, duration_s=seconds)
    factory = PromptFactory(seed=0, input_dist=parse_length(16), output_dist=parse_length(output_tokens))

    async def main() -> None:
        session = make_session()
        try:
            await Runner(target=Target(url=url), plan=plan, factory=factory, sink=sink).run(session)
        finally:
            await session.close()

    asyncio.run(main())
    return [r for r in sink.records if r["phase"] == "measure" and r["ok"]]


def test_a_request_leaves_before_the_work_queued_behind_it():
    # each record queues 15 ms of work on the loop just before the user sends its next request. Written at once,
    # the request still meets the server's 50 ms (the work is done long before the first token); written from a
    # task of its own (aiohttp on Python < 3.12) it waited behind that work: 65 ms
    with start_fake_server(ttft=f"{TTFT_MS:g}ms", itl="5ms") as srv:
        recs = closed_loop(srv.url, 2, 8, 2.0, Sink(queued_work_s=0.015))
    assert len(recs) >= 2 * 15
    ttft = sorted(r["ttft_ms"] for r in recs)
    assert statistics.median(ttft) < TTFT_MS + 3.0, ttft
    assert statistics.median(r["tpot_ms"] for r in recs) == pytest.approx(5.0, abs=0.5)


def test_pool_reuses_prewarmed_connections():
    with start_fake_server(ttft="1ms", itl="1ms") as srv:
        before = srv.stats()["connections_opened"]
        recs = closed_loop(srv.url, 4, 4, 1.0, Sink())
        opened = srv.stats()["connections_opened"] - before - 1  # less this /stats
    assert len(recs) > 40
    assert opened == 4  # one per stream, opened before the level: none during it
    assert all(r["retries"] == 0 for r in recs)


def test_pool_closes_its_connections():
    async def main(url: str) -> int:
        async with Pool() as pool:
            assert await pool.prewarm(url + "/v1/completions", 3) == 3
            assert await pool.prewarm(url + "/v1/completions", 3) == 0  # already idle
            conns = [c for idle in pool.idle.values() for c in idle]

        def still_open() -> int:
            return sum(1 for c in conns if c.transport is not None and not c.transport.is_closing())

        await until(lambda: not still_open(), 5)
        return still_open()

    with start_fake_server(ttft="1ms", itl="1ms") as srv:
        assert asyncio.run(main(srv.url)) == 0


def pct50(xs: list[float]) -> float:
    return statistics.median(xs)


def test_ttft_matches_a_bare_client_side_by_side():
    # 32 closed-loop streams of a 50 ms / 20 ms server: the bare stdlib client (benchmarks/bare_client.py) and
    # the real `kvcap bench`, alternated twice against the same server; kvcap's TTFT p50 within 3 ms of the bare
    # client's (pooled over the rounds: one round is only three lock-stepped cycles)
    streams, out_t, warm, dur = 32, 64, 1.0, 4.0
    bare: list[float] = []
    kv: list[float] = []
    with start_fake_server(ttft=f"{TTFT_MS:g}ms", itl="20ms") as srv:
        for _ in range(2):
            p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bare_client.py"), "--url", srv.url,
                                "--streams", str(streams), "--warmup", str(warm), "--duration", str(dur),
                                "--output-tokens", str(out_t)], capture_output=True, text=True, timeout=60, cwd=ROOT)
            assert p.returncode == 0, p.stderr[-2000:]
            b = json.loads(p.stdout)
            assert b["errors"] == 0
            bare.extend(b["ttft_ms"])
            recs = closed_loop(srv.url, streams, out_t, dur, Sink())
            kv.extend(r["ttft_ms"] for r in recs)
    assert len(kv) >= 100 and len(bare) >= 100
    assert pct50(kv) < pct50(bare) + 3.0, (pct50(kv), pct50(bare))
