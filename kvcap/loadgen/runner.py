"""Load models: closed loop (fixed concurrency), open loop (fixed arrival rate), trace replay.

Each level runs warm-up → measured window → drain. Requests are tagged by the phase in which they were
*scheduled*; a level's windows go to ``levels.jsonl`` so throughput is counted over the steady state. Open-loop
arrivals are fixed in advance on absolute times and latency counts from the scheduled time, so a client or
server that falls behind shows up as latency, never as a silently lower rate (no coordinated omission).

Multi-turn sessions (``workload.turns`` ≥ 2, :mod:`kvcap.workload.sessions`): a closed-loop user runs one session's
turns after another and then starts the next session; an open-loop arrival opens a session (the rate is of
sessions). A later turn is sent ``think_time`` after the previous turn's last token, its latency counted from that
send. A session takes the phase in which it started, and so do all its turns: only sessions start inside the
measured window (a request count is rounded up to whole sessions), and a session started there may send its
last turns in the drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp

from kvcap.loadgen.client import READ_BUFSIZE, ConnectionPolicy, Outcome, Target, stream_request, to_record
from kvcap.loadgen.guard import ErrorRule, ErrorWatch, backoff_s
from kvcap.loadgen.http import Pool
from kvcap.loadgen.monitor import LoopMonitor
from kvcap.rundir import RecordTags, RequestRecord
from kvcap.workload.loadplan import LoadPlan, rate_schedule, trace_schedule
from kvcap.workload.prompts import PromptFactory, RequestSpec, TokenCounter
from kvcap.workload.sessions import SessionPlan, session_quota, session_schedule_plan


class Sink(Protocol):
    def record(self, rec: dict[str, Any]) -> None: ...
    def level(self, info: dict[str, Any]) -> None: ...


class Progress(Protocol):
    def level_start(self, mode: str, level: float, repeat: int, expected_s: float | None) -> None: ...
    def on_record(self, rec: dict[str, Any]) -> None: ...
    def level_end(self, info: dict[str, Any]) -> None: ...


class NoProgress:
    def level_start(self, mode: str, level: float, repeat: int, expected_s: float | None) -> None:
        pass

    def on_record(self, rec: dict[str, Any]) -> None:
        pass

    def level_end(self, info: dict[str, Any]) -> None:
        pass


def make_session(limit: int = 0) -> aiohttp.ClientSession:
    """The session for a run's probes and telemetry (the measured requests go through the level's own
    :class:`~kvcap.loadgen.http.Pool`): unlimited connections, big reads."""
    connector = aiohttp.TCPConnector(limit=limit, limit_per_host=0, ttl_dns_cache=300, enable_cleanup_closed=True,
                                     keepalive_timeout=30)
    return aiohttp.ClientSession(connector=connector, read_bufsize=READ_BUFSIZE, auto_decompress=False,
                                 timeout=aiohttp.ClientTimeout(total=None))


@dataclass
class Runner:
    """Drives one worker's share of a load plan against a target, handing each record to the sink."""

    target: Target
    plan: LoadPlan
    factory: PromptFactory
    sink: Sink
    counter: TokenCounter | None = None
    progress: Progress = field(default_factory=NoProgress)
    worker: int = 0
    workers: int = 1
    keep_texts: bool = False
    origin: float = field(default_factory=time.perf_counter)
    stop: asyncio.Event | None = None
    client_stats: list[dict[str, Any]] = field(default_factory=list)
    interrupted: bool = False
    connections: ConnectionPolicy = field(default_factory=ConnectionPolicy)
    pool: Pool | None = None
    """The level's keep-alive connections (kvcap.loadgen.http), opened before it starts and closed after."""
    rule: ErrorRule = field(default_factory=ErrorRule)
    """When a level — and with it the run — stops itself (kvcap.loadgen.guard)."""
    stopped: dict[str, Any] | None = None
    """Why this runner's error rule stopped the run (``ErrorWatch.verdict``), or None."""
    halt: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the run stops by the error rule — this runner's, or (shared between a worker's runners and set
    from the parent) another worker's: the level stops issuing and drains, and no level follows."""

    def clock(self) -> float:
        return time.perf_counter() - self.origin

    def _stopped(self) -> bool:
        return self.stop is not None and self.stop.is_set()

    async def run(self, session: aiohttp.ClientSession) -> None:
        if self.stop is None:
            self.stop = asyncio.Event()
        for repeat in range(self.plan.first_repeat, self.plan.first_repeat + self.plan.repeats):
            for level in self.plan.levels:
                if self._stopped():
                    self.interrupted = True
                    return
                await self.run_level(session, level, repeat)
                if self.halt.is_set():
                    return

    async def run_level(self, session: aiohttp.ClientSession, level: float, repeat: int) -> None:
        p = self.plan
        expected = (p.warmup_s + p.duration_s) if p.duration_s is not None else None
        self.progress.level_start(p.mode, level, repeat, expected)
        self.pool = Pool()
        try:
            await self._prewarm(level)
            monitor = LoopMonitor()
            monitor.start()
            t_start = self.clock()
            if p.mode == "concurrency":
                info = await self._closed(session, int(level), repeat, t_start)
            else:
                info = await self._open(session, level, repeat, t_start)
            client = await monitor.stop()
        finally:
            self.pool.close()
        info.update({"mode": p.mode, "level": level, "repeat": repeat, "worker": self.worker,
                     "t_start_s": round(t_start, 6), "t_end_s": round(self.clock(), 6), "client": client,
                     "interrupted": self._stopped()})
        self.client_stats.append(client)
        self.sink.level(info)
        self.progress.level_end(info)

    async def _prewarm(self, level: float) -> None:
        """Open this worker's closed-loop streams' connections before the level's clock starts, so no measured
        request pays a TCP (or TLS) handshake. Open loop: the pool grows as arrivals need it."""
        if self.plan.mode == "concurrency":
            c = int(level)
            await self.pool.prewarm(self.target.endpoint, c // self.workers + (1 if self.worker < c % self.workers
                                                                                else 0))

    async def _send(self, session: aiohttp.ClientSession, req: RequestSpec, t_sched: float,
                    tags: RecordTags) -> RequestRecord:
        """One request on this level's connection pool (``session`` serves only callers without one)."""
        o = Outcome(t_sched=t_sched)
        try:
            await stream_request(self.pool or session, self.target, req, o, self.clock, self.connections)
        except asyncio.CancelledError:
            o.error = o.error or "cancelled"
            self._emit(o, req, tags)
            raise
        return self._emit(o, req, tags)

    def _emit(self, o: Outcome, req: RequestSpec, tags: RecordTags) -> RequestRecord:
        rec = to_record(o, req, self.counter, tags, self.keep_texts)
        self.sink.record(rec)
        self.progress.on_record(rec)
        return rec

    def _judge(self, watch: ErrorWatch, rec: RequestRecord, level: float, repeat: int) -> None:
        """Feed the level's error rule; the first time it trips, stop the level (and the run) and say why."""
        if watch.add(rec) and self.stopped is None:
            self.stopped = watch.verdict(self.plan.mode, level, repeat, self.clock())
            self.halt.set()

    async def _back_off(self, seconds: float) -> float:
        """Wait ``seconds`` (cut short by a halt); returns the time really waited."""
        t = self.clock()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.halt.wait(), seconds)
        return self.clock() - t

    # ---------------------------------------------------------------- closed loop
    async def _closed(self, session: aiohttp.ClientSession, concurrency: int, repeat: int, t_start: float) -> dict:
        p = self.plan
        share = [concurrency // self.workers + (1 if w < concurrency % self.workers else 0)
                 for w in range(self.workers)]
        mine = share[self.worker]
        measure_start = t_start + p.warmup_s
        measure_end = measure_start + p.duration_s if p.duration_s is not None else math.inf
        quota = None if p.requests is None else p.requests // self.workers + (
            1 if self.worker < p.requests % self.workers else 0)
        indices = itertools.count(self.worker, self.workers)
        state = {"measured": 0, "stop_issuing_at": None, "backoff_s": 0.0}
        tags_base = {"mode": "concurrency", "level": concurrency, "repeat": repeat, "worker": self.worker}
        watch = self.rule.watch()

        async def user(started: dict[str, int], limit: int | None,
                       one: Callable[[float, str], Awaitable[bool]]) -> None:
            """One user: a unit of work (a request, or a whole session) after another until the window or
            ``limit`` measured units are reached; ``one(now, phase)`` sends a unit and says whether it succeeded."""
            failures = 0  # in a row, this user's: its backoff (guard.backoff_s) grows with them
            while not self._stopped():
                now = self.clock()
                if self.halt.is_set() or now >= measure_end or (limit is not None and started["measured"] >= limit):
                    if state["stop_issuing_at"] is None:
                        state["stop_issuing_at"] = now
                    return
                phase = "warmup" if now < measure_start else "measure"
                if phase == "measure":
                    started["measured"] += 1
                failures = 0 if await one(now, phase) else failures + 1
                if failures and not self.halt.is_set():
                    state["backoff_s"] += await self._back_off(backoff_s(failures))

        async def one_request(now: float, phase: str) -> bool:
            req = self.factory.request(next(indices), level=concurrency, repeat=repeat)
            rec = await self._send(session, req, now, {**tags_base, "phase": phase})
            self._judge(watch, rec, concurrency, repeat)
            return bool(rec["ok"])

        sessions = self.factory.sessions
        if sessions is not None:  # each user holds one conversation after another (kvcap.workload.sessions)
            session_ids = itertools.count(self.worker, self.workers)
            turns_measured = {"n": 0}

            async def one_session(now: float, phase: str) -> bool:
                return await self._session(session, sessions, next(session_ids), now, concurrency, repeat,
                                           {**tags_base, "phase": phase}, watch, turns_measured)

            started: dict[str, int] = {"measured": 0}
            tasks = [asyncio.create_task(user(started, session_quota(quota, sessions.turns), one_session))
                     for _ in range(mine)]
        else:
            tasks = [asyncio.create_task(user(state, quota, one_request)) for _ in range(mine)]
        await self._drain(tasks, until=measure_end if math.isfinite(measure_end) else None)
        if sessions is not None:
            state["measured"] = turns_measured["n"]
        end = state["stop_issuing_at"] if state["stop_issuing_at"] is not None else self.clock()
        if math.isfinite(measure_end):
            end = min(end, measure_end)
        return {"target": concurrency, "concurrency_this_worker": mine, "measure_start_s": round(measure_start, 6),
                "measure_end_s": round(max(end, measure_start), 6), "sent_measured": state["measured"],
                "backoff_s": round(state["backoff_s"], 3), "stopped": self.stopped}

    async def _session(self, session: aiohttp.ClientSession, plan: SessionPlan, sid: int, t_send: float,
                       level: float, repeat: int, tags: RecordTags, watch: ErrorWatch, measured: dict[str, int],
                       sem: asyncio.Semaphore | None = None) -> bool:
        """Session ``sid``'s turns one after another, the first sent at ``t_send``, each later one ``think_time``
        after the previous one's end (its latency counts from then). A failed turn ends the session: the next
        turn's history would hold an answer the server never gave. Every turn takes the session's phase.
        ``measured`` counts the measured turns sent; ``sem``: the open loop's bound on requests in flight, held per
        turn. True when every turn succeeded."""
        for turn in range(1, plan.turns + 1):
            if turn > 1:
                t_send = self.clock() + plan.think_time_s
                if await self._until(t_send):
                    return False
            if sem is not None:
                await sem.acquire()
            try:
                if self.halt.is_set():
                    return False
                if tags["phase"] == "measure":
                    measured["n"] += 1
                req = self.factory.session_request(plan, sid, turn, level=level, repeat=repeat)
                rec = await self._send(session, req, t_send, tags)
            finally:
                if sem is not None:
                    sem.release()
            self._judge(watch, rec, level, repeat)
            if not rec["ok"]:
                return False
        return True

    async def _until(self, t: float) -> bool:
        """Wait until run time ``t``; True when the run halts (or is stopped) first."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.halt.wait(), max(0.0, t - self.clock()))
        return self.halt.is_set() or self._stopped()

    async def _drain(self, tasks: list[asyncio.Task], until: float | None) -> None:
        """Wait for the level's tasks; on stop or after the drain timeout, cancel what is still in flight."""
        pending = set(tasks)
        deadline = (until if until is not None else math.inf) + self.plan.drain_timeout_s
        stop_wait = asyncio.create_task(self.stop.wait()) if self.stop is not None else None
        try:
            while pending:
                left = deadline - self.clock()
                if left <= 0:
                    break
                waiters = set(pending) | ({stop_wait} if stop_wait else set())
                done, _ = await asyncio.wait(waiters, timeout=min(left, 3600.0), return_when=asyncio.FIRST_COMPLETED)
                pending -= done
                if stop_wait is not None and stop_wait in done:
                    break
        finally:
            if stop_wait is not None:
                stop_wait.cancel()
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)

    # ---------------------------------------------------------------- open loop and trace
    def _schedule(self, level: float, repeat: int) -> tuple[Sequence[float], Callable[[int], RequestSpec]]:
        """The send offsets of the level's requests, and how to build request k when it is sent (not before:
        a long level holds its schedule, not a request object per entry)."""
        p = self.plan
        if p.mode == "trace":
            rows, offsets = trace_schedule(p)

            def trace_request(k: int) -> RequestSpec:
                r = rows[k]
                return self.factory.trace_request(k, r.input_tokens, r.output_tokens, r.hash_ids, level=level,
                                                  repeat=repeat)
            return offsets, trace_request
        if (sessions := self.factory.sessions) is not None:  # session arrivals; their turns are built by _session
            return rate_schedule(session_schedule_plan(p, sessions.turns), level, repeat), self.factory.request
        return rate_schedule(p, level, repeat), lambda k: self.factory.request(k, level=level, repeat=repeat)

    async def _open(self, session: aiohttp.ClientSession, level: float, repeat: int, t_start: float) -> dict:
        p = self.plan
        offsets, make = self._schedule(level, repeat)
        lead = 0.02
        t0 = t_start + lead
        measure_start = t0 + p.warmup_s
        sem = asyncio.Semaphore(p.max_inflight)
        inflight: set[asyncio.Task] = set()  # finished ones leave it: memory follows the requests in flight
        tags_base = {"mode": p.mode, "level": level, "repeat": repeat, "worker": self.worker}
        sent_measured = 0
        late = 0
        first_measured = last_measured = None
        halted_at = None
        watch = self.rule.watch()
        # a rate of sessions: each arrival opens one, later turns follow its answers (kvcap.workload.sessions)
        sessions = self.factory.sessions if p.mode == "rate" else None
        turns_measured = {"n": 0}

        async def one(req: RequestSpec, sched: float, phase: str) -> None:
            try:
                rec = await self._send(session, req, sched, {**tags_base, "phase": phase})
                self._judge(watch, rec, level, repeat)
            finally:
                sem.release()

        # no backoff here: the schedule is the independent variable, and a fixed rate cannot spin; a failing
        # server meets the error rule instead
        for k, off in enumerate(offsets):
            if k % self.workers != self.worker:
                continue
            if self._stopped():
                break
            sched = t0 + off
            delay = sched - self.clock()
            if delay > 0:
                await asyncio.sleep(delay)
            elif delay < -0.005:
                late += 1
            if sessions is None:
                await sem.acquire()  # a full client queues here; the latency still counts from ``sched``
            if self.halt.is_set():
                if sessions is None:
                    sem.release()
                halted_at = self.clock()
                break
            phase = "warmup" if sched < measure_start else "measure"
            if phase == "measure":
                sent_measured += 1
                first_measured = sched if first_measured is None else first_measured
                last_measured = sched
            if sessions is not None:  # arrival k opens session k; its turns hold ``sem`` one at a time
                task = asyncio.create_task(self._session(session, sessions, k, sched, level, repeat,
                                                         {**tags_base, "phase": phase}, watch, turns_measured, sem))
            else:
                task = asyncio.create_task(one(make(k), sched, phase))
            inflight.add(task)
            task.add_done_callback(inflight.discard)
        if p.duration_s is not None and p.mode == "rate":
            measure_end = measure_start + p.duration_s
        elif last_measured is not None:
            measure_end = last_measured
        else:
            measure_end = self.clock()
        if halted_at is not None:  # the measured window ends where the sends did (empty if still warming up)
            measure_end = max(min(measure_end, halted_at), measure_start)
        await self._drain(list(inflight), until=max(measure_end, self.clock()))
        window = max(measure_end - measure_start, 1e-9)
        info = {"target": level, "measure_start_s": round(measure_start, 6), "measure_end_s": round(measure_end, 6),
                "sent_measured": sent_measured if sessions is None else turns_measured["n"], "late_sends": late,
                "achieved_rate": round(sent_measured / window, 4) if p.mode == "rate" else None,
                "stopped": self.stopped}
        if p.mode == "trace":
            info["trace_requests"] = len(offsets)
        return info
