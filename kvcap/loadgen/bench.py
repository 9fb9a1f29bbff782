"""``kvcap bench``: assemble one run — probe the server, write the manifest, drive the load (in this process or
in worker processes), sample server metrics, and summarise what finished (also after SIGINT)."""

from __future__ import annotations

import asyncio
import hashlib
import multiprocessing as mp
import queue
import socket
import sys
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvcap.analysis.summary import build_summary
from kvcap.loadgen.client import Target
from kvcap.loadgen.guard import ErrorRule, run_failure
from kvcap.loadgen.lengths import InputLengths, calibrate
from kvcap.loadgen.preflight import probe_server
from kvcap.loadgen.runner import LoadPlan, NoProgress, Progress, Runner, make_session
from kvcap.loadgen.share import make_factory, merge_level_infos, share_runner
from kvcap.rundir import SUMMARY, Manifest, RunDir, RunWriter, write_json_atomic
from kvcap.rundir.levels import StopReason
from kvcap.rundir.summary import ClientTotals, LostWorker, PrometheusPull, Summary
from kvcap.specs.lengths import LengthDist
from kvcap.telemetry.scrape import MetricsSampler
from kvcap.workload.prompts import PromptFactory, TokenCounter
from kvcap.workload.reuse import prompt_parts
from kvcap.workload.sessions import session_parts


@dataclass
class BenchConfig:
    """Everything one ``bench`` run needs; the fixed variables of the manifest come from here."""

    target: Target
    plan: LoadPlan
    out: Path
    input_dist: LengthDist
    output_dist: LengthDist
    tokenizer: str | None = None
    dataset: str | None = None
    prefix_tokens: int = 0
    prefix_groups: int = 0
    prompts_per_group: int | None = None
    unique_prefix: bool = True
    turns: int = 1
    """Turns per multi-turn session (kvcap.workload.sessions); 1: single requests."""
    think_time_s: float = 0.0
    metrics_urls: list[str] = field(default_factory=list)
    prometheus: str | None = None
    """Prometheus base URL: after the run, every known series in the run window is fetched (query_range)."""
    local_telemetry: bool = False
    """Sample this host too (/proc/net/dev, NVML if present): for a client on the server host."""
    prometheus_wait_s: float = 2.0
    """How long to let Prometheus scrape the end of the run before querying it."""
    slo: dict[str, float] = field(default_factory=dict)
    workers: int = 1
    overwrite: bool = False
    arm: str | None = None
    fixed: dict[str, Any] = field(default_factory=dict)
    record_text: bool = False
    under_test: list[str] = field(default_factory=list)
    append: bool = False
    """Add this run's repeats to an existing run directory (same manifest), as ``ab`` does between arms."""
    origin: float | None = None
    """perf_counter origin shared by every part of one experiment, so appended repeats share one time axis."""
    error_rule: ErrorRule = field(default_factory=ErrorRule)
    """When the run stops itself against a failing endpoint (kvcap.loadgen.guard)."""
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    lengths: InputLengths | None = None
    server_lengths: bool = True
    """Ask the server how it counts before the sweep (``--input-lengths server``); False: the local counter only."""
    """How prompts are sized to the server's count (kvcap.loadgen.lengths), set before the sweep; workers get it."""
    ray: str | None = None
    """A Ray cluster's address (``--ray``): the workers run there as actors (kvcap.loadgen.ray_workers)."""
    placement: str = "spread"
    """``--placement``: spread the Ray workers over nodes, or pack them together."""


