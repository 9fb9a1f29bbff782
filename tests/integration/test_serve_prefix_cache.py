"""The test server's prefix cache is exact: over loopback HTTP, a hand-designed sequence of prompts gives the
``vllm:prefix_cache_*`` counters and per-request ``cached_tokens`` that an LRU worked out by hand gives, blocks a
running request holds survive capacity pressure, a hit's TTFT is shorter by exactly the prefill it skipped, and
without the option nothing changes.

Hand-worked cases use blocks of 4 words and a capacity of 4 blocks. ``P`` is an 8-word shared prefix (blocks
P1 P2); ``P+a`` is P and 5 more words (blocks P1 P2 A1, then a partial block, never hashed).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest

from kvcap.testing.prefix_cache import PrefixCache
from kvcap.testing.server import ServerConfig
from kvcap.workload.blocks import prompt_block_hashes
from tests import servers
from tests.servers import FakeServer, start_fake_server
from tests.streams import TOL_MS, Stream, arun, session, stream, truth_check
from tests.waiting import until

fake_server = servers.fake_server  # the factory fixture

BLOCK, CAPACITY = 4, 4
P = [f"p{i}" for i in range(8)]


def tail(tag: str, n: int = 5) -> list[str]:
    return [f"{tag}{i}" for i in range(n)]


# The sequence and what an exact LRU (vLLM's rules, kvcap/testing/prefix_cache.py) gives, worked by hand.
# "free" is the LRU of unreferenced blocks after the request ends, next to evict first.
SEQUENCE: list[tuple[list[str], int]] = [
    (P + tail("a"), 0),   # stores P1 P2 A1; free: A1 P2 P1 (a request's blocks are freed last block first)
    (P + tail("b"), 8),   # hits P1 P2; B1 takes the 4th place; free: A1 B1 P2 P1
    (P + tail("c"), 8),   # hits P1 P2; C1 evicts A1;          free: B1 C1 P2 P1
    (P + tail("a"), 8),   # A1 was evicted: hits P1 P2 only; A1 evicts B1; free: C1 A1 P2 P1
    (P + tail("a"), 12),  # the whole chain P1 P2 A1;           free: C1 A1 P2 P1
    (P + tail("b"), 8),   # B1 was evicted; B1 evicts C1;       free: A1 B1 P2 P1
    (P, 4),               # 8 tokens: the last token is always computed, so at most (8-1)//4 = 1 block hits
]
QUERIES = sum(len(words) for words, _ in SEQUENCE)  # 6*13 + 8 = 86 prompt tokens looked up
HITS = sum(hit for _, hit in SEQUENCE)  # 48 tokens found
EVICTIONS = 3  # A1, B1, C1


def metric(srv: FakeServer, name: str) -> float | None:
    text = srv.get("/metrics").decode()
    m = re.search(rf'^{re.escape(name)}{{model_name="fake-model"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else None


def cached_of(usage: dict[str, Any] | None) -> int:
    """The usage's cached tokens; vLLM leaves ``prompt_tokens_details`` out when none were found."""
    assert usage is not None
    details = usage.get("prompt_tokens_details")
    assert details is None or details["cached_tokens"] > 0, usage
    return details["cached_tokens"] if details else 0


async def send(s: aiohttp.ClientSession, srv: FakeServer, words: list[str], way: str, others: int = 0,
               **body: Any) -> int:
    """One request by ``way`` (completions or chat, streamed or whole); returns its usage's cached tokens once the
    server has released it (the fixed engine releases when the response is out), i.e. runs only ``others``."""
    chat, streamed = way.startswith("chat"), way.endswith("stream")
    if chat:  # two messages: the server hashes their contents as one token sequence
        body["messages"] = [{"role": "system", "content": " ".join(words[:6])},
                            {"role": "user", "content": " ".join(words[6:])}]
    else:
        body["prompt"] = " ".join(words)
    r = await stream(s, srv.url, chat=chat, stream=streamed, stream_options={"include_usage": True}, **body)
    assert r.status == 200 and r.error is None, (r.status, r.body[:300], r.error)
    usage = r.usage if streamed else json.loads(r.body)["usage"]
    assert usage["prompt_tokens"] == len(words)
    assert await until(lambda: srv.stats()["running"] == others, 10)
    return cached_of(usage)


