"""The judgement on what real engines showed (issue 33): vLLM's batch cap and its block-granular KV pool told
apart from compute, and llama.cpp's host prompt cache named a gain at equal effective capacity.

Summaries are hand-built (``tests/summaries.py``) with the figures measured on the real engines; the manifests
carry what ``bench`` records of them (``vllm:cache_config_info``'s pool, a scenario's ``serving.max_num_seqs``).
"""

from __future__ import annotations

import pytest

from kvcap.analysis.diagnosis import diagnose
from kvcap.analysis.engine_limits import EngineLimits, command_flags, engine_limits
from kvcap.analysis.verdict import decide, judge
from kvcap.rundir.compare import ArmResult, GoodputGain
from kvcap.rundir.manifest import Manifest
from kvcap.rundir.summary import LevelSummary, Summary
from tests.summaries import summary_of

_EMPTY = {"p50": None, "p90": None, "p95": None, "p99": None, "mean": None}


def lv(c: int, tpot: float, ttft: float = 30.0, **extra) -> LevelSummary:
    """A level with p50 TTFT/TPOT (ms) and whatever server telemetry ``extra`` gives."""
    return LevelSummary.model_validate({
        "mode": "concurrency", "level": c, "requests": 100, "ok": 100, "errors": 0, "cancelled": 0,
        "output_tok_s": 0.0, "goodput_tok_s": 0.0, "ttft_ms": _EMPTY | {"p50": ttft},
        "tpot_ms": _EMPTY | {"p50": tpot}, "slo_ok": True, "failed_checks": [], **extra})


def manifest(server: dict | None = None, fixed: dict | None = None) -> Manifest:
    return Manifest(source="bench", run_id="r", started_at=0.0, server={"engine": "vllm", **(server or {})},
                    fixed=fixed or {})


def bounds(summary: Summary, limits: EngineLimits) -> list[str]:
    return [f.bound for f in diagnose(summary.levels, "run", limits=limits)]


# vLLM --max-num-seqs 8: 8 run and 8 wait at c=16 with the KV cache 58% used; TPOT 6.8 → 5.4 ms from c=8 to 16.
# Prompts of 256 tokens in blocks of 128 (vLLM's CPU block): 2 blocks for the next one, 17 of 40 usable
# (vLLM's num_gpu_blocks counts its null block) free.
CAPPED = summary_of(
    lv(1, 4.0, server_running_max=1, server_waiting_mean=0.0, kv_usage_max=0.07, input_tokens_mean=256.0),
    lv(4, 5.2, server_running_max=4, server_waiting_mean=0.0, kv_usage_max=0.29, input_tokens_mean=256.0),
    lv(8, 6.8, server_running_max=8, server_waiting_mean=0.0, kv_usage_max=0.58, input_tokens_mean=256.0),
    lv(16, 5.4, ttft=900.0, server_running_max=8, server_waiting_mean=8.0, server_waiting_max=8,
       kv_usage_max=0.58, input_tokens_mean=256.0))
VLLM_POOL = {"num_gpu_blocks": 41, "block_size": 128, "enable_prefix_caching": True, "kv_engines": 1}


def test_a_batch_cap_with_kv_room_is_not_compute():
    # what the old rules said: TPOT ×1.35 from c=1 → "compute"; the cap is inferred: running flat at 8 from c=8
    # while 8 wait, and the next request's blocks fit
    limits = engine_limits(manifest(VLLM_POOL))
    assert limits.max_running is None and (limits.pool_blocks, limits.block_size) == (40, 128)  # less vLLM's null block
    f = diagnose(CAPPED.levels, "control", limits=limits)
    assert [x.bound for x in f] == ["batch_cap"]
    assert f[0].evidence == (
        "from c=16 requests queue (server waiting 8.0 on average) while 8 run at once, flat from c=8: the "
        "engine's limit, inferred, with KV room left (23 of 40 blocks of 128 tokens in use at most (58%); the "
        "next request's 256 prompt tokens need 2 blocks, 17 are free); TPOT p50 6.8 → 5.4 ms from c=8 to c=16 "
        "with the batch held at the cap; TPOT p50 grew 4.0 → 6.8 ms (×1.70) from c=1 to c=8 as the batch grew: a "
        "higher cap costs TPOT")
    assert "raise the cap (vLLM --max-num-seqs" in f[0].direction


