"""One streaming request to an OpenAI-compatible endpoint, timed at each received SSE event.

Why it is written the way it is:
- the clock (``time.perf_counter``, monotonic) is read once per received network chunk, before parsing, so
  parsing cost never inflates a latency; events that arrived in one chunk honestly share a timestamp;
- latency counts from the *scheduled* start the caller passes in (open loop: no coordinated omission), and the
  request's bytes are written synchronously right after ``t_sent`` is read (:mod:`kvcap.loadgen.http`: no task
  switch between the clock and the socket, none per received chunk);
- the first *content* token ends TTFT (a chat stream's role-only first chunk does not);
- a multi-token event contributes one ITL per token (its gap split evenly), so len(itl) = N − 1;
- failures are classified per request and never raise into the runner (except cancellation, re-raised after
  the record is handed over);
- the server's own count of prompt tokens it found cached is read from the objects already parsed (the usage's
  ``prompt_tokens_details``, else llama.cpp's ``timings``): an event only keeps a reference, the record reads it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import aiohttp
import orjson

from kvcap.loadgen.http import ABORT, DRAIN, MORE, Endpoint, Pool, StaleConnection, endpoint, exchange, request_head
from kvcap.rundir import RecordTags, RequestRecord, tpot_ms
from kvcap.workload.prompts import RequestSpec, TokenCounter

ERROR_CLASSES = ("http_4xx", "http_5xx", "timeout", "connection", "malformed_stream", "server_error_in_stream",
                 "cancelled")
READ_BUFSIZE = 1 << 21
"""aiohttp's default 64 KiB read buffer throttles long streams; 2 MiB keeps reads whole."""


@dataclass(frozen=True)
class Target:
    """Where and how to send: endpoint URL, API flavour, model, headers, decoding params, timeouts."""

    url: str
    api: str = "completions"
    model: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    timeout_s: float = 120.0
    stall_timeout_s: float | None = None
    force_length: bool = True
    temperature: float = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)

    @property
    def endpoint(self) -> str:
        return endpoint_url(self.url, self.api)


def endpoint_url(url: str, api: str) -> str:
    """``http://h:8000`` or ``…/v1`` → ``…/v1/completions`` (or chat); a full endpoint path is kept."""
    u = url.rstrip("/")
    if u.endswith("/completions"):
        return u
    if u.endswith("/v1"):
        u = u[:-3]
    return f"{u}/v1/chat/completions" if api == "chat" else f"{u}/v1/completions"


