"""A deterministic OpenAI-compatible fake LLM server, so client measurements can be checked against known truth.

Run it as ``python -m kvcap.testing.server --port 0 [options]``: it binds 127.0.0.1 (another address only when
``--host`` is given) and prints exactly one line, ``listening on http://HOST:PORT``, once it accepts connections.

Protocol (mimics vLLM's OpenAI server): ``POST /v1/completions`` and ``POST /v1/chat/completions`` with
``stream`` true or false; ``GET /v1/models``, ``/health``, ``/version``, ``/metrics`` (Prometheus text, vLLM
names) and ``/stats`` (JSON counters for tests). The fake tokenizer counts one token per whitespace-separated
word; output token ``i`` is the word ``"w{i} "``, so a client re-counting words gets the true count.

Timing truth (every time is an absolute deadline on the event loop clock, so sleeps never accumulate drift):

* **Fixed** (default, ``--ttft 50ms --itl 20ms``): token ``i`` (0-based) of a request is due at
  ``t_arrival + ttft + i*itl``, however many requests run. ``t_arrival`` is when the handler starts, i.e. after
  the request head has been parsed. ``--ttft 0 --itl 0`` streams as fast as the loop can (each token still its
  own event), for measuring client overhead.
* **Batching** (``--slots N --step-a A --step-b B [--prefill-per-token P]``): one engine loop runs steps back to
  back. At a step start, requests that arrived *no later than that instant* are admitted FIFO while fewer than
  ``N`` run; the rest wait. The step lasts ``A + B*batch + P*(prompt tokens of requests admitted at this step)``
  where ``batch`` is the number running at the step start. At the step end each running request receives one
  token (so its first step yields its first token: TTFT = queue wait + first step); finished requests free their
  slot then, and the next step starts at once. An idle engine starts a step at the arrival instant.
  Consequences, used by :func:`batching_truth`: with ``c >= 2N`` closed-loop clients every step has batch ``N``
  and every inter-token gap is exactly ``A + B*N``; with ``2 <= c <= N`` each client's next request arrives just
  *after* the boundary that freed its slot, so it sits out one step per request (the closed-loop bubble) and a
  cycle of ``L`` output tokens takes exactly ``(L+1)*A + B*c*L``.
* **Faults** (``--fault KIND:every=K[,offset=J][,after=T]``, repeatable, the first match wins) hit generation
  requests whose arrival index (0-based, counting valid generation requests) satisfies ``index % K == J``:
  ``http_500`` / ``http_429`` answer an error before streaming; at the moment token ``T`` (default 2) is due,
  ``reset`` aborts the TCP connection (RST), ``stall`` stops sending but keeps the connection open until the
  client leaves, ``malformed`` sends one event of invalid JSON and then continues normally, and
  ``error_in_200`` sends a llama.cpp-style ``{"error": ...}`` event and ends the response without ``[DONE]``.
  Non-streaming requests get the same faults (a truncated or ``{"error": ...}`` JSON body for the last two).
  In batching mode a stalled request keeps its slot until its tokens would have been done; a reset one (or one
  whose client left) frees it at the next step start.
* ``--close-after-response`` says ``Connection: keep-alive`` but closes after every response (llama.cpp), which
  breaks clients that reuse pooled connections without retrying.

One process sustains thousands of concurrent streams: no threads, chunk bytes are pre-serialized per request
(only the token text is spliced in), and the batching engine wakes a stream only when its next chunk is ready.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import selectors
import signal
import socket
import struct
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from aiohttp import web

from kvcap import __version__
from kvcap.errors import InputError
from kvcap.units import parse_duration

FAULT_KINDS = ("http_500", "http_429", "reset", "stall", "malformed", "error_in_200")
DEFAULT_FAULT_AFTER = 2
_YIELD_EVERY = 32
"""In fast mode (deadlines already past) yield to the loop every this many events so other streams progress."""


# ----------------------------------------------------------------------------------------------- configuration

@dataclass(frozen=True)
class FaultSpec:
    """One ``--fault`` rule: which requests (by arrival index) it hits and when (after how many tokens)."""

    kind: str
    every: int
    offset: int = 0
    after: int = DEFAULT_FAULT_AFTER

    def matches(self, index: int) -> bool:
        return index % self.every == self.offset

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        """``'reset:every=5,offset=1,after=3'`` → FaultSpec; raises InputError on anything unclear."""
        kind, _, rest = text.partition(":")
        kind = kind.strip()
        if kind not in FAULT_KINDS:
            raise InputError(f"unknown fault kind {kind!r} in {text!r} (use one of {', '.join(FAULT_KINDS)})")
        params: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in rest.split(","))):
            key, eq, value = part.partition("=")
            if not eq or key not in ("every", "offset", "after"):
                raise InputError(f"bad fault parameter {part!r} in {text!r} (use every=K, offset=J, after=T)")
            try:
                params[key] = int(value)
            except ValueError:
                raise InputError(f"fault parameter {key} must be an integer, got {value!r} in {text!r}") from None
        if "every" not in params:
            raise InputError(f"fault {text!r} needs every=K")
        spec = cls(kind=kind, **params)
        if spec.every < 1 or not 0 <= spec.offset < spec.every or spec.after < 0:
            raise InputError(f"fault {text!r} needs every >= 1, 0 <= offset < every, after >= 0")
        return spec


@dataclass(frozen=True)
class ServerConfig:
    """Everything that decides the server's behaviour; durations in seconds."""

    model_name: str = "fake-model"
    ttft_s: float = 0.050
    itl_s: float = 0.020
    tokens_per_chunk: int = 1
    eos_after: int | None = None
    slots: int | None = None
    step_a_s: float = 0.010
    step_b_s: float = 0.0
    prefill_per_token_s: float = 0.0
    faults: tuple[FaultSpec, ...] = ()
    close_after_response: bool = False
    max_model_len: int = 131072
    stall_max_s: float = 600.0

    @property
    def batching(self) -> bool:
        return self.slots is not None

    def fault_for(self, index: int) -> FaultSpec | None:
        for f in self.faults:
            if f.matches(index):
                return f
        return None


