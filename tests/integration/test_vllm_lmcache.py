"""The article's second answer on real engines: vLLM (CPU build) with a small KV pool, without and with a REAL
LMCache server as a tier behind it (KV shipped over TCP on loopback). Under a shared-prefix workload whose
prefixes exceed vLLM's pool, the tier serves the prefixes vLLM evicted and ``compare`` names the gain with the
tier's hits as its evidence; kvcap's reading of the tier is checked against vLLM's and LMCache's own counters."""

from __future__ import annotations

import json

import pytest

from kvcap.rundir import RunDir
from tests.conftest import run_cli
from tests.vllm_cpu import BLOCK_TOKENS, MODEL_NAME, VllmConfig, counter, lmcache_server, scrape, vllm_server

pytestmark = pytest.mark.vllm

# 8 groups x 1,024-token prefixes = 64 blocks of 128, against 23 usable blocks: vLLM's own cache thrashes
POOL = VllmConfig(blocks=24, max_num_seqs=4, max_model_len=2048)
WORKLOAD = ("--prefix-tokens", "1024", "--prefix-groups", "8", "--prompts-per-group", "2", "--input-tokens", "100",
            "--output-tokens", "16", "--seed", "11", "--no-unique-prefix")
LOAD = ("--concurrency", "1,2", "--requests", "32", "--warmup", "0s")


def _bench(url: str, out, *metrics: str) -> None:
    urls = [a for m in (url + "/metrics", *metrics) for a in ("--metrics-url", m)]
    p = run_cli("bench", "--url", url, "--model", MODEL_NAME, "--out", str(out), "--quiet", *LOAD, *WORKLOAD, *urls,
                "--slo", "ttft_p95=500ms", timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]


def test_a_remote_tier_serves_what_vllm_evicted(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    with vllm_server(home, POOL) as url:
        _bench(url, tmp_path / "control")
    with lmcache_server(home) as lmc, vllm_server(home, VllmConfig(**{**POOL.__dict__, "lmcache_port": lmc.port})) \
            as url:
        before, lm_before = scrape(url + "/metrics"), scrape(lmc.metrics_url)
        _bench(url, tmp_path / "treatment", "lmcache=" + lmc.metrics_url)
        after, lm_after = scrape(url + "/metrics"), scrape(lmc.metrics_url)

    def delta(name: str, **labels: str) -> float:
        return counter(after, name, **labels) - counter(before, name, **labels)

    external = delta("vllm:external_prefix_cache_hits_total")
    # whole vLLM blocks (LMCache serves 256-token chunks, but what vLLM already holds is not loaded again)
    assert external > 0 and external % BLOCK_TOKENS == 0
    assert external == delta("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")

    def lm_delta(name: str) -> float:
        return counter(lm_after, name) - counter(lm_before, name)

    # the server stored chunks, and found at least what vLLM loaded (its lookups count from the prompt's start)
    assert lm_delta("lmcache_mp_l1_write_chunks_total") > 0
    assert lm_delta("lmcache_mp_lookup_hit_tokens_total") >= external

    # kvcap's reading of the same run: the tier's hits per level add up to vLLM's counter
    summary = json.loads(run_cli("analyze", str(tmp_path / "treatment"), "--json").stdout)
    reuse = [lv["prefix_reuse"] for lv in summary["levels"]]
    assert all(r and r["tier_hit_tokens"] > 0 for r in reuse), reuse
    assert sum(r["tier_hit_tokens"] for r in reuse) == pytest.approx(external, rel=0.02)
    tel = RunDir(tmp_path / "treatment").telemetry()
    assert any(t["labels"].get("raw", "").startswith("lmcache_mp_") for t in tel)

    p = run_cli("compare", str(tmp_path / "control"), str(tmp_path / "treatment"), "--json", timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    verdict = json.loads(p.stdout)
    print(json.dumps({k: verdict.get(k) for k in ("verdict", "moved", "warnings")}, indent=1))
    assert verdict["verdict"] in ("performance-scaling", "performance-only")
    assert not any("took effect" in w for w in verdict.get("warnings", []))
