"""Each diagnosis on the evidence that should trigger it, and not on evidence that should not.

Levels are hand-made summaries (p50 TTFT/TPOT in ms, optional server telemetry); the thresholds are the
module's: TPOT flat within ×1.15, growing from ×1.30, queueing when TTFT exceeds 2·TTFT₀ + 5·TPOT₀ or the
server has ≥ 0.5 requests waiting, KV full from 90%, a link busy from 80%, a client lagging below 0.85.
"""

from __future__ import annotations

from kvcap.analysis.diagnosis import diagnose
from kvcap.rundir.summary import Finding, LevelSummary

_EMPTY = {"p50": None, "p90": None, "p95": None, "p99": None, "mean": None}


def lv(c: float, ttft: float | None, tpot: float | None, ok: int = 100, **extra) -> LevelSummary:
    """A summary level with the figures the diagnosis reads; the rest neutral."""
    return LevelSummary.model_validate({
        "mode": "concurrency", "level": c, "requests": ok, "ok": ok, "errors": 0, "cancelled": 0,
        "error_classes": {}, "output_tok_s": 0.0, "request_s": 0.0, "output_tok_s_repeats": [],
        "goodput_tok_s": 0.0, "goodput_tok_s_repeats": [], "in_flight_mean": None, "error_rate": 0.0,
        "truncated": 0, "output_tokens_mean": None, "input_tokens_mean": None,
        "ttft_ms": _EMPTY | {"p50": ttft}, "tpot_ms": _EMPTY | {"p50": tpot}, "e2e_ms": _EMPTY, "itl_ms": _EMPTY,
        "queue_ms": _EMPTY, "send_delay_ms": _EMPTY, "ci95": {}, "slo_ok": True, "failed_checks": [], **extra})


def run(*levels: LevelSummary, arm: str = "control") -> list[Finding]:
    return diagnose(list(levels), arm)


def bounds(findings: list[Finding]) -> list[str]:
    return [f.bound for f in findings]


def test_kv_capacity_from_client_latencies():
    # TTFT jumps past 2·100 + 5·20 = 300 ms at c=16 while TPOT stays within ×1.15
    f = run(lv(1, 100.0, 20.0), lv(8, 150.0, 21.0), lv(16, 900.0, 22.0))
    assert bounds(f) == ["kv_capacity"] and f[0].arm == "control"
    assert f[0].evidence == ("from c=16 requests queue (TTFT p50 900 ms vs 100 ms at c=1) while TPOT p50 stays "
                                "20.0 → 22.0 ms (×1.10) from c=1 to c=16")
    assert "more KV memory" in f[0].direction


def test_kv_capacity_from_the_server_queue():
    f = run(lv(1, 100.0, 20.0), lv(8, 110.0, 20.0, server_waiting_mean=2.0), lv(16, 120.0, 21.0))
    assert bounds(f) == ["kv_capacity"]
    assert f[0].evidence.startswith("from c=8 requests queue (server waiting 2.0 on average)")


def test_no_kv_capacity_when_tpot_grows_too():
    f = run(lv(1, 100.0, 20.0), lv(16, 900.0, 30.0))        # queueing, but TPOT ×1.5: the GPU is busy
    assert "kv_capacity" not in bounds(f) and bounds(f) == ["compute"]


def test_compute_bound():
    f = run(lv(1, 100.0, 20.0, server_running_max=1.0),
            lv(16, 120.0, 30.0, server_running_max=16.0, gpu_util_mean=0.95, kv_usage_max=0.4))
    assert bounds(f) == ["compute"]
    assert f[0].evidence == ("TPOT p50 grows 20.0 → 30.0 ms (×1.50) from c=1 to c=16 with 16 requests running; "
                                "TTFT p50 100 → 120 ms; GPU utilisation 95% with the KV cache 40% full")
    assert "more memory won't" in f[0].direction


def test_compute_needs_tpot_growth_of_thirty_percent():
    assert bounds(run(lv(1, 100.0, 20.0), lv(16, 120.0, 25.0))) == ["none_seen"]    # ×1.25
    assert bounds(run(lv(1, 100.0, 20.0), lv(16, 120.0, 26.0))) == ["compute"]      # ×1.30


