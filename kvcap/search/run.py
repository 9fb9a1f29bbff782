"""``kvcap search``: every grid point is one ``kvcap sim`` of the scenario with the point's keys set, run in
local processes (``--jobs``) or as Ray tasks (``--ray ADDRESS``), the same function either way.

The search directory::

    DIR/points.jsonl    one row per finished point, appended as each finishes; rewritten in grid order at the end
                        (also after Ctrl-C), so two searches of one grid compare equal byte for byte
    DIR/search.json     grid, target, prices, recommended, pareto, per-knob effects, what finished
    DIR/timings.jsonl   per point: wall time and host (kept out of points.jsonl: it differs run to run)
    DIR/points/NAME/    each point's run directory (only its summary.json with --summary-only)
    DIR/search.html     the search page
    DIR/search.key      what the search is (scenario, grid, overrides, load, prices, targets): ``--resume`` runs
                        only the points a search with the same key has not finished

A point runs in a ``.partial`` folder renamed when it finishes, so an interrupted search leaves only whole points
(and only those it recorded).
On Ray, a task writes into its node's temp folder and ships the files back: nodes need not share a disk.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcap.analysis.summary import best_goodput_level
from kvcap.errors import EndpointError, InputError
from kvcap.rundir import COLUMN_COPIES, SUMMARY, _dumps, read_jsonl, write_json_atomic
from kvcap.rundir.summary import Summary
from kvcap.search import pareto
from kvcap.search.grid import Prices, Target, baseline, expand, point_name
from kvcap.sim.cluster import cluster_model
from kvcap.sim.run import config_for, run_sim

POINTS = "points.jsonl"
SEARCH = "search.json"
TIMINGS = "timings.jsonl"
POINT_DIRS = "points"
PARTIAL = ".partial"
KEY = "search.key"
OUTPUTS = (POINTS, SEARCH, TIMINGS, "search.html", KEY)


@dataclass(frozen=True)
class PointTask:
    """Everything one point needs, picklable (a worker process or a Ray node has nothing else)."""

    index: int
    point: dict[str, Any]
    data: dict[str, Any]
    overrides: dict[str, Any]
    where: str
    dest: str
    """The point's run directory as the driver sees it (written directly unless ``ship``)."""
    summary_only: bool = False
    ship: bool = False
    trace: tuple[Any, ...] = ()
    trace_file: str | None = None
    trace_speed: float = 1.0
    slo: str | None = None
    record_itl: bool = True

    def config(self, out: Path) -> Any:
        return config_for(self.data, {**self.overrides, **self.point}, out, where=self.where, trace=self.trace,
                          trace_file=self.trace_file, trace_speed=self.trace_speed, slo=self.slo,
                          record_itl=self.record_itl)


@dataclass
class SearchSpec:
    scenario: str
    data: dict[str, Any]
    grid: dict[str, list[Any]]
    out: Path
    overrides: dict[str, Any] = field(default_factory=dict)
    targets: list[Target] = field(default_factory=list)
    prices: Prices = field(default_factory=Prices)
    jobs: int = 1
    ray: str | None = None
    summary_only: bool = False
    overwrite: bool = False
    trace: tuple[Any, ...] = ()
    trace_file: str | None = None
    trace_speed: float = 1.0
    slo: str | None = None
    record_itl: bool = True
    resume: bool = False

    def key(self) -> str:
        """What makes two searches the same search (not how they run: jobs, Ray, the output folder)."""
        what = {"data": self.data, "grid": self.grid, "set": self.overrides, "targets": [t.text for t in self.targets],
                "prices": self.prices.as_json(), "summary_only": self.summary_only, "trace": repr(self.trace),
                "trace_speed": self.trace_speed, "slo": self.slo, "record_itl": self.record_itl}
        return hashlib.sha256(_dumps(what).encode()).hexdigest()


