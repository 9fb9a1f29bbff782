"""The scheduling seam: vLLM's decisions on a tiny hand-made replica, and a second policy plugged into the replica.

One replica of a few 16-token blocks, no tiers; requests are placed in its queues by hand, so every expected
admission, preemption and reservation below is worked out from the rules in kvcap/sim/policy_vllm.py.
"""

from __future__ import annotations

import math

import pytest

from kvcap.sim.cost import cost_model
from kvcap.sim.engine import Simulation
from kvcap.sim.links import LinkSet
from kvcap.sim.policy import Batch, SchedulingPolicy
from kvcap.sim.policy_vllm import VllmPolicy
from kvcap.sim.replica import Replica
from kvcap.sim.replica_state import ReplicaConfig, ReplicaState
from kvcap.sim.request import SimRequest
from kvcap.specs.hardware import load_gpu
from kvcap.specs.model import load_model

BLOCK = 16


def replica(blocks: int, *, max_num_seqs: int = 8, budget: int = 64, policy: SchedulingPolicy | None = None,
            max_model_len: int | None = None) -> tuple[Replica, Simulation]:
    cfg = ReplicaConfig(blocks=blocks, block_size=BLOCK, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                        chunked_prefill=True, cost=cost_model(load_model("llama-2-7b"), load_gpu("rtx4090")),
                        kv_bytes_per_token=1.0, hash_block_tokens=0, prefix_caching=False, park_after_prefill=False,
                        node=0, host_link=None, nic_links=(), max_model_len=max_model_len)
    sim = Simulation([cfg], {}, LinkSet(), lambda: policy or VllmPolicy())
    return sim.replicas[0], sim