def file_sha256(path: str | Path) -> str:
    """A file's content digest: compare judges a dataset by it, so the same file at two paths is the same workload
    and an edited file at the same path is not."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _manifest(cfg: BenchConfig, server: dict[str, Any], factory: PromptFactory, started: float,
              epoch_at_origin: float) -> Manifest:
    t = cfg.target
    fixed: dict[str, Any] = {
        "target.url": t.endpoint, "target.api": t.api, "model.name": t.model,
        "server.engine": server.get("engine"), "server.version": server.get("version"),
        "workload.input_tokens": cfg.input_dist.spec if cfg.dataset is None else None,
        "workload.input_tokens_measured": cfg.lengths.measured_mean if cfg.lengths else None,
        "workload.output_tokens": cfg.output_dist.spec,
        "workload.dataset": cfg.dataset,
        **({"workload.dataset_sha256": file_sha256(cfg.dataset)} if cfg.dataset else {}),
        "workload.prefix_tokens": cfg.prefix_tokens,
        "workload.prefix_groups": cfg.prefix_groups, "workload.unique_prefix": cfg.unique_prefix,
        **(prompt_parts(cfg.prefix_tokens, cfg.prompts_per_group) if cfg.prefix_groups and cfg.dataset is None
           and cfg.turns == 1 else {}),
        **(session_parts(cfg.turns, cfg.think_time_s, cfg.prefix_tokens) if cfg.turns > 1 else {}),
        "workload.prompt_set": factory.identity(),
        "workload.tokenizer": Path(cfg.tokenizer).name if cfg.tokenizer else None,
        "decoding.temperature": t.temperature, "decoding.force_length": t.force_length,
        "decoding.extra_body": t.extra_body or None,
        "timeouts.request": t.timeout_s, "timeouts.stall": t.stall_timeout_s,
        "client.host": socket.gethostname(), "client.workers": cfg.workers,
        **({"client.ray": cfg.ray, "client.placement": cfg.placement} if cfg.ray else {}),
        **cfg.plan.manifest(), **cfg.fixed,
    }
    if cfg.plan.mode == "trace":
        fixed["load.trace_rows"] = hashlib.sha256(repr(cfg.plan.trace).encode()).hexdigest()[:16]
    if cfg.lengths is not None:
        server = {**server, "input_lengths": cfg.lengths.report}
    return Manifest(source="bench", run_id=cfg.run_id, started_at=started, fixed=fixed, server=server, arm=cfg.arm,
                    slo=cfg.slo, under_test=cfg.under_test, header_names=sorted(t.headers),
                    clock={"epoch_at_origin": epoch_at_origin})


async def run_bench(cfg: BenchConfig, progress: Progress | None = None, stop: asyncio.Event | None = None,
                    extra_sampler_urls: list[str] | None = None) -> Summary:
    """Run the whole sweep; returns the summary (also written to ``summary.json``)."""
    counter = TokenCounter(cfg.tokenizer)
    RunWriter.check_destination(cfg.out, cfg.overwrite, cfg.append)
    server = await probe_server(cfg.target)  # before the run directory is emptied: a dead endpoint keeps the old run
    if cfg.target.model is None and server.get("models"):
        cfg.target = replace(cfg.target, model=server["models"][0])
    if cfg.server_lengths:
        cfg.lengths = await calibrate(cfg.target, server, lambda lengths: make_factory(cfg, counter, lengths), cfg.plan,
                                      local_tokenizer=cfg.tokenizer is not None)
    else:
        cfg.lengths = InputLengths(report={"method": "off", "counter": "tokenizer" if cfg.tokenizer else "words",
                                           "checked": False})
    factory = make_factory(cfg, counter)
    pool = await _ray_pool(cfg) if cfg.ray else None  # a bad address fails before the old run is emptied
    writer = RunWriter(cfg.out, overwrite=cfg.overwrite, append=cfg.append)
    started = time.time()
    origin = cfg.origin if cfg.origin is not None else time.perf_counter()
    epoch_at_origin = time.time() - (time.perf_counter() - origin)
    manifest = _manifest(cfg, server, factory, started, epoch_at_origin)
    fresh = not (cfg.append and (cfg.out / "manifest.json").exists())
    if pool is not None:
        manifest.clock["workers"] = pool.clock_report()
    if fresh:
        writer.manifest(manifest)
    stop = stop or asyncio.Event()
    client_stats: list[dict[str, Any]] = []
    interrupted = False
    stopped: dict[str, Any] | None = None
    session = make_session()
    sampler = MetricsSampler(cfg.metrics_urls + (extra_sampler_urls or []), writer.telemetry,
                             clock=lambda: time.perf_counter() - origin)
    local = None
    if cfg.local_telemetry:
        from kvcap.telemetry.local import LocalSampler

        local = LocalSampler(writer.telemetry, clock=lambda: time.perf_counter() - origin)
    try:
        if sampler.urls:
            await sampler.start(session)
        if local is not None:
            local.start()
        if pool is not None:
            client_stats, interrupted, stopped = await pool.run(writer, progress or NoProgress(), origin, stop)
        elif cfg.workers <= 1:
            runner = Runner(target=cfg.target, plan=cfg.plan, factory=factory, sink=writer, counter=counter,
                            progress=progress or NoProgress(), origin=origin, stop=stop,
                            keep_texts=cfg.record_text, rule=cfg.error_rule)
            await runner.run(session)
            client_stats = runner.client_stats
            interrupted = runner.interrupted or stop.is_set()
            stopped = runner.stopped
        else:
            client_stats, interrupted, stopped = await _run_workers(cfg, writer, progress or NoProgress(), origin,
                                                                    stop)
    finally:
        if pool is not None:
            await pool.finish()
            manifest.clock["workers"] = pool.clock_report()
            if fresh:
                writer.manifest(manifest)
        if sampler.urls:
            await sampler.stop(session)
        if local is not None:
            await local.stop()
        await session.close()
        prom = await _fetch_prometheus(cfg, writer, epoch_at_origin, started) if cfg.prometheus else {}
        writer.close()
    summary = build_summary(RunDir(cfg.out), slo=cfg.slo, write_copies=True)
    if prom:
        summary.prometheus = PrometheusPull.model_validate(prom)
    summary.interrupted = interrupted
    summary.stopped = None if stopped is None else StopReason.model_validate(stopped)
    summary.failed = run_failure(summary.to_json())
    summary.client = ClientTotals.model_validate(_client_summary(client_stats))
    summary.telemetry_samples = sampler.samples
    if pool is not None:
        summary.lost_workers = [LostWorker.model_validate(w) for w in pool.lost_workers()]
        summary.warnings = [*summary.warnings, *pool.warnings()]
    write_json_atomic(cfg.out / SUMMARY, summary.to_json())
    return summary


async def _ray_pool(cfg: BenchConfig) -> Any:
    """The run's workers as actors on the Ray cluster at ``cfg.ray``, placed and clock-synchronised."""
    from kvcap.loadgen.ray_workers import RayPool

    pool = RayPool(cfg, cfg.ray or "", cfg.placement)
    await pool.start()
    return pool