def run_point(task: PointTask) -> dict[str, Any]:
    """One grid point: the sim run and its summary (plus the run directory's files when shipped)."""
    t0 = time.perf_counter()
    if task.ship:
        with tempfile.TemporaryDirectory(prefix="kvcap-search-") as tmp:
            summary = _simulate(task, Path(tmp) / "run")
            # the column copies stay behind: written elsewhere, their JSONL's time is not theirs (never trusted)
            names = [SUMMARY] if task.summary_only else sorted(p.name for p in (Path(tmp) / "run").iterdir()
                                                               if p.name not in COLUMN_COPIES)
            files = {n: (Path(tmp) / "run" / n).read_bytes() for n in names}
    else:
        dest = Path(task.dest)
        work = dest.with_name(dest.name + PARTIAL)
        shutil.rmtree(work, ignore_errors=True)
        summary = _simulate(task, work)
        if task.summary_only:
            for p in work.iterdir():
                if p.name != SUMMARY:
                    p.unlink()
        shutil.rmtree(dest, ignore_errors=True)
        work.rename(dest)
        files = None
    return {"index": task.index, "summary": summary, "files": files, "host": socket.gethostname(),
            "node": _ray_node(), "pid": os.getpid(), "wall_s": round(time.perf_counter() - t0, 3)}


def _ray_node() -> str | None:
    """The Ray node id when this runs as a Ray task (else None): which node ran a point, for timings.jsonl."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    return str(ray.get_runtime_context().get_node_id())


def _simulate(task: PointTask, out: Path) -> Summary:
    summary = run_sim(task.config(out))
    if summary.interrupted:  # run_sim keeps a partial run on Ctrl-C; a search keeps only whole points
        raise KeyboardInterrupt
    return summary


def row_of(task: PointTask, summary: Summary | dict[str, Any], gpus: int, cost: float,
           run_dir: str) -> dict[str, Any]:
    """A finished point as its points.jsonl row: the analysis' capacities (summary.json's ``capacity``) and
    the best level's goodput (as ``compare`` reports it). Nothing timed: rows must compare equal across runs."""
    summ = summary if isinstance(summary, Summary) else Summary.model_validate(summary)
    cap = summ.capacity
    best = best_goodput_level(summ.levels)
    return {"index": task.index, "point": task.point, "effective": cap.effective,
            "resident": cap.resident, "stress_limit": cap.stress_limit,
            "goodput_tok_s": best.goodput_tok_s if best else 0.0, "goodput_level": best.level if best else None,
            "limited_by": cap.limited_by, "resident_source": cap.resident_source,
            "resident_lower_bound": cap.resident_lower_bound,
            "plan_resident": summ.sim.plan_resident if summ.sim is not None else None, "failed": bool(summ.failed),
            "gpus": gpus, "cost": cost, "meets_target": False, "run_dir": run_dir}


def prepare(spec: SearchSpec) -> tuple[list[PointTask], list[tuple[int, float]]]:
    """The tasks in grid order, each point checked here first (keys, values, the cluster it builds), so bad input
    fails in one line before anything runs; with each its GPU count and cost."""
    clash = sorted(set(spec.grid) & set(spec.overrides))
    if clash:
        raise InputError(f"{', '.join(clash)}: given both as --grid and as --set/flag; keep one")
    tasks, costs = [], []
    for i, point in enumerate(expand(spec.grid)):
        dest = spec.out / POINT_DIRS / point_name(i, point)
        task = PointTask(index=i, point=point, data=spec.data, overrides=spec.overrides, where=spec.scenario,
                         dest=str(dest), summary_only=spec.summary_only, ship=spec.ray is not None,
                         trace=spec.trace, trace_file=spec.trace_file, trace_speed=spec.trace_speed, slo=spec.slo,
                         record_itl=spec.record_itl)
        try:
            cfg = task.config(dest)
            cluster_model(cfg.scenario)
        except InputError as exc:
            raise InputError(f"point {_point_text(point)}: {exc}") from None
        gpus = cfg.scenario.cluster.gpus
        tasks.append(task)
        costs.append((gpus, spec.prices.cost(point, gpus)))
    return tasks, costs


def _point_text(point: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in point.items())


