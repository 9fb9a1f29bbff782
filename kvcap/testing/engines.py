"""The test server's engines, whose token times are known exactly — the truths client measurements are checked
against. Every time is an absolute deadline on the event loop clock, so sleeps never accumulate drift.

* **Fixed** (:class:`FixedTimingEngine`, ``--ttft 50ms --itl 20ms``): token ``i`` (0-based) of a request is due
  at ``t_arrival + ttft + i*itl``, however many requests run. ``t_arrival`` is when the handler starts, i.e.
  after the request head has been parsed. ``--ttft 0 --itl 0`` streams as fast as the loop can (each token still
  its own event), for measuring client overhead.
* **Batching** (:class:`BatchingEngine`, ``--slots N --step-a A --step-b B [--prefill-per-token P]``): one
  engine loop runs steps back to back. At a step start, requests that arrived *no later than that instant* are
  admitted FIFO while fewer than ``N`` run; the rest wait. The step lasts ``A + B*batch + P*(prompt tokens of
  requests admitted at this step)`` where ``batch`` is the number running at the step start. At the step end
  each running request receives one token (so its first step yields its first token: TTFT = queue wait + first
  step); finished requests free their slot then, and the next step starts at once. An idle engine starts a step
  at the arrival instant. :func:`kvcap.testing.truth.batching_truth` gives the consequences for closed loops.

Either may keep an exact prefix cache (:mod:`kvcap.testing.prefix_cache`; off unless given one). The batching
engine looks a request up when it admits it, in admission order (a request admitted at the same step as another
with the same prefix finds the blocks that one stored, as vLLM v1's scheduler does), and charges ``P`` only for
the prompt tokens it did not find: a hit of ``h`` tokens makes its first step, and so its TTFT, exactly ``P*h``
shorter. The fixed engine looks a request up on arrival and its times do not change. Either releases the
request's blocks when it ends (the batching engine at the step end that finished it, or at the next step start
for a request whose client left; the fixed engine when the front end is done with it).

Both expose vLLM's metric names on ``/metrics``: counters as ``*_total`` plus ``*_created``, KV usage as the
share of slots in use (0 in fixed mode), and with a prefix cache ``vllm:prefix_cache_queries``/``_hits`` (in
tokens).
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Callable, Sequence

from kvcap.aio import cancel_and_wait
from kvcap.serve.engine import EngineLoad, Occupancy, TokenSlot
from kvcap.serve.loop import sleep_until
from kvcap.serve.metrics import Counter, Gauge, MetricFamily, RequestCounters
from kvcap.testing.prefix_cache import PrefixCache, PrefixHold

NO_HOLD = PrefixHold([], 0)
"""What a request holds when the engine has no prefix cache (or has not looked it up yet); never mutated."""


def vllm_families(occupancy: Occupancy, kv_usage: float, served: RequestCounters,
                  started_wall: float, prefix_cache: PrefixCache | None = None) -> list[MetricFamily]:
    """The test engines' /metrics: load from the engine, token and success counts from the front end, and the
    prefix cache's token counters when there is one."""
    cache: list[MetricFamily] = [] if prefix_cache is None else [
        Counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                [("", prefix_cache.queries_tokens)], started_wall),
        Counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                [("", prefix_cache.hits_tokens)], started_wall),
    ]
    return [
        Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", occupancy.running),
        Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", occupancy.waiting),
        Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", kv_usage),
        Counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", [("", 0)],
                started_wall),
        Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", [("", served.prompt_tokens_total)],
                started_wall),
        Counter("vllm:generation_tokens", "Number of generation tokens processed.",
                [("", served.completion_tokens_total)], started_wall),
        Counter("vllm:request_success", "Count of successfully processed requests.",
                [(f'finished_reason="{r}",', v) for r, v in sorted(served.finished_by_reason.items())],
                started_wall),
        *cache,
    ]