def decoding(rep: Replica, rid: int, prompt: int, out: int) -> SimRequest:
    """A running request that has sampled ``out`` tokens: KV for all but the last is in its blocks."""
    kv = prompt + out - 1
    req = SimRequest(rid=rid, arrival=float(rid), prompt=prompt, max_out=100, replica=0, state="running", kv=kv,
                     out=out, blocks=-(-kv // BLOCK), t_sched=0.0)
    assert rep.hbm.take(req.blocks)
    rep.running.append(req)
    return req


def waiting(rep: Replica, rid: int, prompt: int) -> SimRequest:
    req = SimRequest(rid=rid, arrival=float(rid), prompt=prompt, max_out=100, replica=0, state="waiting")
    rep.waiting.append(req)
    return req


def test_a_missing_block_preempts_the_newest_running_request_which_recomputes():
    rep, _ = replica(blocks=5)
    old = decoding(rep, 1, prompt=32, out=1)  # 32 tokens in 2 blocks: its 33rd needs a third
    new = decoding(rep, 2, prompt=40, out=1)  # 40 tokens in 3 blocks: its 41st fits
    assert rep.hbm.free() == 0
    batch = VllmPolicy().next_batch(rep, now=1.0)
    # the old one's block comes from the newest: its 3 blocks go back, it waits at the head with no KV
    assert batch.decoders == [old] and batch.prefills == [] and batch.reserved == {1: 1}
    assert rep.running == [old] and list(rep.waiting) == [new]
    assert (new.state, new.kv, new.blocks, new.preemptions, new.recomputed) == ("waiting", 0, 0, 1, 40)
    assert rep.preemptions == 1 and old.blocks == 3
    # it is not readmitted in the same step: 41 tokens need 3 blocks, 2 are free
    assert rep.hbm.used == 3 and rep.hbm.free() == 2


def test_a_request_that_cannot_get_its_block_and_is_newest_preempts_itself():
    rep, _ = replica(blocks=4)
    a = decoding(rep, 1, prompt=40, out=1)  # 3 blocks, next token fits
    b = decoding(rep, 2, prompt=16, out=1)  # 1 block, its 17th token needs a second
    batch = VllmPolicy().next_batch(rep, now=0.0)
    assert batch.decoders == [a] and batch.reserved == {1: 0}
    assert list(rep.waiting) == [b] and b.recomputed == 16 and rep.hbm.used == 3


def test_waiting_requests_are_admitted_in_order_within_the_token_budget():
    rep, _ = replica(blocks=20, budget=64)
    a = decoding(rep, 1, prompt=32, out=1)
    c = waiting(rep, 3, prompt=100)
    d = waiting(rep, 4, prompt=10)
    batch = VllmPolicy().next_batch(rep, now=2.0)
    # the decode takes 1 token of 64; the long prompt gets a 63-token chunk and blocks for all 100 tokens;
    # the budget is spent, so the short prompt behind it waits (arrival order, no skipping ahead)
    assert batch.decoders == [a] and batch.prefills == [(c, 63)] and batch.reserved == {1: 1, 3: 0}
    assert c.blocks == 7 and c.state == "running" and c.t_sched == 2.0
    assert rep.running == [a, c] and list(rep.waiting) == [d] and rep.hbm.used == 3 + 7


def test_admission_stops_at_max_num_seqs():
    rep, _ = replica(blocks=20, max_num_seqs=2)
    decoding(rep, 1, prompt=32, out=1)
    c = waiting(rep, 3, prompt=20)
    d = waiting(rep, 4, prompt=20)
    batch = VllmPolicy().next_batch(rep, now=0.0)
    assert batch.prefills == [(c, 20)] and list(rep.waiting) == [d] and d.t_sched is None


def test_refusals_and_span_decisions():
    policy = VllmPolicy()
    plain, _ = replica(blocks=5)
    short_context, _ = replica(blocks=5, max_model_len=64)
    too_big = SimRequest(rid=1, arrival=0.0, prompt=60, max_out=30)  # 90 tokens: 6 blocks > 5
    fits = SimRequest(rid=2, arrival=0.0, prompt=50, max_out=30)  # 80 tokens: exactly 5 blocks
    assert policy.rejects(plain, too_big) and not policy.rejects(plain, fits)
    assert policy.rejects(short_context, fits)  # 80 tokens > max_model_len 64
    # a head that needs 3 blocks with 2 free: neither cut a span nor shorten the next one
    rep, _ = replica(blocks=5)
    decoding(rep, 1, prompt=48, out=1)  # 3 blocks
    waiting(rep, 2, prompt=40)
    assert not policy.should_cut_span(rep) and not policy.admits_after_one_step(rep)
    rep.hbm.give(1)
    assert policy.should_cut_span(rep) and policy.admits_after_one_step(rep)
    # a preempted request parked in a tier comes back first: a span is cut for it, and nothing new is admitted
    parked = SimRequest(rid=3, arrival=0.5, prompt=10, max_out=5, state="parked")
    rep.parked.append((parked.arrival, parked.rid, parked))
    assert policy.should_cut_span(rep) and not policy.admits_after_one_step(rep)


class OneAtATime:
    """A second engine profile through the same seam: one request at a time, its whole sequence's blocks taken
    at admission, the prompt in one step, then every output token in one decode span."""

    def rejects(self, rep: ReplicaState, req: SimRequest) -> bool:
        return rep.hbm.blocks_for(req.prompt + req.max_out) > rep.cfg.blocks

    def next_batch(self, rep: ReplicaState, now: float) -> Batch:
        batch = Batch()
        if rep.running:
            batch.decoders.append(rep.running[0])
        elif rep.waiting:
            req = rep.waiting.popleft()
            need = rep.hbm.private_need(req, req.prompt + req.max_out)
            assert rep.hbm.take(need)
            req.blocks, req.state, req.t_sched = need, "running", now
            rep.running.append(req)
            batch.prefills.append((req, req.prompt))
        return batch

    def should_cut_span(self, rep: ReplicaState) -> bool:
        return False

    def admits_after_one_step(self, rep: ReplicaState) -> bool:
        return False

    def on_prefilled(self, rep: ReplicaState, completed: list[SimRequest], now: float) -> None:
        pass


def test_a_second_policy_drives_the_same_replica():
    rep, sim = replica(blocks=20, policy=OneAtATime())
    first = SimRequest(rid=1, arrival=0.0, prompt=100, max_out=10)
    second = SimRequest(rid=2, arrival=0.0, prompt=100, max_out=10)
    for r in (first, second):
        sim.submit(r, 0.0)
    sim.run_until(math.inf)
    assert first.state == second.state == "done" and first.out == second.out == 10
    # 2 arrivals, then per request one prefill step and one 9-step decode span: 6 events in all
    assert sim.events == 6
    assert second.t_sched == first.t_last  # admitted the moment the first finished, not before
    assert second.t_first - second.t_sched == pytest.approx(first.t_first)  # same prompt, same prefill time
    assert len(first.token_times()) == 10 and rep.hbm.used == 0 and rep.preemptions == 0