def batching_truth(concurrency: int, slots: int, a: float, b: float, output_tokens: int) -> dict[str, Any]:
    """Steady-state truths of the batching mode for a closed loop of ``concurrency`` clients.

    Assumes: each client keeps exactly one streaming request outstanding and sends the next one as soon as the
    previous ends (no think time), all requests ask for ``output_tokens = L`` tokens with EOS ignored, no
    prefill cost (``--prefill-per-token 0``), no faults, and a network delay small against one step (but > 0,
    so a new request lands just after the step boundary that ended its predecessor). Times in seconds; TTFT is
    from the server's arrival, i.e. excludes the network and client overhead.

    Regimes (``c`` = concurrency, ``N`` = slots, ``S`` = step time):

    * ``c == 1``: the engine is idle when each request lands, so it starts at once: ``S = a + b``, TTFT = S,
      TPOT = S, throughput = 1/S. Exact.
    * ``2 <= c <= N``: each request sits out the step it arrived in (its slot was freed at the boundary just
      before), so every client cycles through ``L + 1`` steps of which it runs ``L``. Exact, whatever the
      clients' phases: e2e = ``(L+1)*a + b*c*L``, throughput = ``c*L / e2e``. A full-batch gap is ``a + b*c``;
      because other clients' sit-out steps can fall inside a request's decode window, a request's TPOT lies in
      ``[a + b*c - b*(c-1)/(L-1), a + b*c]`` (returned as ``tpot_s_min``/``tpot_s``) and the mean TTFT (about
      two steps: the rest of the arrival step, then the first step) in ``[2a + b*c, 2a + 2*b*c - b]``
      (``ttft_s_steady`` is the lower end, ``ttft_s_max`` the upper).
    * ``c > N``: the queue never empties, so batches stay at ``N``: every gap is ``S = a + b*N`` (TPOT exact),
      throughput = ``N / S``, and by Little's law the mean e2e is ``c*L*S/N`` and mean TTFT
      ``S * (L*(c/N - 1) + 1)``, i.e. one step plus a queue wait of ``(c/N - 1)`` service times (``L*S``).
      Exact for ``c >= 2N``; for ``N < c < 2N`` exact only once no more than ``c - N`` requests finish at any one
      boundary (requests admitted together finish together, so a synchronized start can leave short batches
      for a while) — ``exact`` is False there.
    """
    c, n, length = int(concurrency), int(slots), int(output_tokens)
    if c < 1 or n < 1 or length < 1:
        raise ValueError("concurrency, slots and output_tokens must be >= 1")
    if c == 1:
        s = a + b
        return {"regime": "idle_start", "exact": True, "batch": 1.0, "step_s": s, "tpot_s": s, "tpot_s_min": s,
                "ttft_s_steady": s, "ttft_s_max": s, "e2e_s": length * s, "queue_s": 0.0,
                "throughput_tok_s": 1.0 / s}
    if c <= n:
        e2e = (length + 1) * a + b * c * length
        tpot = a + b * c
        tpot_min = tpot - (b * (c - 1) / (length - 1) if length > 1 else 0.0)
        return {"regime": "bubble", "exact": True, "batch": c * length / (length + 1), "step_s": tpot,
                "tpot_s": tpot, "tpot_s_min": tpot_min, "ttft_s_steady": 2 * a + b * c,
                "ttft_s_max": 2 * a + 2 * b * c - b, "e2e_s": e2e, "queue_s": None,
                "throughput_tok_s": c * length / e2e}
    s = a + b * n
    e2e = c * length * s / n
    ttft = s * (length * (c / n - 1) + 1)
    return {"regime": "queued", "exact": c >= 2 * n, "batch": float(n), "step_s": s, "tpot_s": s,
            "tpot_s_min": s, "ttft_s_steady": ttft, "ttft_s_max": ttft, "e2e_s": e2e, "queue_s": ttft - s,
            "throughput_tok_s": n / s}


# --------------------------------------------------------------------------------------------------- counters

