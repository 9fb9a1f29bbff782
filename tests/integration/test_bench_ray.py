"""`kvcap bench --ray`: the workers as Ray actors on a real 2-node Ray cluster on 127.0.0.1, against the batching
test server (10 ms per step: TPOT 10 ms, TTFT one or two steps), compared with a single-process run."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvcap.loadgen.ray_workers import best_offset, clock_warnings, ping_offset
from kvcap.rundir import RunDir
from tests.conftest import ROOT, run_cli
from tests.ray_cluster import needs_ray, ray_cluster
from tests.servers import start_fake_server

SERVER = {"slots": 64, "step_a": "10ms", "step_b": "0ms"}
LOAD = ("--input-tokens", "16", "--output-tokens", "12", "--warmup", "0.5s", "--input-lengths", "local")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with ray_cluster(tmp_path_factory.mktemp("ray"), nodes=2) as c:
        yield c


@pytest.fixture(scope="module")
def server():
    with start_fake_server(**SERVER) as srv:
        yield srv


def bench(url: str, out: Path, *args: str) -> dict:
    proc = run_cli("bench", "--url", url, "--out", str(out), "--quiet", "--json", *LOAD, *args, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_ping_offset_brackets_the_worker_read():
    # driver sent at 10.000, worker read 12.0015, reply at 10.003: worker is 2 s ahead, ± 1.5 ms
    offset, unc = ping_offset(10.000, 12.0015, 10.003)
    assert offset == pytest.approx(2.0) and unc == pytest.approx(0.0015)
    assert best_offset([(0.0, 5.0, 0.004), (1.0, 6.0011, 1.0002), (2.0, 7.0, 2.01)]) == pytest.approx((5.001, 1e-4))


def test_clock_warning_only_above_one_millisecond():
    row = {"worker": 1, "host": "h", "start": {"offset_s": 0.0, "uncertainty_s": 0.0004},
           "end": {"offset_s": 0.0, "uncertainty_s": 0.0004}}
    assert clock_warnings([row]) == []
    row["end"] = {"offset_s": 0.0, "uncertainty_s": 0.0021}
    (w,) = clock_warnings([row])
    assert "worker 1" in w and "2.10 ms" in w


def test_ray_missing_is_one_line_exit_2(tmp_path, server):
    fake = tmp_path / "noray" / "ray"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('no ray here')\n")
    proc = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(fake.parent)!r}); "
                           "from kvcap.cli import main; sys.exit(main())", "bench", "--url", server.url,
                           "--concurrency", "1", "--out", str(tmp_path / "run"), "--ray", "127.0.0.1:1"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "install kvcap[ray]" in proc.stderr
    assert not (tmp_path / "run").exists()


@needs_ray
def test_two_nodes_match_one_process(cluster, server, tmp_path):
    """2 actors on 2 nodes at 2×4 streams vs one process at 8: same latency, every request once, clocks true."""
    before = server.stats()["requests_started"]
    ray_summary = bench(server.url, tmp_path / "ray", "--ray", cluster.address, "--workers", "2",
                        "--placement", "spread", "--concurrency", "8", "--duration", "2s")
    sent = server.stats()["requests_started"] - before
    one = bench(server.url, tmp_path / "one", "--concurrency", "8", "--duration", "2s")

    run = RunDir(tmp_path / "ray")
    recs = run.records()
    assert len(recs) == sent > 50 and all(r["ok"] for r in recs)
    assert len({(r["level"], r["repeat"], r["index"]) for r in recs}) == len(recs)
    # spread: one worker per node, each record says where it ran
    placed = {(r["worker"], r["node_id"]) for r in recs}
    assert {w for w, _ in placed} == {0, 1} and {n for _, n in placed} == set(cluster.node_ids())
    assert len(placed) == 2 and all(r["host"] for r in recs)
    assert ray_summary["levels"][0]["tpot_ms"]["p50"] == pytest.approx(one["levels"][0]["tpot_ms"]["p50"], abs=2.0)
    assert ray_summary["levels"][0]["tpot_ms"]["p50"] == pytest.approx(10.0, abs=1.0)
    # TTFT is one or two 10 ms steps (the phase of the arrival against the server's step), so its median may sit
    # anywhere between: both runs within the truth's bounds, plus a few ms of client and loopback time
    for summary in (ray_summary, one):
        assert 10.0 <= summary["levels"][0]["ttft_ms"]["p50"] <= 20.0 + 5.0
    # both nodes share this host's monotonic clock: the true offset is 0, so it must lie within the uncertainty
    clock = run.manifest.clock["workers"]
    assert [c["worker"] for c in clock] == [0, 1]
    for c in clock:
        for end in ("start", "end"):
            assert abs(c[end]["offset_s"]) <= c[end]["uncertainty_s"] + 1e-6, c
    (level,) = run.levels()
    per_worker = level.client.per_worker or []
    assert level.workers == 2 and {w["worker"] for w in per_worker} == {0, 1}
    assert all("loop_lag_p99_ms" in w and "cpu_fraction" in w for w in per_worker)
    assert level.t_start_s is not None and level.t_end_s is not None
    assert all(level.t_start_s - 0.05 <= r["start_s"] <= level.t_end_s for r in recs)
    assert ray_summary["lost_workers"] == []


@needs_ray
def test_a_workers_open_drain_answers_as_soon_as_it_has_a_record(cluster, server, tmp_path):
    """The collecting logic with a real actor: the driver's drain call stays open while the worker has nothing new,
    and answers the moment a record (or a request started) is there — not at the next poll — so what a worker
    finished reaches the driver a round trip later, and a lost worker's last records are kept."""
    import ray

    from kvcap.loadgen.bench import BenchConfig
    from kvcap.loadgen.client import Target
    from kvcap.loadgen.ray_workers import _actor_class
    from kvcap.specs.lengths import parse_length
    from kvcap.workload.loadplan import LoadPlan

    cfg = BenchConfig(target=Target(url=server.url + "/v1/completions"), plan=LoadPlan("concurrency", (1,)),
                      out=tmp_path / "unused", input_dist=parse_length("16"), output_dist=parse_length("4"))
    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False, configure_logging=False)
    try:
        actor = _actor_class(ray).remote(cfg, 0)
        assert ray.get(actor.identity.remote(), timeout=120)["worker"] == 0
        assert ray.get(actor.drain.remote(0.0), timeout=30) == ([], [], [])  # nothing yet, answered at once
        waiting = actor.drain.remote(60.0)
        ready, _ = ray.wait([waiting], timeout=1.0)
        assert ready == []  # no news: the call stays open
        rec = {"level": 1.0, "repeat": 0, "index": 7, "ok": True}
        t0 = time.monotonic()
        actor.record.remote(dict(rec))
        records, levels, started = ray.get(waiting, timeout=30)
        assert time.monotonic() - t0 < 30  # woken by the record, long before its 60 s
        assert records == [{**rec, "host": records[0]["host"], "node_id": records[0]["node_id"]}]
        assert levels == [] and started == []
        assert ray.get(actor.drain.remote(0.0), timeout=30) == ([], [], [])  # handed over once
        ray.kill(actor)
    finally:
        ray.shutdown()


