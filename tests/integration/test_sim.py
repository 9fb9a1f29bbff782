"""The simulator end to end: residency against the plan, physics directions, trace replay, and the run directory
it writes (the engine driven directly is in test_sim_engine.py; its parts in test_sim_kv/_policy_vllm/_links.py).

Simulated runs are short (tens of simulated seconds) and fast (well under a second each); the truths are the
plan's arithmetic, link physics and invariants the engine must never break.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvcap.plan import plan, resolve
from kvcap.sim.cluster import cluster_model
from kvcap.sim.run import SimConfig, run_sim
from kvcap.specs.scenario import load_scenario
from kvcap.workload.loadplan import LoadPlan
from tests.conftest import DATA, ROOT, run_cli

SCENARIO = ROOT / "scenarios" / "seed-reference.yaml"
FIXED = {"workload.input_tokens": 1024, "workload.output_tokens": 256, "load.repeats": 1,
         "load.warmup": "5s", "load.duration": "25s"}
SLO = {"ttft_p95": 500.0, "tpot_p95": 80.0}


def scenario(**overrides: Any):
    return load_scenario(SCENARIO, {**FIXED, **{k.replace("__", "."): v for k, v in overrides.items()}})


def simulate(tmp_path: Path, name: str, **overrides: Any) -> tuple[dict, list[dict]]:
    sc = scenario(**overrides)
    out = tmp_path / name
    summary = run_sim(SimConfig(scenario=sc, plan=LoadPlan.from_spec(sc.load), out=out, slo=SLO))
    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert summary.to_json() == json.loads((out / "summary.json").read_text())  # what run_sim returns it wrote
    return summary.to_json(), records


def measured(records: list[dict]) -> list[dict]:
    return [r for r in records if r["phase"] == "measure" and r["ok"]]


# ------------------------------------------------------------------------------------------ residency


def test_residency_per_tier_matches_plan(tmp_path):
    sc = scenario(serving__kv_offload="host+remote")
    p = plan(resolve(sc))
    cm = cluster_model(sc)
    sim = cm.build()
    per_request_blocks = sim.replicas[0].hbm.blocks_for(1024 + 256)
    assert sim.replicas[0].cfg.blocks == p.kv_blocks_per_gpu
    assert sim.replicas[0].cfg.blocks // per_request_blocks * p.replicas == p.resident_requests["hbm"]
    req_bytes = p.kv_bytes_per_request
    assert sum(int(t.capacity // req_bytes) for t in sim.tiers["host"]) == p.resident_requests["host"]
    assert int(sim.tiers["remote"][0].capacity // req_bytes) == p.resident_requests["remote"]
    # parking engines decode only what fits in HBM at full length: running never exceeds the plan's HBM count
    summary, _ = simulate(tmp_path, "park", serving__kv_offload="remote", load__concurrency=[160])
    lv = summary["levels"][0]
    assert lv["server_running_max"] <= p.resident_requests["hbm"]
    assert lv["server_running_max"] + lv["server_parked_max"] == 160


def test_vram_bound_control_queues_past_the_plans_residency(tmp_path):
    summary, _ = simulate(tmp_path, "control", load__concurrency=[32, 96])
    low, high = summary["levels"]
    assert low["kv_usage_max"] < 0.8 and low["server_waiting_mean"] < 1
    assert high["server_waiting_mean"] > 30  # 96 users, ~48-60 fit in VRAM: the rest wait
    assert high["kv_usage_max"] > 0.95
    assert summary["diagnosis"][0]["bound"] == "kv_capacity"


# ------------------------------------------------------------------------------------------ physics directions


def test_twice_the_vram_more_than_doubles_residency(tmp_path):
    small = plan(resolve(scenario()))
    big = plan(resolve(scenario(cluster__gpu__memory="48GiB")))
    assert big.resident_requests["hbm"] > 2 * small.resident_requests["hbm"]  # weights are paid once
    s_small, _ = simulate(tmp_path, "v24", load__concurrency=[256])
    s_big, _ = simulate(tmp_path, "v48", load__concurrency=[256], cluster__gpu__memory="48GiB")
    assert s_big["levels"][0]["server_running_max"] > 2 * s_small["levels"][0]["server_running_max"]


def test_a_faster_link_cuts_the_spilled_requests_transfer_time(tmp_path):
    results = {}
    for bw in ("25Gbps", "100Gbps", "400Gbps"):
        summary, records = simulate(tmp_path, bw, serving__kv_offload="remote", load__concurrency=[96],
                                    cluster__interconnect__bandwidth=bw)
        spilled = [r for r in measured(records) if r["parked_ms"] > 0]
        assert len(spilled) > 20
        results[bw] = (float(np.mean([r["copy_ms"] for r in spilled])), summary["levels"][0]["output_tok_s"],
                       summary["levels"][0]["link_util_max"])
    # one copy out and one back of ~1024 tokens × 512 KiB over the NIC at 90% efficiency, plus contention
    one_way_400 = 1025 * 524288 / (400e9 / 8 * 0.9) * 1e3
    assert 2 * one_way_400 <= results["400Gbps"][0] < 3 * one_way_400
    assert results["25Gbps"][0] > 4 * results["100Gbps"][0] > 4 * results["400Gbps"][0]
    assert results["25Gbps"][1] < results["100Gbps"][1] < results["400Gbps"][1]  # throughput follows
    assert results["25Gbps"][2] >= 0.85  # a saturated 25 Gbps NIC shows in link.util


def test_a_faster_link_cuts_spill_over_tpot_when_preempted_kv_is_swapped(tmp_path):
    # vLLM's admission with a remote tier: preempted sequences are copied out (the step waits for the copy) and
    # back in before they decode, so the copy is on the TPOT path of the spilled requests and of the batch
    tpot = {}
    for bw in ("25Gbps", "100Gbps"):
        summary, records = simulate(tmp_path, bw, serving__kv_offload="remote", serving__offload_admission="hbm",
                                    load__concurrency=[64], load__duration="40s", load__warmup="10s",
                                    cluster__interconnect__bandwidth=bw)
        spilled = [r for r in measured(records) if r["copy_ms"] > 0]
        assert len(spilled) >= 10 and summary["levels"][0]["preemptions"] > 0
        tpot[bw] = (float(np.mean([r["tpot_ms"] for r in spilled])),
                    float(np.mean([r["tpot_ms"] for r in measured(records)])))
    assert tpot["100Gbps"][0] < 0.9 * tpot["25Gbps"][0]
    assert tpot["100Gbps"][1] < tpot["25Gbps"][1]


def test_offload_changes_nothing_while_vram_suffices(tmp_path):
    _, control = simulate(tmp_path, "c", load__concurrency=[16])
    _, remote = simulate(tmp_path, "r", load__concurrency=[16], serving__kv_offload="remote")
    key = ["start_s", "ttft_ms", "e2e_ms", "output_tokens"]
    assert [[r[k] for k in key] for r in control] == [[r[k] for k in key] for r in remote]


# ------------------------------------------------------------------------------------------ load models, traces


def test_open_loop_rate_is_offered_and_latency_counts_from_arrival(tmp_path):
    summary, records = simulate(tmp_path, "rate", load__concurrency=None, load__rate=[2.0], load__duration="60s",
                                load__arrival="constant")
    lv = summary["levels"][0]
    assert lv["mode"] == "rate"
    assert lv["achieved_rate"] == pytest.approx(2.0, rel=0.02)
    starts = sorted(r["start_s"] for r in records)
    assert np.diff(starts) == pytest.approx(0.5, abs=1e-6)  # arrivals on schedule, whatever the cluster does
    r = measured(records)[0]
    assert r["ttft_ms"] >= r["queue_ms"] >= 0
    assert r["e2e_ms"] == pytest.approx(r["ttft_ms"] + sum(r["itl_ms"]), abs=0.01 * len(r["itl_ms"]))


def test_records_obey_the_definitions(tmp_path):
    _, records = simulate(tmp_path, "defs", load__concurrency=[8])
    for r in measured(records)[:50]:
        assert len(r["itl_ms"]) == r["output_tokens"] - 1 == 255
        assert r["tpot_ms"] == pytest.approx((r["e2e_ms"] - r["ttft_ms"]) / (r["output_tokens"] - 1), abs=1e-3)
        assert r["ttft_ms"] > 100  # a 1024-token prefill of a 7B model on a 4090 takes ~0.13 s
        assert 18 < r["tpot_ms"] < 40


def reusable_prefix_tokens(rows) -> int:
    """The truth: prompt tokens whose 512-token block (and every block before it) an earlier request had."""
    seen: set[int] = set()
    total = 0
    for r in rows:
        for h in r.hash_ids[: r.input_tokens // 512]:
            if h not in seen:
                break
            total += 512
        seen.update(r.hash_ids)
    return total


def test_mooncake_trace_drives_prefix_caching_and_the_tier(tmp_path):

    from kvcap.workload.trace import read_trace

    rows = [r for r in read_trace(str(DATA / "traces" / "mooncake_conversation_trace.jsonl.gz"), limit=600)
            if r.arrival_s < 120]
    sc = scenario(serving__kv_offload="remote", serving__routing="kv_aware", load__duration="120s",
                  load__warmup="0s", model__preset="llama-3.1-8b", model__weights_dtype="bf16",
                  cluster__gpu__preset="a100-80gb", cluster__remote_memory="4TiB")
    plan_ = LoadPlan.from_spec(sc.load, trace=rows, drain_timeout_s=600)
    out = tmp_path / "trace"
    summary = run_sim(SimConfig(scenario=sc, plan=plan_, out=out, slo=SLO))
    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert summary.levels[0].mode == "trace"
    assert len(records) == len(rows) and all(r["ok"] for r in records)  # every row served, none lost
    hbm = sum(r["prefix_hit_tokens"] for r in records)
    tier = sum(r["tier_hit_tokens"] for r in records)
    truth = reusable_prefix_tokens(rows)
    assert 0.7 * truth <= hbm + tier <= truth  # never more reuse than the trace holds; most of it found
    assert tier > 0  # a prefix cached on another replica comes from the shared pool over the NIC
    hit = [r for r in records if r["prefix_hit_tokens"] >= 4096]
    miss = [r for r in records if r["prefix_hit_tokens"] + r["tier_hit_tokens"] == 0 and r["input_tokens"] >= 4096]
    # time from admission to first token, per prompt token: cached prefixes are not recomputed
    per_token = lambda rs: np.median([(r["ttft_ms"] - r["queue_ms"]) / r["input_tokens"] for r in rs])  # noqa: E731
    assert hit and miss and per_token(hit) < 0.5 * per_token(miss)


# ------------------------------------------------------------------------------------------ the CLI


def test_sim_cli_writes_a_run_directory_analyze_reads(tmp_path):
    out = tmp_path / "run"
    p = run_cli("sim", str(SCENARIO), "--out", str(out), "--concurrency", "8,48", "--duration", "20s",
                "--warmup", "5s", "--repeats", "2", "--set", "serving.kv_offload=remote", "--json")
    assert p.returncode == 0, p.stderr
    summary = json.loads(p.stdout)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["source"] == "sim"
    assert manifest["fixed"]["serving.kv_offload"] == "remote"
    assert manifest["fixed"]["model.preset"] == "llama-2-7b"
    names = {json.loads(line)["name"] for line in (out / "telemetry.jsonl").read_text().splitlines()}
    assert {"server.requests_running", "server.requests_waiting", "server.requests_parked", "server.kv_usage",
            "server.preemptions_total", "gpu.util", "link.util", "net.tx_bytes_s", "server.kv_tier_usage"} <= names
    levels = [json.loads(line) for line in (out / "levels.jsonl").read_text().splitlines()]
    assert len(levels) == 4 and {lv["repeat"] for lv in levels} == {0, 1}
    assert summary["sim"]["realtime_factor"] > 100
    again = run_cli("analyze", str(out), "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["levels"][1]["output_tok_s"] == summary["levels"][1]["output_tok_s"]


@pytest.mark.parametrize("args, fragment", [
    (["--set", "cluster.nodes=0"], "cluster.nodes"),
    (["--set", "serving.kv_offload=disk"], "serving.kv_offload"),
    (["--set", "cluster.bogus=1"], "unknown key"),
    (["--concurrency", "8,x"], "--concurrency"),
    (["--set", "workload.input_tokens=uniform:9"], "input"),
])
def test_sim_bad_input_is_one_line_exit_2(tmp_path, args, fragment):
    p = run_cli("sim", str(SCENARIO), "--out", str(tmp_path / "x"), *args)
    assert p.returncode == 2, p.stderr
    assert fragment in p.stderr and "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_sim_missing_scenario_is_exit_2(tmp_path):
    p = run_cli("sim", str(tmp_path / "nope.yaml"), "--out", str(tmp_path / "x"))
    assert p.returncode == 2 and "not found" in p.stderr


def test_demo_gives_the_verdict_and_the_report(tmp_path):
    out = tmp_path / "demo"
    p = run_cli("demo", "--out", str(out), "--set", "load.repeats=2", "--set", "load.duration=30s",
                "--set", "load.concurrency=[16,24,48,96]")
    assert p.returncode == 0, p.stderr
    assert "verdict: capacity-only" in p.stdout
    assert str(out / "report.html") in p.stdout
    answers = p.stdout[p.stdout.index("The article's two answers"):]
    assert "(the article's workload): capacity-only" in answers
    assert "(prefix reuse): performance-scaling" in answers
    prefix = json.loads((out / "prefix-reuse" / "compare.json").read_text())
    assert prefix["verdict"] == "performance-scaling"
    assert prefix["treatment"]["effective"] > (prefix["control"]["effective"] or 0)
    result = json.loads((out / "compare.json").read_text())
    assert result["verdict"] == "capacity-only"
    c, t = result["control"], result["treatment"]
    assert c["effective"] == t["effective"] == 48
    assert t["resident"] == 96 > c["resident"]
    assert result["fixed_variables"]["equal"] and result["fixed_variables"]["under_test"] == ["serving.kv_offload"]
    for arm in ("control", "treatment"):
        assert (out / arm / "requests.jsonl").exists() and (out / arm / "summary.json").exists()
    html = (out / "report.html").read_text()
    assert "capacity-only" in html and "<svg" in html


def test_sim_sigint_keeps_records_and_writes_the_summary(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "long"
    proc = subprocess.Popen([sys.executable, "-m", "kvcap", "sim", str(SCENARIO), "--out", str(out), "--concurrency",
                             "96", "--duration", "100000s", "--repeats", "1", "--quiet"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        req = out / "requests.jsonl"
        if req.exists() and req.stat().st_size > 200_000:
            break
        time.sleep(0.2)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    rc = proc.wait(timeout=30)
    assert time.monotonic() - t0 < 10
    assert rc == 130, proc.stderr.read()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is True
    lines = (out / "requests.jsonl").read_text().splitlines()
    assert summary["levels"][0]["requests"] + 1 >= sum(1 for x in lines if json.loads(x)["phase"] == "measure") > 0


def test_report_of_a_sim_run_has_per_node_and_link_sections(tmp_path):
    out = tmp_path / "run"
    p = run_cli("sim", str(SCENARIO), "--out", str(out), "--concurrency", "64", "--duration", "20s", "--warmup", "5s",
                "--repeats", "1", "--set", "serving.kv_offload=remote", "--quiet")
    assert p.returncode == 0, p.stderr
    p = run_cli("report", str(out), "--out", str(tmp_path / "r.html"))
    assert p.returncode == 0, p.stderr
    html = (tmp_path / "r.html").read_text()
    assert "Per node" in html and ">n3<" in html  # four replicas on four nodes
    assert "parked in a lower tier" in html and "busiest link utilisation" in html
    assert "GPU utilisation per node" in html


# ------------------------------------------------------------------------------------------ regressions (review)


def test_requests_mid_copy_at_the_drain_limit_are_recorded_and_nothing_new_is_sent(tmp_path):
    from dataclasses import replace

    sc = scenario(cluster__nodes=1, cluster__gpu__memory="16GiB", serving__kv_offload="remote",
                  cluster__remote_memory_bandwidth="10Mbps", load__concurrency=[8], load__warmup="0s",
                  load__duration="5s", workload__output_tokens=64)
    out = tmp_path / "drain"
    run_sim(SimConfig(scenario=sc, plan=replace(LoadPlan.from_spec(sc.load), drain_timeout_s=5.0), out=out))
    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    info = json.loads((out / "levels.jsonl").read_text().splitlines()[0])
    assert len(records) == info["sent_measured"] >= 8  # every request sent has a record
    assert info["sim"]["simulated_s"] == pytest.approx(10.0)  # the drain limit, not the last event
    assert info["sim"]["cancelled"] == sum(1 for r in records if r["error"] == "cancelled") > 0




def test_the_same_scenario_and_seed_give_the_same_records_in_separate_processes(tmp_path):
    """Reproducible to the byte with a tier in play (links keep transfers in start order, not in sets ordered by
    memory address, which an unrelated allocation could reorder)."""
    outs = []
    for name in ("a", "b"):
        out = tmp_path / name
        p = run_cli("sim", str(SCENARIO), "--out", str(out), "--concurrency", "96", "--warmup", "2s",
                    "--duration", "20s", "--repeats", "1", "--set", "serving.kv_offload=remote", "--quiet")
        assert p.returncode == 0, p.stderr
        outs.append((out / "requests.jsonl").read_bytes())
    assert outs[0] == outs[1] and outs[0].count(b"\n") > 100


def test_sim_records_follow_the_one_record_schema(tmp_path):
    """``rundir.RequestRecord`` is the schema both builders are typed against: every key a sim record carries is
    in it, and every required key is there (``tests/integration/test_bench.py`` holds bench's records to the same)."""
    from kvcap.rundir import RECORD_FIELDS, REQUIRED_RECORD_FIELDS

    _, records = simulate(tmp_path, "schema", serving__kv_offload="remote", load__concurrency=[64])
    assert records and "mode" in REQUIRED_RECORD_FIELDS and "replica" in RECORD_FIELDS - REQUIRED_RECORD_FIELDS
    for r in records:
        assert REQUIRED_RECORD_FIELDS <= r.keys() <= RECORD_FIELDS, set(r) ^ RECORD_FIELDS


def test_every_level_sends_the_same_request_lengths_and_repeats_draw_afresh(tmp_path):
    """Request i has the same (input, output) lengths at every level, as bench sends one prompt set at every level:
    levels then differ by load alone. A repeat draws its own set (the simulator's only run-to-run variation)."""
    _, records = simulate(tmp_path, "lengths", workload__input_tokens="lognormal:512,256",
                          workload__output_tokens="lognormal:64,32", load__rate=[2, 8], load__repeats=2,
                          load__warmup="0s", load__duration="10s")
    sets: dict[tuple[float, int], dict[int, tuple[int, int]]] = {}
    for r in records:
        sets.setdefault((r["level"], r["repeat"]), {})[r["index"]] = (r["input_tokens"], r["requested_output_tokens"])
    for repeat in (0, 1):
        low, high = sets[(2, repeat)], sets[(8, repeat)]
        shared = sorted(set(low) & set(high))
        assert len(shared) >= 10 and len({low[i] for i in shared}) > 5  # varied lengths, many requests in both
        assert all(low[i] == high[i] for i in shared)
    first = sorted(set(sets[(8, 0)]) & set(sets[(8, 1)]))
    assert sum(sets[(8, 0)][i] != sets[(8, 1)][i] for i in first) > len(first) // 2
