"""``kvcap bench --ray ADDRESS``: the bench workers as Ray actors over an existing cluster's nodes.

Each actor is one worker of ``--workers``: its own event loop (an async actor), its own connection pool, its share
of every level exactly as a local worker process takes it (kvcap.loadgen.share). The driver starts each level on
all actors together and keeps one call open per actor that returns as soon as the actor has news (records,
level lines, requests started; at the latest after ``DRAIN_S``), so what an actor finished reaches the driver, and
the one run directory, a round trip later rather than at the next poll. Each actor times with its own monotonic
clock; the driver maps it onto its own axis by an
offset measured by pings at the start and at the end (``offset = worker − (t0 + t1) / 2``, ± ``(t1 − t0) / 2``).
A worker whose node is lost ends the run for that worker only: the records it streamed up to its loss are kept,
its requests in flight are written as ``cancelled`` with the reason, and the summary names it (``lost_workers``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvcap.errors import EndpointError, InputError
from kvcap.loadgen.client import Outcome, to_record
from kvcap.loadgen.runner import Progress, Runner, make_session
from kvcap.loadgen.share import make_factory, merge_level_infos, share_runner
from kvcap.rundir import RecordTags, RequestRecord
from kvcap.workload.prompts import RequestSpec, TokenCounter

DRAIN_S = 0.1
"""The longest an actor holds the driver's open drain call without news: then it answers empty, and the driver
looks at the level's state (stop, error rule, the level call's return) before asking again."""
PINGS = 15
"""Clock pings per measurement; the one with the shortest round trip gives the offset."""
CALL_TIMEOUT_S = 10.0
"""A control call unanswered this long: the worker is taken as lost."""
MAX_UNCERTAINTY_S = 1e-3
"""Above this clock-offset uncertainty a worker's start_s could be misplaced by more than a millisecond: warn."""
PLACEMENTS = ("spread", "pack")

log = logging.getLogger(__name__)


def import_ray() -> Any:
    """Ray is an optional extra, imported only for ``--ray``."""
    try:
        import ray
    except ImportError:
        raise InputError("--ray needs Ray: install kvcap[ray]") from None
    return ray


GRPC_HELLO = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000")
"""HTTP/2's client preface and an empty SETTINGS frame: a Ray head (its GCS is a gRPC server) answers with its own
SETTINGS frame at once; anything else listening there (a web server, a closed door) does not."""
SETTINGS_FRAME = 0x04


def ray_head_refusal(address: str, timeout_s: float = 5.0) -> str | None:
    """Why a HOST:PORT Ray head does not answer (None when it does, or for ``auto`` and ``ray://``, left to Ray):
    one line now instead of ``ray.init``'s minutes of retries against a port where nothing, or something else than
    a Ray head, listens. ``bench --ray`` and ``search --ray`` both ask."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return None
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as conn:
            conn.settimeout(timeout_s)
            conn.sendall(GRPC_HELLO)
            head = b""
            while len(head) < 4:
                more = conn.recv(9 - len(head))
                if not more:
                    break
                head += more
    except TimeoutError:
        return f"no answer within {timeout_s:g} s"
    except OSError as exc:
        return str(exc.strerror or exc)
    if len(head) < 4 or head[3] != SETTINGS_FRAME:
        log.debug("%s answered %r to an HTTP/2 preface", address, head[:9])
        return "something listens there, but not a Ray head (no gRPC answer)"
    return None


def reachable(address: str, timeout_s: float = 5.0) -> None:
    """Ray is installed (else bad input, exit 2) and a HOST:PORT head answers (else, as for a dead ``--url``, an
    endpoint that cannot serve the run: exit 1). ``bench --ray`` and ``search --ray`` both check this way."""
    import_ray()
    why = ray_head_refusal(address, timeout_s)
    if why is not None:
        raise EndpointError(f"cannot reach the Ray cluster at {address}: {why}")


def ping_offset(t0: float, worker: float, t1: float) -> tuple[float, float]:
    """(offset, uncertainty) of a worker clock from one ping: driver sent at ``t0``, the worker read ``worker``,
    the driver got it back at ``t1``; the worker's read lies somewhere in [t0, t1]."""
    return worker - (t0 + t1) / 2, (t1 - t0) / 2


def best_offset(pings: list[tuple[float, float, float]]) -> tuple[float, float]:
    """The tightest of several pings (least round trip, so least uncertainty)."""
    return min((ping_offset(*p) for p in pings), key=lambda o: o[1])


def clock_warnings(report: list[dict[str, Any]], limit_s: float = MAX_UNCERTAINTY_S) -> list[str]:
    """One warning per worker whose clock offset (``clock_report`` rows) is known only to worse than ``limit_s``."""
    out = []
    for row in report:
        worst = max((row[k]["uncertainty_s"] for k in ("start", "end") if row[k]["uncertainty_s"] is not None),
                    default=None)
        if worst is not None and worst > limit_s:
            out.append(f"worker {row['worker']} ({row.get('host')}): clock offset uncertain by {worst * 1e3:.2f} ms "
                       f"(> {limit_s * 1e3:g} ms); its start_s may be off by that much")
    return out