def test_nothing_seen_asks_for_more_load():
    f = run(lv(1, 100.0, 20.0), lv(16, 150.0, 21.0))
    assert bounds(f) == ["none_seen"]
    assert f[0].evidence == "TPOT p50 20.0 → 21.0 ms, no queueing seen up to c=16"


def test_kv_full_with_requests_waiting():
    f = run(lv(48, 200.0, 20.0, kv_usage_max=0.7),
            lv(64, 2900.0, 25.0, kv_usage_max=0.99, server_waiting_mean=3.0, server_running_max=60.0),
            lv(96, 5000.0, 30.0, kv_usage_max=0.99, server_waiting_mean=30.0))
    assert bounds(f) == ["kv_capacity"]                     # not "compute", although TPOT grows ×1.5
    assert f[0].evidence == ("from c=64 the KV cache is 99% full with 3.0 requests waiting; at most 60 run "
                                "(decode) at once; TPOT p50 20.0 → 30.0 ms from c=48 to c=96")
    assert f[0].direction.startswith("VRAM for KV binds")


def test_kv_full_with_requests_parked_in_a_lower_tier():
    f = run(lv(48, 200.0, 20.0), lv(96, 1100.0, 113.0, kv_usage_max=0.99, server_parked_mean=36.0))
    assert bounds(f) == ["kv_capacity"]
    assert "and 36.0 parked in a lower tier" in f[0].evidence
    assert f[0].direction.startswith("the offload tier holds the extra requests but only HBM-resident ones")


def test_kv_not_full_without_anyone_waiting():
    f = run(lv(1, 100.0, 20.0), lv(16, 110.0, 20.0, kv_usage_max=0.95, server_waiting_mean=0.4))
    assert bounds(f) == ["none_seen"]
    f = run(lv(1, 100.0, 20.0), lv(16, 110.0, 20.0, kv_usage_max=0.89, server_waiting_mean=5.0))
    assert bounds(f) == ["kv_capacity"] and "KV cache" not in f[0].evidence   # the queue, not a full cache


def test_client_limited():
    warned = run(lv(1, 100.0, 20.0, client_warnings=["event loop lagged"]), lv(16, 110.0, 20.0))
    assert bounds(warned) == ["client"] and warned[0].evidence == "event loop lagged"   # not "none_seen"
    lagging = run(lv(1, 100.0, 20.0),
                  lv(8, 110.0, 20.0, littles_law={"in_flight": 4.0, "ratio_to_concurrency": 0.5}))
    assert lagging[0].bound == "client" and lagging[0].evidence == "in flight 4.0 at c=8 (ratio 0.50)"
    fine = run(lv(1, 100.0, 20.0), lv(8, 110.0, 20.0, littles_law={"in_flight": 7.2, "ratio_to_concurrency": 0.9}))
    assert "client" not in bounds(fine)


def test_interconnect():
    f = run(lv(1, 100.0, 20.0), lv(16, 110.0, 20.0, link_util_max=0.85))
    assert bounds(f) == ["interconnect"] and f[0].evidence == "link utilisation up to 85%"
    assert "interconnect" not in bounds(run(lv(1, 100.0, 20.0), lv(16, 110.0, 20.0, link_util_max=0.79)))


def test_imbalance():
    hot = {"metric": "gpu_util_mean", "hot": "node0", "hot_value": 0.95, "cold": "node1", "cold_value": 0.3}
    f = run(lv(1, 100.0, 20.0), lv(16, 110.0, 20.0, imbalance=hot))
    assert bounds(f) == ["imbalance"]
    assert f[0].evidence == "at c=16 node node0 has gpu_util_mean 95% while node node1 has 30%"


def test_one_level_says_only_what_telemetry_shows():
    assert run(lv(8, 100.0, 20.0)) == []
    assert bounds(run(lv(8, 100.0, 20.0, link_util_max=0.9))) == ["interconnect"]
    # levels that completed nothing do not count as levels
    assert run(lv(1, 100.0, 20.0), lv(16, None, None, ok=0)) == []
    assert diagnose([]) == []


