"""``kvcap compare`` on real ``kvcap sim`` runs: a prefix tier that serves prompt tokens took effect (its tier-hit
tokens are the evidence, equal to the records' own count), and a tier turned on that serves none is a warning.

The trace arms replay the Mooncake conversation trace (its ``hash_ids`` repeat prefix blocks) on a cluster whose
cards hold its prompts (as test_sim.py's trace test does); the parking arms are the reference scenario's A/B.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvcap.rundir import RunDir
from tests.conftest import DATA, ROOT, run_cli

SCENARIO = ROOT / "scenarios" / "seed-reference.yaml"
TRACE = DATA / "traces" / "mooncake_conversation_trace.jsonl.gz"
BIG_CARDS = ("serving.routing=kv_aware", "model.preset=llama-3.1-8b", "model.weights_dtype=bf16",
             "cluster.gpu.preset=a100-80gb", "cluster.remote_memory=4TiB")
IDLE = "tier on, no hit tokens: it cannot have saved work"


def sim(out: Path, offload: str, *args: str, sets: tuple[str, ...] = ()) -> Path:
    p = run_cli("sim", str(SCENARIO), "--out", str(out), "--quiet", "--set", f"serving.kv_offload={offload}",
                *(x for s in sets for x in ("--set", s)), *args, timeout=600)
    assert p.returncode == 0, p.stderr
    return out


def compare(control: Path, treatment: Path) -> dict:
    p = run_cli("compare", str(control), str(treatment), "--allow-diff", "serving.kv_offload", "--json")
    assert p.returncode == 0, p.stderr
    result: dict = json.loads(p.stdout)
    return result


def measured_tier_hits(run: Path) -> tuple[int, int]:
    """(tier-hit tokens, prompt tokens) of the measured requests that succeeded, from the records themselves."""
    recs = [r for r in RunDir(run).records() if r["phase"] == "measure" and r["ok"]]
    return sum(r["tier_hit_tokens"] for r in recs), sum(r["input_tokens"] for r in recs)


def test_tier_hit_tokens_show_the_prefix_tier_took_effect(tmp_path):
    trace = ("--trace", str(TRACE), "--duration", "60s", "--warmup", "10s", "--repeats", "1")
    control = sim(tmp_path / "control", "none", *trace, sets=BIG_CARDS)
    treatment = sim(tmp_path / "treatment", "remote", *trace, sets=BIG_CARDS)
    tier, prompt = measured_tier_hits(treatment)
    assert tier > 0 and measured_tier_hits(control)[0] == 0  # the remote pool served prefixes; no tier, none
    result = compare(control, treatment)
    assert result["treatment_took_effect"] is True
    assert result["effect_evidence"] == [
        f"more prompt tokens loaded from a lower tier: {tier:,} tier-hit tokens in the treatment "
        f"({tier / prompt:.1%} of {prompt:,} prompt tokens) vs 0 in the control (0.0% of {prompt:,} prompt tokens), "
        "from the measured requests' records"]
    assert not any(w.startswith(IDLE) for w in result["warnings"])
    st = RunDir(treatment).summary
    assert st is not None
    reuse = st.levels[0].prefix_reuse
    assert reuse is not None and reuse.tier_hit_tokens == tier and reuse.prompt_tokens == prompt
    text = run_cli("compare", str(control), str(treatment), "--allow-diff", "serving.kv_offload")
    assert f"treatment took effect: more prompt tokens loaded from a lower tier: {tier:,}" in text.stdout


def test_a_parking_tier_with_no_hit_tokens_is_a_warning(tmp_path):
    load = ("--concurrency", "8,48", "--duration", "10s", "--warmup", "2s", "--repeats", "1")
    control = sim(tmp_path / "control", "none", *load)
    treatment = sim(tmp_path / "treatment", "remote", *load)
    assert measured_tier_hits(treatment)[0] == 0  # no prompt shares a prefix: nothing to load from the tier
    result = compare(control, treatment)
    assert [w for w in result["warnings"] if w.startswith(IDLE)] == [
        f"{IDLE} (serving.kv_offload=remote, 0 tier-hit tokens in the treatment's measured windows): any gain is "
        "parked requests, not saved prefill"]
    assert "effect_evidence" not in result
    summary = json.loads((treatment / "summary.json").read_text())
    assert all("prefix_reuse" not in lv for lv in summary["levels"])  # no hit anywhere: the summary as before
