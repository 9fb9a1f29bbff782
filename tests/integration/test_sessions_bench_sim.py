"""A multi-turn session workload is one workload in ``bench`` and ``sim``: the history tokens a real prefix cache
finds in what ``bench`` sends equal the tokens the simulator's cache finds in the session's hash ids, both what the
plan says; and ``bench`` waits the think time after each turn's end before the next turn.

The test server's exact LRU prefix cache (16-token blocks) never evicts; the simulator runs one replica at
``serving.hash_block_tokens`` = 16 with a pool that never fills. Two users hold their sessions side by side (or
sessions arrive at a rate, several at once); sessions share no block, so the hits do not depend on how they
interleave. No turn's prompt is a whole number
of blocks (where the server always recomputes the last block and the simulator only the last token).
"""

from __future__ import annotations

import json
import re
from itertools import pairwise
from pathlib import Path

import pytest

from kvcap.rundir import RunDir
from kvcap.specs.lengths import parse_length
from kvcap.workload.sessions import session_plan, session_quota
from tests.conftest import ROOT, run_cli
from tests.servers import start_fake_server

BLOCK = 16
TURNS, THINK_S, QUESTION, ANSWER, USERS, REQUESTS = 3, 0.05, 37, 4, 2, 12
WORKLOAD = ("--turns", str(TURNS), "--think-time", "50ms", "--input-tokens", str(QUESTION),
            "--output-tokens", str(ANSWER))


def expected_hits() -> int:
    """Worked from the plan alone: turn k finds turn k−1's full blocks (every earlier question and answer but the
    last question's partial block), turn 1 nothing; every session the run starts sends all its turns."""
    plan = session_plan(0, TURNS, THINK_S, parse_length(QUESTION), parse_length(ANSWER))
    assert plan is not None
    sessions = session_quota(REQUESTS, TURNS)
    assert sessions is not None
    return sum((plan.turn(s, k - 1).input_tokens // BLOCK) * BLOCK
               for s in range(sessions) for k in range(2, TURNS + 1))


def counter(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


@pytest.mark.parametrize("load", [("--concurrency", str(USERS)), ("--rate", "20")], ids=["users", "session-rate"])
def test_bench_and_sim_sessions_give_the_same_prefix_hits_and_bench_waits_the_think_time(tmp_path: Path,
                                                                                        load: tuple[str, str]):
    want = expected_hits()
    assert want == 4 * ((QUESTION // BLOCK) + ((2 * QUESTION + ANSWER) // BLOCK)) * BLOCK

    with start_fake_server(slots=1, step_a="1ms", prefix_cache_blocks=100_000, block_size=BLOCK) as srv:
        proc = run_cli("bench", "--url", srv.url, "--out", str(tmp_path / "bench"), "--quiet", "--json",
                       *load, "--requests", str(REQUESTS), "--warmup", "0",
                       "--input-lengths", "local", *WORKLOAD, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        metrics = srv.get("/metrics").decode()
    server_hits = counter(metrics, "vllm:prefix_cache_hits_total")
    sent = [r for r in RunDir(tmp_path / "bench").records() if r["ok"]]
    assert len(sent) == REQUESTS
    assert sorted(r["input_tokens"] for r in sent) == sorted(
        [QUESTION, 2 * QUESTION + ANSWER, 3 * QUESTION + 2 * ANSWER] * (REQUESTS // TURNS))

    by_session: dict[int, list[dict]] = {}
    for r in sent:
        by_session.setdefault(r["session"], []).append(r)
    assert len(by_session) == REQUESTS // TURNS
    for turns in by_session.values():
        turns.sort(key=lambda r: r["turn"])
        assert [r["turn"] for r in turns] == list(range(1, TURNS + 1))
        for before, after in pairwise(turns):
            assert after["start_s"] >= before["end_s"] + THINK_S - 1e-6, (before, after)

    proc = run_cli("sim", str(ROOT / "scenarios" / "seed-reference.yaml"), "--out", str(tmp_path / "sim"), "--quiet",
                   *load, "--requests", str(REQUESTS), "--warmup", "0", "--repeats", "1",
                   *WORKLOAD, "--set", f"serving.hash_block_tokens={BLOCK}", "--set", f"serving.block_size={BLOCK}",
                   "--set", "cluster.nodes=1", timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    simulated = list(RunDir(tmp_path / "sim").records())
    assert len(simulated) == REQUESTS and all(r["ok"] for r in simulated)
    sim_hits = sum(r["prefix_hit_tokens"] for r in simulated)

    assert server_hits == sim_hits == want
    assert sorted((r["session"], r["turn"]) for r in simulated) == sorted((r["session"], r["turn"]) for r in sent)
    for run in ("bench", "sim"):
        fixed = json.loads((tmp_path / run / "manifest.json").read_text())["fixed"]
        assert fixed["workload.turns"] == TURNS and fixed["workload.think_time"] == THINK_S, run
        assert "planned answer" in fixed["workload.prompt"], run