def test_a_batch_cap_without_the_pool_size_estimates_the_room():
    # no cache_config_info: one more request of the running ones' share (58% / 8) fits in the 42% free
    f = diagnose(CAPPED.levels, "control", limits=engine_limits(manifest()))
    assert [x.bound for x in f] == ["batch_cap"]
    assert "with KV room left (the KV cache 58% full at most with 8 running: one more takes about 7%)" in f[0].evidence


@pytest.mark.parametrize("where", [
    {"fixed": {"serving.max_num_seqs": 8}},
    {"fixed": {"server.command": "python -m vllm.entrypoints.openai.api_server --model m --max-num-seqs 8"}},
    {"server": {"max_running_requests": 8}},
])
def test_a_stated_limit_names_the_cap(where):
    limits = engine_limits(manifest(**where))
    assert limits.max_running == 8
    f = diagnose(CAPPED.levels, "control", limits=limits)
    assert [x.bound for x in f] == ["batch_cap"]
    assert f"8 run at once, the engine's limit (8 from {limits.running_source})" in f[0].evidence


def test_below_a_stated_limit_there_is_no_cap():
    # the same levels against max_num_seqs 16: running flat at 8 is not the limit, and the queue with TPOT
    # flat from c=1 (×1.35 is growth) is read as before
    assert "batch_cap" not in bounds(CAPPED, engine_limits(manifest(fixed={"serving.max_num_seqs": 16})))


# vLLM with a 24-block pool (--num-gpu-blocks-override 24, blocks of 128) and 1,088-token prompts: 2 run, 2 wait,
# usage at its block-granular maximum of 78% — 18 of the 23 usable blocks used (vLLM's null block is the 24th),
# 5 free, the next prompt needs 9.
FULL_POOL = summary_of(
    lv(1, 5.0, server_running_max=1, server_waiting_mean=0.0, kv_usage_max=0.39, input_tokens_mean=1088.0),
    lv(2, 5.6, server_running_max=2, server_waiting_mean=0.0, kv_usage_max=0.78, input_tokens_mean=1088.0),
    lv(4, 7.0, ttft=2400.0, server_running_max=2, server_waiting_mean=2.0, server_waiting_max=2,
       kv_usage_max=0.78, input_tokens_mean=1088.0))


def test_kv_capacity_at_block_granularity_below_any_usage_threshold():
    limits = engine_limits(manifest({"num_gpu_blocks": 24, "block_size": 128}))
    f = diagnose(FULL_POOL.levels, "control", limits=limits)
    assert [x.bound for x in f] == ["kv_capacity"]                  # not "compute" (TPOT ×1.40), not the cap
    assert f[0].evidence == (
        "from c=4 the KV pool has no room for the next request with 2.0 requests waiting: 18 of 23 blocks of 128 "
        "tokens in use at most (78%); the next request's 1,088 prompt tokens need 9 blocks, 5 are free; at most 2 "
        "run (decode) at once; TPOT p50 5.6 → 7.0 ms from c=2 to c=4")
    assert f[0].direction.startswith("VRAM for KV binds")


def test_the_pool_from_the_server_command():
    cmd = "vllm serve m --num-gpu-blocks-override 24 --block-size=128 --max-num-seqs 256"
    assert command_flags(cmd) == {"--num-gpu-blocks-override": 24, "--block-size": 128, "--max-num-seqs": 256}
    limits = engine_limits(manifest(fixed={"server.command": cmd}))
    assert (limits.pool_blocks, limits.block_size, limits.max_running) == (23, 128, 256)  # less vLLM's null block
    assert bounds(FULL_POOL, limits) == ["kv_capacity"]


