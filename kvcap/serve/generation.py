"""Runs one generation request against the engine: a streamed or a whole response, with its fault if any.

Why: this is where the front end decides *when* bytes leave — each SSE event the moment the engine holds its
tokens — and keeps the counters honest however the request ends (normally, by a fault, or because the client
left).
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from kvcap.serve.engine import PrefixCachingEngine
from kvcap.serve.protocol import DONE, Job, SseFrames, completion_body, tokens_text
from kvcap.serve.state import ServerState

YIELD_EVERY = 32
"""When deadlines are already past (a fast engine), yield to the loop every this many events so other streams
progress."""


class Generation:
    """One request's run; :meth:`run` returns the response (499 when the connection is already gone)."""

    def __init__(self, state: ServerState, request: web.Request, job: Job) -> None:
        self.state, self.request, self.job = state, request, job
        self.fault = state.faults.fault_for(job.index) if state.faults is not None else None
        self.handle: object = None
        self.sent = 0  # tokens sent to the client
        self.ok = False  # reached the normal end ([DONE] or the whole JSON body)

    def _count_fault(self) -> None:
        assert self.fault is not None
        self.state.counters.faults_injected[self.fault.kind] += 1

    def _finish(self) -> None:
        s = self.state.counters
        s.completion_tokens_total += self.sent
        if self.ok:
            s.requests_finished += 1
            s.finished_by_reason[self.job.finish_reason] = s.finished_by_reason.get(self.job.finish_reason, 0) + 1
        else:
            s.requests_aborted += 1

    async def run(self) -> web.StreamResponse:
        job, fault, engine = self.job, self.fault, self.state.engine
        refusal = fault.refusal() if fault is not None else None
        if refusal is not None:
            self._count_fault()
            self.state.counters.requests_aborted += 1
            return refusal
        if job.block_hashes is not None:
            assert isinstance(engine, PrefixCachingEngine)
            self.handle = engine.submit_blocks(job.t_arrival, job.prompt_tokens, job.n_out, job.block_hashes)
        else:
            self.handle = engine.submit(job.t_arrival, job.prompt_tokens, job.n_out)
        self.state.counters.prompt_tokens_total += job.prompt_tokens
        try:
            resp = await (self._stream() if job.stream else self._whole())
            return resp if resp is not None else web.Response(status=499)  # connection already gone
        finally:
            engine.release(self.handle)
            self._finish()

    def _cached_tokens(self) -> int:
        """What usage reports as cached: the engine's count when the server reports it, else 0 (left out)."""
        engine = self.state.engine
        if not self.state.prompt_tokens_details or self.job.block_hashes is None:
            return 0
        assert isinstance(engine, PrefixCachingEngine)
        return engine.cached_tokens(self.handle)

    async def _whole(self) -> web.StreamResponse | None:
        job, fault, engine = self.job, self.fault, self.state.engine
        n_out = job.n_out
        if fault is not None:
            cut = min(fault.after, n_out)
            await engine.wait(self.handle, cut + 1 if cut < n_out else n_out)
            self._count_fault()
            self.sent = cut
            return await fault.strike_whole(self.request)
        await engine.wait(self.handle, n_out)
        self.sent = n_out
        self.ok = True
        return web.json_response(completion_body(job, n_out, self._cached_tokens()))

    async def _stream(self) -> web.StreamResponse:
        job, fault, engine, handle = self.job, self.fault, self.state.engine, self.handle
        frames = SseFrames(job)
        resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream",
                                                       "Cache-Control": "no-cache"})
        await resp.prepare(self.request)
        if job.chat:
            await resp.write(frames.role())
        n_out, k = job.n_out, max(1, self.state.api.tokens_per_chunk)
        fault_at = min(fault.after, n_out) if fault is not None else None
        unslept = 0
        while True:
            if fault is not None and self.sent == fault_at:
                fault_at = None  # fires once, when token `after` is due (or with the last token, if past the end)
                if self.sent < n_out and await engine.wait(handle, self.sent + 1):
                    unslept = 0
                self._count_fault()
                if not await fault.strike_stream(self.request, resp):
                    return resp
            if self.sent >= n_out:
                break
            stop = min(self.sent + k, n_out)
            if fault_at is not None and self.sent < fault_at < stop:
                stop = fault_at  # a short chunk so that exactly `after` tokens precede the fault
            if await engine.wait(handle, stop):
                unslept = 0
            else:
                unslept += 1
                if unslept >= YIELD_EVERY:
                    unslept = 0
                    await asyncio.sleep(0)
            await resp.write(frames.chunk(tokens_text(self.sent, stop), job.finish_reason if stop == n_out else None))
            self.sent = stop
        if job.include_usage:
            await resp.write(frames.usage(job, self.sent, self._cached_tokens()))
        await resp.write(DONE)
        await resp.write_eof()
        self.ok = True
        return resp
