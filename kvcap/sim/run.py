"""``kvcap sim``: drive the simulated cluster with the same load plans as ``bench`` and write the same run
directory — per-request records appended as each finishes, level windows, telemetry with normalised names,
the manifest (source ``sim``) and the summary — so ``analyze``, ``compare`` and ``report`` cannot tell the two
apart except by the manifest.

Every level (and repeat) starts from an empty cluster, like a freshly started server; levels follow each
other on the run's time axis. Closed loop: each of N users sends its next request the moment the previous
one ends. Open loop: arrivals fixed in advance from the same generator and seed as ``bench``, latency from the
arrival. Trace: the rows' arrival times and lengths (Mooncake ``hash_ids`` drive prefix caching).

Multi-turn sessions (:mod:`kvcap.workload.sessions`) run as ``bench`` runs them (:mod:`kvcap.loadgen.runner`): a
closed-loop user's next turn goes ``think_time`` after its previous turn's end, and a new session when the last
turn of one ends; an open loop's arrivals open sessions. A session takes the phase in which it started.
"""

from __future__ import annotations

import math
import time
import uuid
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np

from kvcap import __version__
from kvcap.analysis.slo import parse_slo
from kvcap.analysis.summary import build_summary
from kvcap.errors import InputError
from kvcap.rundir import (
    REQUESTS,
    SUMMARY,
    TELEMETRY,
    Manifest,
    RunDir,
    RunWriter,
    write_json_atomic,
)
from kvcap.rundir.store.column_file import ColumnWriter, TelemetryWriter
from kvcap.rundir.store.record_columns import RecordColumns
from kvcap.rundir.summary import SimTotals, Summary
from kvcap.sim import NATIVE
from kvcap.sim.cluster import ClusterModel, cluster_model
from kvcap.sim.records import record_of
from kvcap.sim.request import SimRequest
from kvcap.sim.request_stream import DrawnLengths, SharedPrefixRequests, request_stream
from kvcap.sim.sampler import Sampler
from kvcap.sim.warm import CarriedCaches, cached_prefixes, restore
from kvcap.specs.scenario import Scenario, scenario_noting
from kvcap.workload.loadplan import LoadPlan, rate_offsets, trace_schedule
from kvcap.workload.reuse import prompt_parts
from kvcap.workload.sessions import (
    SessionPlan,
    session_parts,
    session_plan,
    session_quota,
    session_schedule_plan,
)

LEVEL_GAP_S = 1.0
REFUSED_IN_A_ROW = 10_000
"""Closed-loop requests refused the instant they were sent, in a row, that end a level as bad input (its users
would resend forever without the clock moving)."""
MAX_EVENTS = 50_000_000
FLUSH_S = 0.5
"""Records and telemetry reach the disk at least this often (wall seconds) and at each level's end."""


@dataclass
class SimConfig:
    scenario: Scenario
    plan: LoadPlan
    out: Path
    slo: dict[str, float] = field(default_factory=dict)
    arm: str | None = None
    under_test: list[str] = field(default_factory=list)
    overwrite: bool = False
    record_itl: bool = True
    trace_file: str | None = None
    full_telemetry: bool = False
    """Write every series at every ``sampler.SAMPLE_S`` (the old grid) instead of on change: for tests and
    comparisons."""
    notes: list[str] = field(default_factory=list)
    """What the command line replaced in the scenario (``specs.load.displaced_by_overrides``), for the manifest."""
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])


def config_for(data: dict[str, Any], overrides: dict[str, Any], out: Path, *, where: str = "input",
               trace: Sequence[Any] = (), trace_file: str | None = None, trace_speed: float = 1.0,
               slo: str | None = None, arm: str | None = None, overwrite: bool = False,
               record_itl: bool = True) -> SimConfig:
    """A scenario file's data plus ``--set``/load overrides → the run ``kvcap sim`` makes of them: the one
    translation, which ``kvcap search`` repeats per grid point. ``slo`` (``--slo`` text) replaces the scenario's."""
    scenario, notes = scenario_noting(data, overrides, where)
    if trace and scenario.workload.turns > 1:
        raise InputError("--trace replays the trace's own requests: drop workload.turns (sessions are generated)")
    if trace and any(overrides.get(k) is not None for k in ("load.concurrency", "load.rate")):
        raise InputError("--trace replays the trace's own arrivals: drop load.concurrency / load.rate from --set")
    plan = LoadPlan.from_spec(scenario.load, trace=tuple(trace), trace_speed=trace_speed)
    if plan.mode != "rate" and overrides.get("load.arrival") is not None:
        raise InputError(f"load.arrival applies to open-loop rates only; this run is {plan.mode} "
                         f"({'the trace' if trace else 'load.concurrency'})")
    return SimConfig(scenario=scenario, plan=plan, out=out, slo=parse_slo(slo or scenario.slo), arm=arm,
                     overwrite=overwrite, record_itl=record_itl, trace_file=trace_file, notes=notes)