def _prepare_out(spec: SearchSpec, tasks: Sequence[PointTask]) -> list[dict[str, Any]]:
    """An empty search directory (its key written first), or with ``--resume`` the rows of the points the same
    search already finished (their run directories whole), which are then not run again."""
    out = spec.out
    if spec.resume and (out / POINTS).exists():
        held = (out / KEY).read_text().strip() if (out / KEY).exists() else None
        if held != spec.key():
            raise InputError(f"--resume: {str(out)!r} holds a different search (scenario, grid, --set, load, "
                             "--price or --target differ): resume with the same command, or choose another --out")
        by_index = {t.index: t for t in tasks}
        done = [r for r in read_jsonl(out / POINTS)
                if r.get("index") in by_index and Path(by_index[r["index"]].dest).is_dir()]
        for p in (out / POINT_DIRS).glob("*" + PARTIAL):
            shutil.rmtree(p, ignore_errors=True)
        return sorted({r["index"]: r for r in done}.values(), key=lambda r: r["index"])
    if (out / POINTS).exists() and not spec.overwrite:
        raise InputError(f"{str(out)!r} already holds a search: choose another --out (or --overwrite, --resume)")
    out.mkdir(parents=True, exist_ok=True)
    for name in OUTPUTS:
        (out / name).unlink(missing_ok=True)
    shutil.rmtree(out / POINT_DIRS, ignore_errors=True)
    (out / POINT_DIRS).mkdir()
    (out / KEY).write_text(spec.key() + "\n")
    return []


# ---------------------------------------------------------------- executors: each yields results as they finish

def _in_process(tasks: Sequence[PointTask]) -> Iterator[dict[str, Any]]:
    for t in tasks:
        yield run_point(t)


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's: it stops the pool and keeps what finished


def _processes(tasks: Sequence[PointTask], jobs: int) -> Iterator[dict[str, Any]]:
    import multiprocessing

    pool = multiprocessing.get_context().Pool(min(jobs, len(tasks)), initializer=_ignore_sigint)
    try:
        yield from pool.imap_unordered(run_point, tasks)
        pool.close()
    finally:
        pool.terminate()
        pool.join()