@dataclass
class Stats:
    """Counters behind /stats and /metrics; plain ints, mutated only on the event loop."""

    requests_started: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    requests_rejected: int = 0
    finished_by_reason: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0})
    prompt_tokens_total: int = 0
    completion_tokens_total: int = 0
    running: int = 0
    waiting: int = 0
    max_running: int = 0
    max_waiting: int = 0
    connections_opened: int = 0
    faults_injected: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAULT_KINDS, 0))

    def set_running(self, n: int) -> None:
        self.running = n
        self.max_running = max(self.max_running, n)

    def set_waiting(self, n: int) -> None:
        self.waiting = n
        self.max_waiting = max(self.max_waiting, n)


# ------------------------------------------------------------------------------------------------ token clocks

def _release(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


@dataclass
class TimerStats:
    """How late timed sends woke up. The truths hold only while the host keeps up; tests read this (``timer`` in
    /stats) to tell a broken schedule from a starved machine."""

    wakeups: int = 0
    late_over_1ms: int = 0
    late_over_5ms: int = 0
    max_late_s: float = 0.0

    def record(self, late: float) -> None:
        self.wakeups += 1
        if late > 0.001:
            self.late_over_1ms += 1
            if late > 0.005:
                self.late_over_5ms += 1
        if late > self.max_late_s:
            self.max_late_s = late

    def as_dict(self) -> dict[str, float]:
        return {"wakeups": self.wakeups, "late_over_1ms": self.late_over_1ms, "late_over_5ms": self.late_over_5ms,
                "max_late_ms": round(self.max_late_s * 1e3, 3)}


TIMERS = TimerStats()
"""Process-wide: one server per process is the intended use."""


async def sleep_until(loop: asyncio.AbstractEventLoop, when: float, record: bool = True) -> bool:
    """Sleep to an absolute ``loop.time()`` deadline; returns False (without yielding) if it has passed.

    ``record``: count the wake-up's lateness (also when already past due) in :data:`TIMERS`."""
    now = loop.time()
    if when <= now:
        if record:
            TIMERS.record(now - when)
        return False
    fut = loop.create_future()
    handle = loop.call_at(when, _release, fut)
    try:
        await fut
    finally:
        handle.cancel()
    if record:
        TIMERS.record(loop.time() - when)
    return True


class _FixedClock:
    """Token ``i`` due at ``t0 + ttft + i*itl``; ``wait(n)`` returns once ``n`` tokens are due."""

    def __init__(self, loop: asyncio.AbstractEventLoop, t0: float, ttft: float, itl: float) -> None:
        self.loop, self.t0, self.ttft, self.itl = loop, t0, ttft, itl
        self.timed = ttft > 0 or itl > 0  # fast mode has no schedule to be late for

    async def wait(self, n: int) -> bool:
        return await sleep_until(self.loop, self.t0 + self.ttft + (n - 1) * self.itl, self.timed)

    def close(self) -> None:
        pass


class _EngineRequest:
    """A request inside the batching engine: how many tokens it needs and how many it has been given."""

    __slots__ = ("cancelled", "n_out", "produced", "prompt_tokens", "t_arrival", "waiter", "want")

    def __init__(self, t_arrival: float, prompt_tokens: int, n_out: int) -> None:
        self.t_arrival = t_arrival
        self.prompt_tokens = prompt_tokens
        self.n_out = n_out
        self.produced = 0
        self.want = 0
        self.cancelled = False
        self.waiter: asyncio.Future[None] | None = None


class BatchingEngine:
    """One loop of fixed-cost steps over at most ``slots`` requests (see the module docstring for the truth)."""

    def __init__(self, cfg: ServerConfig, stats: Stats) -> None:
        assert cfg.slots is not None
        self.slots = cfg.slots
        self.a, self.b, self.ppt = cfg.step_a_s, cfg.step_b_s, cfg.prefill_per_token_s
        self.stats = stats
        self.waiting: deque[_EngineRequest] = deque()
        self.running: list[_EngineRequest] = []
        self._wake: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self.steps = 0
        self.resyncs = 0  # steps restarted from "now" because the loop fell a whole step behind

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kvcap-fake-engine")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def submit(self, t_arrival: float, prompt_tokens: int, n_out: int) -> _EngineRequest:
        r = _EngineRequest(t_arrival, prompt_tokens, n_out)
        self.waiting.append(r)
        self.stats.set_waiting(len(self.waiting))
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)
        return r

    async def wait(self, r: _EngineRequest, n: int) -> bool:
        """Until ``r`` holds ``n`` tokens; True if it had to wait."""
        if r.produced >= n:
            return False
        loop = asyncio.get_running_loop()
        while r.produced < n:
            r.want = n
            r.waiter = loop.create_future()
            await r.waiter
        return True

    def cancel(self, r: _EngineRequest) -> None:
        """The client left: drop ``r`` at the next step start (it still counts in a step already under way)."""
        if r.produced < r.n_out:
            r.cancelled = True
            if r in self.waiting:
                self.waiting.remove(r)
                self.stats.set_waiting(len(self.waiting))

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        t_end = -math.inf
        step = 0.0
        while True:
            self.running = [r for r in self.running if not r.cancelled]
            if not self.running and not self.waiting:
                self.stats.set_running(0)
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
            prefill = 0
            while self.waiting and len(self.running) < self.slots and self.waiting[0].t_arrival <= t_start:
                r = self.waiting.popleft()
                self.running.append(r)
                prefill += r.prompt_tokens
            self.stats.set_running(len(self.running))
            self.stats.set_waiting(len(self.waiting))
            step = self.a + self.b * len(self.running) + self.ppt * prefill
            t_end = t_start + step
            if not self.running:  # the only waiters arrived after t_start (clock skew): wait for them
                await sleep_until(loop, self.waiting[0].t_arrival, record=False)
                t_end = -math.inf
                continue
            await sleep_until(loop, t_end)
            self.steps += 1
            for r in self.running:
                if r.cancelled:
                    continue
                r.produced += 1
                w = r.waiter
                if w is not None and r.produced >= r.want and not w.done():
                    w.set_result(None)
            self.running = [r for r in self.running if r.produced < r.n_out and not r.cancelled]


