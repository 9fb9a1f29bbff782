"""``kvcap sim`` records at scale (issue 14): streamed to requests.jsonl as each request finishes, ITLs handed to
the writer as the numpy vector the engine already has (no per-token Python list), flushed at most every
``FLUSH_S`` and at each level's end — and the parsed records exactly what the old path (a list of floats
through ``json.dumps``) wrote.
"""

from __future__ import annotations

import gc
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvcap.rundir import REQUESTS, RunDir, RunWriter
from kvcap.sim import run as sim_run
from kvcap.sim.cluster import cluster_model
from kvcap.sim.records import record_of
from kvcap.sim.request import SimRequest
from kvcap.sim.run import simulate_level
from kvcap.specs.scenario import load_scenario
from kvcap.workload.loadplan import LoadPlan, rate_schedule
from tests.conftest import ROOT

REQUESTS_PER_LEVEL = 600


def test_a_numpy_itl_vector_is_written_as_its_list(tmp_path: Path) -> None:
    """The writer takes ITLs as a numpy vector and writes the same JSON list the floats would give."""
    itl = np.round(np.diff(np.cumsum(np.random.default_rng(3).random(257) * 0.04)) * 1e3, 3)
    rec: dict[str, Any] = {"index": 1, "ok": True, "itl_ms": itl, "ttft_ms": 12.5, "error": None}
    w = RunWriter(tmp_path)
    w.record(rec)  # type: ignore[arg-type]
    w.record(rec | {"itl_ms": itl[::2]})  # type: ignore[arg-type]  # not contiguous: still a list
    w.close()
    got = RunDir(tmp_path).records()
    assert got[0] == json.loads(json.dumps(rec | {"itl_ms": itl.tolist()}))
    assert got[0]["itl_ms"] == itl.tolist() and len(got[0]["itl_ms"]) == 256
    assert got[1]["itl_ms"] == itl[::2].tolist()


def _live_requests() -> int:
    """SimRequests still reachable (garbage in unreachable cycles collected first)."""
    gc.collect()
    return sum(type(o) is SimRequest for o in gc.get_objects())


class _Tap(RunWriter):
    """The run's writer, also keeping each record as the old path dumped it (its ITLs a list of floats through
    ``json.dumps``) and, every 150 records, the live SimRequest count."""

    def __init__(self, out: Path, before: int):
        super().__init__(out, flush_s=sim_run.FLUSH_S)
        self.old: list[str] = []
        self.live: list[int] = []
        self.before = before

    def record(self, rec: Any) -> None:
        itl = rec["itl_ms"]
        listed = rec | {"itl_ms": itl.tolist() if isinstance(itl, np.ndarray) else itl}
        self.old.append(json.dumps(listed, separators=(",", ":"), allow_nan=False))
        if len(self.old) % 150 == 0:
            self.live.append(_live_requests() - self.before)
        super().record(rec)


@pytest.fixture(scope="module")
def streamed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two levels of the issue's case (seed-reference, remote tier; c = 32 and c = 96, which parks) written by
    the run's writer, beside each record as the old path dumped it, and the live SimRequest count."""
    out = tmp_path_factory.mktemp("stream")
    sc = load_scenario(ROOT / "scenarios" / "seed-reference.yaml", {"serving.kv_offload": "remote"})
    cm = cluster_model(sc)
    plan = LoadPlan(mode="concurrency", levels=(32.0, 96.0), warmup_s=0.0, duration_s=None,
                    requests=REQUESTS_PER_LEVEL, repeats=1)
    writer = _Tap(out, _live_requests())  # what earlier tests in this process left behind is not counted
    on_disk: list[int] = []
    try:
        offset = 0.0
        for level in plan.levels:
            _, length = simulate_level(cm, plan, level, 0, offset, writer)
            on_disk.append(len((out / REQUESTS).read_bytes().splitlines()))  # flushed at the level's end
            offset += length + sim_run.LEVEL_GAP_S
    finally:
        writer.close()
    return {"records": RunDir(out).records(), "old": [json.loads(line) for line in writer.old],
            "live": writer.live, "on_disk": on_disk, "levels": RunDir(out).levels()}


def test_the_record_is_the_same_with_itls_as_a_vector_or_a_list() -> None:
    """``record_of``'s two ITL forms give the same record once written (the vector is the streamed path's), on
    requests that parked in the remote tier and came back, and on those that did not."""
    sc = load_scenario(ROOT / "scenarios" / "seed-reference.yaml", {"serving.kv_offload": "remote"})
    sim = cluster_model(sc).build()
    done: list[SimRequest] = []
    sim.on_finish = lambda req, now: done.append(req)
    for i in range(160):  # 160 at once on 4 × 12 resident: most park after their prefill
        sim.submit(SimRequest(rid=i + 1, arrival=0.0, prompt=1024, max_out=64 + i % 64, tags={
            "mode": "concurrency", "level": 160, "repeat": 0, "phase": "measure"}), 0.0)
    sim.run_until(1e9)
    assert len(done) == 160 and sum(r.parked_s > 0 for r in done) > 40
    for req in done:
        vec, lst = record_of(req, 5.0, itl_array=True), record_of(req, 5.0)
        assert isinstance(vec["itl_ms"], np.ndarray) and isinstance(lst["itl_ms"], list)
        assert len(lst["itl_ms"]) == req.max_out - 1
        assert vec | {"itl_ms": vec["itl_ms"].tolist()} == lst


