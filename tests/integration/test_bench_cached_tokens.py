"""``bench`` records carry the server's own per-request ``cached_tokens``, and a level without prefix counters
gets its prefix figure from them: against the test server's exact prefix cache (vLLM's rules, counts checked
against its ``vllm:prefix_cache_hits_total``).

The server hashes the words it receives into 16-token blocks with an LRU that never evicts here, and reports
``usage.prompt_tokens_details.cached_tokens`` as vLLM does with ``--enable-prompt-tokens-details``: only for a
request that found something (the others' count is None in the record, 0 in the sums).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvcap.rundir import RunDir
from tests.conftest import run_cli
from tests.servers import FakeServer, start_fake_server

BLOCK = 16
WORKLOAD = ("--prefix-tokens", "70", "--prefix-groups", "3", "--prompts-per-group", "2", "--input-tokens", "37",
            "--output-tokens", "4")
REQUESTS = 30


def hits_counter(srv: FakeServer) -> float:
    text = srv.get("/metrics").decode()
    m = re.search(r"^vllm:prefix_cache_hits_total\{[^}]*\} (\S+)$", text, re.M)
    assert m, "vllm:prefix_cache_hits_total not in /metrics"
    return float(m.group(1))


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_records_cached_tokens_sum_to_the_servers_prefix_cache_hits(tmp_path: Path, api: str) -> None:
    out = tmp_path / "bench"
    with start_fake_server(slots=2, step_a="1ms", prefix_cache_blocks=100_000, block_size=BLOCK,
                           enable_prompt_tokens_details=True) as srv:
        before = hits_counter(srv)
        proc = run_cli("bench", "--url", srv.url, "--api", api, "--out", str(out), "--quiet", "--json",
                       "--concurrency", "2", "--requests", str(REQUESTS), "--warmup", "0", "--input-lengths", "local",
                       *WORKLOAD, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        rise = hits_counter(srv) - before
    recs = RunDir(out).records()
    assert len(recs) == REQUESTS and all(r["ok"] for r in recs)
    counts = [r["cached_tokens"] for r in recs]
    assert None in counts and all(c is None or (c > 0 and c % BLOCK == 0) for c in counts)  # vLLM's rules
    assert rise > 0 and sum(c or 0 for c in counts) == rise

    reuse = json.loads(proc.stdout)["levels"][0]["prefix_reuse"]  # no --metrics-url: no prefix counter
    prompt = sum(r["input_tokens"] for r in recs)
    assert reuse == {"source": "records", "prompt_tokens": prompt, "hbm_hit_tokens": int(rise),
                     "tier_hit_tokens": None, "hbm_hit_rate": round(rise / prompt, 4), "tier_hit_rate": None,
                     "server_cached_tokens": int(rise)}


def test_the_servers_prefix_counters_come_first(tmp_path: Path) -> None:
    """With ``--metrics-url`` the level's figure is the counters' (as before), not the records'."""
    out = tmp_path / "bench"
    with start_fake_server(slots=2, step_a="1ms", prefix_cache_blocks=100_000, block_size=BLOCK,
                           enable_prompt_tokens_details=True) as srv:
        proc = run_cli("bench", "--url", srv.url, "--out", str(out), "--quiet", "--json", "--concurrency", "2",
                       "--duration", "3s", "--warmup", "0", "--input-lengths", "local", "--metrics-url",
                       srv.url + "/metrics", *WORKLOAD, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
    assert any(r["cached_tokens"] for r in RunDir(out).records())
    reuse = json.loads(proc.stdout)["levels"][0]["prefix_reuse"]
    assert reuse["source"] == "telemetry" and "server_cached_tokens" not in reuse and reuse["hbm_hit_tokens"] > 0