# ------------------------------------------------------------------------------------------------- in process

def test_lru_by_hand_in_process() -> None:
    cache = PrefixCache(CAPACITY, BLOCK)
    found = []
    for words, _ in SEQUENCE:
        hold = cache.acquire(prompt_block_hashes(words, BLOCK), len(words))
        found.append(hold.cached_tokens)
        cache.release(hold)
    assert found == [hit for _, hit in SEQUENCE]
    assert (cache.queries_tokens, cache.hits_tokens, cache.evictions) == (QUERIES, HITS, EVICTIONS)
    h = {name: prompt_block_hashes(P + tail(name), BLOCK)[2] for name in "abc"}
    p1, p2 = prompt_block_hashes(P, BLOCK)
    assert list(cache.free) == [h["a"], h["b"], p2, p1] and cache.stored_blocks == CAPACITY
    assert not any(cache.refs.values())


def test_held_blocks_are_not_evicted_in_process() -> None:
    cache = PrefixCache(2, BLOCK)
    x = prompt_block_hashes(tail("x", 9), BLOCK)  # X1 X2
    y = prompt_block_hashes(tail("y", 9), BLOCK)  # Y1 Y2
    hold_x = cache.acquire(x, 9)
    hold_y = cache.acquire(y, 9)  # both places held by X: Y is computed but not kept
    assert hold_y.blocks == [] and cache.stored_blocks == 2
    cache.release(hold_y)
    cache.release(hold_x)
    assert cache.acquire(x, 9).cached_tokens == 8


# ---------------------------------------------------------------------------------------------------- over HTTP

@pytest.mark.parametrize("engine", [{"ttft": "0", "itl": "0"}, {"slots": 2, "step_a": "1ms"}],
                         ids=["fixed", "batching"])
@arun
async def test_hits_equal_the_hand_worked_lru(fake_server: Callable[..., FakeServer], engine: dict[str, Any]) -> None:
    srv = fake_server(**engine, prefix_cache_blocks=CAPACITY, block_size=BLOCK, enable_prompt_tokens_details=True)
    ways = ["completion", "completion", "chat", "chat-stream", "completion-stream", "chat", "completion-stream"]
    async with session() as s:
        found = [await send(s, srv, words, way, max_tokens=3) for (words, _), way in zip(SEQUENCE, ways)]
    assert found == [hit for _, hit in SEQUENCE]
    assert metric(srv, "vllm:prefix_cache_queries_total") == QUERIES
    assert metric(srv, "vllm:prefix_cache_hits_total") == HITS
    assert metric(srv, "vllm:prefix_cache_hits_created") is not None
    config = srv.stats()["config"]
    assert (config["prefix_cache_blocks"], config["block_size"], config["prompt_tokens_details"]) == (4, 4, True)


@arun
async def test_blocks_held_by_a_running_request_survive_capacity_pressure(
        fake_server: Callable[..., FakeServer]) -> None:
    srv = fake_server(slots=2, step_a="2ms", prefix_cache_blocks=CAPACITY, block_size=BLOCK,
                      enable_prompt_tokens_details=True)
    x, y = tail("x", 13), tail("y", 13)  # blocks X1 X2 X3 and Y1 Y2 Y3
    async with session() as s:
        long_x = asyncio.ensure_future(stream(s, srv.url, prompt=" ".join(x), max_tokens=100_000))
        assert await until(lambda: srv.stats()["running"] == 1, 10)  # X admitted: it holds X1 X2 X3
        # Y: one free place for Y1; Y2 finds every other block held by X, so Y2 and Y3 are not kept
        got = [await send(s, srv, y, "completion", others=1, max_tokens=2)]  # free after: Y1
        long_x.cancel()  # X's client leaves: X's blocks are released at the next step start
        with contextlib.suppress(asyncio.CancelledError):
            await long_x
        assert await until(lambda: srv.stats()["running"] == 0 and srv.stats()["requests_aborted"] == 1, 10)
        # free: Y1 X3 X2 X1
        got.append(await send(s, srv, x, "completion", max_tokens=2))  # hits X1 X2 X3; free: Y1 X3 X2 X1
        got.append(await send(s, srv, y, "completion", max_tokens=2))  # hits Y1; Y2, Y3 evict X3, X2
        got.append(await send(s, srv, x, "completion", max_tokens=2))  # hits X1; X2, X3 evict Y3, Y2
    assert got == [0, 12, 4, 4]
    assert metric(srv, "vllm:prefix_cache_queries_total") == 5 * 13
    assert metric(srv, "vllm:prefix_cache_hits_total") == 20  # X's first lookup found nothing either