class _EngineClock:
    """Adapter: the batching engine as a token clock for one request."""

    def __init__(self, engine: BatchingEngine, r: _EngineRequest) -> None:
        self.engine, self.r = engine, r

    async def wait(self, n: int) -> bool:
        return await self.engine.wait(self.r, n)

    def close(self) -> None:
        self.engine.cancel(self.r)


# -------------------------------------------------------------------------------------------- request parsing

class _BadRequest(Exception):
    def __init__(self, status: int, message: str, err_type: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status, self.message, self.err_type = status, message, err_type


@dataclass
class _Job:
    """One parsed generation request and its planned outcome."""

    chat: bool
    stream: bool
    model: str
    prompt_tokens: int
    max_tokens: int
    n_out: int
    finish_reason: str
    include_usage: bool
    t_arrival: float
    created: int
    index: int = -1


def _count_prompt(body: dict[str, Any], chat: bool) -> int:
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _BadRequest(400, "messages must be a non-empty list")
        n = 0
        for m in messages:
            if not isinstance(m, dict):
                raise _BadRequest(400, "each message must be an object")
            content = m.get("content")
            if isinstance(content, str):
                n += len(content.split())
            elif isinstance(content, list):  # OpenAI content parts: count the text ones
                n += sum(len(str(p.get("text", "")).split()) for p in content if isinstance(p, dict))
            elif content is not None:
                raise _BadRequest(400, "message content must be a string")
        return n
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        if prompt and all(isinstance(t, int) for t in prompt):
            return len(prompt)  # token ids
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            raise _BadRequest(400, "prompt must be a string or a list of one string (batched prompts unsupported)")
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise _BadRequest(400, "prompt must be a string")
    return len(prompt.split())


def _int_field(body: dict[str, Any], key: str, default: int | None) -> int | None:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise _BadRequest(400, f"{key} must be an integer")
    return v


def _plan(cfg: ServerConfig, body: Any, chat: bool, t_arrival: float) -> _Job:
    """Validate like vLLM and decide the output length and finish reason up front (the fake is deterministic)."""
    if not isinstance(body, dict):
        raise _BadRequest(400, "request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != cfg.model_name:
        raise _BadRequest(404, f"The model `{model}` does not exist.", "NotFoundError")
    if body.get("n", 1) != 1:
        raise _BadRequest(400, "n > 1 is not supported by the fake server")
    prompt_tokens = _count_prompt(body, chat)
    max_tokens = _int_field(body, "max_completion_tokens" if chat and "max_tokens" not in body else "max_tokens", 16)
    assert max_tokens is not None
    if max_tokens < 1:
        raise _BadRequest(400, f"max_tokens must be at least 1, got {max_tokens}.")
    min_tokens = _int_field(body, "min_tokens", 0) or 0
    if min_tokens < 0 or min_tokens > max_tokens:
        raise _BadRequest(400, f"min_tokens must be in [0, max_tokens], got {min_tokens}")
    if prompt_tokens + max_tokens > cfg.max_model_len:
        raise _BadRequest(400, f"This model's maximum context length is {cfg.max_model_len} tokens. However, you "
                               f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, "
                               f"{max_tokens} in the completion). Please reduce the length of the messages or "
                               f"completion.")
    n_out, finish = max_tokens, "length"
    if cfg.eos_after is not None and not body.get("ignore_eos", False):
        eos_at = max(cfg.eos_after, min_tokens, 1)
        if eos_at < max_tokens:
            n_out, finish = eos_at, "stop"
    opts = body.get("stream_options")
    include_usage = bool(isinstance(opts, dict) and opts.get("include_usage"))
    return _Job(chat=chat, stream=bool(body.get("stream", False)), model=cfg.model_name, prompt_tokens=prompt_tokens,
                max_tokens=max_tokens, n_out=n_out, finish_reason=finish, include_usage=include_usage,
                t_arrival=t_arrival, created=int(time.time()))


# ------------------------------------------------------------------------------------------ pre-serialization

_WORDS: list[str] = []


def token_text(i: int) -> str:
    """Text of output token ``i``: one whitespace-delimited word, so the fake tokenizer counts it as one."""
    while len(_WORDS) <= i:
        _WORDS.extend(f"w{k} " for k in range(len(_WORDS), max(2 * len(_WORDS), 1024)))
    return _WORDS[i]


def _tokens_text(start: int, stop: int) -> str:
    return "".join(token_text(i) for i in range(start, stop))


class _Frames:
    """Byte templates for one request's SSE events: only the token text and finish reason are spliced in."""

    def __init__(self, job: _Job) -> None:
        model = json.dumps(job.model)
        if job.chat:
            self.rid = f"chatcmpl-fake{job.index:024d}"
            self.obj = "chat.completion.chunk"
        else:
            self.rid = f"cmpl-fake{job.index:024d}"
            self.obj = "text_completion"
        head = f'{{"id":"{self.rid}","object":"{self.obj}","created":{job.created},"model":{model},'
        self.head = head
        if job.chat:
            self.pre = f'data: {head}"choices":[{{"index":0,"delta":{{"content":"'.encode()
            self.mid = b'"},"logprobs":null,"finish_reason":'
        else:
            self.pre = f'data: {head}"choices":[{{"index":0,"text":"'.encode()
            self.mid = b'","logprobs":null,"finish_reason":'
        self.post = b"}]}\n\n"

    def chunk(self, text: str, finish: str | None) -> bytes:
        fr = b"null" if finish is None else b'"' + finish.encode() + b'"'
        return b"".join((self.pre, text.encode(), self.mid, fr, self.post))

    def role(self) -> bytes:
        return (f'data: {self.head}"choices":[{{"index":0,"delta":{{"role":"assistant","content":""}},'
                f'"logprobs":null,"finish_reason":null}}]}}\n\n').encode()

    def usage(self, job: _Job, completion_tokens: int) -> bytes:
        u = _usage(job.prompt_tokens, completion_tokens)
        return f'data: {self.head}"choices":[],"usage":{json.dumps(u, separators=(",", ":"))}}}\n\n'.encode()


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens}


DONE = b"data: [DONE]\n\n"
MALFORMED_EVENT = b'data: {"choices": [{"text": \n\n'
ERROR_EVENT = (b'data: {"error": {"code": 500, "message": "injected fault: error_in_200 (llama.cpp style)", '
               b'"type": "server_error"}}\n\n')


def _error_body(status: int, message: str, err_type: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": None, "code": status}}


# ------------------------------------------------------------------------------------------------ the server

STATE: web.AppKey[FakeServerState] = web.AppKey("kvcap_fake_state")


class FakeServerState:
    """Config, counters and (in batching mode) the engine, shared by all handlers of one app."""

    def __init__(self, cfg: ServerConfig, engine: Any = None,
                 metrics: Callable[[FakeServerState], str] | None = None) -> None:
        self.cfg = cfg
        self.stats = Stats()
        self.engine: Any = engine if engine is not None else (
            BatchingEngine(cfg, self.stats) if cfg.batching else None)
        """The batching engine, or any object with its interface (``kvcap serve-sim`` plugs the simulator in)."""
        self.metrics = metrics or render_metrics
        self.next_index = 0
        self.started_wall = time.time()

    def clock_for(self, job: _Job) -> _FixedClock | _EngineClock:
        if self.engine is not None:
            return _EngineClock(self.engine, self.engine.submit(job.t_arrival, job.prompt_tokens, job.n_out))
        return _FixedClock(asyncio.get_running_loop(), job.t_arrival, self.cfg.ttft_s, self.cfg.itl_s)

    def snapshot(self) -> dict[str, Any]:
        """The /stats body. ``requests_started`` counts valid generation requests (each takes an arrival index);
        ``requests_finished`` those that reached their normal end; ``requests_aborted`` the rest (faults, clients
        that left); ``requests_rejected`` 4xx validation failures (no index). ``connections_opened`` counts every
        accepted TCP connection, the ones that fetched /stats or /metrics included. ``running``/``waiting`` are
        now; ``max_*`` are high-water marks; ``faults_injected`` is per kind; ``timer`` says how late timed sends
        woke (the timing truths hold only while ``late_over_5ms`` stays 0)."""
        s = self.stats
        return {
            "requests_started": s.requests_started, "requests_finished": s.requests_finished,
            "requests_aborted": s.requests_aborted, "requests_rejected": s.requests_rejected,
            "finished_by_reason": dict(s.finished_by_reason),
            "prompt_tokens_total": s.prompt_tokens_total, "completion_tokens_total": s.completion_tokens_total,
            "running": s.running, "waiting": s.waiting, "max_running": s.max_running, "max_waiting": s.max_waiting,
            "connections_opened": s.connections_opened, "faults_injected": dict(s.faults_injected),
            "engine_steps": self.engine.steps if self.engine is not None else None,
            "engine_resyncs": self.engine.resyncs if self.engine is not None else None,
            "timer": TIMERS.as_dict(),
            "config": _config_json(self.cfg),
        }


def _config_json(cfg: ServerConfig) -> dict[str, Any]:
    d = asdict(cfg)
    d["faults"] = [asdict(f) for f in cfg.faults]
    d["mode"] = "batching" if cfg.batching else "fixed"
    return d


def _abort_with_rst(request: web.Request) -> None:
    """Reset the TCP connection (SO_LINGER 0 makes close send RST, as a crashed server's kernel would)."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


async def _wait_client_gone(request: web.Request, limit_s: float) -> None:
    """For ``stall``: hold the connection open until the client goes away (or ``limit_s`` passes)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    while loop.time() < deadline:
        t = request.transport
        if t is None or t.is_closing():
            return
        await asyncio.sleep(0.05)


class _Generation:
    """Runs one generation request: stream or not, with its fault if any; keeps the counters honest."""

    def __init__(self, state: FakeServerState, request: web.Request, job: _Job) -> None:
        self.state, self.request, self.job = state, request, job
        self.cfg = state.cfg
        self.fault = self.cfg.fault_for(job.index)
        self.sent = 0  # tokens sent to the client
        self.ok = False  # reached the normal end ([DONE] or the whole JSON body)

    def _count_fault(self) -> None:
        assert self.fault is not None
        self.state.stats.faults_injected[self.fault.kind] += 1

    def _finish(self) -> None:
        s = self.state.stats
        s.completion_tokens_total += self.sent
        if self.ok:
            s.requests_finished += 1
            s.finished_by_reason[self.job.finish_reason] = s.finished_by_reason.get(self.job.finish_reason, 0) + 1
        else:
            s.requests_aborted += 1

    async def run(self) -> web.StreamResponse:
        job, fault = self.job, self.fault
        if fault is not None and fault.kind in ("http_500", "http_429"):
            self._count_fault()
            self.state.stats.requests_aborted += 1
            if fault.kind == "http_500":
                return web.json_response(_error_body(500, "injected fault: http_500", "InternalServerError"),
                                         status=500)
            return web.json_response(_error_body(429, "injected fault: http_429 (too many requests)",
                                                 "TooManyRequestsError"), status=429, headers={"Retry-After": "1"})
        clock = self.state.clock_for(job)
        s = self.state.stats
        s.prompt_tokens_total += job.prompt_tokens
        if self.state.engine is None:
            s.set_running(s.running + 1)
        try:
            resp = await (self._stream(clock) if job.stream else self._whole(clock))
            return resp if resp is not None else web.Response(status=499)  # connection already gone
        finally:
            clock.close()
            if self.state.engine is None:
                s.set_running(s.running - 1)
            self._finish()

    async def _whole(self, clock: _FixedClock | _EngineClock) -> web.StreamResponse | None:
        job, fault = self.job, self.fault
        n_out = job.n_out
        if fault is not None:
            cut = min(fault.after, n_out)
            await clock.wait(cut + 1 if cut < n_out else n_out)
            self._count_fault()
            self.sent = cut
            if fault.kind == "reset":
                _abort_with_rst(self.request)
                return None
            if fault.kind == "stall":
                await _wait_client_gone(self.request, self.cfg.stall_max_s)
                return None
            body = ERROR_EVENT[6:-2] if fault.kind == "error_in_200" else MALFORMED_EVENT[6:-2]
            return web.Response(status=200, body=body, content_type="application/json")
        await clock.wait(n_out)
        self.sent = n_out
        text = _tokens_text(0, n_out)
        rid = ("chatcmpl-fake" if job.chat else "cmpl-fake") + f"{job.index:024d}"
        if job.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "logprobs": None, "finish_reason": job.finish_reason, "stop_reason": None}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": job.finish_reason,
                      "stop_reason": None}
            obj = "text_completion"
        body = {"id": rid, "object": obj, "created": job.created, "model": job.model, "choices": [choice],
                "usage": _usage(job.prompt_tokens, n_out)}
        self.ok = True
        return web.json_response(body)

    async def _stream(self, clock: _FixedClock | _EngineClock) -> web.StreamResponse:
        job, fault, cfg = self.job, self.fault, self.cfg
        frames = _Frames(job)
        resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream",
                                                       "Cache-Control": "no-cache"})
        await resp.prepare(self.request)
        if job.chat:
            await resp.write(frames.role())
        n_out, k = job.n_out, max(1, cfg.tokens_per_chunk)
        fault_at = min(fault.after, n_out) if fault is not None else None
        unslept = 0
        while True:
            if fault is not None and self.sent == fault_at:
                fault_at = None  # fires once, when token `after` is due (or with the last token, if past the end)
                if self.sent < n_out and await clock.wait(self.sent + 1):
                    unslept = 0
                self._count_fault()
                if fault.kind == "reset":
                    _abort_with_rst(self.request)
                    return resp
                if fault.kind == "stall":
                    await _wait_client_gone(self.request, cfg.stall_max_s)
                    return resp
                if fault.kind == "error_in_200":
                    await resp.write(ERROR_EVENT)
                    await resp.write_eof()
                    return resp
                await resp.write(MALFORMED_EVENT)  # malformed: then carry on normally
            if self.sent >= n_out:
                break
            stop = min(self.sent + k, n_out)
            if fault_at is not None and self.sent < fault_at < stop:
                stop = fault_at  # a short chunk so that exactly `after` tokens precede the fault
            if await clock.wait(stop):
                unslept = 0
            else:
                unslept += 1
                if unslept >= _YIELD_EVERY:
                    unslept = 0
                    await asyncio.sleep(0)
            await resp.write(frames.chunk(_tokens_text(self.sent, stop), job.finish_reason if stop == n_out else None))
            self.sent = stop
        if job.include_usage:
            await resp.write(frames.usage(job, self.sent))
        await resp.write(DONE)
        await resp.write_eof()
        self.ok = True
        return resp