def test_streamed_records_equal_the_old_path(streamed: dict[str, Any]) -> None:
    assert len(streamed["records"]) == len(streamed["old"]) >= 2 * REQUESTS_PER_LEVEL
    assert streamed["records"] == streamed["old"]  # same keys, same values, same order


def test_records_hold_what_was_asked(streamed: dict[str, Any]) -> None:
    """Independent truths: every request asked is recorded once, and each record's ITLs are its own decode."""
    recs = streamed["records"]
    for level in (32, 96):
        mine = [r for r in recs if r["level"] == level]
        assert sum(r["phase"] == "measure" for r in mine) == REQUESTS_PER_LEVEL
        assert len({r["index"] for r in mine}) == len(mine)
    ok = [r for r in recs if r["ok"]]
    assert len(ok) >= 2 * REQUESTS_PER_LEVEL
    assert any(r["parked_ms"] > 0 for r in ok)  # c = 96 parks KV in the remote tier
    for r in ok:
        assert len(r["itl_ms"]) == r["output_tokens"] - 1
        # each gap is rounded to the µs: the sum of n gaps is within n × 0.5 µs of E2E − TTFT (also rounded)
        assert abs(sum(r["itl_ms"]) - (r["e2e_ms"] - r["ttft_ms"])) <= 0.0005 * len(r["itl_ms"]) + 0.001
        assert abs((r["end_s"] - r["start_s"]) * 1e3 - r["e2e_ms"]) <= 0.002
        assert min(r["itl_ms"]) >= 0


def test_each_level_is_on_disk_when_it_ends(streamed: dict[str, Any]) -> None:
    """Buffered writes (``FLUSH_S``) still leave every finished record on disk at the level's end."""
    finished = [lv.sim.finished + lv.sim.errors + lv.sim.cancelled for lv in streamed["levels"] if lv.sim is not None]
    assert streamed["on_disk"] == [finished[0], finished[0] + finished[1]]


def test_no_request_is_kept_once_recorded(streamed: dict[str, Any]) -> None:
    """Memory flat in run length: only the requests in flight are alive (≤ the level's users, plus the one
    being recorded), however many have finished."""
    assert len(streamed["live"]) >= 7
    assert max(streamed["live"]) <= 96 + 1


# ------------------------------------------------------------------ open loop: the schedule is fed, not submitted

def _eager(run: sim_run._LevelRun) -> None:
    """The old open loop's start: every scheduled request built and submitted before the clock starts (a function,
    not a subclass: the compiled ``_LevelRun`` is a native class)."""
    specs = [(t, *run.lengths.next()) for t in rate_schedule(run.plan, run.level, run.repeat)]
    run.arrivals = [t for t, *_ in specs]
    for t, i_tok, o_tok, hashes in specs:
        req = run.new_request(t, i_tok, o_tok, tuple(hashes))
        if req.tags["phase"] == "measure":
            run.last_measured = t
        run.sim.submit(req, t)


def _open_loop(start: Callable[[sim_run._LevelRun], None], out: Path, rate: float) -> dict[str, Any]:
    """One open-loop level (remote tier) written to ``out``, with the live SimRequest count every 100 records."""
    sc = load_scenario(ROOT / "scenarios" / "seed-reference.yaml", {"serving.kv_offload": "remote"})
    plan = LoadPlan(mode="rate", levels=(rate,), warmup_s=5.0, duration_s=120.0 if rate < 10 else 40.0, repeats=1)
    writer = RunWriter(out)
    run = sim_run._LevelRun(cluster_model(sc), plan, rate, 0, 0.0, writer, True)
    live: list[int] = []
    finish = run.on_finish
    before = _live_requests()

    def counted(req: SimRequest, now: float) -> None:
        finish(req, now)
        if writer.records % 100 == 0:
            live.append(_live_requests() - before)

    run.sim.on_finish = counted
    start(run)
    t_end, cancelled = run.run()
    writer.level(run.info(t_end, 1.0, len(cancelled)))
    writer.close()
    schedule = sys.getsizeof(run.arrivals) + sys.getsizeof(run.sim._feed_keys) + sys.getsizeof(run.sim._feed_order)
    return {"dir": RunDir(out), "live": live, "scheduled": len(run.arrivals), "cancelled": len(cancelled),
            "schedule_bytes": schedule}


@pytest.mark.parametrize("rate", [4.0, 30.0])  # within capacity; far past it (cancelled at the drain limit)
def test_a_fed_schedule_runs_as_the_submitted_one(tmp_path: Path, rate: float) -> None:
    fed = _open_loop(sim_run._LevelRun.start_load, tmp_path / "fed", rate)
    eager = _open_loop(_eager, tmp_path / "eager", rate)
    assert fed["dir"].records() == eager["dir"].records()
    assert fed["dir"].levels() == eager["dir"].levels()
    assert fed["dir"].telemetry() == eager["dir"].telemetry()
    assert len(fed["dir"].records()) == fed["scheduled"] > 100
    assert (fed["cancelled"] > 0) == (rate > 10)
    # memory: the fed run holds the requests in flight, the submitted one the whole schedule up front
    assert max(eager["live"]) >= fed["scheduled"] - 100
    if rate < 10:  # within capacity: a few in flight (the queue grows past it: the overloaded level holds it)
        assert max(fed["live"]) < fed["scheduled"] / 10
    # the schedule itself: each arrival's time and its key, ~8 bytes each (no float object, no order list: a list
    # of floats would take 32 bytes an entry)
    assert fed["schedule_bytes"] <= 20 * fed["scheduled"] + 1000