def test_a_stated_cap_and_a_full_pool_are_both_named():
    limits = engine_limits(manifest({"num_gpu_blocks": 24, "block_size": 128}, {"serving.max_num_seqs": 2}))
    f = diagnose(FULL_POOL.levels, "control", limits=limits)
    assert [x.bound for x in f] == ["batch_cap", "kv_capacity"]
    assert f[1].evidence.startswith("at c=4 the KV pool has no room for the next request either: 18 of 23")


def test_a_full_usage_figure_with_blocks_free_is_not_kv_capacity():
    # 90% of a 400-block pool leaves 40 blocks, and the next request needs 2: whatever holds it, not KV room
    levels = summary_of(lv(1, 5.0, server_running_max=1, server_waiting_mean=0.0, kv_usage_max=0.1,
                           input_tokens_mean=256.0),
                        lv(8, 5.2, ttft=400.0, server_running_max=8, server_waiting_mean=3.0, kv_usage_max=0.9,
                           input_tokens_mean=256.0)).levels
    pool = engine_limits(manifest({"num_gpu_blocks": 400, "block_size": 128}))
    assert "the KV cache is 90% full" not in " ".join(f.evidence for f in diagnose(levels, limits=pool))
    assert "the KV cache is 90% full" in diagnose(levels)[0].evidence        # without the pool: the threshold


def test_queueing_is_the_servers_waiting_count_where_it_reports_one():
    # TTFT triples (prefill), but the server says nobody waits: no queue, so no KV capacity
    levels = summary_of(lv(1, 20.0, ttft=100.0, server_waiting_mean=0.0),
                        lv(16, 21.0, ttft=900.0, server_waiting_mean=0.1)).levels
    assert [f.bound for f in diagnose(levels)] == ["none_seen"]
    unreported = summary_of(lv(1, 20.0, ttft=100.0), lv(16, 21.0, ttft=900.0)).levels
    assert [f.bound for f in diagnose(unreported)] == ["kv_capacity"]   # no count: the client's TTFT jump


def test_simulated_limits_are_per_replica_times_replicas():
    m = Manifest(source="sim", run_id="s", started_at=0.0, server={"replicas": 4, "kv_blocks_per_replica": 983},
                 fixed={"serving.max_num_seqs": 256, "serving.block_size": 16})
    limits = engine_limits(m)
    assert (limits.max_running, limits.pool_blocks, limits.block_size, limits.replicas) == (1024, 983, 16, 4)
    assert engine_limits(manifest({"total_slots": 2, "n_ctx": 2048})).max_running == 2   # llama.cpp /props
    assert engine_limits(None) == EngineLimits()


# ------------------------------------------------------------------ the verdict: a gain at equal capacity


def ab_level(c: int, ttft_p50: float, ttft_p95: tuple[float, float, float], tok_s: float,
             tpot_p95: tuple[float, float, float]) -> LevelSummary:
    """A level both arms ran: p95 as (value, interval low, interval high)."""
    return LevelSummary.model_validate({
        "mode": "concurrency", "level": c, "requests": 40, "ok": 40, "errors": 0, "cancelled": 0,
        "output_tok_s": tok_s, "goodput_tok_s": tok_s, "ttft_ms": _EMPTY | {"p50": ttft_p50, "p95": ttft_p95[0]},
        "tpot_ms": _EMPTY | {"p50": tpot_p95[0] * 0.9, "p95": tpot_p95[0]},
        "ci95": {"ttft_p95_ms": list(ttft_p95[1:]), "tpot_p95_ms": list(tpot_p95[1:])},
        "slo_ok": c == 1, "failed_checks": [] if c == 1 else ["throughput_growth"]})


def arm_summary(*levels: LevelSummary, effective: int | None) -> Summary:
    s = summary_of(*levels)
    s.capacity.effective = effective
    return s


