"""Prefix-reuse telemetry per tier (issue 32): the simulator's counters under vLLM's names against its own records.

serve-sim over HTTP with a shared-prefix ``kvcap bench``: ``/metrics``' ``vllm:prefix_cache_hits_total`` is the
sum of the logged records' ``prefix_hit_tokens`` and its queries their prompt tokens. An offline ``kvcap sim``
with an offload tier: every level's last value of each replica's reuse counter is the sum of that replica's
records, HBM and tier; a workload without block hashes writes no reuse counter at all.
"""

from __future__ import annotations

import json
import re
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

import yaml

from kvcap.analysis.telemetry import expand_held
from kvcap.rundir import RunDir
from kvcap.sim.run import config_for, run_sim
from tests.conftest import run_cli
from tests.integration.test_serve_sim import SCENARIO, running_serve_sim
from tests.waiting import wait_until

SHARED = ("--prefix-tokens", "256", "--prefix-groups", "2", "--prompts-per-group", "3", "--input-tokens", "48",
          "--output-tokens", "8")
REUSE = ("server.prefix_cache_queries_total", "server.prefix_cache_hits_total",
         "server.offload_prefix_queries_total", "server.offload_prefix_hits_total")


def _metric(text: str, name: str) -> float | None:
    """The sum over a family's series on a /metrics page (None: no such series)."""
    values = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)]
    return sum(values) if values else None


def test_serve_sim_metrics_count_the_prefix_hits_its_records_show(tmp_path: Path) -> None:
    one = ("cluster.nodes=1", "serving.hash_block_tokens=16")
    out = tmp_path / "bench"
    with running_serve_sim(tmp_path, *one) as (url, log):
        p = run_cli("bench", "--url", url, "--concurrency", "2", *SHARED, "--warmup", "0s", "--requests", "12",
                    "--metrics-url", url + "/metrics", "--out", str(out), "--quiet", "--json", timeout=120)
        assert p.returncode == 0, p.stderr
        sent = sum(1 for _ in (out / "requests.jsonl").open())
        assert wait_until(lambda: log.read_text().count("\n") >= sent, 10)
        with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
            page = r.read().decode()
    logged = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(logged) == sent >= 12 and all(r["ok"] for r in logged)
    hits = sum(r["prefix_hit_tokens"] for r in logged)
    assert hits > 0  # the groups' system prompts were found in HBM
    assert _metric(page, "vllm:prefix_cache_hits_total") == hits
    assert _metric(page, "vllm:prefix_cache_queries_total") == sum(r["input_tokens"] for r in logged)
    assert _metric(page, "vllm:external_prefix_cache_hits_total") is None  # no tier, no connector counters
    # bench read them through the catalog: the level's figure comes from the counters the server exposed
    names = {json.loads(line)["name"] for line in (out / "telemetry.jsonl").open()}
    assert {"server.prefix_cache_queries_total", "server.prefix_cache_hits_total"} <= names


def _sim(tmp_path: Path, name: str, sets: dict[str, Any], full: bool = False) -> RunDir:
    data = yaml.safe_load(SCENARIO.read_text())
    overrides = {"cluster.nodes": 2, "serving.hash_block_tokens": 16, "load.concurrency": [4, 8],
                 "load.duration": "6s", "load.warmup": "1s", "load.repeats": 1, **sets}
    cfg = config_for(data, overrides, tmp_path / name)
    cfg.full_telemetry = full
    run_sim(cfg)
    return RunDir(tmp_path / name)


def _last_values(run: RunDir) -> dict[tuple[int, str, str], float]:
    """(level, series, replica) → the series' last value in that level's span."""
    spans = [(lv["level"], lv["t_start_s"], lv["t_end_s"]) for lv in map(json.loads, (run.dir / "levels.jsonl").open())]
    out: dict[tuple[int, str, str], float] = {}
    for row in map(json.loads, (run.dir / "telemetry.jsonl").open()):
        if row["name"] in REUSE:
            level = next(lv for lv, t0, t1 in spans if t0 <= row["t_s"] <= t1)
            out[level, row["name"], row["labels"]["replica"]] = row["value"]
    return out


def test_sim_reuse_counters_end_at_the_records_sums(tmp_path: Path) -> None:
    shared = {"workload.prefix_tokens": 256, "workload.prefix_groups": 4, "workload.prompts_per_group": 4,
              "workload.input_tokens": 48, "workload.output_tokens": 8, "serving.kv_offload": "remote"}
    run = _sim(tmp_path, "thin", shared)
    sums: dict[tuple[int, str, str], int] = defaultdict(int)
    for rec in map(json.loads, (run.dir / "requests.jsonl").open()):
        if rec["ok"]:
            key = (rec["level"], f"r{rec['replica']}")
            for name, value in zip(REUSE, (rec["input_tokens"], rec["prefix_hit_tokens"], rec["input_tokens"],
                                           rec["tier_hit_tokens"])):
                sums[key[0], name, key[1]] += value
    assert _last_values(run) == dict(sums)
    assert sum(v for (_, n, _), v in sums.items() if n == REUSE[1]) > 0
    assert sum(v for (_, n, _), v in sums.items() if n == REUSE[3]) > 0  # some prefixes came back from the pool
    # bytes per tier link: the NICs carried prefixes out to the pool and back
    moved = defaultdict(float)
    for row in map(json.loads, (run.dir / "telemetry.jsonl").open()):
        if row["name"] == "link.bytes_total" and row["labels"]["kind"] == "nic":
            moved[row["labels"]["direction"]] = max(moved[row["labels"]["direction"]], row["value"])
    assert moved["out"] > 0 and moved["in"] > 0
    # written on change, the rows expand to the full grid's, reuse counters included
    full = _sim(tmp_path, "full", shared, full=True)
    assert expand_held(run.telemetry()) == full.telemetry()


def test_a_workload_without_block_hashes_writes_no_reuse_counter(tmp_path: Path) -> None:
    run = _sim(tmp_path, "plain", {"workload.input_tokens": 48, "workload.output_tokens": 8})
    names = {json.loads(line)["name"] for line in (run.dir / "telemetry.jsonl").open()}
    assert "server.requests_running" in names and not names & set(REUSE)
    summary = json.loads((run.dir / "summary.json").read_text())
    assert all("prefix_reuse" not in lv for lv in summary["levels"])