class FixedRequest:
    """A request of the fixed engine: when it arrived and what it holds in the prefix cache."""

    __slots__ = ("hold", "t_arrival")

    def __init__(self, t_arrival: float, hold: PrefixHold = NO_HOLD) -> None:
        self.t_arrival = t_arrival
        self.hold = hold


class FixedTimingEngine:
    """Token ``i`` of a request due at ``t_arrival + ttft + i*itl``; a prefix cache, if any, changes no time."""

    def __init__(self, ttft_s: float, itl_s: float, prefix_cache: PrefixCache | None = None) -> None:
        self.ttft, self.itl = ttft_s, itl_s
        self.timed = ttft_s > 0 or itl_s > 0  # fast mode has no schedule to be late for
        self.occupancy = Occupancy()
        self.prefix_cache = prefix_cache
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def prefix_block_tokens(self) -> int | None:
        return self.prefix_cache.block_tokens if self.prefix_cache is not None else None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()

    async def stop(self) -> None:
        pass

    def submit(self, t_arrival: float, prompt_tokens: int, n_out: int) -> FixedRequest:
        self.occupancy.set_running(self.occupancy.running + 1)
        return FixedRequest(t_arrival)

    def submit_blocks(self, t_arrival: float, prompt_tokens: int, n_out: int,
                      block_hashes: Sequence[int]) -> FixedRequest:
        """:meth:`submit`, looked up in the prefix cache at once (on arrival)."""
        r = self.submit(t_arrival, prompt_tokens, n_out)
        if self.prefix_cache is not None:
            r.hold = self.prefix_cache.acquire(block_hashes, prompt_tokens)
        return r

    def cached_tokens(self, r: FixedRequest) -> int:
        return r.hold.cached_tokens

    async def wait(self, r: FixedRequest, n: int) -> bool:
        """Until ``n`` tokens are due; True if it had to sleep."""
        assert self._loop is not None
        return await sleep_until(self._loop, r.t_arrival + self.ttft + (n - 1) * self.itl, self.timed)

    def release(self, r: FixedRequest) -> None:
        self.occupancy.set_running(self.occupancy.running - 1)
        if self.prefix_cache is not None and r.hold.blocks:
            self.prefix_cache.release(r.hold)

    def load(self) -> EngineLoad:
        return self.occupancy.load()

    def metric_families(self, served: RequestCounters, started_wall: float) -> list[MetricFamily]:
        return vllm_families(self.occupancy, 0.0, served, started_wall, self.prefix_cache)


class EngineRequest(TokenSlot):
    """A request inside the batching engine: how many tokens it needs and how many it has been given."""

    __slots__ = ("block_hashes", "cancelled", "hold", "n_out", "prompt_tokens", "t_arrival")

    def __init__(self, t_arrival: float, prompt_tokens: int, n_out: int,
                 block_hashes: Sequence[int] | None = None) -> None:
        super().__init__()
        self.t_arrival = t_arrival
        self.prompt_tokens = prompt_tokens
        self.n_out = n_out
        self.cancelled = False
        self.block_hashes = block_hashes
        self.hold = NO_HOLD


