"""`kvcap bench` over real loopback HTTP against the project's test server, whose timing is known."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvcap.rundir import RunDir, read_jsonl
from tests.conftest import ROOT, run_cli
from tests.servers import start_fake_server
from tests.starvation import ServerTimers, judge_unless_starved, starved
from tests.waiting import wait_until


def bench(url: str, out: Path, *args: str, timeout: float = 120) -> dict:
    proc = run_cli("bench", "--url", url, "--out", str(out), "--quiet", "--json", *args, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def level(summary: dict, value: float) -> dict:
    return next(lv for lv in summary["levels"] if lv["level"] == value)


@pytest.fixture(scope="module")
def fixed_server():
    with start_fake_server(ttft="50ms", itl="20ms") as srv:
        yield srv


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_ttft_tpot_itl_truth_at_1_8_32_streams(fixed_server, tmp_path, api):
    """Up to three sweeps: a systematic error fails all three; one sweep caught by a VM's timer hiccup does not."""
    for attempt in range(3):
        try:
            return _truth_sweep(fixed_server, tmp_path / f"run{attempt}", api)
        except AssertionError:
            if attempt == 2:
                raise


def _truth_sweep(fixed_server, out, api) -> None:
    s = bench(fixed_server.url, out, "--api", api, "--concurrency", "1,8,32", "--input-tokens", "64",
              "--output-tokens", "24", "--warmup", "0.5s", "--duration", "2s")
    for c in (1, 8, 32):
        lv = level(s, c)
        assert lv["ok"] >= c and lv["errors"] == 0
        # ≈ 1-2 ms of loopback + aiohttp-server latency sit on top of the 50 ms (a bare aiohttp client sees the
        # same), plus the server taking 32 simultaneous arrivals one by one; TPOT and ITL are differences of
        # arrival times, so those offsets cancel there
        # (issue 11 measured a bare stdlib client at 55-56 ms against this 50 ms server on this 2-core VM; kvcap's
        # own overhead against a bare client side by side is that test, not this one's)
        assert 50 <= lv["ttft_ms"]["p50"] <= 56 + c / 8, (c, lv["ttft_ms"])
        assert lv["tpot_ms"]["p50"] == pytest.approx(20, abs=1.0), lv["tpot_ms"]
        assert lv["itl_ms"]["p50"] == pytest.approx(20, abs=1.5), lv["itl_ms"]
        # E2E = TTFT + 23 gaps: the server's timer slack (~0.1-0.3 ms a wake-up on a 2-core VM) adds up over 23
        # steps, so E2E is held to its parts (which are held to the truth above) and to the truth within 23 × 0.5 ms
        assert lv["e2e_ms"]["p50"] == pytest.approx(lv["ttft_ms"]["p50"] + 23 * lv["tpot_ms"]["p50"], abs=3)
        assert lv["e2e_ms"]["p50"] == pytest.approx(50 + 23 * 20, abs=2.5 + c / 8 + 23 * 0.5)
        # steady state: each stream yields one token per 20 ms after a 50 ms start → 24 tokens per 510 ms
        assert lv["output_tok_s"] == pytest.approx(c * 24 / 0.510, rel=0.08)
    from kvcap.rundir import RECORD_FIELDS, REQUIRED_RECORD_FIELDS

    recs = [r for r in RunDir(out).records() if r["ok"]]
    assert all(REQUIRED_RECORD_FIELDS <= r.keys() <= RECORD_FIELDS for r in recs)  # the one record schema
    assert all(r["output_tokens"] == 24 and len(r["itl_ms"]) == 23 and r["tokens_source"] == "usage" for r in recs)


def test_multi_token_chunks_are_split_into_itls(tmp_path):
    with start_fake_server(ttft="40ms", itl="10ms", tokens_per_chunk=4) as srv:
        s = bench(srv.url, tmp_path / "run", "--concurrency", "2", "--input-tokens", "16", "--output-tokens", "33",
                  "--warmup", "0s", "--requests", "6")
    lv = level(s, 2)
    assert lv["ok"] == 6
    rec = next(r for r in RunDir(tmp_path / "run").records() if r["ok"])
    assert rec["output_tokens"] == 33 and len(rec["itl_ms"]) == 32
    # the first event holds 4 tokens at once; afterwards 4 tokens per 40 ms → 10 ms each
    assert rec["itl_ms"][:3] == [0.0, 0.0, 0.0]
    assert sum(rec["itl_ms"]) == pytest.approx(rec["e2e_ms"] - rec["ttft_ms"], abs=2)
    assert lv["tpot_ms"]["p50"] == pytest.approx((33 - 4) * 10 / 32, abs=1.0)


