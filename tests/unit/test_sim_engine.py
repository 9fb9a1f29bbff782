"""The engine driven directly (no run directory): KV accounting and invariants under load, refusals, limits.

Each test builds a fresh cluster from the reference scenario and feeds the event loop itself, checking the
replicas' block pools, tiers and queues before every event.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from kvcap.sim.cluster import cluster_model
from kvcap.sim.request import SimRequest
from tests.integration.test_sim import scenario


def drive_closed(overrides: dict, users: int, horizon_s: float, check) -> tuple[int, int, Any]:
    """Closed loop straight on the engine, calling ``check(sim)`` before every event."""
    cm = cluster_model(scenario(**overrides))
    counts = {"submitted": 0, "finished": 0}
    wl = cm.scenario.workload

    def on_finish(req: SimRequest, now: float) -> None:
        counts["finished"] += 1
        if now < horizon_s:
            submit(now)

    sim = cm.build(on_finish=on_finish)

    def submit(t: float) -> None:
        counts["submitted"] += 1
        sim.submit(SimRequest(rid=counts["submitted"], arrival=t, prompt=wl.input_tokens, max_out=wl.output_tokens,
                              tags={}), t)

    for _ in range(users):
        submit(0.0)
    sim.run_until(math.inf, on_time=lambda t: check(sim))
    return counts["submitted"], counts["finished"], sim


@pytest.mark.parametrize("offload", ["none", "remote", "host"])
def test_blocks_never_exceed_capacity_and_every_request_finishes(offload):
    worst = {"used": 0, "tier": 0.0}

    def check(sim):
        for rep in sim.replicas:
            assert 0 <= rep.hbm.used <= rep.cfg.blocks
            assert 0 <= rep.kv_usage() <= 1.0
            worst["used"] = max(worst["used"], rep.hbm.used)
        for group in sim.tiers.values():
            for tier in group:
                assert tier.used <= tier.capacity + 1
                worst["tier"] = max(worst["tier"], tier.used)

    submitted, finished, sim = drive_closed({"serving.kv_offload": offload}, users=160, horizon_s=40.0, check=check)
    assert submitted == finished > 160  # conservation: nothing lost, nothing stuck
    blocks = sim.replicas[0].cfg.blocks
    assert worst["used"] >= 0.9 * blocks  # the pool really was pushed to its limit
    preemptions = sum(r.preemptions for r in sim.replicas)
    if offload == "none":
        assert preemptions > 0  # vLLM's rule: a request that cannot get its next block preempts the newest
    else:
        assert worst["tier"] > 0
        # the default admission (tiers) parks a request's KV in the tier until HBM has room for its whole
        # sequence, so a full pool never preempts
        assert preemptions == 0
    assert all(not r.running and not r.waiting and not r.parked and r.hbm.used == 0 for r in sim.replicas)


def test_parking_never_runs_more_than_max_num_seqs():
    worst = [0]

    def check(sim):
        for rep in sim.replicas:
            worst[0] = max(worst[0], len(rep.running))
            assert len(rep.running) + rep.incoming <= rep.cfg.max_num_seqs

    submitted, finished, _ = drive_closed({"serving.kv_offload": "remote", "serving.max_num_seqs": 2,
                                           "cluster.nodes": 1}, users=8, horizon_s=30.0, check=check)
    assert submitted == finished and worst[0] == 2


@pytest.mark.parametrize("offload, admission", [("none", "tiers"), ("remote", "hbm"), ("remote", "tiers")])
def test_a_sequence_larger_than_the_kv_pool_is_refused_not_stuck(offload, admission):
    cm = cluster_model(scenario(cluster__nodes=1, cluster__gpu__memory="16GiB", serving__kv_offload=offload,
                                serving__offload_admission=admission))
    done: list[SimRequest] = []
    sim = cm.build(on_finish=lambda r, t: done.append(r))
    pool = sim.replicas[0].cfg.blocks * sim.replicas[0].cfg.block_size
    big = SimRequest(rid=1, arrival=0.0, prompt=pool - 100, max_out=200, tags={})  # prompt fits, sequence not
    small = SimRequest(rid=2, arrival=0.0, prompt=100, max_out=20, tags={})
    for r in (big, small):
        sim.submit(r, 0.0)
    sim.run_until(math.inf)
    assert {r.rid: r.error for r in done} == {1: "http_4xx", 2: None}


def test_a_cached_prefix_lets_a_request_in_while_the_owner_still_decodes():
    cm = cluster_model(scenario(cluster__nodes=1, cluster__gpu__memory="16GiB"))
    sim = cm.build()
    owner = SimRequest(rid=1, arrival=0.0, prompt=1100, max_out=250, hashes=(10, 11, 12), tags={})
    reuse = SimRequest(rid=2, arrival=1.0, prompt=1100, max_out=10, hashes=(10, 11, 12), tags={})
    for r in (owner, reuse):
        sim.submit(r, r.arrival)
    sim.run_until(math.inf)
    assert reuse.hit_hbm == 1024
    assert reuse.t_sched - reuse.arrival < 0.1 < owner.t_last - reuse.arrival  # admitted at the next step


FUZZ = [
    {"model.preset": "gemma-2-9b", "model.weights_dtype": "bf16", "cluster.gpu.preset": "a100-80gb"},  # sliding
    {"model.preset": "deepseek-v2-lite", "model.weights_dtype": "bf16", "cluster.gpu.preset": "h100-sxm"},  # MLA+MoE
    {"model.preset": "jamba-mini", "model.weights_dtype": "int4", "cluster.gpu.preset": "h200"},  # hybrid SSM
    {"model.preset": "llama-3.1-70b", "model.weights_dtype": "fp8", "cluster.gpu.preset": "h100-sxm",
     "cluster.gpus_per_node": 4, "cluster.nodes": 2, "serving.tensor_parallel": 4},  # TP across a node
    {"serving.chunked_prefill": False, "serving.max_num_seqs": 6, "serving.kv_offload": "host+remote"},
    {"serving.max_num_batched_tokens": 512, "serving.kv_offload": "host", "serving.routing": "round_robin",
     "workload.input_tokens": "lognormal:1500,1200,3000", "workload.output_tokens": "uniform:1,300"},
    {"serving.kv_offload": "remote", "serving.offload_admission": "hbm", "cluster.remote_memory": "8GiB",
     "cluster.remote_memory_bandwidth": "50Gbps"},  # a small, slow pool that fills up
]


@pytest.mark.parametrize("overrides", FUZZ, ids=[str(i) for i in range(len(FUZZ))])
def test_engine_invariants_across_models_and_settings(overrides):
    def check(sim):
        for rep in sim.replicas:
            assert 0 <= rep.hbm.used <= rep.cfg.blocks
            assert rep.moving >= 0 and rep.stalled >= 0 and rep.committed >= 0
        for group in sim.tiers.values():
            for tier in group:
                assert tier.parked_bytes >= -1 and tier.used <= tier.capacity + 1

    ov = {k: v for k, v in overrides.items() if not k.startswith("workload.")}
    wl = {k: v for k, v in overrides.items() if k.startswith("workload.")}
    sc = scenario(**{k.replace(".", "__"): v for k, v in {**ov, **wl}.items()})
    cm = cluster_model(sc)
    from kvcap.sim.request_stream import DrawnLengths

    lengths = DrawnLengths(sc.workload.input_tokens, sc.workload.output_tokens, (0, 1, 0))
    counts = {"submitted": 0, "finished": 0, "errors": 0}

    def on_finish(req: SimRequest, now: float) -> None:
        counts["finished"] += 1
        counts["errors"] += req.error is not None
        if now < 20.0:
            submit(now)

    sim = cm.build(on_finish=on_finish)

    def submit(t: float) -> None:
        counts["submitted"] += 1
        i, o, _ = lengths.next()
        sim.submit(SimRequest(rid=counts["submitted"], arrival=t, prompt=i, max_out=o, tags={}), t)

    for _ in range(64):
        submit(0.0)
    sim.run_until(math.inf, on_time=lambda t: check(sim), stop=lambda: sim.events > 2_000_000)
    assert sim.events <= 2_000_000, "runaway event loop"
    assert counts["submitted"] == counts["finished"] > 64
    assert counts["errors"] == 0
    assert all(not r.running and not r.waiting and not r.parked and r.moving == 0 for r in sim.replicas)
    assert all(r.hbm.used == r.hbm.cached_blocks for r in sim.replicas)  # only cached prefix blocks may stay allocated


def _kv_usage_each_second(max_span: int | None, at_sample_time: bool = True) -> list[list[float]]:
    """A closed loop of 40 users (1,000 in, 200 out) on the reference cluster; each replica's KV usage every
    simulated second, read as the sampler reads it (before the event that passes that second)."""
    cm = cluster_model(scenario())
    sim = cm.build(on_finish=lambda req, now: submit(now) if now < 120 else None)
    sim.max_span = max_span
    sent, samples, next_t = [0], [], [0.0]

    def submit(t: float) -> None:
        sent[0] += 1
        sim.submit(SimRequest(rid=sent[0], arrival=t, prompt=1000, max_out=200, tags={}), t)

    def on_time(t: float) -> None:
        while next_t[0] <= t:
            samples.append([r.kv_usage(next_t[0] if at_sample_time else None) for r in sim.replicas])
            next_t[0] += 1.0

    for _ in range(40):
        submit(0.0)
    sim.run_until(math.inf, on_time=on_time)
    return samples


def test_kv_usage_inside_a_decode_span_is_what_one_step_at_a_time_holds():
    """A decode span takes the blocks of all its steps when planned; vLLM takes each step's when it is scheduled.
    Sampled inside spans, the KV usage must be the one-event-per-step engine's, to the bit — and the blocks as
    held (reservations counted) would not be."""
    per_step = _kv_usage_each_second(1)
    assert len(per_step) > 100 and max(max(s) for s in per_step) > 0.3
    assert _kv_usage_each_second(None) == per_step
    held = _kv_usage_each_second(None, at_sample_time=False)
    assert max(max(a - b for a, b in zip(h, p)) for h, p in zip(held, per_step)) > 0.05