def request_body(target: Target, req: RequestSpec) -> dict[str, Any]:
    body: dict[str, Any] = {"stream": True, "stream_options": {"include_usage": True},
                            "max_tokens": req.output_tokens, "temperature": target.temperature}
    if target.model:
        body["model"] = target.model
    if target.force_length:  # vLLM/SGLang/llama.cpp honour these; others ignore unknown fields
        body["ignore_eos"] = True
        body["min_tokens"] = req.output_tokens
    if target.api == "chat":
        body["messages"] = req.messages or [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    body.update(target.extra_body)
    return body


@dataclass
class Outcome:
    """What came back for one request, in seconds since the run's clock origin."""

    t_sched: float
    t_sent: float = 0.0
    t_first: float | None = None
    t_last: float | None = None
    event_times: list[float] = field(default_factory=list)
    event_chars: list[int] = field(default_factory=list)
    event_texts: list[str] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None
    """llama.cpp's ``timings`` object, from the last event carrying one."""
    finish_reason: str | None = None
    status: int | None = None
    error: str | None = None
    detail: str | None = None
    retries: int = 0
    done: bool = False


def _split_tokens(chars: list[int], texts: list[str], total: int, counter: TokenCounter | None) -> list[int]:
    """Tokens per content event, summing to ``total`` (usage) — by tokenizer counts or by characters."""
    n = len(chars)
    if n == 0:
        return []
    if total == n:
        return [1] * n
    if counter is not None and counter.exact:
        weights = [max(1, counter.count(t)) for t in texts]
    else:
        weights = [max(1, c) for c in chars]
    if total < n:  # fewer tokens than events (e.g. empty-text events): one each, cut at the end
        return [1] * total + [0] * (n - total)
    base = [1] * n
    extra = total - n
    wsum = float(sum(weights))
    share = [extra * w / wsum for w in weights]
    floors = [int(s) for s in share]
    left = extra - sum(floors)
    order = sorted(range(n), key=lambda i: share[i] - floors[i], reverse=True)
    for i in order[:left]:
        floors[i] += 1
    return [b + f for b, f in zip(base, floors)]


def _count(x: Any) -> int | None:
    """A token count the server sent, None when it is not one (absent, null, not a number)."""
    return int(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0 else None


def cached_tokens(usage: dict[str, Any], timings: dict[str, Any] | None) -> int | None:
    """The prompt tokens the server says it served from its prefix cache: ``usage.prompt_tokens_details
    .cached_tokens`` (vLLM with ``--enable-prompt-tokens-details``, SGLang, llama.cpp), else llama.cpp's
    ``timings.cache_n`` (the same figure, in builds without the usage detail); None when the server said neither.
    vLLM leaves the detail out when it found nothing: that request's count is None, not 0."""
    details = usage.get("prompt_tokens_details")
    n = _count(details.get("cached_tokens")) if isinstance(details, dict) else None
    if n is None and isinstance(timings, dict):
        n = _count(timings.get("cache_n"))
    return n


def to_record(o: Outcome, req: RequestSpec, counter: TokenCounter | None, tags: RecordTags,
              keep_texts: bool = False) -> RequestRecord:
    """The request's record (``rundir.RequestRecord``) after its tags; times in ms from the scheduled start."""
    usage = o.usage or {}
    n_events = len(o.event_times)
    if usage.get("completion_tokens") is not None:
        n_out, source = int(usage["completion_tokens"]), "usage"
    elif counter is not None and counter.exact:
        n_out, source = sum(max(1, counter.count(t)) for t in o.event_texts), "counted"
    else:
        n_out, source = n_events, "counted"
    per_event = _split_tokens(o.event_chars, o.event_texts, n_out, counter)
    itl: list[float] = []
    if n_events:
        itl.extend([0.0] * max(0, per_event[0] - 1))
        for j in range(1, n_events):
            k = per_event[j]
            if k:
                gap = (o.event_times[j] - o.event_times[j - 1]) * 1e3 / k
                itl.extend([gap] * k)
    ok = o.error is None and o.done
    error = o.error if o.error else (None if o.done else "malformed_stream")
    ttft = (o.t_first - o.t_sched) * 1e3 if o.t_first is not None else None
    e2e = (o.t_last - o.t_sched) * 1e3 if o.t_last is not None and ok else None
    tpot = tpot_ms(ttft, e2e, n_out)
    finish = o.finish_reason
    rec: RequestRecord = {
        **tags, "index": req.index, "start_s": round(o.t_sched, 6),
        "end_s": round(o.t_last, 6) if o.t_last is not None else None,
        "send_delay_ms": round((o.t_sent - o.t_sched) * 1e3, 3),
        "ok": ok, "error": error, "status": o.status,
        "input_tokens": int(usage.get("prompt_tokens") or req.input_tokens),
        "cached_tokens": cached_tokens(usage, o.timings),
        "output_tokens": n_out, "requested_output_tokens": req.output_tokens, "tokens_source": source,
        "ttft_ms": _r(ttft), "tpot_ms": _r(tpot), "e2e_ms": _r(e2e),
        "itl_ms": [round(x, 3) for x in itl], "queue_ms": None,
        "finish_reason": finish,
        "truncated": bool(ok and n_out < req.output_tokens and finish == "length"),
        "early_stop": bool(ok and n_out < req.output_tokens and finish == "stop"),
        "retries": o.retries, "group": req.group,
    }
    if req.session is not None and req.turn is not None:
        rec["session"], rec["turn"] = req.session, req.turn
    if o.detail:
        rec["error_detail"] = o.detail[:300]
    if keep_texts:
        rec["text"] = "".join(o.event_texts)
    return rec


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def classify_exception(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "timeout"
    return "connection"


STALE_BEFORE_CLOSE = 2
"""Stale pooled connections seen before every later request asks for ``Connection: close``: one can be a server's
idle timeout racing a send; more is a server that closes what it said to keep."""


@dataclass
class ConnectionPolicy:
    """Shared by a session's requests: once a server is seen closing pooled connections it said to keep
    (llama.cpp), every later request asks for ``Connection: close`` instead of tripping over a dead socket. Only a
    reused connection that died before any byte of its response counts — a reset or a stall in the middle of a
    response is that request's failure and changes nothing for the others."""

    close: bool = False
    stale_seen: int = 0


@lru_cache(maxsize=64)
def _head(endpoint: Endpoint, headers: tuple[tuple[str, str], ...], length: int, close: bool) -> bytes:
    return request_head(endpoint, {"Content-Type": "application/json", "Accept": "text/event-stream",
                                   **dict(headers)}, length, close)


class _Stream:
    """The SSE side of one response: splits de-framed body pieces into events and times them into ``o``."""

    __slots__ = ("buf", "chat", "error_body", "o")

    def __init__(self, o: Outcome, chat: bool) -> None:
        self.o, self.chat = o, chat
        self.buf = b""
        self.error_body: list[bytes] | None = None

    def head(self, status: int, headers: dict[str, str]) -> None:
        self.o.status = status
        if status >= 400:
            self.error_body = []

    def body(self, now: float, piece: bytes) -> int:
        """One body piece, received at ``now`` (read once per network chunk, before parsing)."""
        if self.error_body is not None:
            if sum(map(len, self.error_body)) < 4096:
                self.error_body.append(piece)
            return MORE
        o = self.o
        o.t_last = now
        if b"\r" in piece:
            piece = piece.replace(b"\r\n", b"\n")
        buf = self.buf + piece if self.buf else piece
        start = 0
        while True:
            cut = buf.find(b"\n\n", start)
            if cut < 0:
                break
            event, start = buf[start:cut], cut + 2
            if _handle_event(event, o, self.chat, now):
                self.buf = b""
                # done: read the body to its end so the connection goes back to the pool; failed: drop it
                return DRAIN if o.done else ABORT
        self.buf = buf[start:]
        return MORE


async def stream_request(session: Pool | aiohttp.ClientSession, target: Target, req: RequestSpec, o: Outcome,
                         clock: Callable[[], float], policy: ConnectionPolicy | None = None) -> Outcome:
    """Send one streaming request and time every event into ``o``.

    ``session`` is the runner's connection :class:`~kvcap.loadgen.http.Pool`; anything else (a one-off caller's
    aiohttp session) gets a connection of its own, closed afterwards. Never raises except CancelledError; then
    ``o`` (which the caller holds) is marked ``cancelled``.
    """
    if not isinstance(session, Pool):
        async with Pool() as pool:
            return await stream_request(pool, target, req, o, clock, policy)
    body = orjson.dumps(request_body(target, req))
    stream = _Stream(o, target.api == "chat")
    headers = tuple(target.headers.items())

    def sent(t: float) -> None:
        o.t_sent = t

    try:
        ep = endpoint(target.endpoint)
        while True:
            close = policy is not None and policy.close
            try:
                await exchange(session, ep, _head(ep, headers, len(body), close), body, clock, sent, stream.head,
                               stream.body, target.timeout_s, target.stall_timeout_s, keep_alive=not close,
                               fresh=o.retries > 0)
                break
            except StaleConnection as exc:
                # a pooled connection the server had closed (llama.cpp says Keep-Alive, then closes): the request
                # never reached it, so a retry is safe; latency still counts from the scheduled start
                if o.retries >= 2 or policy is None:
                    raise
                policy.stale_seen += 1
                policy.close = policy.stale_seen >= STALE_BEFORE_CLOSE
                o.retries += 1
                o.detail = f"retried after {type(exc).__name__}"
        if stream.error_body is not None:
            o.error = "http_5xx" if (o.status or 0) >= 500 else "http_4xx"
            o.detail = f"HTTP {o.status}: {b''.join(stream.error_body).decode(errors='replace')[:300]}"
            o.t_last = clock()
    except asyncio.CancelledError:
        o.error = o.error or "cancelled"
        o.t_last = clock()
        raise
    except Exception as exc:
        if o.error is None:
            o.error = classify_exception(exc)
            o.detail = f"{type(exc).__name__}: {exc}"[:300]
        o.t_last = clock()
    return o


def _handle_event(event: bytes, o: Outcome, chat: bool, now: float) -> bool:
    """Parse one SSE event; returns True when the stream is over (done or failed)."""
    for line in event.split(b"\n"):
        if not line.startswith(b"data:"):
            continue  # comments (": ping"), event:/id: lines
        payload = line[5:].strip()
        if payload == b"[DONE]":
            o.done = True
            return True
        try:
            obj = orjson.loads(payload)
        except ValueError:
            o.error, o.detail = "malformed_stream", f"bad JSON in event: {payload[:120]!r}"
            return True
        if not isinstance(obj, dict):
            o.error, o.detail = "malformed_stream", f"event is not an object: {payload[:120]!r}"
            return True
        if obj.get("error") is not None:
            err = obj["error"]
            o.error = "server_error_in_stream"
            o.detail = json.dumps(err)[:300] if not isinstance(err, str) else err[:300]
            return True
        if obj.get("usage"):
            o.usage = obj["usage"]
        if obj.get("timings"):  # llama.cpp: kept as is, read once by the record
            o.timings = obj["timings"]
        for choice in obj.get("choices") or ():
            if chat:
                delta = choice.get("delta") or {}
                text = delta.get("content") or delta.get("reasoning_content") or ""
            else:
                text = choice.get("text") or ""
            if text:
                if o.t_first is None:
                    o.t_first = now
                o.event_times.append(now)
                o.event_chars.append(len(text))
                o.event_texts.append(text)
            if choice.get("finish_reason"):
                o.finish_reason = choice["finish_reason"]
    return False