def request_key(rec: dict[str, Any]) -> tuple[float, int, int]:
    """A request's identity within a run: its level, repeat and index (indices are unique within a level)."""
    return (rec["level"], rec["repeat"], rec["index"])


class _TrackedRunner(Runner):
    """A Runner that tells its actor which requests are in flight, so a lost node's are still recorded."""

    inflight: dict[tuple[float, int, int], RequestRecord] | None = None
    news: asyncio.Event | None = None
    """Set when a request starts: the actor's open drain call answers with it."""

    async def _send(self, session: Any, req: RequestSpec, t_sched: float, tags: RecordTags) -> RequestRecord:
        placeholder = to_record(Outcome(t_sched=t_sched, t_sent=t_sched, error="cancelled"), req, None, tags)
        key = request_key(placeholder)
        if self.inflight is not None:
            self.inflight[key] = placeholder
        if self.news is not None:
            self.news.set()
        try:
            return await super()._send(session, req, t_sched, tags)
        finally:
            if self.inflight is not None:
                self.inflight.pop(key, None)


class BenchWorker:
    """The actor (made remote by :func:`_actor_class`): one worker's levels, records kept until drained."""

    def __init__(self, cfg: Any, w: int) -> None:
        import ray

        self.cfg, self.w = cfg, w
        self.host = socket.gethostname()
        self.node_id = ray.get_runtime_context().get_node_id()
        self.records: list[dict[str, Any]] = []
        self.levels: list[dict[str, Any]] = []
        self.inflight: dict[tuple[float, int, int], RequestRecord] = {}
        self.reported: set[tuple[float, int, int]] = set()
        self.counter = TokenCounter(cfg.tokenizer)
        self.factory = make_factory(cfg, self.counter)
        self.session: Any = None
        self.stop_event: asyncio.Event | None = None
        self.halt_event: asyncio.Event | None = None
        self.news = asyncio.Event()
        """Set by a finished record, a level line or a request started: what the driver's open drain waits for."""

    def identity(self) -> dict[str, Any]:
        import os

        return {"worker": self.w, "host": self.host, "node_id": self.node_id, "pid": os.getpid()}

    def clock(self) -> float:
        return time.perf_counter()

    async def run_level(self, level: float, repeat: int, origin: float) -> None:
        """Worker ``w``'s share of one level, timed from ``origin`` on this actor's clock."""
        if self.session is None:
            self.session = make_session()
            self.stop_event, self.halt_event = asyncio.Event(), asyncio.Event()
        if self.stop_event.is_set() or self.halt_event.is_set():
            return
        runner = share_runner(self.cfg, self.w, level, origin, self, self.counter, self.factory, self.stop_event,
                              self.halt_event, runner_cls=_TrackedRunner)
        runner.inflight, runner.news = self.inflight, self.news
        await runner.run_level(self.session, level, repeat)

    def record(self, rec: dict[str, Any]) -> None:
        rec["host"], rec["node_id"] = self.host, self.node_id
        self.records.append(rec)
        self.news.set()

    def level(self, info: dict[str, Any]) -> None:
        info["client"] = {**info["client"], "worker": self.w, "host": self.host, "node_id": self.node_id}
        self.levels.append(info)
        self.news.set()

    async def drain(self, wait_s: float = 0.0) -> tuple[list[dict[str, Any]], list[dict[str, Any]],
                                                        list[dict[str, Any]]]:
        """(finished records, finished level lines, requests newly in flight) since the last drain — at once when
        there are any, else as soon as there are, or empty after ``wait_s``."""
        if wait_s > 0 and not (self.records or self.levels or self.inflight.keys() - self.reported):
            self.news.clear()
            # nothing new in wait_s: an empty answer lets the driver look at the level's state
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.news.wait(), wait_s)
        records, levels = self.records, self.levels
        self.records, self.levels = [], []
        started = [rec for key, rec in self.inflight.items() if key not in self.reported]
        self.reported = set(self.inflight)
        return records, levels, started

    def stop(self, halt: bool = False) -> None:
        """Stop the sweep (Ctrl-C at the driver) or halt it (another worker's error rule tripped)."""
        event = self.halt_event if halt else self.stop_event
        if event is not None:
            event.set()

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()


def _actor_class(ray: Any) -> Any:
    return ray.remote(num_cpus=1, max_restarts=0, max_concurrency=1000)(BenchWorker)