def test_open_loop_rate_is_achieved_and_queueing_shows_in_latency(tmp_path):
    # batching server: 2 slots, each step 10 ms; 20 output tokens → service ≈ 20 steps ≈ 0.2 s, capacity ≈ 10 req/s
    with start_fake_server(slots=2, step_a="10ms", step_b="0ms") as srv:
        s = bench(srv.url, tmp_path / "run", "--rate", "4,20", "--arrival", "constant", "--input-tokens", "8",
                  "--output-tokens", "20", "--warmup", "0s", "--duration", "3s", "--timeout", "30s")
    under, over = level(s, 4), level(s, 20)
    assert under["achieved_rate"] == pytest.approx(4, rel=0.05)
    assert over["achieved_rate"] == pytest.approx(20, rel=0.05)
    assert under["ttft_ms"]["p95"] < 60
    # past capacity the queue grows for the whole window: latency from the *scheduled* send shows it
    assert over["ttft_ms"]["p95"] > 1000
    assert over["send_delay_ms"]["p99"] < 20  # the client itself sent on time


def test_client_side_queue_is_not_hidden(tmp_path, fixed_server):
    # one stream allowed in flight, arrivals every 50 ms, each request takes ≈ 250 ms: the backlog is the
    # client's, and open-loop latency must count it (coordinated omission would report ≈ 50 ms TTFT)
    s = bench(fixed_server.url, tmp_path / "run", "--rate", "20", "--arrival", "constant", "--max-inflight", "1",
              "--input-tokens", "8", "--output-tokens", "11", "--warmup", "0s", "--requests", "12")
    lv = level(s, 20)
    assert lv["ok"] == 12
    assert lv["ttft_ms"]["p99"] > 1500
    assert lv["send_delay_ms"]["p99"] > 1500


FAULTS = ["http_500:every=10,offset=1", "http_429:every=10,offset=2", "reset:every=10,offset=3",
          "stall:every=10,offset=4", "malformed:every=10,offset=5", "error_in_200:every=10,offset=6"]


def test_every_fault_class_is_counted(tmp_path):
    with start_fake_server(ttft="5ms", itl="2ms", fault=FAULTS) as srv:
        s = bench(srv.url, tmp_path / "run", "--concurrency", "4", "--input-tokens", "8", "--output-tokens", "10",
                  "--warmup", "0s", "--requests", "40", "--timeout", "10s", "--stall-timeout", "1s")
        stats = srv.stats()
    lv = level(s, 4)
    assert lv["requests"] == 40
    assert lv["error_classes"] == {"http_5xx": 4, "http_4xx": 4, "connection": 4, "timeout": 4,
                                   "malformed_stream": 4, "server_error_in_stream": 4}
    assert lv["ok"] == 16 and lv["error_rate"] == pytest.approx(24 / 40)
    assert stats["requests_started"] == 40
    # failures never disturb the others' figures
    assert lv["ttft_ms"]["p50"] == pytest.approx(5, abs=2.5) and lv["tpot_ms"]["p50"] == pytest.approx(2, abs=1)
    recs = RunDir(tmp_path / "run").records()
    assert all(r["error_detail"] for r in recs if not r["ok"])


def test_connections_are_pooled_and_keepalive_then_close_is_survived(tmp_path):
    with start_fake_server(ttft="5ms", itl="1ms") as srv:
        bench(srv.url, tmp_path / "a", "--concurrency", "4", "--input-tokens", "8", "--output-tokens", "5",
              "--warmup", "0s", "--requests", "40")
        pooled = srv.stats()
    assert pooled["connections_opened"] <= 4 + 4  # one per stream plus the start-up probe (3 GETs), not 40
    with start_fake_server(ttft="5ms", itl="1ms", close_after_response=True) as srv:
        s = bench(srv.url, tmp_path / "b", "--concurrency", "4", "--input-tokens", "8", "--output-tokens", "5",
                  "--warmup", "0s", "--requests", "40")
    assert level(s, 4)["errors"] == 0 and level(s, 4)["ok"] == 40


def test_early_stop_is_flagged_when_length_is_not_forced(tmp_path):
    with start_fake_server(ttft="5ms", itl="1ms", eos_after=6) as srv:
        bench(srv.url, tmp_path / "run", "--concurrency", "1", "--input-tokens", "8", "--output-tokens", "20",
              "--warmup", "0s", "--requests", "3", "--no-force-length")
    recs = RunDir(tmp_path / "run").records()
    assert all(r["output_tokens"] == 6 and r["early_stop"] and not r["truncated"] for r in recs)