async def _fetch_prometheus(cfg: BenchConfig, writer: RunWriter, epoch_at_origin: float,
                            started: float) -> dict[str, Any]:
    """Pull the run window from Prometheus into telemetry.jsonl; a failure is reported, never fatal to the run."""
    from kvcap.errors import InputError
    from kvcap.telemetry.prometheus import fetch

    await asyncio.sleep(cfg.prometheus_wait_s)
    end = time.time()
    try:
        rows = await asyncio.get_running_loop().run_in_executor(
            None, lambda: fetch(cfg.prometheus or "", started - 1.0, end, epoch_at_origin))
    except InputError as exc:
        print(f"kvcap bench: warning: {exc}", file=sys.stderr)
        return {"url": cfg.prometheus, "error": str(exc), "rows": 0}
    writer.telemetry(rows)
    return {"url": cfg.prometheus, "rows": len(rows),
            "series": len({(r["name"], tuple(sorted(r["labels"].items()))) for r in rows})}


def _client_summary(stats: list[dict[str, Any]]) -> dict[str, Any]:
    if not stats:
        return {"warnings": []}
    warnings = sorted({w for s in stats for w in s.get("warnings", [])})
    return {"loop_lag_p99_ms_max": max(s["loop_lag_p99_ms"] for s in stats),
            "loop_lag_max_ms": max(s["loop_lag_max_ms"] for s in stats),
            "cpu_fraction_max": max(s["cpu_fraction"] for s in stats), "warnings": warnings}


# ---------------------------------------------------------------- worker processes