def _error_response(status: int, message: str, err_type: str) -> web.Response:
    return web.json_response(_error_body(status, message, err_type), status=status)


def _make_generation_handler(chat: bool) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handler(request: web.Request) -> web.StreamResponse:
        t_arrival = asyncio.get_running_loop().time()
        state = request.app[STATE]
        try:
            try:
                body = await request.json()
            except ValueError as exc:
                raise _BadRequest(400, f"invalid JSON body: {exc}") from None
            job = _plan(state.cfg, body, chat, t_arrival)
        except _BadRequest as exc:
            state.stats.requests_rejected += 1
            return _error_response(exc.status, exc.message, exc.err_type)
        job.index = state.next_index
        state.next_index += 1
        state.stats.requests_started += 1
        return await _Generation(state, request, job).run()
    return handler


async def _models(request: web.Request) -> web.Response:
    cfg = request.app[STATE].cfg
    created = int(request.app[STATE].started_wall)
    return web.json_response({"object": "list", "data": [{
        "id": cfg.model_name, "object": "model", "created": created, "owned_by": "vllm", "root": cfg.model_name,
        "parent": None, "max_model_len": cfg.max_model_len}]})


async def _health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def _version(request: web.Request) -> web.Response:
    return web.json_response({"version": f"kvcap-fake-{__version__}"})