@arun
async def test_a_hit_shortens_ttft_by_the_prefill_it_skips(fake_server: Callable[..., FakeServer]) -> None:
    # an idle batching engine starts at once: TTFT = A + B + P * (prompt tokens not found in the cache)
    a_ms, p_ms, block = 5.0, 0.25, 16
    srv = fake_server(slots=2, step_a=f"{a_ms}ms", prefill_per_token=f"{p_ms}ms", prefix_cache_blocks=1000,
                      block_size=block, enable_prompt_tokens_details=True)
    prefix_len, question_len = 4 * block, block  # 80-token prompts; a hit finds the 4 prefix blocks
    miss_ms, hit_ms = a_ms + p_ms * (prefix_len + question_len), a_ms + p_ms * question_len
    groups = iter(range(1000))

    async def measure() -> tuple[list[Stream], list[Stream]]:
        misses, hits = [], []
        async with session() as s:
            await stream(s, srv.url, max_tokens=1, prompt="x")  # warm the connection: no handshake in TTFT
            for _ in range(3):
                g = next(groups)
                prefix = " ".join(f"g{g}p{i}" for i in range(prefix_len))
                for store, q in ((misses, "q"), (hits, "r")):
                    question = " ".join(f"g{g}{q}{i}" for i in range(question_len))
                    store.append(await stream(s, srv.url, prompt=f"{prefix} {question}", max_tokens=2,
                                              stream_options={"include_usage": True}))
        assert all(r.done for r in misses + hits)
        assert [cached_of(r.usage) for r in misses + hits] == [0] * 3 + [prefix_len] * 3
        return misses, hits

    def check(data: tuple[list[Stream], list[Stream]]) -> None:
        misses, hits = (min(r.ttft_ms for r in rs) for rs in data)
        assert miss_ms - 0.2 <= misses <= miss_ms + TOL_MS, (misses, miss_ms)
        assert hit_ms - 0.2 <= hits <= hit_ms + TOL_MS, (hits, hit_ms)
        assert abs((misses - hits) - p_ms * prefix_len) <= TOL_MS, (misses, hits)

    await truth_check(srv, measure, check)


# ------------------------------------------------------------------------------------------------- off by default

@arun
async def test_without_the_option_nothing_is_cached_or_reported(fake_server: Callable[..., FakeServer]) -> None:
    srv = fake_server(slots=2, step_a="1ms", enable_prompt_tokens_details=False)
    async with session() as s:
        got = [await send(s, srv, P + tail("a"), "completion-stream", max_tokens=2) for _ in range(2)]
    assert got == [0, 0]
    assert "prefix_cache" not in srv.get("/metrics").decode()
    assert not {"prefix_cache_blocks", "block_size", "prompt_tokens_details"} & srv.stats()["config"].keys()
    assert "block_size" not in ServerConfig(block_size=8).as_json()  # the cache's keys only when it is on
    assert ServerConfig(prefix_cache_blocks=3).as_json()["prefix_cache_blocks"] == 3


def test_cli_rejects_a_block_size_without_a_cache() -> None:
    for args in (["--block-size", "8"], ["--prefix-cache-blocks", "0"]):
        proc = subprocess.run([sys.executable, "-m", "kvcap.testing.server", *args], capture_output=True, text=True,
                              timeout=20)
        assert proc.returncode == 2 and "error:" in proc.stderr.strip().splitlines()[-1], proc
    with start_fake_server(prefix_cache_blocks=2) as srv:  # block size defaults to vLLM's 16
        assert srv.stats()["config"]["block_size"] == 16
