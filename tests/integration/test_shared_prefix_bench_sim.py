"""A shared-prefix workload is one workload in ``bench`` and ``sim``: the prefix tokens a real prefix cache finds
in what ``bench`` sends equal the tokens the simulator's cache finds in the hash ids it reads.

The test server hashes the words it receives into 16-token chained blocks with an exact LRU (vLLM's rules,
``kvcap/testing/prefix_cache.py``) big enough never to evict; the simulator hashes the same workload at
``serving.hash_block_tokens`` = 16 with an HBM pool that never fills either. One user sends one request at a
time, so both see the same order. Sizes are chosen so that no prompt is a whole number of blocks (where the server
always recomputes the last block and the simulator only the last token).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from kvcap.rundir import RunDir
from kvcap.specs.lengths import parse_length
from kvcap.workload.blocks import prompt_block_hashes
from kvcap.workload.prompts import PromptFactory
from kvcap.workload.reuse import shared_prefix_plan
from tests.conftest import ROOT, run_cli
from tests.servers import start_fake_server

BLOCK = 16
GROUPS, PER_GROUP, PREFIX, QUESTION, OUTPUT, REQUESTS = 3, 2, 70, 37, 4, 30
WORKLOAD = ("--prefix-tokens", str(PREFIX), "--prefix-groups", str(GROUPS), "--prompts-per-group", str(PER_GROUP),
            "--input-tokens", str(QUESTION), "--output-tokens", str(OUTPUT))


def expected_hits() -> int:
    """Worked from the plan alone: a group's first prompt finds nothing, its next prompts the prefix's full blocks,
    a prompt seen before all its full blocks."""
    plan = shared_prefix_plan(0, PREFIX, GROUPS, parse_length(QUESTION), parse_length(OUTPUT), PER_GROUP)
    assert plan is not None
    groups, slots, hits = set(), set(), 0
    for i in range(REQUESTS):
        p = plan.prompt(i)
        if p.slot in slots:
            hits += (p.input_tokens // BLOCK) * BLOCK
        elif p.group in groups:
            hits += (PREFIX // BLOCK) * BLOCK
        groups.add(p.group)
        slots.add(p.slot)
    return hits


def counter(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def test_bench_words_and_sim_hash_ids_give_the_same_prefix_hits(tmp_path: Path):
    want = expected_hits()
    assert 0 < want < REQUESTS * (PREFIX + QUESTION)

    with start_fake_server(slots=1, step_a="1ms", prefix_cache_blocks=100_000, block_size=BLOCK) as srv:
        proc = run_cli("bench", "--url", srv.url, "--out", str(tmp_path / "bench"), "--quiet", "--json",
                       "--concurrency", "1", "--requests", str(REQUESTS), "--warmup", "0", "--input-lengths", "local",
                       *WORKLOAD, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        metrics = srv.get("/metrics").decode()
    server_hits = counter(metrics, "vllm:prefix_cache_hits_total")
    sent = [r for r in RunDir(tmp_path / "bench").records() if r["ok"]]
    assert len(sent) == REQUESTS and {r["input_tokens"] for r in sent} == {PREFIX + QUESTION}

    proc = run_cli("sim", str(ROOT / "scenarios" / "seed-reference.yaml"), "--out", str(tmp_path / "sim"), "--quiet",
                   "--concurrency", "1", "--requests", str(REQUESTS), "--warmup", "0", "--repeats", "1", *WORKLOAD,
                   "--set", f"serving.hash_block_tokens={BLOCK}", "--set", f"serving.block_size={BLOCK}",
                   "--set", "cluster.nodes=1", timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    simulated = list(RunDir(tmp_path / "sim").records())
    sim_hits = sum(r["prefix_hit_tokens"] for r in simulated)
    assert len(simulated) == REQUESTS

    assert server_hits == sim_hits == want
    manifest = json.loads((tmp_path / "sim" / "manifest.json").read_text())["fixed"]
    assert manifest["workload.prompts_per_group"] == PER_GROUP and "shared prefix" in manifest["workload.prompt"]


def test_the_words_bench_sends_chain_into_the_blocks_the_sim_hashes():
    """Request by request, the prompt's words share a leading run of full blocks with an earlier prompt exactly
    where the plan's hash ids do."""
    factory = PromptFactory(seed=0, input_dist=parse_length(QUESTION), output_dist=parse_length(OUTPUT),
                            prefix_tokens=PREFIX, prefix_groups=GROUPS, prompts_per_group=PER_GROUP, run_id="r")
    plan = factory.shared
    assert plan is not None
    seen_words: set[int] = set()
    seen_ids: set[int] = set()
    for i in range(REQUESTS):
        words = factory.request(i, level=1).prompt.split()
        by_words = prompt_block_hashes(words, BLOCK)
        by_ids = plan.hash_ids(plan.prompt(i), BLOCK)[: len(words) // BLOCK]
        assert len(by_words) == len(by_ids)
        assert [h in seen_words for h in by_words] == [h in seen_ids for h in by_ids], i
        seen_words.update(by_words)
        seen_ids.update(by_ids)
