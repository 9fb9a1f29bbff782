"""serve-sim's offload tiers under the connectors' own names (issue 32): LMCache's multiprocess server
(``lmcache_mp_*``) with ``kv_tier_profile: lmcache``, Dynamo's KVBM (``kvbm_*``) with ``kvbm``.

A real serve-sim process, a bounded shared-prefix ``kvcap bench`` against it, its ``/metrics`` read through
kvcap's own telemetry path (the catalog's normalised names) and held against the simulator's records: the tokens
loaded per tier sum to the records' ``tier_hit_tokens``, the chunks or blocks read are the units those tokens
touch (tokens / unit where the load is unit-aligned), and the units written times their bytes are the bytes the
tier links carried out of the GPUs.
"""

from __future__ import annotations

import json
import re
import urllib.request
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvcap.sim.cluster import cluster_model
from kvcap.sim.tiers import LMCACHE_CHUNK_TOKENS
from kvcap.specs.scenario import load_scenario
from kvcap.telemetry.scrape import parse_metrics
from tests.conftest import run_cli
from tests.integration.test_serve_sim import SCENARIO, running_serve_sim
from tests.waiting import wait_until

BLOCK = 16
SHARED = ("--prefix-tokens", "512", "--prefix-groups", "4", "--prompts-per-group", "4", "--input-tokens", "48",
          "--output-tokens", "8")
CALM = {"serving.hash_block_tokens": BLOCK, "serving.offload_admission": "hbm"}
"""Hash blocks of a KV block each; no request parked in a tier, so the tier links carry prefixes only."""


Rows = list[dict[str, Any]]


def _serve_and_bench(tmp_path: Path, sets: dict[str, Any],
                     settled: Callable[[Rows], bool]) -> tuple[Rows, Rows, str]:
    """(the /metrics page's telemetry rows once ``settled`` holds for them, the simulator's records, the page)
    after a bounded shared-prefix bench against serve-sim with ``sets``."""
    out = tmp_path / "bench"
    with running_serve_sim(tmp_path, *(f"{k}={v}" for k, v in sets.items())) as (url, log):
        p = run_cli("bench", "--url", url, "--concurrency", "2", *SHARED, "--warmup", "0s", "--requests", "16",
                    "--metrics-url", url + "/metrics", "--out", str(out), "--quiet", "--json", timeout=180)
        assert p.returncode == 0, p.stderr
        sent = sum(1 for _ in (out / "requests.jsonl").open())
        assert wait_until(lambda: log.read_text().count("\n") >= sent, 10)
        records = [json.loads(line) for line in log.read_text().splitlines()]
        rows: Rows = []
        page = [""]

        def scraped() -> bool:  # the last prefix writes are copies nothing waits for: done soon after
            with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
                page[0] = r.read().decode()
            rows[:] = parse_metrics(page[0], 0.0, "metrics:" + url)
            return settled(rows)

        assert wait_until(scraped, 10, every_s=0.2), "the tier links never carried what the tiers say was written"
    assert len(records) == sent >= 16 and all(r["ok"] for r in records)
    # the scrapes bench took went through the same catalog: the connector's counters reached its telemetry
    names = {json.loads(line)["name"] for line in (out / "telemetry.jsonl").open()}
    assert "server.offload_prefix_hits_total" in names
    return rows, records, page[0]


def _sums(rows: Rows) -> dict[str, float]:
    """Normalised name → its value summed over the page's series."""
    out: dict[str, float] = defaultdict(float)
    for row in rows:
        out[row["name"]] += row["value"]
    return out


def _carried_out(rows: Rows, kind: str) -> float:
    """Bytes the tier links of ``kind`` carried out of the GPUs."""
    return sum(r["value"] for r in rows if r["name"] == "link.bytes_total"
               and r["labels"].get("kind") == kind and r["labels"].get("direction") == "out")