class BatchingEngine:
    """One loop of fixed-cost steps over at most ``slots`` requests (see the module docstring for the truth)."""

    def __init__(self, slots: int, step_a_s: float, step_b_s: float, prefill_per_token_s: float = 0.0,
                 prefix_cache: PrefixCache | None = None) -> None:
        self.slots = slots
        self.a, self.b, self.ppt = step_a_s, step_b_s, prefill_per_token_s
        self.prefix_cache = prefix_cache
        self.occupancy = Occupancy()
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self._wake: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self.steps = 0
        self.resyncs = 0  # steps restarted from "now" because the loop fell a whole step behind

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kvcap-fake-engine")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    @property
    def prefix_block_tokens(self) -> int | None:
        return self.prefix_cache.block_tokens if self.prefix_cache is not None else None

    def submit(self, t_arrival: float, prompt_tokens: int, n_out: int) -> EngineRequest:
        return self.submit_blocks(t_arrival, prompt_tokens, n_out, None)

    def submit_blocks(self, t_arrival: float, prompt_tokens: int, n_out: int,
                      block_hashes: Sequence[int] | None) -> EngineRequest:
        """:meth:`submit` with the prompt's block hashes, looked up in the prefix cache when it is admitted."""
        r = EngineRequest(t_arrival, prompt_tokens, n_out, block_hashes)
        self.waiting.append(r)
        self.occupancy.set_waiting(len(self.waiting))
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)
        return r

    def cached_tokens(self, r: EngineRequest) -> int:
        return r.hold.cached_tokens

    async def wait(self, r: EngineRequest, n: int) -> bool:
        """Until ``r`` holds ``n`` tokens; True if it had to wait."""
        return await r.wait_for(n)

    def release(self, r: EngineRequest) -> None:
        """If the client left: drop ``r`` at the next step start (it still counts in a step already under way)."""
        if r.produced < r.n_out:
            r.cancelled = True
            if r in self.waiting:
                self.waiting.remove(r)
                self.occupancy.set_waiting(len(self.waiting))

    def load(self) -> EngineLoad:
        return self.occupancy.load(self.steps, self.resyncs)

    def metric_families(self, served: RequestCounters, started_wall: float) -> list[MetricFamily]:
        return vllm_families(self.occupancy, self.occupancy.running / self.slots, served, started_wall,
                             self.prefix_cache)

    def _admit(self, t_start: float) -> int:
        """Move requests that arrived by ``t_start`` into free slots, FIFO, looking each up in the prefix cache;
        returns the prompt tokens they must compute (those not found in the cache)."""
        prefill = 0
        cache = self.prefix_cache
        while self.waiting and len(self.running) < self.slots and self.waiting[0].t_arrival <= t_start:
            r = self.waiting.popleft()
            self.running.append(r)
            if cache is not None and r.block_hashes is not None:
                r.hold = cache.acquire(r.block_hashes, r.prompt_tokens)
            prefill += r.prompt_tokens - r.hold.cached_tokens
        self.occupancy.set_running(len(self.running))
        self.occupancy.set_waiting(len(self.waiting))
        return prefill

    def _keep_running(self, keep: Callable[[EngineRequest], bool]) -> None:
        """Keep the running requests for which ``keep`` holds; the others release their cached blocks."""
        cache, kept = self.prefix_cache, []
        for r in self.running:
            if keep(r):
                kept.append(r)
            elif cache is not None and r.hold.blocks:
                cache.release(r.hold)
        self.running = kept

    def _deliver(self) -> None:
        """A step ended: one token to each running request; finished ones free their slot (and cached blocks)."""
        self.steps += 1
        for r in self.running:
            if not r.cancelled:
                r.deliver(r.produced + 1)
        self._keep_running(lambda r: r.produced < r.n_out and not r.cancelled)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        t_end = -math.inf
        step = 0.0
        while True:
            self._keep_running(lambda r: not r.cancelled)
            if not self.running and not self.waiting:
                self.occupancy.set_running(0)
                self._wake = loop.create_future()
                await self._wake
                self._wake = None
                continue
            if self.running:
                # back to back, on absolute deadlines; only if we fell a whole step behind do we restart the clock
                now = loop.time()
                t_start = t_end
                if now - t_end >= max(step, 0.002):
                    t_start = now
                    self.resyncs += 1
            else:  # idle: the step starts when the oldest waiting request arrived
                t_start = max(t_end, self.waiting[0].t_arrival)
            prefill = self._admit(t_start)
            step = self.a + self.b * len(self.running) + self.ppt * prefill
            t_end = t_start + step
            if not self.running:  # the only waiters arrived after t_start (clock skew): wait for them
                await sleep_until(loop, self.waiting[0].t_arrival, record=False)
                t_end = -math.inf
                continue
            await sleep_until(loop, t_end)
            self._deliver()