def _worker_main(cfg: BenchConfig, w: int, origin: float, records: mp.Queue, barrier: Any, stop_flag: Any,
                 halt_flag: Any) -> None:
    """A worker process: its share of every level, records sent to the parent, SIGINT left to the parent; a halt
    (another worker's error rule tripped) ends the level it is in and the sweep."""
    import signal
    import threading

    signal.signal(signal.SIGINT, signal.SIG_IGN)

    class QueueSink:
        def record(self, rec: dict[str, Any]) -> None:
            records.put(("record", rec))

        def level(self, info: dict[str, Any]) -> None:
            records.put(("level", info))

    async def main() -> None:
        counter = TokenCounter(cfg.tokenizer)
        factory = make_factory(cfg, counter)
        stop, halt = asyncio.Event(), asyncio.Event()

        async def watch() -> None:
            while not stop_flag.is_set() and not halt_flag.is_set():
                await asyncio.sleep(0.1)
            (stop if stop_flag.is_set() else halt).set()

        watcher = asyncio.create_task(watch())
        session = make_session()
        loop = asyncio.get_running_loop()
        try:
            for repeat in range(cfg.plan.first_repeat, cfg.plan.first_repeat + cfg.plan.repeats):
                for level in cfg.plan.levels:
                    try:
                        await loop.run_in_executor(None, barrier.wait)
                    except threading.BrokenBarrierError:  # the parent stopped the sweep
                        return
                    if stop.is_set() or halt.is_set():
                        return
                    runner = share_runner(cfg, w, level, origin, QueueSink(), counter, factory, stop, halt)
                    await runner.run_level(session, level, repeat)
                    if halt.is_set():
                        return
        finally:
            watcher.cancel()
            await session.close()
            records.put(("done", w))

    asyncio.run(main())


async def _run_workers(cfg: BenchConfig, writer: RunWriter, progress: Progress, origin: float,
                       stop: asyncio.Event) -> tuple[list[dict[str, Any]], bool, dict[str, Any] | None]:
    """Spread each level over ``cfg.workers`` processes on this host (perf_counter is system-wide monotonic).
    Each worker judges its own share by the error rule; the first to trip halts them all (the verdict is returned)."""
    ctx = mp.get_context("spawn")
    records: mp.Queue = ctx.Queue()
    barrier = ctx.Barrier(cfg.workers)
    stop_flag, halt_flag = ctx.Event(), ctx.Event()
    procs = [ctx.Process(target=_worker_main, args=(cfg, w, origin, records, barrier, stop_flag, halt_flag),
                         daemon=True)
             for w in range(cfg.workers)]
    for p in procs:
        p.start()
    pending_levels: dict[tuple[float, int], list[dict[str, Any]]] = {}
    client_stats: list[dict[str, Any]] = []
    stopped: dict[str, Any] | None = None
    done = 0
    level_started: set[tuple[float, int]] = set()
    loop = asyncio.get_running_loop()
    while done < cfg.workers:
        if stop.is_set():
            stop_flag.set()
            barrier.abort()
        try:
            kind, payload = await loop.run_in_executor(None, lambda: records.get(timeout=0.2))
        except queue.Empty:
            if not any(p.is_alive() for p in procs):
                break
            continue
        if kind == "record":
            key = (payload["level"], payload["repeat"])
            if key not in level_started:
                level_started.add(key)
                progress.level_start(cfg.plan.mode, payload["level"], payload["repeat"],
                                     (cfg.plan.warmup_s + cfg.plan.duration_s) if cfg.plan.duration_s else None)
            writer.record(payload)
            progress.on_record(payload)
        elif kind == "level":
            key = (payload["level"], payload["repeat"])
            pending_levels.setdefault(key, []).append(payload)
            client_stats.append(payload["client"])
            if payload.get("stopped") and stopped is None:
                stopped = payload["stopped"]
                halt_flag.set()
                barrier.abort()
            if len(pending_levels[key]) == cfg.workers:
                merged = merge_level_infos(pending_levels.pop(key))
                writer.level(merged)
                progress.level_end(merged)
        elif kind == "done":
            done += 1
    for infos in pending_levels.values():
        writer.level(merge_level_infos(infos))
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    return client_stats, stop.is_set(), stopped