def flatten(prefix: str, obj: Any, out: dict[str, Any]) -> dict[str, Any]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        out[prefix] = obj
    return out


def _manifest(cfg: SimConfig, cm: ClusterModel, started: float) -> Manifest:
    sc = cfg.scenario
    data = sc.model_dump(mode="json", exclude={"name", "description", "load", "slo"})
    fixed = flatten("", data, {})
    wl = sc.workload
    if wl.prefix_groups and wl.turns == 1:
        fixed.update(prompt_parts(wl.prefix_tokens, wl.prompts_per_group))
    if wl.turns > 1:
        fixed.update(session_parts(wl.turns, wl.think_time, wl.prefix_tokens))
    fixed.update({"workload.input_tokens": wl.input_dist.spec, "workload.output_tokens": wl.output_dist.spec,
                  "model.name": cm.inputs.model.name, "server.engine": "kvcap-sim", "server.version": __version__,
                  "load.trace": Path(cfg.trace_file).name if cfg.trace_file else None, **cfg.plan.manifest()})
    p = cm.plan
    server = {"engine": "kvcap-sim", "version": __version__, "replicas": p.replicas,
              "kv_blocks_per_replica": p.kv_blocks_per_gpu, "kv_tokens_per_replica": p.kv_tokens_per_gpu,
              "resident_requests": p.resident_requests}
    return Manifest(source="sim", run_id=cfg.run_id, started_at=started, fixed=fixed, server=server, arm=cfg.arm,
                    slo=cfg.slo, under_test=cfg.under_test, scenario=sc.name, notes=cfg.notes)