@dataclass
class WorkerState:
    """The driver's view of one actor."""

    w: int
    actor: Any
    identity: dict[str, Any] = field(default_factory=dict)
    clock_start: tuple[float, float] | None = None
    clock_end: tuple[float, float] | None = None
    inflight: dict[tuple[float, int, int], dict[str, Any]] = field(default_factory=dict)
    lost: str | None = None


class RayPool:
    """The bench workers of one run on a Ray cluster: placed, clock-synchronised, driven level by level."""

    def __init__(self, cfg: Any, address: str, placement: str = "spread") -> None:
        if placement not in PLACEMENTS:
            raise InputError(f"--placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
        self.cfg, self.address, self.placement = cfg, address, placement
        self.ray = import_ray()
        self.workers: list[WorkerState] = []
        self.group: Any = None

    async def start(self) -> None:
        """Connect, place one actor per worker (spread: over distinct nodes where it can; pack: together), and
        measure each actor's clock offset."""
        ray = self.ray
        reachable(self.address)
        try:
            ray.init(address=self.address, logging_level="ERROR", log_to_driver=False, configure_logging=False)
        except (ConnectionError, ValueError, RuntimeError) as exc:  # as search --ray: exit 1, one line
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise EndpointError(f"cannot join the Ray cluster at {self.address}: {first}") from None
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        n = self.cfg.workers
        self.group = placement_group([{"CPU": 1}] * n, strategy=self.placement.upper())
        ready, _ = await asyncio.get_running_loop().run_in_executor(
            None, lambda: ray.wait([self.group.ready()], timeout=60))
        if not ready:
            self.close_sync()
            raise InputError(f"--ray {self.address}: the cluster has no room for {n} workers (1 CPU each)")
        cls = _actor_class(ray)
        for w in range(n):
            strategy = PlacementGroupSchedulingStrategy(placement_group=self.group, placement_group_bundle_index=w)
            self.workers.append(WorkerState(w, cls.options(scheduling_strategy=strategy).remote(self.cfg, w)))
        for ws in self.workers:
            try:
                ws.identity = await self._call(ws, ws.actor.identity.remote(), timeout=120)
                ws.clock_start = await self._offset(ws)
            except Exception as exc:  # kvcap missing on a node, a node gone: one line, not a traceback
                self.close_sync()
                first = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
                raise InputError(f"--ray {self.address}: worker {ws.w} did not start ({first[:200]}); kvcap must "
                                 "be installed on every node") from None

    async def _call(self, ws: WorkerState, ref: Any, timeout: float = CALL_TIMEOUT_S) -> Any:
        return await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout)

    async def _offset(self, ws: WorkerState) -> tuple[float, float]:
        pings = []
        for _ in range(PINGS):
            t0 = time.perf_counter()
            worker = await self._call(ws, ws.actor.clock.remote())
            pings.append((t0, worker, time.perf_counter()))
        return best_offset(pings)

    async def run(self, writer: Any, progress: Progress, origin: float,
                  stop: asyncio.Event) -> tuple[list[dict[str, Any]], bool, dict[str, Any] | None]:
        """Every level on every live actor together; returns (client stats, interrupted, error-rule verdict)."""
        plan = self.cfg.plan
        client_stats: list[dict[str, Any]] = []
        stopped: dict[str, Any] | None = None
        started_levels: set[tuple[float, int]] = set()
        for repeat in range(plan.first_repeat, plan.first_repeat + plan.repeats):
            for level in plan.levels:
                live = [ws for ws in self.workers if ws.lost is None]
                if stop.is_set() or stopped is not None or not live:
                    return client_stats, stop.is_set(), stopped
                refs = {ws.w: ws.actor.run_level.remote(level, repeat, origin + ws.clock_start[0]) for ws in live}
                infos: list[dict[str, Any]] = []

                def take(batch: tuple[list, list, list], infos: list[dict[str, Any]] = infos) -> None:
                    nonlocal stopped
                    records, levels, _ = batch
                    for rec in records:
                        key = (rec["level"], rec["repeat"])
                        if key not in started_levels:
                            started_levels.add(key)
                            progress.level_start(plan.mode, rec["level"], rec["repeat"],
                                                 (plan.warmup_s + plan.duration_s) if plan.duration_s else None)
                        writer.record(rec)
                        progress.on_record(rec)
                    for info in levels:
                        infos.append(info)
                        client_stats.append(info["client"])
                        if info.get("stopped") and stopped is None:
                            stopped = info["stopped"]

                follow = [asyncio.create_task(self._follow(ws, refs[ws.w], take)) for ws in live]
                halted = stopping = False
                while True:
                    done, _ = await asyncio.wait(follow, timeout=DRAIN_S)
                    if stop.is_set() and not stopping:
                        stopping = True
                        await self._broadcast(live, halt=False)
                    if stopped is not None and not halted:
                        halted = True
                        await self._broadcast(live, halt=True)
                    if len(done) == len(follow):
                        break
                for task in follow:
                    task.result()  # a bug in the collecting logic surfaces here, not as a silently short run
                for ws in live:
                    if ws.lost is not None and ws.inflight:
                        self._write_lost(ws, writer)
                if infos:
                    merged = merge_level_infos(infos)
                    writer.level(merged)
                    progress.level_end(merged)
        return client_stats, stop.is_set(), stopped

    async def _follow(self, ws: WorkerState, ref: Any, take: Callable[[tuple[list, list, list]], None]) -> None:
        """Actor ``ws``'s records as it finishes them, into ``take``, until its level call has returned and the
        last of them is in (or it is lost: then what it streamed is kept, its requests in flight stay known)."""
        while ws.lost is None:
            returned = self._returned(ws, ref)
            batch = await self._drain(ws, wait_s=0.0 if returned else DRAIN_S)
            if batch is not None:
                take(batch)
            if returned:
                return

    def _returned(self, ws: WorkerState, ref: Any) -> bool:
        """Whether the actor's level call has returned; a failure of the actor marks the worker lost."""
        done, _ = self.ray.wait([ref], timeout=0)
        if not done:
            return False
        try:
            self.ray.get(done[0], timeout=0)
        except Exception as exc:  # any failure of the actor: a lost worker, not a crash
            self._lose(ws, exc)
        return True

    async def _drain(self, ws: WorkerState, wait_s: float = 0.0) -> tuple[list, list, list] | None:
        if ws.lost is not None:
            return None
        try:
            records, levels, started = await self._call(ws, ws.actor.drain.remote(wait_s),
                                                        timeout=CALL_TIMEOUT_S + wait_s)
        except Exception as exc:
            self._lose(ws, exc)
            return None
        for rec in started:
            ws.inflight[request_key(rec)] = rec
        for rec in records:
            ws.inflight.pop(request_key(rec), None)
        return records, levels, started

    def _lose(self, ws: WorkerState, exc: BaseException) -> None:
        if ws.lost is None:
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else "no reply"
            reason = f"{type(exc).__name__}: {text}"
            ws.lost = reason if len(reason) <= 200 else reason[:197] + "..."
            log.debug("worker %d lost: %s", ws.w, reason)

    def _write_lost(self, ws: WorkerState, writer: Any) -> None:
        """The lost worker's requests in flight at its last drain, as ``cancelled`` records with the reason."""
        for rec in ws.inflight.values():
            rec = {**rec, "host": ws.identity.get("host"), "node_id": ws.identity.get("node_id"),
                   "error_detail": f"worker {ws.w} lost: {ws.lost}"[:300]}
            writer.record(rec)
        ws.inflight.clear()

    async def _broadcast(self, live: list[WorkerState], halt: bool) -> None:
        for ws in live:
            if ws.lost is None:
                ws.actor.stop.remote(halt)

    async def finish(self) -> None:
        """Measure the end offsets, close the actors' sessions, release the cluster."""
        for ws in self.workers:
            if ws.lost is not None:
                continue
            try:
                ws.clock_end = await self._offset(ws)
                await self._call(ws, ws.actor.close.remote())
            except Exception as exc:
                self._lose(ws, exc)
        self.close_sync()

    def close_sync(self) -> None:
        ray = self.ray
        for ws in self.workers:
            try:
                ray.kill(ws.actor)
            except Exception as exc:  # already gone with its node: nothing left to stop
                log.debug("worker %d not killed (already gone): %s: %s", ws.w, type(exc).__name__, exc)
        if self.group is not None:
            try:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(self.group)
            except Exception as exc:  # the cluster frees it when this driver disconnects (ray.shutdown below)
                log.debug("placement group not removed: %s: %s", type(exc).__name__, exc)
        ray.shutdown()

    def clock_report(self) -> list[dict[str, Any]]:
        """Per worker: where it ran and its clock offset (and uncertainty) at the start and the end, seconds."""
        def pair(o: tuple[float, float] | None) -> dict[str, float | None]:
            return {"offset_s": round(o[0], 9) if o else None, "uncertainty_s": round(o[1], 9) if o else None}

        return [{**ws.identity, "start": pair(ws.clock_start), "end": pair(ws.clock_end)} for ws in self.workers]

    def warnings(self) -> list[str]:
        """Clock offsets too uncertain to place start_s within a millisecond, and workers lost."""
        lost = [f"worker {ws.w} ({ws.identity.get('host')}) lost: {ws.lost}" for ws in self.workers if ws.lost]
        return clock_warnings(self.clock_report()) + lost

    def lost_workers(self) -> list[dict[str, Any]]:
        return [{"worker": ws.w, "host": ws.identity.get("host"), "node_id": ws.identity.get("node_id"),
                 "reason": ws.lost} for ws in self.workers if ws.lost]