# llama.cpp --cache-ram 0 vs 256 MiB, 8 groups of 512-token shared prefixes, one thread: effective capacity 1 in
# both arms; TTFT p50 1,288 → 207 ms (c=1) and 1,943 → 423 ms (c=2); 10.4 → 30.4 and 10.8 → 28.8 tok/s
CACHE_OFF = arm_summary(ab_level(1, 1288.0, (1420.0, 1330.0, 1510.0), 10.4, (96.0, 92.0, 101.0)),
                        ab_level(2, 1943.0, (2150.0, 2010.0, 2290.0), 10.8, (181.0, 172.0, 190.0)), effective=1)
CACHE_ON = arm_summary(ab_level(1, 207.0, (262.0, 231.0, 298.0), 30.4, (31.0, 29.5, 33.0)),
                       ab_level(2, 423.0, (510.0, 455.0, 570.0), 28.8, (66.0, 62.0, 71.0)), effective=1)
GAIN = GoodputGain(delta_tok_s=19.6, ci95=[15.2, 22.8], beyond_noise=True)


def test_a_host_prompt_cache_is_a_performance_gain_at_equal_capacity():
    verdict, moved = judge(CACHE_OFF, CACHE_ON, GAIN)
    assert verdict == "performance-only"                     # was "no-gain": effective capacity 1 → 1
    assert (moved.capacity, moved.goodput, moved.latency) == ("same", "higher", "lower")
    assert moved.latency_evidence == ["TTFT p95 1,420 → 262 ms at c=1", "TPOT p95 96.0 → 31.0 ms at c=1"]
    assert moved.text == ("effective capacity same (1 → 1); goodput higher beyond noise (+19.6 tok/s, 95% CI "
                          "[+15.2, +22.8]); latency lower: TTFT p95 1,420 → 262 ms at c=1; TPOT p95 96.0 → 31.0 "
                          "ms at c=1")


def test_latency_counts_every_level_both_ran_where_neither_arm_has_an_effective_capacity():
    off = arm_summary(*CACHE_OFF.levels, effective=None)
    on = arm_summary(*CACHE_ON.levels, effective=None)
    verdict, moved = judge(off, on, GAIN)
    assert verdict == "performance-only" and len(moved.latency_evidence) == 4


def test_no_gain_where_goodput_or_latency_stays_inside_the_noise():
    assert judge(CACHE_OFF, CACHE_ON, GoodputGain(delta_tok_s=2.0, ci95=[-1.0, 5.0], beyond_noise=False))[0] == \
        "no-gain"
    # the same arm twice: every interval overlaps its own, latency 'same'
    verdict, moved = judge(CACHE_OFF, CACHE_OFF, GAIN)
    assert verdict == "no-gain" and moved.latency == "same"


def arm(effective: float | None, resident: int | None) -> ArmResult:
    return ArmResult(effective=effective, resident=resident, resident_source=None, stress_limit=None,
                     goodput_tok_s=0.0, goodput_level=None, limited_by=None, arm="a")


@pytest.mark.parametrize(("control", "treatment", "ci", "latency", "verdict"), [
    (arm(1, 2), arm(1, 2), (15.2, 22.8), "lower", "performance-only"),
    (arm(48, 60), arm(48, 96), (10.0, 50.0), "lower", "performance-only"),    # before capacity-only: it delivers
    (arm(48, 60), arm(48, 60), (10.0, 50.0), "mixed", "no-gain"),            # faster TTFT, slower TPOT: no claim
    (arm(48, 60), arm(48, 60), (10.0, 50.0), "unknown", "no-gain"),          # no latency intervals to tell
    (arm(48, 60), arm(64, 60), (-5.0, 5.0), "lower", "no-gain"),             # more effective needs goodput too
    (arm(48, 60), arm(64, 80), (10.0, 50.0), "higher", "performance-scaling"),
    (arm(48, 60), arm(48, 60), (-50.0, -10.0), "lower", "regression"),
])
def test_decide_with_latency(control, treatment, ci, latency, verdict):
    assert decide(control, treatment, *ci, latency) == verdict
