"""The article's second answer on real engines: vLLM (CPU build) with a small KV pool, without and with a REAL
LMCache server as a tier behind it (KV shipped over TCP on loopback). Under a shared-prefix workload whose
prefixes exceed vLLM's pool, the tier serves the prefixes vLLM evicted and ``compare`` names the gain with the
tier's hits as its evidence; kvcap's reading of the tier is checked against vLLM's and LMCache's own counters."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from kvcap.rundir import RunDir
from tests.conftest import run_cli
from tests.vllm_cpu import BLOCK_TOKENS, MODEL_NAME, VllmConfig, counter, lmcache_server, scrape, vllm_server

pytestmark = pytest.mark.vllm

# 8 groups x 1,024-token prefixes = 64 blocks of 128, against 23 usable blocks: vLLM's own cache thrashes
POOL = VllmConfig(blocks=24, max_num_seqs=4, max_model_len=2048)
REUSE = ("--prefix-tokens", "1024", "--prefix-groups", "8", "--prompts-per-group", "2", "--input-tokens", "100",
         "--output-tokens", "16", "--seed", "11", "--no-unique-prefix")
NO_REUSE = ("--input-tokens", "1124", "--output-tokens", "16", "--seed", "12")
"""The same prompt length with no prefix in common: nothing for a tier to serve."""
LOAD = ("--concurrency", "1,2", "--requests", "32", "--warmup", "0s")


@dataclass
class Arm:
    runs: dict[str, Path]
    vllm: tuple[str, str]
    """vLLM's /metrics before and after the reuse workload."""
    lmcache: tuple[str, str] = ("", "")
    """The LMCache server's /metrics before and after the reuse workload."""


def _bench(url: str, out: Path, workload: tuple[str, ...], *metrics: str) -> None:
    urls = [a for m in (url + "/metrics", *metrics) for a in ("--metrics-url", m)]
    p = run_cli("bench", "--url", url, "--model", MODEL_NAME, "--out", str(out), "--quiet", *LOAD, *workload, *urls,
                "--slo", "ttft_p95=500ms", timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]


def _arm(url: str, out: Path, lmcache_metrics: str | None = None) -> Arm:
    extra = ("lmcache=" + lmcache_metrics,) if lmcache_metrics else ()
    _bench(url, out / "no-reuse", NO_REUSE, *extra)
    vllm_before = scrape(url + "/metrics")
    lm_before = scrape(lmcache_metrics) if lmcache_metrics else ""
    _bench(url, out / "reuse", REUSE, *extra)
    return Arm({"reuse": out / "reuse", "no-reuse": out / "no-reuse"}, (vllm_before, scrape(url + "/metrics")),
               (lm_before, scrape(lmcache_metrics) if lmcache_metrics else ""))


@pytest.fixture(scope="module")
def arms(tmp_path_factory) -> dict[str, Arm]:
    """Both arms, each one server start running both workloads (no reuse first, so it leaves nothing to hit)."""
    home = tmp_path_factory.mktemp("lmcache-ab")
    with vllm_server(home, POOL) as url:
        control = _arm(url, home / "control")
    with lmcache_server(home) as lmc, vllm_server(home, replace(POOL, lmcache_port=lmc.port)) as url:
        treatment = _arm(url, home / "treatment", lmc.metrics_url)
    return {"control": control, "treatment": treatment}


def _compare(arms: dict[str, Arm], workload: str) -> dict:
    p = run_cli("compare", str(arms["control"].runs[workload]), str(arms["treatment"].runs[workload]), "--json",
                timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout)


def test_a_remote_tier_serves_what_vllm_evicted(arms):
    treatment = arms["treatment"]
    (before, after), (lm_before, lm_after) = treatment.vllm, treatment.lmcache

    def delta(name: str, **labels: str) -> float:
        return counter(after, name, **labels) - counter(before, name, **labels)

    external = delta("vllm:external_prefix_cache_hits_total")
    # whole vLLM blocks (LMCache serves 256-token chunks, but what vLLM already holds is not loaded again)
    assert external > 0 and external % BLOCK_TOKENS == 0
    assert external == delta("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    # the server stored chunks, and found at least what vLLM loaded (its lookups count from the prompt's start)
    def lm_delta(name: str) -> float:
        return counter(lm_after, name) - counter(lm_before, name)

    assert lm_delta("lmcache_mp_l1_write_chunks_total") > 0
    assert lm_delta("lmcache_mp_lookup_hit_tokens_total") >= external

    # kvcap's reading of the same run: the tier's hits per level add up to vLLM's counter
    summary = json.loads(run_cli("analyze", str(treatment.runs["reuse"]), "--json").stdout)
    reuse = [lv["prefix_reuse"] for lv in summary["levels"]]
    assert all(r and r["tier_hit_tokens"] > 0 for r in reuse), reuse
    assert sum(r["tier_hit_tokens"] for r in reuse) == pytest.approx(external, rel=0.05)
    tel = RunDir(treatment.runs["reuse"]).telemetry()
    assert any(t["labels"].get("raw", "").startswith("lmcache_mp_") for t in tel)

    # the A/B: the tier pays, and compare names its hits as the sign it took effect
    verdict = _compare(arms, "reuse")
    assert verdict["verdict"] in ("performance-scaling", "performance-only"), verdict["verdict"]
    assert not any("took effect" in w for w in verdict.get("warnings", []))


def test_without_reuse_the_tier_gives_nothing_and_compare_says_it_sat_idle(arms):
    verdict = _compare(arms, "no-reuse")
    assert verdict["verdict"] in ("no-gain", "regression"), verdict["verdict"]
    assert any("hit" in w for w in verdict.get("warnings", [])), verdict.get("warnings")
