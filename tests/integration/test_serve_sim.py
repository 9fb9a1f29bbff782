"""serve-sim over real HTTP: kvcap bench measures the simulated cluster and gets what the simulator logged."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import yaml

from kvcap.procs import terminate
from kvcap.serve.engine import Engine, EngineLoad
from kvcap.serve.metrics import RequestCounters, render_metrics
from kvcap.sim.cluster import cluster_model
from kvcap.sim.server import RealTimeSim
from kvcap.specs.scenario import load_scenario
from tests.conftest import ROOT, run_cli
from tests.waiting import wait_until

SCENARIO = ROOT / "scenarios" / "seed-reference.yaml"


@contextmanager
def running_serve_sim(tmp_path: Path, *overrides: str) -> Iterator[tuple[str, Path]]:
    """``kvcap serve-sim`` of the reference scenario with ``--set`` overrides, on a free port; (url, its log)."""
    log = tmp_path / "sim-log.jsonl"
    err = open(tmp_path / "serve-sim.err", "w+")  # noqa: SIM115 - the server writes to it while it runs
    sets = [a for o in overrides for a in ("--set", o)]
    proc = subprocess.Popen([sys.executable, "-m", "kvcap", "serve-sim", str(SCENARIO), "--port", "0",
                             "--log", str(log), *sets], stderr=err, stdout=subprocess.DEVNULL, cwd=ROOT)
    url = None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and url is None:
        err.seek(0)
        m = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", err.read())
        if m:
            url = m.group(1)
        elif proc.poll() is not None:
            break
        else:
            time.sleep(0.1)
    assert url, f"serve-sim did not start: {(tmp_path / 'serve-sim.err').read_text()}"
    try:
        yield url, log
    finally:
        terminate(proc)
        err.close()


@pytest.fixture
def serve_sim(tmp_path):
    with running_serve_sim(tmp_path, "serving.kv_offload=remote") as got:
        yield got


def test_bench_against_serve_sim_matches_the_simulators_log(serve_sim, tmp_path):
    url, log = serve_sim
    with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
        assert json.load(r)["data"][0]["id"] == "llama-2-7b"
    body = json.dumps({"model": "llama-2-7b", "messages": [{"role": "user", "content": "hello " * 300}],
                       "max_tokens": 20}).encode()
    chat = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                  headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(chat, timeout=30) as r:
        reply = json.load(r)
    took = time.perf_counter() - t0
    assert reply["usage"] == {"prompt_tokens": 300, "completion_tokens": 20, "total_tokens": 320}
    assert reply["choices"][0]["message"]["role"] == "assistant"
    assert 0.03 + 19 * 0.018 < took < 2.0  # a short prefill and 19 decode steps of ~20 ms, in real time
    out = tmp_path / "bench"
    p = run_cli("bench", "--url", url, "--concurrency", "4,24", "--input-tokens", "1024", "--output-tokens", "64",
                "--warmup", "2s", "--duration", "8s", "--metrics-url", url + "/metrics", "--out", str(out),
                "--quiet", "--json", timeout=120)
    assert p.returncode == 0, p.stderr
    measured = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    # serve-sim logs a request once it has sent it all, which the client may have read first (+1: the chat call)
    assert wait_until(lambda: log.read_text().count("\n") >= len(measured) + 1, 10)
    logged = sorted((json.loads(line) for line in log.read_text().splitlines()), key=lambda r: r["start_s"])[1:]
    # (the first logged request is the chat call above)
    assert all(r["ok"] for r in measured) and all(r["ok"] for r in logged)
    assert len(measured) == len(logged) > 40
    assert sum(r["output_tokens"] for r in measured) == sum(r["output_tokens"] for r in logged)
    assert sum(r["input_tokens"] for r in measured) == sum(r["input_tokens"] for r in logged)

    def mean(rs, key):
        return float(np.mean([r[key] for r in rs]))

    # the client sees the simulator's times plus loopback HTTP and its own event loop: a little later, never
    # earlier (6-8 ms on a quiet 2-core VM today; the client-overhead goal against a bare client is issue 11's)
    assert 0 <= mean(measured, "ttft_ms") - mean(logged, "ttft_ms") < 10
    assert abs(mean(measured, "tpot_ms") - mean(logged, "tpot_ms")) < 0.5
    # E2E adds the real-time engine's wake-up slack once per step (≤ 0.1 ms each over 63 steps) to TTFT's offset
    assert 0 <= mean(measured, "e2e_ms") - mean(logged, "e2e_ms") < 10 + 63 * 0.1
    assert mean(logged, "ttft_ms") > 100  # a 1024-token prefill of a 7B model on a 4090, not an instant
    telemetry = [json.loads(line) for line in (out / "telemetry.jsonl").read_text().splitlines()]
    running = [t["value"] for t in telemetry if t["name"] == "server.requests_running"]
    assert max(running) <= 24 and max(running) >= 16
    assert any(t["name"] == "server.requests_parked" for t in telemetry)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["capacity"]["resident_source"].startswith("telemetry")
    # the pool the simulated vLLM reports in its cache_config_info, recorded at preflight, is the simulator's own
    truth = cluster_model(load_scenario(SCENARIO, overrides={"serving.kv_offload": "remote"})).build().replicas[0].cfg
    server = json.loads((out / "manifest.json").read_text())["server"]
    # vLLM counts its null block in num_gpu_blocks
    assert (server["num_gpu_blocks"], server["block_size"]) == (truth.blocks + 1, truth.block_size)
    assert server["enable_prefix_caching"] is True and server["engine"] == "vllm" and server["kv_engines"] == 4


def test_calibrate_takes_the_kv_pool_from_vllms_cache_config_and_predicts_the_wall(tmp_path):
    """Fit below the KV wall (c = 2, 8: every request resident), predict c = 24 held out, where the pool the
    server reported (vLLM ``cache_config_info``) holds only part of them: the prediction must see the wall. Prefix
    caching off (the bench's prompts share a prefix, which would hide the wall), as the server reports too; one
    replica (one engine)."""
    one = {"cluster.nodes": 1, "serving.enable_prefix_caching": False}  # one replica: the endpoint is one engine
    truth = cluster_model(load_scenario(SCENARIO, overrides=one)).build().replicas[0].cfg
    pool = truth.blocks * truth.block_size
    lengths = ("--input-tokens", "1024", "--output-tokens", "64")
    assert 8 * 1088 < pool < 24 * 1088
    out = tmp_path / "bench"
    with running_serve_sim(tmp_path, *(f"{k}={v}" for k, v in one.items())) as (url, _):
        p = run_cli("bench", "--url", url, "--concurrency", "2,8,24", *lengths, "--warmup", "2s", "--duration", "6s",
                    "--metrics-url", url + "/metrics", "--out", str(out), "--quiet", "--json", timeout=180)
    assert p.returncode == 0, p.stderr
    measured = {lv["level"]: lv for lv in json.loads(p.stdout)["levels"]}
    assert measured[24]["server_running_max"] < 24  # the wall is real: the server could not hold them all
    cal = run_cli("calibrate", str(out), "--out", str(tmp_path / "cal.yaml"), "--holdout", "24", "--json",
                  timeout=300)
    assert cal.returncode == 0, cal.stderr
    fit = json.loads(cal.stdout)
    assert fit["kv_tokens"] == pool
    section = yaml.safe_load((tmp_path / "cal.yaml").read_text())["calibration"]
    assert "cache_config_info" in section["kv_tokens_source"]
    assert yaml.safe_load((tmp_path / "cal.yaml").read_text())["serving"]["enable_prefix_caching"] is False
    held = next(r for r in fit["table"] if r["held_out"])
    # the wall's consequence is queueing: TTFT ~3 s measured (not the ~0.4 s of c = 8), and no more throughput.
    # In a 6 s window TTFT there is bimodal (requests sent before the pool filled start in ~1.5 s, the rest wait
    # ~3.4 s), and its median falls between the modes on one request more or less (2,170 or 3,244 ms for the same
    # times): the check is on p95
    assert held["measured"]["ttft_p95"] > 5 * measured[8]["ttft_ms"]["p95"]
    assert abs(held["error_pct"]["ttft_p95"]) < 10, held
    assert abs(held["error_pct"]["throughput"]) < 10, held
    # TPOT extrapolates the pure decode step from batches of 2 and 8 to the ~15 resident, and adds the prompts
    # at the cost the records showed them to have (within 1% measured)
    assert abs(held["error_pct"]["tpot_p50"]) < 10, held
    # the fit read the steps from the records: the truth's step (19.4 ms + 0.75 ms a sequence, a 1,024-token
    # prompt adding 119 ms) and no front end beyond the wait for a step
    cost = {k: v["value_s"] for k, v in fit["step_cost"].items()}
    assert cost["per_prefill_token"] * 1024 == pytest.approx(0.119, rel=0.1)
    assert cost["per_decode"] == pytest.approx(0.00075, rel=0.15)
    assert cost["per_request"] < 0.01


def test_serve_sim_stats_count_what_was_sent(serve_sim):
    url, _ = serve_sim
    sent = [(False, 8), (True, 5), (False, 3)]  # (stream, max_tokens), 40-word prompts
    for streamed, max_tokens in sent:
        body = json.dumps({"prompt": "word " * 40, "max_tokens": max_tokens, "stream": streamed}).encode()
        req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200
            r.read()
    bad = urllib.request.Request(url + "/v1/completions", data=b'{"prompt": "a", "model": "other"}',
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(bad, timeout=5)
    assert refused.value.code == 404
    with urllib.request.urlopen(url + "/stats", timeout=5) as r:
        assert r.status == 200
        stats = json.load(r)
    assert stats["requests_started"] == stats["requests_finished"] == 3
    assert stats["requests_rejected"] == 1 and stats["requests_aborted"] == 0
    assert stats["finished_by_reason"] == {"stop": 0, "length": 3}
    assert stats["prompt_tokens_total"] == 3 * 40 and stats["completion_tokens_total"] == 8 + 5 + 3
    assert stats["running"] == 0 and stats["waiting"] == 0 and stats["max_running"] == 1  # one request at a time
    assert stats["faults_injected"] == {} and stats["engine_steps"] is None
    assert stats["config"] == {"model_name": "llama-2-7b", "tokens_per_chunk": 1, "eos_after": None,
                               "max_model_len": 4096, "tokenizer": "words", "prompt_overhead": 0, "tokenize": True,
                               "mode": "simulated"}


def test_real_time_sim_is_an_engine():
    cm = cluster_model(load_scenario(SCENARIO))
    engine = RealTimeSim(cm)
    assert isinstance(engine, Engine)
    assert engine.load() == EngineLoad(running=0, waiting=0, max_running=0, max_waiting=0)
    text = render_metrics(engine.metric_families(RequestCounters(), 0.0), "llama-2-7b")
    assert 'kvcap:num_requests_parked{model_name="llama-2-7b"} 0.0' in text
    assert "_created" not in text and "request_success" not in text  # the simulator's own series only


def test_serve_sim_bad_scenario_is_exit_2(tmp_path):
    p = run_cli("serve-sim", str(tmp_path / "missing.yaml"))
    assert p.returncode == 2 and "not found" in p.stderr
    p = run_cli("serve-sim", str(SCENARIO), "--port", "70000")
    assert p.returncode == 2 and "--port" in p.stderr
    assert Path(SCENARIO).exists()