def _touched(records: list[dict[str, Any]], unit: int) -> int:
    """Units of ``unit`` tokens the records' tier loads reach into (a load starts where the HBM hit ends)."""
    return sum(-(-(r["prefix_hit_tokens"] + r["tier_hit_tokens"]) // unit) - r["prefix_hit_tokens"] // unit
               for r in records if r["tier_hit_tokens"])


def _kv_bytes_per_token(sets: dict[str, Any]) -> float:
    return cluster_model(load_scenario(SCENARIO, overrides=sets)).build().replicas[0].cfg.kv_bytes_per_token


def test_lmcache_profile_shows_its_tiers_under_lmcache_names(tmp_path: Path) -> None:
    # two replicas on one node share its host memory (LMCache's L1): a prefix one computed, the other loads
    sets = {"cluster.nodes": 1, "cluster.gpus_per_node": 2, "serving.kv_offload": "host",
            "serving.kv_tier_profile": "lmcache", **CALM}
    chunk_bytes = LMCACHE_CHUNK_TOKENS * _kv_bytes_per_token(sets)

    def settled(rows: Rows) -> bool:  # every chunk written to L1 crossed the host link
        written = _sums(rows)["server.offload_l1_write_chunks_total"]
        return written > 0 and _carried_out(rows, "host") == written * chunk_bytes

    rows, records, _ = _serve_and_bench(tmp_path, sets, settled)
    sums = _sums(rows)
    loaded = sum(r["tier_hit_tokens"] for r in records)
    assert loaded > 0  # some group's prefix reached a replica that had not computed it
    assert sums["server.offload_l1_hit_tokens_total"] == loaded
    assert sums["server.offload_l2_hit_tokens_total"] == 0  # nothing below L1 here
    assert sums["server.offload_prefix_hits_total"] == loaded  # vLLM's connector counter, still there
    reads = sums["server.offload_l1_read_chunks_total"]
    assert reads == _touched(records, LMCACHE_CHUNK_TOKENS) > 0
    if all(r["prefix_hit_tokens"] % LMCACHE_CHUNK_TOKENS == r["tier_hit_tokens"] % LMCACHE_CHUNK_TOKENS == 0
           for r in records):
        assert reads == loaded / LMCACHE_CHUNK_TOKENS  # whole chunks: tokens / 256
    writes = sums["server.offload_l1_write_chunks_total"]
    assert writes > 0 and sums["server.offload_l1_evicted_chunks_total"] == 0  # host RAM is far from full
    capacity = cluster_model(load_scenario(SCENARIO, overrides=sets)).build().tiers["host"][0].capacity
    assert sums["server.kv_usage_host"] == pytest.approx(writes * chunk_bytes / capacity)
    # vLLM's prompt tokens by source, one normalised name per label value
    assert sums["server.prompt_tokens_offload_hits_total"] == loaded
    assert sums["server.prompt_tokens_prefix_cache_hits_total"] == sum(r["prefix_hit_tokens"] for r in records)
    assert sums["server.prompt_tokens_computed_total"] == sum(
        r["input_tokens"] - r["prefix_hit_tokens"] - r["tier_hit_tokens"] for r in records)
    assert {r["labels"]["raw"] for r in rows if r["name"].startswith("server.offload_l1")} == {
        "lmcache_mp_lookup_hit_l1_tokens_total", "lmcache_mp_l1_read_chunks_total",
        "lmcache_mp_l1_write_chunks_total", "lmcache_mp_l1_evicted_chunks_total"}


def test_kvbm_profile_shows_its_tiers_under_kvbm_names(tmp_path: Path) -> None:
    # two nodes, each its own host memory (G2), one pool below them (G3): a prefix the other node computed comes
    # from the pool; one this node's other requests computed is in HBM already
    sets = {"cluster.nodes": 2, "cluster.gpus_per_node": 1, "serving.kv_offload": "host+remote",
            "serving.kv_tier_profile": "kvbm", **CALM}
    block_bytes = BLOCK * _kv_bytes_per_token(sets)

    def settled(rows: Rows) -> bool:  # every block written crossed its links: PCIe to host memory, NICs to the pool
        sums = _sums(rows)
        d2h, h2d = sums["server.offload_blocks_d2h_total"], sums["server.offload_blocks_h2d_total"]
        return (d2h > 0 and _carried_out(rows, "host") == d2h * block_bytes
                and _carried_out(rows, "nic") == h2d * block_bytes)

    rows, records, page = _serve_and_bench(tmp_path, sets, settled)
    sums = _sums(rows)
    loaded = sum(r["tier_hit_tokens"] for r in records)
    assert loaded > 0
    assert sums["server.offload_matched_tokens_total"] == loaded
    onboard = sums["server.onboard_blocks_h2d_total"] + sums["server.onboard_blocks_d2d_total"]
    assert onboard == _touched(records, BLOCK) > 0
    if all(r["tier_hit_tokens"] % BLOCK == 0 for r in records):
        assert onboard == loaded / BLOCK  # whole blocks: tokens / 16
    # write-through: every block written to a node's host memory went to the pool as well (each node wrote its
    # groups' prefixes once; the pool keeps one copy of what both nodes wrote)
    d2h, h2d = sums["server.offload_blocks_d2h_total"], sums["server.offload_blocks_h2d_total"]
    assert d2h >= h2d > 0
    exposed = {m.group(1) for m in re.finditer(r"^(kvbm_\w+)\{", page, re.M)}
    assert exposed == {"kvbm_matched_tokens", "kvbm_onboard_blocks_h2d", "kvbm_onboard_blocks_d2d",
                    "kvbm_offload_blocks_d2h", "kvbm_offload_blocks_h2d"}  # Dynamo's names, no _total suffix