def test_manifest_prompt_identity_and_metrics(tmp_path, fixed_server):
    args = ("--concurrency", "2", "--input-tokens", "uniform:10,40", "--output-tokens", "4", "--warmup", "0s",
            "--requests", "4", "--metrics-url", fixed_server.url + "/metrics")
    bench(fixed_server.url, tmp_path / "a", *args, "--seed", "1", "--slo", "ttft_p95=500ms")
    bench(fixed_server.url, tmp_path / "b", *args, "--seed", "1")
    bench(fixed_server.url, tmp_path / "c", *args, "--seed", "2")
    ma, mb, mc = (RunDir(tmp_path / x).manifest for x in "abc")
    assert ma is not None and mb is not None and mc is not None
    assert ma.fixed["workload.prompt_set"] == mb.fixed["workload.prompt_set"]
    assert ma.fixed["workload.prompt_set"] != mc.fixed["workload.prompt_set"]
    assert ma.run_id != mb.run_id and ma.source == "bench"
    for key in ("target.url", "model.name", "workload.input_tokens", "workload.output_tokens", "load.concurrency",
                "decoding.temperature", "timeouts.request", "client.host", "load.seed"):
        assert key in ma.fixed, key
    assert ma.fixed["model.name"] == "fake-model" and ma.slo == {"ttft_p95": 500.0}
    tel = RunDir(tmp_path / "a").telemetry()
    assert {"server.requests_running", "server.requests_waiting"} <= {t["name"] for t in tel}
    assert all(t["labels"]["raw"].startswith("vllm:") for t in tel)