async def _stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[STATE].snapshot())


def render_metrics(state: FakeServerState) -> str:
    """Prometheus text exposition with vLLM's metric names (counters as ``*_total`` plus ``*_created``)."""
    cfg, s = state.cfg, state.stats
    label = f'model_name="{cfg.model_name}"'
    kv = (s.running / cfg.slots) if cfg.slots else 0.0
    out: list[str] = []

    def gauge(name: str, help_: str, value: float) -> None:
        out.extend((f"# HELP {name} {help_}", f"# TYPE {name} gauge", f"{name}{{{label}}} {float(value)!r}"))

    def counter(name: str, help_: str, series: Sequence[tuple[str, float]]) -> None:
        out.extend((f"# HELP {name}_total {help_}", f"# TYPE {name}_total counter"))
        out.extend(f"{name}_total{{{extra}{label}}} {float(v)!r}" for extra, v in series)
        out.extend((f"# HELP {name}_created {help_}", f"# TYPE {name}_created gauge"))
        out.extend(f"{name}_created{{{extra}{label}}} {state.started_wall!r}" for extra, _ in series)

    gauge("vllm:num_requests_running", "Number of requests in model execution batches.", s.running)
    gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", s.waiting)
    gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", kv)
    counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", [("", 0)])
    counter("vllm:prompt_tokens", "Number of prefill tokens processed.", [("", s.prompt_tokens_total)])
    counter("vllm:generation_tokens", "Number of generation tokens processed.", [("", s.completion_tokens_total)])
    counter("vllm:request_success", "Count of successfully processed requests.",
            [(f'finished_reason="{r}",', v) for r, v in sorted(s.finished_by_reason.items())])
    return "\n".join(out) + "\n"