def _ray_tasks(tasks: Sequence[PointTask], address: str) -> Iterator[dict[str, Any]]:
    import ray

    started = not ray.is_initialized()
    if started:
        try:
            ray.init(address=address, logging_level="WARNING", log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise EndpointError(f"cannot join the Ray cluster at {address}: {str(exc).splitlines()[0]}") from None
    remote = ray.remote(num_cpus=1, scheduling_strategy="SPREAD", max_retries=0)(run_point)
    pending = [remote.remote(t) for t in tasks]
    try:
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                yield ray.get(done[0])
            except ray.exceptions.RayTaskError as exc:
                if isinstance(exc.cause, InputError):
                    raise InputError(str(exc.cause)) from None
                raise
    finally:
        for ref in pending:
            ray.cancel(ref, force=True)
        if started:
            ray.shutdown()


def _check_ray(address: str) -> None:
    """Before anything is written: Ray is installed, and a HOST:PORT head answers."""
    from kvcap.loadgen.ray_workers import reachable

    reachable(address)


def _results(spec: SearchSpec, tasks: Sequence[PointTask]) -> Iterator[dict[str, Any]]:
    if spec.ray is not None:
        return _ray_tasks(tasks, spec.ray)
    if spec.jobs > 1 and len(tasks) > 1:
        return _processes(tasks, spec.jobs)
    return _in_process(tasks)


# ---------------------------------------------------------------- the search

ProgressFn = Callable[[dict[str, Any], int, int], None]
"""Called with each finished point's row, the number finished and the total."""


def run_search(spec: SearchSpec, progress: ProgressFn | None = None) -> dict[str, Any]:
    """Every point of the grid; returns search.json's content (``interrupted`` after Ctrl-C, with what finished)."""
    tasks, costs = prepare(spec)
    if spec.ray is not None:
        _check_ray(spec.ray)
    rows = _prepare_out(spec, tasks)
    finished = {r["index"] for r in rows}
    if rows:  # the file is rewritten with only the kept rows; new ones are appended as they finish
        (spec.out / POINTS).write_text("".join(_dumps(r) + "\n" for r in rows))
    interrupted = False
    wall0 = time.perf_counter()
    results = _results(spec, [t for t in tasks if t.index not in finished])
    try:
        with open(spec.out / POINTS, "a", encoding="utf-8") as pf, open(spec.out / TIMINGS, "a") as tf:
            for res in results:
                task = tasks[res["index"]]
                dest = Path(task.dest)
                if res["files"] is not None:
                    dest.mkdir(parents=True, exist_ok=True)
                    for name, blob in res["files"].items():
                        (dest / name).write_bytes(blob)
                gpus, cost = costs[task.index]
                row = row_of(task, res["summary"], gpus, cost, str(dest.relative_to(spec.out)))
                rows.append(row)
                row["meets_target"] = pareto.meets(row, spec.targets, rows)
                pf.write(_dumps(row) + "\n")
                pf.flush()
                tf.write(_dumps({"index": task.index, "host": res["host"], "node": res["node"], "pid": res["pid"],
                                 "wall_s": res["wall_s"]}) + "\n")
                tf.flush()
                if progress is not None:
                    progress(row, len(rows), len(tasks))
    except KeyboardInterrupt:
        interrupted = True
    finally:
        close = getattr(results, "close", None)
        if close is not None:
            close()
        # only recorded points stay: a point in progress (its .partial) and one a worker finished while Ctrl-C
        # stopped the driver before it was recorded (whole, but in no row: resume runs it again) both go
        recorded = {r["run_dir"] for r in rows}
        for p in (spec.out / POINT_DIRS).iterdir() if (spec.out / POINT_DIRS).is_dir() else ():
            if str(p.relative_to(spec.out)) not in recorded:
                shutil.rmtree(p, ignore_errors=True)
    return finish(spec, rows, len(tasks), interrupted, time.perf_counter() - wall0)


def finish(spec: SearchSpec, rows: list[dict[str, Any]], total: int, interrupted: bool,
           wall_s: float) -> dict[str, Any]:
    """Final rows in grid order (targets resolved over all finished points), search.json, the page."""
    rows = sorted(rows, key=lambda r: r["index"])
    for r in rows:
        r["meets_target"] = pareto.meets(r, spec.targets, rows)
    tmp = spec.out / (POINTS + ".tmp")
    tmp.write_text("".join(_dumps(r) + "\n" for r in rows))
    os.replace(tmp, spec.out / POINTS)
    base = baseline(spec.grid)
    recommended = pareto.recommend(rows, base)
    best_effective = max((pareto.effective_of(r) for r in rows), default=0.0)
    search = {
        "scenario": spec.scenario, "grid": spec.grid, "baseline": base, "set": spec.overrides,
        "target": [t.text for t in spec.targets] or None,
        "target_rule": " and ".join(t.text for t in spec.targets) if spec.targets
        else f"effective>={best_effective:g} (no --target: the highest effective capacity found)",
        "prices": spec.prices.as_json(),
        "points": total, "finished": len(rows), "interrupted": interrupted,
        "executor": f"ray {spec.ray}" if spec.ray else f"{min(spec.jobs, max(total, 1))} local process(es)",
        "wall_s": round(wall_s, 3), "points_per_min": round(len(rows) / wall_s * 60, 2) if wall_s > 0 else None,
        "recommended": recommended, "pareto": pareto.pareto(rows),
        "ranked": [r["index"] for r in pareto.ranked(rows, recommended)],
        "effects": pareto.knob_effects(rows, spec.grid, base),
    }
    write_json_atomic(spec.out / SEARCH, search)
    from kvcap.report.search import write_search_html

    write_search_html(spec.out / "search.html", search, rows)
    return search


def load_search(path: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A search directory's search.json and rows (for ``kvcap report DIR``)."""
    import json

    d = Path(path)
    try:
        search = json.loads((d / SEARCH).read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"{str(d)!r} has no readable {SEARCH}: {exc}") from None
    return search, read_jsonl(d / POINTS)


def is_search_dir(path: str | Path) -> bool:
    return (Path(path) / SEARCH).is_file()