class _LevelRun:
    """One level (one repeat) of load on one fresh cluster: sends the requests (closed loop: each user's next
    when its previous one ends; open loop and trace: a schedule fixed in advance), records each as it finishes,
    and at the drain limit records whatever is still in flight as cancelled."""

    def __init__(self, cm: ClusterModel, plan: LoadPlan, level: float, repeat: int, offset: float,
                 writer: RunWriter, record_itl: bool, full_telemetry: bool = False,
                 columns: RecordColumns | None = None, telemetry_copy: TelemetryWriter | None = None):
        self.plan, self.level, self.repeat, self.offset = plan, level, repeat, offset
        self.writer, self.record_itl, self.columns = writer, record_itl, columns
        self.mode = plan.mode
        self.measure_start = plan.warmup_s
        self.measure_end = self.measure_start + plan.duration_s if plan.duration_s is not None else math.inf
        self.base = {"mode": self.mode, "level": int(level) if self.mode == "concurrency" else level,
                     "repeat": repeat}
        self.measured = self.rid = self.inflight = self.ok = self.errors = self.refused_at_once = 0
        self.stop_at: float | None = None
        """When the closed loop stopped sending (past the window, or the request count reached)."""
        self.live: dict[int, SimRequest] = {}
        """Every request submitted and not yet finished, whatever its state (queued, running, parked, mid-copy)."""
        self.draining = False
        self.sim = cm.build(on_finish=self.on_finish)
        self.sampler = Sampler(self.sim, offset, writer.telemetry, tuple(self.sim.tiers), thin=not full_telemetry,
                               copy=telemetry_copy)
        wl = cm.scenario.workload
        self.lengths: DrawnLengths | SharedPrefixRequests = request_stream(cm.scenario, plan.seed, repeat)
        self.sessions: SessionPlan | None = None if self.mode == "trace" else session_plan(
            plan.seed, wl.turns, wl.think_time, wl.input_dist, wl.output_dist, wl.prefix_tokens, wl.prefix_groups)
        """Multi-turn sessions, or None: every request a single one."""
        self.block_tokens = cm.scenario.serving.hash_block_tokens
        self.session_quota = session_quota(plan.requests, wl.turns)
        self.next_session = self.sessions_measured = 0
        """Sessions: the next one's id; how many started in the measured window."""
        self.cap = math.inf
        """The drain limit (set when the level runs): a session's turn due after it is never sent."""
        self.arrivals: Sequence[float] = []
        """Open loop and trace: every request's arrival (s), in schedule order (an open loop's: 8 bytes each)."""
        self.trace_rows: list[Any] = []
        """Trace: the rows replayed (their lengths and hash ids), in schedule order."""
        self.drawn = 0
        """Open loop: requests whose lengths were drawn (one at a time, as they arrive, in schedule order)."""
        self.last_measured: float | None = None

    # ------------------------------------------------------------------ requests in and out
    def on_finish(self, req: SimRequest, now: float) -> None:
        self.inflight -= 1
        self.live.pop(req.rid, None)
        rec = record_of(req, self.offset, self.record_itl, itl_array=True)
        if rec["ok"]:
            self.ok += 1
        else:
            self.errors += 1
        tags = req.tags
        if self.sessions is not None:
            rec["session"], rec["turn"] = int(tags["session"]), int(tags["turn"])
        self.writer.record(rec)
        if self.columns is not None:
            self.columns.add(cast(dict[str, Any], rec))
        if self.sessions is not None and self.mode != "concurrency":
            self._after_turn(req, now, rec["ok"])
        if self.mode == "concurrency":
            if rec["ok"] or req.arrival != now:
                self.refused_at_once = 0
            else:
                self.refused_at_once += 1
                if self.refused_at_once >= REFUSED_IN_A_ROW:
                    raise InputError(f"every request is refused at once at level {self.level:g} ({rec['error']}: "
                                     f"{req.prompt} prompt + {req.max_out} output tokens fit neither the model's "
                                     "context nor a replica's KV pool): shorten the workload")
            if self.sessions is not None:
                self._after_turn(req, now, rec["ok"])
            else:
                self.issue(now)

    def new_request(self, t: float, prompt: int, out: int, hashes: tuple[int, ...] = ()) -> SimRequest:
        phase = "warmup" if t < self.measure_start else "measure"
        if phase == "measure":
            self.measured += 1
        self.rid += 1
        self.inflight += 1
        req = SimRequest(rid=self.rid, arrival=t, prompt=prompt, max_out=out, hashes=hashes,
                         tags={**self.base, "phase": phase})
        self.live[req.rid] = req
        return req

    def issue(self, t: float) -> None:
        """Closed loop: a user sends its next request (or opens its next session), unless the level is over."""
        if self.draining:
            return
        if self.sessions is not None:
            self._open_session(t)
            return
        plan = self.plan
        if t >= self.measure_end or (plan.requests is not None and self.measured >= plan.requests):
            if self.stop_at is None:
                self.stop_at = t
            return
        self.sim.submit(self.new_request(t, *self.lengths.next()), t)

    # ------------------------------------------------------------------ multi-turn sessions
    def _open_session(self, t: float) -> None:
        """Closed loop: a user opens the next session at ``t``, unless the window is over or its sessions started."""
        quota = self.session_quota
        if t >= self.measure_end or (quota is not None and self.sessions_measured >= quota):
            if self.stop_at is None:
                self.stop_at = t
            return
        phase = "warmup" if t < self.measure_start else "measure"
        if phase == "measure":
            self.sessions_measured += 1
        session = self.next_session
        self.next_session += 1
        self._send_turn(session, 1, t, phase)

    def _send_turn(self, session: int, turn: int, t: float, phase: str) -> None:
        if phase == "measure":
            self.measured += 1
        self.inflight += 1
        self.sim.submit(self._turn(session, turn, t, phase), t)

    def _turn(self, session: int, turn: int, t: float, phase: str) -> SimRequest:
        """Turn ``turn`` of ``session`` arriving at ``t``, in ``live`` (its index is ``bench``'s)."""
        plan = self.sessions
        assert plan is not None
        spec = plan.turn(session, turn)
        req = SimRequest(rid=plan.request_index(session, turn) + 1, arrival=t, prompt=spec.input_tokens,
                         max_out=spec.output_tokens, hashes=plan.hash_ids(spec, self.block_tokens),
                         tags={**self.base, "phase": phase, "session": session, "turn": turn})
        self.live[req.rid] = req
        return req

    def _after_turn(self, req: SimRequest, now: float, ok: bool) -> None:
        """A session's turn ended: its next turn ``think_time`` later (not past the drain limit); after its last
        turn, or a failed one (the history would hold an answer never given), a closed-loop user opens a new
        session at once."""
        plan = self.sessions
        if self.draining or plan is None:
            return
        session, turn = int(req.tags["session"]), int(req.tags["turn"])
        if ok and turn < plan.turns:
            t = now + plan.think_time_s
            if t < self.cap:
                self._send_turn(session, turn + 1, t, str(req.tags["phase"]))
            return
        if self.mode == "concurrency":
            self._open_session(now)

    def start_load(self) -> None:
        """Closed loop: every user's first request at 0; open loop and trace: the whole schedule."""
        if self.mode == "concurrency":
            for _ in range(int(self.level)):
                self.issue(0.0)
            return
        if self.mode == "trace":
            self.trace_rows, offsets = trace_schedule(self.plan)
            self.arrivals = offsets
        else:
            plan = self.plan if self.sessions is None else session_schedule_plan(self.plan, self.sessions.turns)
            self.arrivals = array("d", rate_offsets(plan, self.level, self.repeat).tobytes())
        # the schedule is counted now (rid = position + 1, as if each were sent now); each request is built only
        # when it arrives (Simulation.feed), so memory holds the schedule's times and the requests in flight
        times = np.asarray(self.arrivals, float)  # a view of an open loop's array, no copy
        measured = np.flatnonzero(times >= self.measure_start)
        self.measured += int(measured.size)
        self.sessions_measured = int(measured.size)
        if measured.size:
            self.last_measured = float(times[measured[-1]])
        self.rid = self.inflight = len(self.arrivals)
        self.sim.feed(self.arrivals, self._scheduled)

    def _scheduled(self, i: int) -> SimRequest:
        """The schedule's i-th request, as it arrives (open loop and trace)."""
        t = self.arrivals[i]
        if self.sessions is not None:  # arrival i opens session i
            return self._turn(i, 1, t, "warmup" if t < self.measure_start else "measure")
        if self.trace_rows:
            row = self.trace_rows[i]
            i_tok, o_tok, hashes = row.input_tokens, row.output_tokens, tuple(row.hash_ids)
        else:  # an open loop's arrivals come in schedule order: the lengths drawn in it, as bench draws them
            if i != self.drawn:
                raise RuntimeError(f"open-loop request {i} arrived out of schedule order (next: {self.drawn})")
            self.drawn += 1
            i_tok, o_tok, hashes = self.lengths.next()
        req = SimRequest(rid=i + 1, arrival=t, prompt=i_tok, max_out=o_tok, hashes=hashes,
                         tags={**self.base, "phase": "warmup" if t < self.measure_start else "measure"})
        self.live[req.rid] = req
        return req

    # ------------------------------------------------------------------ the clock
    def drain_limit(self) -> float:
        """Simulated time after which nothing more is waited for: the window's (or the schedule's) end plus the
        drain timeout; unbounded for a closed loop counted in requests."""
        finite_end = self.measure_end if math.isfinite(self.measure_end) else 0.0
        cap = finite_end + self.plan.drain_timeout_s if math.isfinite(self.measure_end) else math.inf
        if self.mode != "concurrency" and self.arrivals:
            cap = max(self.arrivals[-1], finite_end) + self.plan.drain_timeout_s
        return cap

    def run(self) -> tuple[float, list[SimRequest]]:
        """Run the events to the drain limit; returns the level's simulated end and the requests cancelled there
        (whatever is still in flight is recorded, never dropped, and nothing new is sent)."""
        sim = self.sim
        cap = self.cap = self.drain_limit()
        sim.run_until(cap, on_time=self.sampler.until, max_events=MAX_EVENTS)
        if sim.events > MAX_EVENTS:
            raise InputError(f"simulation of level {self.level:g} exceeded {MAX_EVENTS:,} events: shorten "
                             "load.duration")
        t_end = cap if sim.pending and math.isfinite(cap) else sim.now  # stopped by the drain limit, or ran dry
        self.draining = True
        sim.unfed()  # scheduled past the drain limit: built now (into ``live``), to be cancelled with the rest
        leftovers = sorted(self.live.values(), key=lambda r: r.rid)
        for req in leftovers:
            req.error = "cancelled"
            sim.finish(req, t_end)
        self.sampler.until(t_end)
        self.sampler.finish()
        return t_end, leftovers

    # ------------------------------------------------------------------ the levels.jsonl line
    def window_end(self, t_end: float) -> float:
        """End of the measured window: when the closed loop stopped sending (at most the window's end), the
        window's end for a timed open loop, else the last measured arrival. Called before the level's end with
        ``t_end`` the clock now, it is a lower bound on that end (the loop stops, and the level ends, no earlier
        than now)."""
        if self.mode == "concurrency":
            end = self.stop_at if self.stop_at is not None else t_end
            if math.isfinite(self.measure_end):
                end = min(end, self.measure_end)
        elif self.mode == "rate" and self.plan.duration_s is not None:
            end = self.measure_end
        else:
            end = self.last_measured if self.last_measured is not None else t_end
        return max(end, self.measure_start)

    def info(self, t_end: float, wall: float, cancelled: int) -> dict[str, Any]:
        offset, level = self.offset, self.base["level"]
        end = self.window_end(t_end)
        window = max(end - self.measure_start, 1e-9)
        reps = self.sim.replicas
        info: dict[str, Any] = {
            "mode": self.mode, "level": level, "repeat": self.repeat, "target": level,
            "t_start_s": round(offset, 6), "t_end_s": round(offset + t_end, 6),
            "measure_start_s": round(offset + self.measure_start, 6), "measure_end_s": round(offset + end, 6),
            "sent_measured": self.measured, "late_sends": 0,
            "achieved_rate": round((self.measured if self.sessions is None else self.sessions_measured) / window, 4)
            if self.mode == "rate" else None,
            "client": {"warnings": []}, "interrupted": False,
            "sim": {"events": self.sim.events, "wall_s": round(wall, 4), "simulated_s": round(t_end, 4),
                    "realtime_factor": round(t_end / wall, 1) if wall > 0 else None, "native": NATIVE,
                    "preemptions": sum(r.preemptions for r in reps),
                    "running_peak": max(r.running_peak for r in reps),
                    "waiting_peak": max(r.waiting_peak for r in reps),
                    "finished": self.ok, "errors": self.errors, "cancelled": cancelled}}
        if self.mode == "trace":
            info["trace_requests"] = len(self.arrivals)
        return info