@needs_ray
def test_lost_node_is_recorded_not_a_crash(cluster, server, tmp_path):
    """Last in the module: it kills the second node. The run finishes; its in-flight requests are cancelled."""
    out = tmp_path / "lost"
    sent_before = server.stats()["requests_started"]
    proc = subprocess.Popen([sys.executable, "-m", "kvcap", "bench", "--url", server.url, "--out", str(out),
                             "--quiet", "--json", *LOAD, "--ray", cluster.address, "--workers", "2",
                             "--concurrency", "8", "--duration", "4s"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        requests = out / "requests.jsonl"
        deadline = time.monotonic() + 60
        while not (requests.exists() and requests.read_text().count('"worker":1,') >= 8):
            assert time.monotonic() < deadline and proc.poll() is None, "no records from worker 1"
            time.sleep(0.1)
        victim_node = cluster.node_ids()[1]
        cluster.kill_node(1)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    summary = json.loads(stdout)
    recs = RunDir(out).records()
    # every request the server got is recorded, finished or cancelled: the lost worker streamed its records and
    # its starts as they happened (only one started within a round trip of the kill may be missing)
    sent = server.stats()["requests_started"] - sent_before
    assert sent - 1 <= len(recs) <= sent, (len(recs), sent)
    lost_w = next(r["worker"] for r in recs if r["node_id"] == victim_node)
    (lost,) = summary["lost_workers"]
    assert lost["worker"] == lost_w and lost["node_id"] == victim_node and lost["reason"]
    assert any(f"worker {lost_w}" in w and "lost" in w for w in summary["warnings"])
    assert f"worker {lost_w}" in stderr
    cancelled = [r for r in recs if r["error"] == "cancelled"]
    # the lost worker had 4 of the 8 streams in flight; the survivor's requests all finished
    assert len(cancelled) == 4 and {r["worker"] for r in cancelled} == {lost_w}
    assert all(f"worker {lost_w} lost" in r["error_detail"] for r in cancelled)
    kept = [r for r in recs if r["worker"] == lost_w and r["ok"]]
    assert len(kept) >= 8  # what it streamed before the loss is kept
    assert all(r["ok"] for r in recs if r["worker"] != lost_w)


@needs_ray
def test_unreachable_cluster_is_one_line_exit_1_and_keeps_the_old_run(server, tmp_path):
    """Exit 1 as for a dead --url (an endpoint that cannot serve the run), as search --ray does."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "requests.jsonl").write_text("old\n")
    proc = run_cli("bench", "--url", server.url, "--concurrency", "1", "--out", str(out), "--overwrite",
                   "--ray", "127.0.0.1:1", timeout=60)
    assert proc.returncode == 1 and "cannot reach the Ray cluster" in proc.stderr, proc.stderr
    assert proc.stderr.strip().count("\n") == 0
    assert (out / "requests.jsonl").read_text() == "old\n"
