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

Both expose vLLM's metric names on ``/metrics``: counters as ``*_total`` plus ``*_created``, KV usage as the
share of slots in use (0 in fixed mode).
"""

from __future__ import annotations

import asyncio
import math
from collections import deque

from kvcap.aio import cancel_and_wait
from kvcap.serve.engine import EngineLoad, Occupancy, TokenSlot
from kvcap.serve.loop import sleep_until
from kvcap.serve.metrics import Counter, Gauge, MetricFamily, RequestCounters


def vllm_families(occupancy: Occupancy, kv_usage: float, served: RequestCounters,
                  started_wall: float) -> list[MetricFamily]:
    """The test engines' /metrics: load from the engine, token and success counts from the front end."""
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
    ]


class FixedTimingEngine:
    """Token ``i`` of a request due at ``t_arrival + ttft + i*itl``; the handle is the arrival time."""

    def __init__(self, ttft_s: float, itl_s: float) -> None:
        self.ttft, self.itl = ttft_s, itl_s
        self.timed = ttft_s > 0 or itl_s > 0  # fast mode has no schedule to be late for
        self.occupancy = Occupancy()
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()

    async def stop(self) -> None:
        pass

    def submit(self, t_arrival: float, prompt_tokens: int, n_out: int) -> float:
        self.occupancy.set_running(self.occupancy.running + 1)
        return t_arrival

    async def wait(self, t_arrival: float, n: int) -> bool:
        """Until ``n`` tokens are due; True if it had to sleep."""
        assert self._loop is not None
        return await sleep_until(self._loop, t_arrival + self.ttft + (n - 1) * self.itl, self.timed)

    def release(self, t_arrival: float) -> None:
        self.occupancy.set_running(self.occupancy.running - 1)

    def load(self) -> EngineLoad:
        return self.occupancy.load()

    def metric_families(self, served: RequestCounters, started_wall: float) -> list[MetricFamily]:
        return vllm_families(self.occupancy, 0.0, served, started_wall)


class EngineRequest(TokenSlot):
    """A request inside the batching engine: how many tokens it needs and how many it has been given."""

    __slots__ = ("cancelled", "n_out", "prompt_tokens", "t_arrival")

    def __init__(self, t_arrival: float, prompt_tokens: int, n_out: int) -> None:
        super().__init__()
        self.t_arrival = t_arrival
        self.prompt_tokens = prompt_tokens
        self.n_out = n_out
        self.cancelled = False


class BatchingEngine:
    """One loop of fixed-cost steps over at most ``slots`` requests (see the module docstring for the truth)."""

    def __init__(self, slots: int, step_a_s: float, step_b_s: float, prefill_per_token_s: float = 0.0) -> None:
        self.slots = slots
        self.a, self.b, self.ppt = step_a_s, step_b_s, prefill_per_token_s
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

    def submit(self, t_arrival: float, prompt_tokens: int, n_out: int) -> EngineRequest:
        r = EngineRequest(t_arrival, prompt_tokens, n_out)
        self.waiting.append(r)
        self.occupancy.set_waiting(len(self.waiting))
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)
        return r

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
        return vllm_families(self.occupancy, self.occupancy.running / self.slots, served, started_wall)

    def _admit(self, t_start: float) -> int:
        """Move requests that arrived by ``t_start`` into free slots, FIFO; returns their prompt tokens."""
        prefill = 0
        while self.waiting and len(self.running) < self.slots and self.waiting[0].t_arrival <= t_start:
            r = self.waiting.popleft()
            self.running.append(r)
            prefill += r.prompt_tokens
        self.occupancy.set_running(len(self.running))
        self.occupancy.set_waiting(len(self.waiting))
        return prefill

    def _deliver(self) -> None:
        """A step ended: one token to each running request; finished ones free their slot."""
        self.steps += 1
        for r in self.running:
            if not r.cancelled:
                r.deliver(r.produced + 1)
        self.running = [r for r in self.running if r.produced < r.n_out and not r.cancelled]

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        t_end = -math.inf
        step = 0.0
        while True:
            self.running = [r for r in self.running if not r.cancelled]
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
