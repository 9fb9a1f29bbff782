"""Both directions of the verdict on one scenario: the prefix-reuse A/B on the reference cluster
(``scenarios/seed-reference-prefix-ab.yaml``) with LMCache's tier rules. A pool too small to hold the shared
prefixes serves almost no prompt tokens and gains nothing; a pool that holds them all serves most prompt tokens and
moves the knee (performance scaling). And the tier inputs that make no sense stop ``kvcap sim`` with one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcap.rundir import RunDir
from tests.conftest import ROOT, run_cli

EXPERIMENT = ROOT / "scenarios" / "seed-reference-prefix-ab.yaml"
SCENARIO = ROOT / "scenarios" / "seed-reference.yaml"
SHORT = ("load.duration=20s", "load.warmup=5s", "load.repeats=1", "serving.kv_tier_profile=lmcache")


def ab(out: Path, pool: str) -> tuple[dict, float]:
    """The A/B with the treatment's pool of this size: compare.json and the treatment's tier-hit share of its
    measured prompt tokens (from the records themselves)."""
    sets = (*SHORT, f"cluster.remote_memory={pool}")
    p = run_cli("ab", str(EXPERIMENT), "--out", str(out), "--quiet", *(x for s in sets for x in ("--set", s)),
                timeout=600)
    assert p.returncode == 0, p.stderr
    recs = [r for r in RunDir(out / "treatment").records() if r["phase"] == "measure" and r["ok"]]
    share = sum(r["tier_hit_tokens"] for r in recs) / sum(r["input_tokens"] for r in recs)
    return json.loads((out / "compare.json").read_text()), share


def test_small_tier_gains_nothing_big_tier_scales(tmp_path):
    small, small_share = ab(tmp_path / "small", "1GiB")
    big, big_share = ab(tmp_path / "big", "256GiB")
    assert small["verdict"] != "performance-scaling" and small_share < 0.02, (small["verdict"], small_share)
    assert not small["goodput_gain"]["beyond_noise"]
    assert big["verdict"] == "performance-scaling" and big_share > 0.3, (big["verdict"], big_share)
    assert big["goodput_gain"]["beyond_noise"] and big["goodput_gain"]["delta_tok_s"] > 0


STORAGE = "{capacity: 1TiB, read_bandwidth: 10GB/s, write_bandwidth: 5GB/s}"


@pytest.mark.parametrize("sets, words", [
    (("serving.kv_tier_profile=nope",), "kv_tier_profile"),
    (("serving.kv_offload=storage",), "cluster.shared_storage"),
    (("serving.kv_offload=storage", "cluster.shared_storage={read_bandwidth: 1GB/s, write_bandwidth: 1GB/s}"),
     "capacity"),
    (("serving.kv_offload=storage", "cluster.shared_storage={capacity: 1TiB}"), "read_bandwidth"),
    (("serving.kv_offload=storage", "cluster.nodes=1", f"cluster.shared_storage={STORAGE}"), "one replica"),
])
def test_bad_tier_input_exits_2_with_one_line(tmp_path, sets, words):
    p = run_cli("sim", str(SCENARIO), "--out", str(tmp_path / "run"), *(x for s in sets for x in ("--set", s)))
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in p.stderr, p.stderr


LLAMA2_7B_KV_BYTES_PER_TOKEN = 2 * 32 * 32 * 128 * 2
"""K and V, 32 layers, 32 KV heads of 128, fp16: the reference scenario's model."""


def test_a_storage_tier_s_links_are_in_the_telemetry(tmp_path):
    """A run with shared storage writes its store's read and write links and the NICs that reach it: utilisation
    and bytes moved — the store's read link carried exactly the KV of the tokens the records say came from it."""
    out = tmp_path / "storage"
    p = run_cli("sim", str(ROOT / "scenarios" / "seed-reference.yaml"), "--out", str(out), "--quiet",
                "--prefix-tokens", "2048", "--prefix-groups", "32", "--prompts-per-group", "8",
                "--input-tokens", "256", "--output-tokens", "64", "--concurrency", "16", "--duration", "20s",
                "--repeats", "1", "--set", "serving.kv_offload=storage", "--set", "serving.kv_tier_profile=lmcache",
                "--set", "serving.hash_block_tokens=16",
                "--set", "cluster.shared_storage={capacity: 256GiB, read_bandwidth: 25GB/s, write_bandwidth: 10GB/s}",
                timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [json.loads(line) for line in (out / "telemetry.jsonl").read_text().splitlines()]
    kinds = {r["labels"].get("kind") for r in rows if r["name"] == "link.util"}
    assert {"storage", "nic"} <= kinds
    moved = {d: max(r["value"] for r in rows if r["name"] == "link.bytes_total"
                    and r["labels"].get("link") == "storage-read" and r["labels"].get("direction") == d)
             for d in ("in", "out")}
    tier_tokens = sum(r.get("tier_hit_tokens", 0) for r in RunDir(out).records())
    assert tier_tokens > 0
    assert moved == {"in": tier_tokens * LLAMA2_7B_KV_BYTES_PER_TOKEN, "out": 0.0}  # every tier hit read from it
