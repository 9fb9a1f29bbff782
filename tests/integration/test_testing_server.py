"""The test server keeps its timing promises over real loopback HTTP, so other tests may trust it as truth: fixed and
batching engines, connection handling and its CLI (its faults: tests/integration/test_testing_faults.py).

Every test talks to a server subprocess (tests/servers.py) through aiohttp, and times events the way a load
generator would: perf_counter per received network chunk (tests/streams.py).
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest

from kvcap.serve.engine import Engine, EngineLoad
from kvcap.serve.metrics import RequestCounters, render_metrics
from kvcap.serve.protocol import ApiConfig
from kvcap.testing.engines import BatchingEngine, FixedTimingEngine
from kvcap.testing.faults import FaultSpec
from kvcap.testing.server import ServerConfig
from kvcap.testing.truth import batching_truth
from tests import servers, streams
from tests.servers import FakeServer, start_fake_server
from tests.streams import ITL_MS, TOL_MS, TTFT_MS, Stream, arun, near, session, stream, truth_check
from tests.waiting import until

fake_server = servers.fake_server  # the factory fixture
fixed_srv = streams.fixed_srv


# ------------------------------------------------------------------------------------------------ fixed timing

@arun
async def test_fixed_timing_single_stream(fixed_srv: FakeServer) -> None:
    async def measure() -> list[Stream]:
        async with session() as s:
            await stream(s, fixed_srv.url, max_tokens=1)  # warm the connection so TTFT has no TCP handshake
            rs = [await stream(s, fixed_srv.url, max_tokens=20) for _ in range(3)]
        assert all(r.status == 200 and r.done and r.n_tokens == 20 and len(r.gaps_ms) == 19 for r in rs)
        return rs

    def check(rs: list[Stream]) -> None:
        # the least-disturbed sample is truth plus the client's minimal overhead; none may come early
        ttfts = [r.ttft_ms for r in rs]
        assert TTFT_MS - 0.2 <= min(ttfts) <= TTFT_MS + TOL_MS and statistics.median(ttfts) <= TTFT_MS + 5, ttfts
        gaps = [g for r in rs for g in r.gaps_ms]
        assert near(statistics.mean(gaps), ITL_MS) and near(statistics.median(gaps), ITL_MS), gaps
        assert all(near(g, ITL_MS, 15.0) for g in gaps), gaps  # single gaps only get sanity bounds

    await truth_check(fixed_srv, measure, check)


@arun
async def test_fixed_timing_16_concurrent_chat_streams(fixed_srv: FakeServer) -> None:
    async def measure() -> list[Stream]:
        async with session() as s:
            await asyncio.gather(*(stream(s, fixed_srv.url, max_tokens=1) for _ in range(16)))  # warm connections

            async def staggered(i: int) -> Stream:
                await asyncio.sleep(0.003 * i)  # so the client's own send overhead does not pile up into TTFT
                return await stream(s, fixed_srv.url, chat=True, max_tokens=16)

            results = await asyncio.gather(*(staggered(i) for i in range(16)))
        for r in results:  # the role-only chunk comes first, and is not content
            assert r.done and r.n_tokens == 16
            first = r.objs()[0]
            assert first["object"] == "chat.completion.chunk"
            assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            assert r.content()[0][0] > r.events[0][0]
        return results

    def check(results: list[Stream]) -> None:
        ttfts = [r.ttft_ms for r in results]
        assert near(statistics.median(ttfts), TTFT_MS) and all(TTFT_MS - 0.2 <= t <= TTFT_MS + 15 for t in ttfts)
        gaps = [g for r in results for g in r.gaps_ms]
        assert near(statistics.mean(gaps), ITL_MS) and near(statistics.median(gaps), ITL_MS)
        assert all((r.events[0][0] - r.t0) * 1e3 < 20 for r in results)  # the role chunk is sent at once

    await truth_check(fixed_srv, measure, check)


@arun
async def test_fast_mode_streams_every_token_as_its_own_event(fake_server: Callable[..., FakeServer]) -> None:
    srv = fake_server(ttft="0", itl="0")
    async with session() as s:
        t0 = time.perf_counter()
        rs = await asyncio.gather(*(stream(s, srv.url, max_tokens=3000) for _ in range(4)))
        elapsed = time.perf_counter() - t0
    assert all(r.done and len(r.texts) == 3000 and r.n_tokens == 3000 for r in rs)
    assert elapsed < 5.0
    # the server yields between events, so concurrent fast streams interleave rather than run one after another
    firsts, lasts = [r.content()[0][0] for r in rs], [r.content()[-1][0] for r in rs]
    assert max(firsts) < min(lasts)


# ---------------------------------------------------------------------------------------------------- batching

async def closed_loop(url: str, clients: int, rounds: int, tokens: int, chat: bool = False) -> list[list[Stream]]:
    """``clients`` loops, each sending ``rounds`` requests back to back; results per client."""
    async with session() as s:
        async def client() -> list[Stream]:
            return [await stream(s, url, chat=chat, max_tokens=tokens, ignore_eos=True) for _ in range(rounds)]
        return await asyncio.gather(*(client() for _ in range(clients)))


@arun
async def test_batching_two_clients_share_steps(fake_server: Callable[..., FakeServer]) -> None:
    srv = fake_server(slots=4, step_a="10ms", step_b="5ms")
    tokens = 25
    truth = batching_truth(2, 4, 0.010, 0.005, tokens)
    assert truth["tpot_s"] == pytest.approx(0.020)

    async def measure() -> tuple[list[list[Stream]], float]:
        t0 = time.perf_counter()
        per_client = await closed_loop(srv.url, clients=2, rounds=3, tokens=tokens)
        assert all(r.done and r.n_tokens == tokens for rs in per_client for r in rs)
        return per_client, time.perf_counter() - t0

    def check(data: tuple[list[list[Stream]], float]) -> None:
        per_client, wall = data
        steady = [r for rs in per_client for r in rs[1:]]
        gaps = [g for r in steady for g in r.gaps_ms]
        assert near(statistics.median(gaps), 20.0, 1.0), gaps  # a + b*c with c = 2
        assert truth["tpot_s_min"] * 1e3 - 1.0 <= statistics.mean(gaps) <= truth["tpot_s"] * 1e3 + 1.0
        e2e = [(r.content()[-1][0] - r.t0) for r in steady]
        assert statistics.mean(e2e) == pytest.approx(truth["e2e_s"], rel=0.04)
        assert 2 * 3 * tokens / wall == pytest.approx(truth["throughput_tok_s"], rel=0.1)

    await truth_check(srv, measure, check, attempts=2)
    st = srv.stats()
    assert st["max_running"] == 2 and st["requests_finished"] % 6 == 0


@arun
async def test_batching_over_slots_queues_and_caps_the_batch(fake_server: Callable[..., FakeServer]) -> None:
    srv = fake_server(slots=4, step_a="10ms", step_b="5ms")
    tokens, clients = 12, 8
    truth = batching_truth(clients, 4, 0.010, 0.005, tokens)
    assert truth["exact"] and truth["tpot_s"] == pytest.approx(0.030)

    async def measure() -> tuple[list[list[Stream]], str]:
        loop_task = asyncio.ensure_future(closed_loop(srv.url, clients=clients, rounds=3, tokens=tokens))
        async with session() as s:  # scraped once the batch is full and a queue waits, as it is for most of the run
            while True:
                async with s.get(srv.url + "/metrics") as r:
                    scraped = await r.text()
                if loop_task.done() or re.search(r'^vllm:num_requests_waiting\{model_name="fake-model"\} [1-9]',
                                                 scraped, re.M):
                    break
                await asyncio.sleep(0.05)
        per_client = await loop_task
        assert all(r.done and r.n_tokens == tokens for rs in per_client for r in rs)
        return per_client, scraped

    def check(data: tuple[list[list[Stream]], str]) -> None:
        per_client, _ = data
        gaps = [g for rs in per_client for r in rs for g in r.gaps_ms]
        assert near(statistics.median(gaps), 30.0, 1.0) and near(statistics.mean(gaps), 30.0, 1.0)  # a + b*N
        # the middle round is steady state (the first ramps up, the last drains as clients stop): exact truths
        middle = [rs[1] for rs in per_client]
        middle_gaps = [g for r in middle for g in r.gaps_ms]
        assert near(statistics.mean(middle_gaps), 30.0, 1.0) and all(near(g, 30.0, 10.0) for g in middle_gaps)
        ttft = [r.ttft_ms for r in middle]  # one step plus (c/N - 1) service times of queueing: 390 ms
        assert statistics.mean(ttft) == pytest.approx(truth["ttft_s_steady"] * 1e3, rel=0.03), ttft

    _, scraped = await truth_check(srv, measure, check, attempts=2)
    metric = {m.group(1): float(m.group(2))
              for m in re.finditer(r'^(vllm:[a-z_]+)\{model_name="fake-model"\} (\S+)$', scraped, re.M)}
    assert metric["vllm:num_requests_running"] == 4 and metric["vllm:num_requests_waiting"] > 0
    assert metric["vllm:kv_cache_usage_perc"] == 1.0
    st = srv.stats()
    assert st["max_running"] == 4 and st["max_waiting"] >= 4 and st["requests_finished"] % 24 == 0


@arun
async def test_batching_single_client_and_prefill(fake_server: Callable[..., FakeServer]) -> None:
    srv = fake_server(slots=2, step_a="10ms", step_b="2ms", prefill_per_token="0.1ms")

    async def measure() -> list[Stream]:
        async with session() as s:
            await stream(s, srv.url, max_tokens=1, prompt="x")
            return [await stream(s, srv.url, max_tokens=8, prompt=" ".join(["w"] * 100)) for _ in range(3)]

    def check(rs: list[Stream]) -> None:
        # an idle engine starts at once: TTFT = a + b*1 + 100 prompt tokens * 0.1 ms; then a + b per token
        ttfts = [r.ttft_ms for r in rs]
        assert 22.0 - 0.2 <= min(ttfts) <= 22.0 + TOL_MS, ttfts
        gaps = [g for r in rs for g in r.gaps_ms]
        assert near(statistics.mean(gaps), 12.0, 1.0), gaps

    await truth_check(srv, measure, check)


@arun
async def test_batching_client_disconnect_frees_the_slot(fake_server: Callable[..., FakeServer]) -> None:
    srv = fake_server(slots=1, step_a="10ms")
    async with session() as s:
        gone = await stream(s, srv.url, max_tokens=500, max_events=2)  # reads 2 tokens, then drops the connection
        t0 = time.perf_counter()
        nxt = await stream(s, srv.url, max_tokens=3)
    assert len(gone.events) == 2 and nxt.done
    assert time.perf_counter() - t0 < 1.0  # not stuck behind the abandoned 500-token request

    def settled() -> bool:  # the server has noticed the abandoned stream's client left
        st = srv.stats()
        return st["running"] == 0 and st["requests_aborted"] >= 1

    await until(settled, 5)
    st = srv.stats()
    assert st["running"] == 0 and st["requests_aborted"] == 1 and st["requests_finished"] == 1


def test_batching_truth_regimes() -> None:
    one = batching_truth(1, 4, 0.010, 0.005, 10)
    assert one["tpot_s"] == pytest.approx(0.015) and one["ttft_s_steady"] == pytest.approx(0.015)
    few = batching_truth(3, 4, 0.010, 0.005, 10)
    assert few["tpot_s"] == pytest.approx(0.025)
    assert few["e2e_s"] == pytest.approx(11 * 0.010 + 0.005 * 3 * 10)
    assert few["throughput_tok_s"] == pytest.approx(30 / few["e2e_s"])
    assert few["tpot_s_min"] < few["tpot_s"] and few["ttft_s_steady"] == pytest.approx(0.035)
    many = batching_truth(8, 4, 0.010, 0.005, 10)
    assert many["exact"] and many["tpot_s"] == pytest.approx(0.030)
    assert many["throughput_tok_s"] == pytest.approx(4 / 0.030)
    assert many["queue_s"] == pytest.approx((8 / 4 - 1) * 10 * 0.030)
    assert not batching_truth(5, 4, 0.010, 0.005, 10)["exact"]
    with pytest.raises(ValueError):
        batching_truth(0, 4, 0.01, 0.0, 10)


def test_cli_rejects_bad_options_and_binds_loopback() -> None:
    proc = subprocess.run([sys.executable, "-m", "kvcap.testing.server", "--fault", "boom:every=2"],
                          capture_output=True, text=True, timeout=20)
    assert proc.returncode == 2 and "unknown fault kind" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "kvcap.testing.server", "--ttft", "5parsecs"],
                          capture_output=True, text=True, timeout=20)
    assert proc.returncode == 2
    with start_fake_server() as srv:
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+", srv.url) and srv.port > 0


# ------------------------------------------------------------------------------------------------- connections

def _raw_request(port: int, path: str, body: dict[str, Any]) -> tuple[bytes, bool]:
    """One HTTP/1.1 request on a fresh socket; returns (everything read, whether the server closed it)."""
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=3) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        got = b""
        sock.settimeout(0.5)
        try:
            while True:
                part = sock.recv(65536)
                if not part:
                    return got, True
                got += part
        except TimeoutError:
            return got, False


def test_close_after_response(fake_server: Callable[..., FakeServer]) -> None:
    srv = fake_server(ttft="0", itl="1ms", close_after_response=True)
    for body in ({"prompt": "a", "max_tokens": 3, "stream": True}, {"prompt": "a", "max_tokens": 3}):
        got, closed = _raw_request(srv.port, "/v1/completions", body)
        head = got.split(b"\r\n\r\n", 1)[0].lower()
        assert b"200 ok" in head and b"connection: keep-alive" in head and closed, got
    plain = fake_server(ttft="0", itl="1ms")
    got, closed = _raw_request(plain.port, "/v1/completions", {"prompt": "a", "max_tokens": 3, "stream": True})
    assert got.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n") and not closed  # the normal server keeps it open


@arun
async def test_connection_counting(fake_server: Callable[..., FakeServer]) -> None:
    srv = fake_server(ttft="0", itl="1ms")
    closing = fake_server(ttft="0", itl="1ms", close_after_response=True)
    base = srv.stats()["connections_opened"]  # each stats() call is itself one new connection
    async with session() as s:
        for _ in range(5):
            assert (await stream(s, srv.url, max_tokens=2)).done
        await asyncio.gather(*(stream(s, srv.url, max_tokens=20) for _ in range(3)))
    # one keep-alive connection for the 5, two more for the concurrent 3, one for stats() itself
    assert srv.stats()["connections_opened"] - base == 3 + 1
    base = closing.stats()["connections_opened"]
    async with session() as s:
        for _ in range(3):
            r = await stream(s, closing.url, max_tokens=2)
            assert r.done, r.error
            # the client sees the server's close before the pool is reused (aiohttp keeps its pool in _conns)
            assert await until(lambda: not any(proto.is_connected() for idle in s.connector._conns.values()
                                               for proto, _ in idle), 5)
    assert closing.stats()["connections_opened"] - base == 3 + 1


@arun
async def test_thousand_concurrent_streams(fake_server: Callable[..., FakeServer]) -> None:
    srv = fake_server(ttft="1.5s", itl="50ms")
    n = 1000

    async def measure() -> list[Stream]:
        async with session() as s:
            rs = await asyncio.gather(*(stream(s, srv.url, max_tokens=10) for _ in range(n)))
        assert all(r.done and r.n_tokens == 10 for r in rs)
        return rs

    def check(rs: list[Stream]) -> None:
        gaps = [g for r in rs for g in r.gaps_ms]
        assert near(statistics.median(gaps), 50.0, TOL_MS) and near(statistics.mean(gaps), 50.0, TOL_MS)

    await truth_check(srv, measure, check, attempts=1)
    st = srv.stats()
    assert st["max_running"] == n and st["requests_finished"] == n and st["connections_opened"] >= n


# ------------------------------------------------------------------------------------------------ in process

def test_server_config_builds_its_parts() -> None:
    cfg = ServerConfig(model_name="tiny", tokens_per_chunk=3, eos_after=7, slots=2, step_a_s=0.02,
                       faults=(FaultSpec("reset", 2),), max_model_len=99)
    assert cfg.api == ApiConfig(model_name="tiny", tokens_per_chunk=3, eos_after=7, max_model_len=99)
    engine = cfg.engine()
    assert isinstance(engine, BatchingEngine) and (engine.slots, engine.a, engine.b) == (2, 0.02, 0.0)
    assert isinstance(ServerConfig().engine(), FixedTimingEngine)
    assert cfg.as_json() == {
        "model_name": "tiny", "ttft_s": 0.05, "itl_s": 0.02, "tokens_per_chunk": 3, "eos_after": 7, "slots": 2,
        "step_a_s": 0.02, "step_b_s": 0.0, "prefill_per_token_s": 0.0,
        "faults": [{"kind": "reset", "every": 2, "offset": 0, "after": 2}], "close_after_response": False,
        "max_model_len": 99, "stall_max_s": 600.0, "tokenizer": "words", "prompt_overhead": 0, "tokenize": True,
        "mode": "batching"}
    assert ServerConfig().as_json()["mode"] == "fixed"


def test_test_engines_report_load_and_vllm_metrics() -> None:
    fixed = FixedTimingEngine(0.05, 0.02)
    batching = BatchingEngine(slots=4, step_a_s=0.01, step_b_s=0.0)
    assert isinstance(fixed, Engine) and isinstance(batching, Engine)
    handles = [fixed.submit(1.0, 3, 5), fixed.submit(2.0, 3, 5)]
    fixed.release(handles[0])
    assert fixed.load() == EngineLoad(running=1, waiting=0, max_running=2, max_waiting=0, steps=None, resyncs=None)
    batching.occupancy.set_running(3)
    batching.occupancy.set_waiting(2)
    batching.occupancy.set_waiting(1)
    assert batching.load() == EngineLoad(running=3, waiting=1, max_running=3, max_waiting=2, steps=0, resyncs=0)
    served = RequestCounters(prompt_tokens_total=12, completion_tokens_total=15,
                             finished_by_reason={"stop": 1, "length": 2})

    def samples(engine: FixedTimingEngine | BatchingEngine) -> dict[str, str]:
        text = render_metrics(engine.metric_families(served, 1000.5), "fake-model")
        return dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))

    label = '{model_name="fake-model"}'
    created = {f"vllm:{name}_created{label}": "1000.5" for name in ("num_preemptions", "prompt_tokens",
                                                                    "generation_tokens")}
    success = {'vllm:request_success_total{finished_reason="length",model_name="fake-model"}': "2.0",
               'vllm:request_success_total{finished_reason="stop",model_name="fake-model"}': "1.0",
               'vllm:request_success_created{finished_reason="length",model_name="fake-model"}': "1000.5",
               'vllm:request_success_created{finished_reason="stop",model_name="fake-model"}': "1000.5"}
    assert samples(batching) == {
        f"vllm:num_requests_running{label}": "3.0", f"vllm:num_requests_waiting{label}": "1.0",
        f"vllm:kv_cache_usage_perc{label}": "0.75", f"vllm:num_preemptions_total{label}": "0.0",
        f"vllm:prompt_tokens_total{label}": "12.0", f"vllm:generation_tokens_total{label}": "15.0",
        **created, **success}
    assert samples(fixed)[f"vllm:kv_cache_usage_perc{label}"] == "0.0"
    assert samples(fixed)[f"vllm:num_requests_running{label}"] == "1.0"