async def _metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.Response(text=state.metrics(state),
                        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


@web.middleware
async def _close_after_response(request: web.Request,
                                handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """llama.cpp behaviour: advertise keep-alive, then close the connection once the response is out."""
    resp = await handler(request)
    if not resp.prepared:
        resp.headers["Connection"] = "keep-alive"
        await resp.prepare(request)
        await resp.write_eof()
    if request.transport is not None:
        request.transport.close()
    return resp


async def _keep_alive_header(request: web.Request, resp: web.StreamResponse) -> None:
    resp.headers["Connection"] = "keep-alive"


def make_app(cfg: ServerConfig, engine: Any = None,
             metrics: Callable[[FakeServerState], str] | None = None) -> web.Application:
    """The aiohttp application; start it with :func:`start_server` to get connection counting. ``engine`` and
    ``metrics`` replace the batching engine and the /metrics body (the simulator behind the same API)."""
    middlewares = [_close_after_response] if cfg.close_after_response else []
    app = web.Application(client_max_size=256 * 2**20, middlewares=middlewares)
    state = FakeServerState(cfg, engine, metrics)
    app[STATE] = state
    app.router.add_post("/v1/completions", _make_generation_handler(chat=False))
    app.router.add_post("/v1/chat/completions", _make_generation_handler(chat=True))
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/version", _version)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/stats", _stats)
    if cfg.close_after_response:
        app.on_response_prepare.append(_keep_alive_header)

    async def on_startup(app: web.Application) -> None:
        if state.engine is not None:
            state.engine.start()

    async def on_cleanup(app: web.Application) -> None:
        if state.engine is not None:
            await state.engine.stop()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


@dataclass
class RunningServer:
    """A started server: its URL, state, and how to stop it."""

    url: str
    port: int
    state: FakeServerState
    runner: web.AppRunner
    server: asyncio.base_events.Server

    async def close(self) -> None:
        self.server.close()
        await self.runner.cleanup()


async def start_server(cfg: ServerConfig, host: str = "127.0.0.1", port: int = 0, engine: Any = None,
                       metrics: Callable[[FakeServerState], str] | None = None) -> RunningServer:
    """Start on the running loop. The protocol factory counts each accepted TCP connection for /stats."""
    app = make_app(cfg, engine, metrics)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    state = app[STATE]
    http = runner.server
    assert http is not None

    def factory() -> asyncio.Protocol:
        state.stats.connections_opened += 1
        return http()

    loop = asyncio.get_running_loop()
    server = await loop.create_server(factory, host, port, backlog=4096, reuse_address=True)
    bound = server.sockets[0].getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    return RunningServer(url=f"http://{shown}:{bound}", port=bound, state=state, runner=runner, server=server)


# ------------------------------------------------------------------------------------------------------ CLI

def _duration(text: str) -> float:
    try:
        return parse_duration(text, "duration", bare_unit="s")
    except InputError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _fault(text: str) -> FaultSpec:
    try:
        return FaultSpec.parse(text)
    except InputError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_int(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvcap.testing.server",
                                description="Deterministic OpenAI-compatible fake LLM server with known timing.")
    p.add_argument("--host", default=None, help="bind address (default 127.0.0.1; others only when given)")
    p.add_argument("--port", type=int, default=0, help="port (0 = pick a free one)")
    p.add_argument("--model-name", default="fake-model")
    p.add_argument("--ttft", type=_duration, default=0.050, help="fixed mode: time to first token (50ms)")
    p.add_argument("--itl", type=_duration, default=0.020, help="fixed mode: inter-token latency (20ms)")
    p.add_argument("--tokens-per-chunk", type=_positive_int, default=1, help="tokens packed into one SSE event")
    p.add_argument("--eos-after", type=_positive_int, default=None,
                   help="stop after N tokens (finish_reason stop) unless the request sets ignore_eos")
    p.add_argument("--slots", type=_positive_int, default=None, help="batching mode: max running requests")
    p.add_argument("--step-a", type=_duration, default=0.010, help="batching: fixed cost per step")
    p.add_argument("--step-b", type=_duration, default=0.0, help="batching: cost per running request per step")
    p.add_argument("--prefill-per-token", type=_duration, default=0.0,
                   help="batching: extra step cost per prompt token of requests admitted at that step")
    p.add_argument("--fault", type=_fault, action="append", default=[],
                   help="KIND:every=K[,offset=J][,after=T], KIND in " + ", ".join(FAULT_KINDS))
    p.add_argument("--close-after-response", action="store_true",
                   help="say keep-alive but close after each response (llama.cpp)")
    p.add_argument("--max-model-len", type=_positive_int, default=131072)
    p.add_argument("--stall-max", type=_duration, default=600.0, help="longest a stall fault holds a connection")
    return p


def config_from_args(ns: argparse.Namespace) -> ServerConfig:
    return ServerConfig(model_name=ns.model_name, ttft_s=ns.ttft, itl_s=ns.itl, tokens_per_chunk=ns.tokens_per_chunk,
                        eos_after=ns.eos_after, slots=ns.slots, step_a_s=ns.step_a, step_b_s=ns.step_b,
                        prefill_per_token_s=ns.prefill_per_token, faults=tuple(ns.fault),
                        close_after_response=ns.close_after_response, max_model_len=ns.max_model_len,
                        stall_max_s=ns.stall_max)


def _raise_fd_limit() -> None:
    """Thousands of streams need thousands of descriptors: lift the soft limit to the hard one."""
    with contextlib.suppress(ImportError, ValueError, OSError):
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or hard > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 65536, hard))


