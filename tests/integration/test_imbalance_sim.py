"""The imbalance finding on simulated runs, both ways: idle replicas at low load are not one; skewed routing is.

Truths: with fewer requests in flight than replicas, a balancer must leave replicas idle; with round-robin
routing and a trace whose even-numbered requests are 10× longer, every long request lands on one replica (the
records say which), so that replica holds most of what is in flight while the other holds little.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import ROOT, run_cli

SCENARIO = ROOT / "scenarios" / "seed-reference.yaml"
SHORT = ("--duration", "20s", "--warmup", "5s", "--repeats", "1", "--json")


def sim(out: Path, *args: str) -> dict:
    p = run_cli("sim", str(SCENARIO), "--out", str(out), *args)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def imbalance_findings(summary: dict) -> list[dict]:
    return [f for f in summary["diagnosis"] if f["bound"] == "imbalance"]


def test_no_imbalance_with_fewer_requests_than_replicas(tmp_path):
    # the demo's cluster (4 replicas, least-loaded): c=1 and c=2 must leave replicas idle; c=4 and c=8 fill all
    summary = sim(tmp_path / "low", "--concurrency", "1,2,4,8", *SHORT)
    by_level = {lv["level"]: lv for lv in summary["levels"]}
    assert by_level[1]["nodes"]["n1"]["gpu_util_mean"] == 0.0  # the idle replica is there, and expected
    assert all("imbalance" not in lv for lv in summary["levels"])
    assert imbalance_findings(summary) == []


def test_two_replicas_at_c1_is_not_imbalance(tmp_path):
    summary = sim(tmp_path / "c1", "--concurrency", "1", "--set", "cluster.nodes=2", *SHORT)
    assert imbalance_findings(summary) == []


def skewed_trace(path: Path) -> Path:
    rows = [{"arrival_s": i * 0.5, "input_tokens": 512, "output_tokens": 500 if i % 2 == 0 else 50}
            for i in range(100)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_round_robin_with_skewed_lengths_is_imbalance_on_the_right_node(tmp_path):
    trace = skewed_trace(tmp_path / "skew.jsonl")
    out = tmp_path / "rr"
    summary = sim(out, "--trace", str(trace), "--set", "cluster.nodes=2", "--set", "serving.routing=round_robin",
                  "--duration", "40s", "--warmup", "5s", "--repeats", "1", "--json")
    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    long_on = {r["replica"] for r in records if r["output_tokens"] == 500}
    short_on = {r["replica"] for r in records if r["output_tokens"] == 50}
    assert len(long_on) == 1 and long_on.isdisjoint(short_on)  # the truth: one replica got every long request
    hot_node = f"n{next(iter(long_on))}"  # one replica per node (gpus_per_node 1): replica i is node i
    (lv,) = summary["levels"]
    assert lv["imbalance"]["hot"] == hot_node and lv["imbalance"]["metric"] == "requests_held"
    # both GPUs are 100% busy (one decode keeps a GPU busy): utilisation alone could not see it
    assert {f["gpu_util_mean"] for f in lv["nodes"].values()} == {1.0}
    (finding,) = imbalance_findings(summary)
    assert f"node {hot_node} holds" in finding["evidence"]
    # the same trace, least-loaded: balanced, no finding
    balanced = sim(tmp_path / "ll", "--trace", str(trace), "--set", "cluster.nodes=2", "--duration", "40s",
                   "--warmup", "5s", "--repeats", "1", "--json")
    assert imbalance_findings(balanced) == [] and "imbalance" not in balanced["levels"][0]