def simulate_level(cm: ClusterModel, plan: LoadPlan, level: float, repeat: int, offset: float,
                   writer: RunWriter, record_itl: bool = True, full_telemetry: bool = False,
                   columns: RecordColumns | None = None,
                   telemetry_copy: TelemetryWriter | None = None,
                   carried: CarriedCaches | None = None) -> tuple[dict[str, Any], float]:
    """One level (one repeat) on a fresh cluster; returns its levels.jsonl line and its simulated length.
    ``columns``: the records' column copy, taken as they are written; ``telemetry_copy``: the telemetry rows';
    ``carried``: the prefix caches the level starts with and, at its end, leaves for the next."""
    run = _LevelRun(cm, plan, level, repeat, offset, writer, record_itl, full_telemetry, columns, telemetry_copy)
    if carried is not None and carried.left is not None:
        restore(run.sim, carried.left)
    run.start_load()
    wall0 = time.perf_counter()
    t_end, cancelled = run.run()
    wall = time.perf_counter() - wall0
    info = run.info(t_end, wall, len(cancelled))
    writer.level(info)
    if carried is not None:
        carried.left = cached_prefixes(run.sim)
    return info, t_end


def run_sim(cfg: SimConfig, progress: Callable[[dict[str, Any]], None] | None = None) -> Summary:
    """Every level × repeat of the plan; returns the summary (also written to ``summary.json``)."""
    cm = cluster_model(cfg.scenario)
    writer = RunWriter(cfg.out, overwrite=cfg.overwrite, flush_s=FLUSH_S)
    started = time.time()
    writer.manifest(_manifest(cfg, cm, started))
    offset = 0.0
    infos: list[dict[str, Any]] = []
    interrupted = False
    columns = RecordColumns(ColumnWriter(cfg.out / REQUESTS))
    telemetry_copy = TelemetryWriter(cfg.out / TELEMETRY)
    wall0 = time.perf_counter()
    carried = None if cfg.scenario.workload.unique_prefix else CarriedCaches()
    try:
        for repeat in range(cfg.plan.first_repeat, cfg.plan.first_repeat + cfg.plan.repeats):
            for level in cfg.plan.levels:
                info, length = simulate_level(cm, cfg.plan, level, repeat, offset, writer, cfg.record_itl,
                                              cfg.full_telemetry, columns, telemetry_copy, carried)
                infos.append(info)
                if progress is not None:
                    progress(info)
                offset += length + LEVEL_GAP_S
    except KeyboardInterrupt:
        interrupted = True
    finally:
        writer.close()
        columns.close_file(writer.records)
        telemetry_copy.close(writer.telemetry_rows)
    wall = time.perf_counter() - wall0
    summary = build_summary(RunDir(cfg.out), slo=cfg.slo)
    simulated = sum(i["sim"]["simulated_s"] for i in infos)
    engine = sum(i["sim"]["wall_s"] for i in infos)
    summary.interrupted = interrupted
    summary.sim = SimTotals(levels=len(infos), requests=sum(i["sim"]["finished"] + i["sim"]["errors"] for i in infos),
                            events=sum(i["sim"]["events"] for i in infos), simulated_s=round(simulated, 3),
                            engine_wall_s=round(engine, 3), wall_s=round(wall, 3),
                            realtime_factor=round(simulated / engine, 1) if engine > 0 else None,
                            plan_resident=cm.plan.resident_requests)
    write_json_atomic(cfg.out / SUMMARY, summary.to_json())
    return summary