def test_api_key_is_sent_but_never_written(tmp_path, fixed_server):
    env_key = "sk-secret-123"
    proc = subprocess.run([sys.executable, "-m", "kvcap", "bench", "--url", fixed_server.url, "--out",
                           str(tmp_path / "run"), "--quiet", "--concurrency", "1", "--input-tokens", "4",
                           "--output-tokens", "2", "--warmup", "0s", "--requests", "2"],
                          capture_output=True, text=True, cwd=ROOT, env={**os.environ, "KVCAP_API_KEY": env_key},
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    for f in (tmp_path / "run").iterdir():  # the binary column copies too
        assert env_key.encode() not in f.read_bytes()
    assert "Authorization" in RunDir(tmp_path / "run").manifest.header_names


def _start_bench(url: str, out: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvcap", "bench", "--url", url, "--out", str(out), "--quiet",
                             *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_sigint_stops_fast_and_writes_summary(tmp_path):
    with start_fake_server(ttft="10ms", itl="50ms") as srv:
        proc = _start_bench(srv.url, tmp_path / "run", "--concurrency", "8", "--input-tokens", "8",
                            "--output-tokens", "20", "--warmup", "0s", "--duration", "60s")
        # a steady run with enough finished for the counts below (about 3 s on a quiet machine)
        assert wait_until(lambda: proc.poll() is not None or srv.stats()["requests_finished"] >= 24, 60)
        assert proc.poll() is None, proc.communicate()[1]
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=15)
        stopped_in = time.monotonic() - t0
        finished = srv.stats()["requests_finished"]
    assert stopped_in < 5 and proc.returncode == 130
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["interrupted"] is True
    recs = RunDir(tmp_path / "run").records()
    ok = [r for r in recs if r["ok"]]
    cancelled = [r for r in recs if r["error"] == "cancelled"]
    assert len(ok) >= finished - 8 and len(ok) >= 10  # every finished request is on disk
    assert 1 <= len(cancelled) <= 8                   # the in-flight ones, recorded as cancelled
    assert level(summary, 8)["ok"] == len(ok)


def test_sigkill_keeps_every_finished_record(tmp_path):
    with start_fake_server(ttft="10ms", itl="20ms") as srv:
        proc = _start_bench(srv.url, tmp_path / "run", "--concurrency", "16", "--input-tokens", "8",
                            "--output-tokens", "10", "--warmup", "0s", "--duration", "60s")
        # enough finished that more than 50 are on disk whatever the 16 in flight do
        assert wait_until(lambda: proc.poll() is not None or srv.stats()["requests_finished"] >= 100, 60)
        assert proc.poll() is None, proc.communicate()[1]
        before = srv.stats()["requests_finished"]
        proc.kill()
        proc.wait(timeout=10)
    lines = (tmp_path / "run" / "requests.jsonl").read_text().splitlines()
    recs = read_jsonl(tmp_path / "run" / "requests.jsonl")
    assert len(recs) >= before - 16 and len(recs) >= len(lines) - 1 and len(recs) > 50
    assert all(r["ok"] for r in recs)


def test_workers_split_the_load(tmp_path, fixed_server):
    """The bench and its two workers beside the server: a run the host starved (one core busy is enough) is taken
    again, and if every one was, the test says so rather than judge a truth that was never delivered."""
    def measure(attempt: int) -> tuple[dict, str | None]:
        timers, out = ServerTimers(fixed_server), tmp_path / f"run{attempt}"
        s = bench(fixed_server.url, out, "--workers", "2", "--concurrency", "4,8", "--input-tokens", "16",
                  "--output-tokens", "12", "--warmup", "0.5s", "--duration", "2s")
        assert all(level(s, c)["errors"] == 0 for c in (4, 8))  # not timing: judged on every attempt
        assert {r["worker"] for r in RunDir(out).records()} == {0, 1}
        return s, starved(s, timers.late())

    def check(s: dict) -> None:
        for c in (4, 8):
            lv = level(s, c)
            assert 50 <= lv["ttft_ms"]["p50"] <= 54, (c, lv["ttft_ms"])
            assert lv["output_tok_s"] == pytest.approx(c * 12 / 0.27, rel=0.1), c

    judge_unless_starved(measure, check)


def test_trace_replay_mooncake_with_shared_prefixes(tmp_path, fixed_server):
    trace = tmp_path / "t.jsonl"
    rows = [{"timestamp": i * 100, "input_length": 40 + i, "output_length": 3, "hash_ids": [0, i]} for i in range(8)]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = bench(fixed_server.url, tmp_path / "run", "--trace", str(trace), "--warmup", "0s", "--record-text")
    lv = s["levels"][0]
    assert lv["mode"] == "trace" and lv["ok"] == 8
    recs = RunDir(tmp_path / "run").records()
    assert sorted(r["input_tokens"] for r in recs) == [40 + i for i in range(8)]
    starts = sorted(r["start_s"] for r in recs)
    assert [b - a for a, b in itertools.pairwise(starts)] == pytest.approx([0.1] * 7, abs=0.01)


@pytest.mark.parametrize(("args", "fragment"), [
    (["--url", "localhost:8000", "--concurrency", "1"], "must start with http"),
    (["--url", "http://127.0.0.1:9", "--concurrency", "1,x"], "not a whole number"),
    (["--url", "http://127.0.0.1:9", "--rate", "0"], "positive"),
    (["--url", "http://127.0.0.1:9", "--rate", "1", "--arrival", "weibull"], "unknown arrival"),
    (["--url", "http://127.0.0.1:9", "--concurrency", "1", "--slo", "ttft_p96=1s"], "unknown SLO key"),
    (["--url", "http://127.0.0.1:9", "--concurrency", "1", "--slo", "ttft_p95=500"], "needs a unit"),
    (["--url", "http://127.0.0.1:9", "--concurrency", "1", "--input-tokens", "gauss:1,2"], "cannot read"),
    (["--url", "http://127.0.0.1:9", "--trace", "/nonexistent.jsonl"], "not found"),
    (["--url", "http://127.0.0.1:9", "--concurrency", "1", "--dataset", "/nonexistent.jsonl"], "not found"),
    (["--url", "http://127.0.0.1:9", "--concurrency", "1", "--rate", "2"], "not allowed with"),
    (["--url", "http://127.0.0.1:9", "--concurrency", "1", "--timeout", "5 parsecs"], "unknown unit"),
])
def test_bench_bad_input(tmp_path, args, fragment):
    p = run_cli("bench", *args, "--out", str(tmp_path / "x"))
    assert p.returncode == 2, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and fragment in p.stderr, p.stderr


def test_unreachable_server_is_one_line_exit_1_not_a_run_of_errors(tmp_path):
    # the preflight refuses it before any load (a server dying mid-run: tests/integration/test_dead_endpoint.py)
    p = run_cli("bench", "--url", "http://127.0.0.1:9", "--out", str(tmp_path / "run"), "--concurrency", "1",
                "--input-tokens", "4", "--output-tokens", "2", "--warmup", "0s", "--requests", "3", "--quiet")
    assert p.returncode == 1 and len(p.stderr.strip().splitlines()) == 1 and "cannot reach" in p.stderr, p.stderr


def test_unwritable_out_is_one_line_exit_2(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    p = run_cli("bench", "--url", "http://127.0.0.1:9", "--concurrency", "1", "--requests", "1", "--warmup", "0s",
                "--out", str(blocker / "run"), "--quiet")
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "Not a directory" in p.stderr