async def _serve(cfg: ServerConfig, host: str, port: int) -> None:
    srv = await start_server(cfg, host, port)
    print(f"listening on {srv.url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await srv.close()


class PreciseEpollSelector(selectors.EpollSelector):
    """epoll waits whole milliseconds and asyncio rounds *up*, so timers fire up to 1 ms late. Rounding down
    instead wakes the loop up to 1 ms early; it then polls without blocking until the deadline. That costs a
    little CPU when idle and buys sub-100 µs timer accuracy, which the timing truths need."""

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is not None and timeout > 0:
            timeout = max(0.0, (math.floor(timeout * 1e3) - 1e-6) * 1e-3)
        return super().select(timeout)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """The loop the CLI runs on: a selector loop with :class:`PreciseEpollSelector` where epoll exists."""
    if hasattr(selectors, "EpollSelector"):
        return asyncio.SelectorEventLoop(PreciseEpollSelector())
    return asyncio.new_event_loop()


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    host = ns.host if ns.host is not None else "127.0.0.1"
    _raise_fd_limit()
    loop = new_event_loop()
    try:
        loop.run_until_complete(_serve(config_from_args(ns), host, ns.port))
    except OSError as exc:
        print(f"error: cannot listen on {host}:{ns.port}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    finally:
        loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