def test_arm_label_on_every_finding():
    f = diagnose([lv(1, 100.0, 20.0), lv(16, 110.0, 20.0, link_util_max=0.9)], "treatment")
    assert {x.arm for x in f} == {"treatment"}


# ------------------------------------------------------------------ imbalance: the rule on per-node figures


def test_idle_replicas_below_one_request_each_are_not_imbalance():
    from kvcap.analysis.telemetry_nodes import imbalance

    idle = {"n0": {"gpu_util_mean": 1.0, "running_mean": 1.0}, "n1": {"gpu_util_mean": 0.0, "running_mean": 0.0}}
    assert imbalance(idle, in_flight=1, replicas=2) is None
    util_only = {n: {"gpu_util_mean": f["gpu_util_mean"]} for n, f in idle.items()}
    assert imbalance(util_only, in_flight=1, replicas=2) is None
    assert imbalance(util_only, in_flight=2, replicas=2)["hot"] == "n0"   # two in flight could fill both GPUs
    # the servers' own counts say held 1 of 1 in flight, whatever in_flight the caller does not know
    assert imbalance(idle) is None


def test_a_node_under_its_fair_share_is_imbalance():
    from kvcap.analysis.telemetry_nodes import imbalance

    skew = {"n0": {"running_mean": 0.7, "waiting_mean": 0.0}, "n1": {"running_mean": 7.3, "waiting_mean": 0.0}}
    assert imbalance(skew, in_flight=8, replicas=2) == {
        "metric": "requests_held", "hot": "n1", "hot_value": 7.3, "cold": "n0", "cold_value": 0.7,
        "fair_share": 4.0, "in_flight": 8, "replicas": 2}
    # 3 on 2 replicas cannot split evenly: 2 and 1 is the best a balancer can do
    assert imbalance({"n0": {"running_mean": 2.0}, "n1": {"running_mean": 1.0}}, in_flight=3, replicas=2) is None
    # counts decide over utilisation: both GPUs busy, the split is still 7.3 / 0.7
    busy = {n: f | {"gpu_util_mean": 1.0} for n, f in skew.items()}
    assert imbalance(busy, in_flight=8, replicas=2)["metric"] == "requests_held"


def test_requests_waiting_beside_a_node_with_room_is_imbalance():
    from kvcap.analysis.telemetry_nodes import imbalance

    nodes = {"n0": {"running_mean": 4.0, "waiting_mean": 3.0, "kv_usage_max": 0.99},
             "n1": {"running_mean": 4.0, "waiting_mean": 0.0, "kv_usage_max": 0.5}}
    found = imbalance(nodes, in_flight=11, replicas=2)
    assert found["metric"] == "waiting_mean" and (found["hot"], found["cold"]) == ("n0", "n1")
    full = nodes | {"n1": nodes["n1"] | {"kv_usage_max": 0.95}}        # n1 has no KV room: nowhere to move them
    assert imbalance(full, in_flight=11, replicas=2) is None


def test_imbalance_evidence_names_what_was_measured():
    hot = {"metric": "requests_held", "hot": "n1", "hot_value": 12.475, "cold": "n0", "cold_value": 1.0,
           "fair_share": 6.737, "in_flight": 14.146, "replicas": 2}
    f = run(lv(1, 100.0, 20.0, mode="trace", imbalance=hot))
    assert [x.to_json() for x in f] == [{"arm": "control", "bound": "imbalance",
                  "evidence": "at trace ×1 node n1 holds 12.5 requests (running + waiting) while node n0 holds "
                              "1.0 of a fair share of 6.7 with 14.1 in flight on 2 replicas",
                  "direction": f[0].direction}]
    waiting = {"metric": "waiting_mean", "hot": "n0", "hot_value": 3.0, "cold": "n1", "cold_value": 0.0,
               "cold_kv_usage_max": 0.5, "in_flight": 11, "replicas": 2}
    f = run(lv(8, 100.0, 20.0, imbalance=waiting))
    assert f[0].evidence == ("at c=8 3.0 requests wait on node n0 while node n1 has 0.0 waiting and its KV "
                             "cache 50% full with 11 in flight on 2 replicas")
