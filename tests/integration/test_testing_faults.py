"""The test server's injected faults (kvcap.testing.faults): each kind breaks a response exactly as documented, the
first matching rule wins, and the counters say what was injected.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import aiohttp
import pytest

from kvcap.testing.faults import FaultRules, FaultSpec, InjectedFault
from tests import servers
from tests.servers import FakeServer
from tests.streams import arun, session, stream
from tests.waiting import until

fake_server = servers.fake_server  # the factory fixture


@pytest.mark.parametrize("kind", ["http_500", "http_429", "reset", "stall", "malformed", "error_in_200"])
@arun
async def test_fault_kinds(fake_server: Callable[..., FakeServer], kind: str) -> None:
    srv = fake_server(ttft="10ms", itl="5ms", fault=[f"{kind}:every=2,offset=1,after=3"])
    timeout = aiohttp.ClientTimeout(total=5, sock_read=0.4)
    async with session() as s:
        before = await stream(s, srv.url, max_tokens=6, timeout=timeout)  # index 0: clean
        hit = await stream(s, srv.url, max_tokens=6, timeout=timeout)  # index 1: faulted
        after = await stream(s, srv.url, max_tokens=6, timeout=timeout)  # index 2: clean
    assert before.done and after.done and before.n_tokens == after.n_tokens == 6
    if kind in ("http_500", "http_429"):
        status = int(kind[-3:])
        assert hit.status == status and json.loads(hit.body)["error"]["code"] == status
        if kind == "http_429":
            assert hit.headers["Retry-After"] == "1"
    elif kind == "reset":
        assert hit.n_tokens == 3 and not hit.done
        assert isinstance(hit.error, (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError,
                                      aiohttp.ClientOSError)), repr(hit.error)
    elif kind == "stall":
        assert hit.n_tokens == 3 and not hit.done
        assert isinstance(hit.error, asyncio.TimeoutError), repr(hit.error)
    elif kind == "malformed":
        assert hit.done and hit.n_tokens == 6  # the stream carries on after the bad event
        objs = hit.objs()
        bad = objs.index(None)
        assert bad == 3 and hit.events[bad][1] == b'{"choices": [{"text": '
    else:  # error_in_200
        assert hit.status == 200 and hit.n_tokens == 3 and not hit.done and hit.error is None
        last = hit.objs()[-1]
        assert last["error"]["type"] == "server_error" and last["error"]["code"] == 500
    await until(lambda: srv.stats()["running"] == 0, 5)  # the stalled handler notices its client left
    st = srv.stats()
    assert st["faults_injected"][kind] == 1 and sum(st["faults_injected"].values()) == 1
    assert st["requests_started"] == 3 and st["running"] == 0


@arun
async def test_fault_selection_and_chunked_cut(fake_server: Callable[..., FakeServer]) -> None:
    srv = fake_server(ttft="0", itl="1ms", tokens_per_chunk=4,
                      fault=["error_in_200:every=3,offset=1,after=6", "http_500:every=2"])
    async with session() as s:
        rs = [await stream(s, srv.url, max_tokens=10) for _ in range(6)]
    # index 0, 2 → http_500 (even) except where the first rule matched first: 1 and 4 → error_in_200
    assert [r.status for r in rs] == [500, 200, 500, 200, 200, 200]
    assert [r.done for r in rs] == [False, False, False, True, False, True]
    assert rs[1].texts == ["w0 w1 w2 w3 ", "w4 w5 "]  # a short chunk so that exactly `after` tokens precede it
    assert srv.stats()["faults_injected"] == {"http_500": 2, "http_429": 0, "reset": 0, "stall": 0,
                                              "malformed": 0, "error_in_200": 2}


@arun
async def test_non_stream_faults(fake_server: Callable[..., FakeServer]) -> None:
    srv = fake_server(ttft="0", itl="1ms", fault=["reset:every=3,offset=0", "http_500:every=3,offset=1",
                                                  "error_in_200:every=3,offset=2"])
    body = {"prompt": "a", "max_tokens": 4}
    async with session() as s:
        with pytest.raises(aiohttp.ClientError):
            async with s.post(srv.url + "/v1/completions", json=body) as r:
                await r.read()
        async with s.post(srv.url + "/v1/completions", json=body) as r:
            assert r.status == 500
        async with s.post(srv.url + "/v1/completions", json=body) as r:
            assert r.status == 200 and (await r.json())["error"]["code"] == 500


def test_fault_spec_parsing() -> None:
    assert FaultSpec.parse("reset:every=5,offset=1,after=3") == FaultSpec("reset", 5, 1, 3)
    assert FaultSpec.parse("stall:every=1") == FaultSpec("stall", 1, 0, 2)
    for bad in ("boom:every=2", "reset", "reset:every=0", "reset:every=2,offset=2", "reset:every=x",
                "reset:every=2,later=1"):
        with pytest.raises(Exception, match=r"fault"):
            FaultSpec.parse(bad)


def test_fault_rules_first_match_wins() -> None:
    rules = FaultRules((FaultSpec.parse("error_in_200:every=3,offset=1,after=6"), FaultSpec.parse("http_500:every=2")),
                       stall_max_s=1.0)
    faults = [rules.fault_for(i) for i in range(6)]
    assert [f.kind if f else None for f in faults] == ["http_500", "error_in_200", "http_500", None, "error_in_200",
                                                       None]
    assert faults[1] is not None and faults[1].after == 6 and faults[1].stall_max_s == 1.0
    assert rules.kinds == ("http_500", "http_429", "reset", "stall", "malformed", "error_in_200")
    too_many = InjectedFault(FaultSpec("http_429", 1), 1.0).refusal()
    assert too_many is not None and too_many.status == 429 and too_many.headers["Retry-After"] == "1"
    assert json.loads(too_many.body)["error"] == {"message": "injected fault: http_429 (too many requests)",
                                                  "type": "TooManyRequestsError", "param": None, "code": 429}
    assert all(InjectedFault(FaultSpec(k, 1), 1.0).refusal() is None for k in ("reset", "stall", "malformed"))
