"""The llm-d tiered prefix-cache A/B in short (fewer requests): what the design guarantees, not the published
figures (``benchmarks/tier_fidelity.py`` compares those). The control has no tier, so it serves nothing from one;
the treatment stores every computed prefix in its replicas' CPU pools and serves repeats from them; a tier can
only add hits, so the treatment's knee is never below the control's."""

from __future__ import annotations

from benchmarks.tier_fidelity import compare, knee, published, simulate
from kvcap.rundir import RunDir
from tests.conftest import ROOT, run_cli
from tests.unit.test_prefix_routing import TREATMENT, llmd, replay, shared_prefix_trace


def test_engine_treatment_serves_from_its_tier_and_control_never_does():
    """The scenario's cluster and router on a shared-prefix trace with the published shape, scaled down
    (40 groups × 5 prompts, a 4,000-token prefix, two passes): repeats of a group hit HBM or the tier."""
    trace = shared_prefix_trace(groups=40, per_group=5, prefix_blocks=250, question_blocks=16, rounds=2, rate=10.0)
    hits = {}
    for arm, overrides in (("control", {}), ("treatment", TREATMENT)):
        done, sim = replay(llmd(**overrides, **{"serving.kv_tokens": 10_000}), trace)
        assert len(done) == len(trace) and not any(r.error for r in done)
        hits[arm] = (sum(r.hit_hbm for r in done), sum(r.hit_tier for r in done))
        if arm == "treatment":
            assert all(rep.tiers.host is not None and rep.tiers.host.prefix for rep in sim.replicas)
    assert hits["control"][1] == 0
    assert hits["treatment"][1] > 0
    assert sum(hits["treatment"]) > sum(hits["control"])


def test_kvcap_sim_of_both_arms_short():
    """Both arms through ``kvcap sim`` at the published stages, 10 s each."""
    pub = published()
    stages = [float(s["qps"]) for s in pub["stages"]]
    sim = simulate(stages, duration="10s")
    assert all(sim["control"][q]["hit_tier"] == 0 for q in stages)
    # the first stage may find every prefix still in HBM; once HBM has let prefixes go, the tier serves them
    assert sim["treatment"][stages[-1]]["hit_tier"] > 0
    limit = float(pub["knee_p90_ttft_s"])
    kc, kt = knee(sim["control"], limit), knee(sim["treatment"], limit)
    assert (kt or 0) >= (kc or 0)
    assert len(compare(pub, sim)["rows"]) == len(stages)


def test_the_experiment_file_runs_as_is_and_set_reaches_both_arms(tmp_path):
    """``kvcap ab scenarios/llmd-tiered-prefix-cache-ab.yaml --set KEY=VALUE``: one short stage; the override is
    in both arms' manifests, the arms differ only in the tier, and the control never loads from one."""
    out = tmp_path / "ab"
    p = run_cli("ab", str(ROOT / "scenarios" / "llmd-tiered-prefix-cache-ab.yaml"), "--out", str(out), "--quiet",
                "--set", "load.rate=[10]", "--set", "load.duration=8s", "--set", "workload.prefix_groups=20",
                timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    arms = {arm: RunDir(out / arm).manifest.fixed for arm in ("control", "treatment")}
    for fixed in arms.values():
        assert fixed["load.duration"] == 8.0 and fixed["workload.prefix_groups"] == 20
    c, t = arms["control"], arms["treatment"]
    differ = {k for k in {*c, *t} if c.get(k) != t.get(k)}
    assert differ == {"serving.kv_offload", "serving.host_kv_scope", "serving.host_kv_tokens"}
    assert sum(r.get("tier_hit_tokens", 0) for r in RunDir(out / "control").records()) == 0
