"""Prefix-aware routing (llm-d's endpoint picker) and per-replica host tiers, driven straight on the engine with
hand-made requests that carry their prompts' block hashes (shared-prefix groups)."""

from __future__ import annotations

import math
import random

import pytest

from kvcap.errors import InputError
from kvcap.sim.cluster import cluster_model
from kvcap.sim.engine import PrefixIndex
from kvcap.sim.request import SimRequest
from kvcap.specs.scenario import apply_overrides, build_scenario, read_yaml
from tests.conftest import ROOT

SCENARIO = ROOT / "scenarios" / "llmd-tiered-prefix-cache.yaml"
TREATMENT = {"serving.kv_offload": "host", "serving.host_kv_scope": "replica", "serving.host_kv_tokens": 1_312_000}


def llmd(**overrides):
    """The llm-d scenario's cluster, engine and router (its workload is replaced by the hand-made trace)."""
    data = read_yaml(SCENARIO)
    data.pop("workload", None)
    return build_scenario(apply_overrides(data, overrides))


def shared_prefix_trace(groups: int, per_group: int, prefix_blocks: int, question_blocks: int, rounds: int,
                        rate: float, seed: int = 0) -> list[tuple[float, int, tuple[int, ...]]]:
    """(arrival, prompt tokens, hashes): groups × per_group prompts (a group's prefix blocks shared, each
    prompt's question blocks its own), shuffled once and cycled ``rounds`` times, Poisson arrivals."""
    rng = random.Random(seed)
    prompts = []
    for g in range(groups):
        prefix = tuple(1_000_000 * (g + 1) + b for b in range(prefix_blocks))
        for p in range(per_group):
            question = tuple(2_000_000_000 + (g * per_group + p) * 1000 + b for b in range(question_blocks))
            prompts.append(prefix + question)
    rng.shuffle(prompts)
    t, out = 0.0, []
    for _ in range(rounds):
        for hashes in prompts:
            t += rng.expovariate(rate)
            out.append((t, len(hashes) * 16, hashes))
    return out


def replay(sc, trace, max_out: int = 32):
    """Every request of the trace through a fresh cluster; the finished requests and the simulation."""
    done: list[SimRequest] = []
    sim = cluster_model(sc).build(on_finish=lambda r, now: done.append(r))
    sim.feed([a for a, _, _ in trace],
             lambda i: SimRequest(rid=i, arrival=trace[i][0], prompt=trace[i][1], max_out=max_out,
                                  hashes=trace[i][2]))
    sim.run_until(math.inf)
    return done, sim


def hit_share(done: list[SimRequest]) -> float:
    return sum(r.hit_hbm + r.hit_tier for r in done) / sum(r.prompt for r in done)


def test_prefix_aware_raises_hit_rate_over_least_loaded():
    """Same trace, same tiers: llm-d's scorers send a group back where its prefix is (in HBM or the replica's
    CPU tier), least-loaded spreads it over all eight replicas, each of which computes it once."""
    trace = shared_prefix_trace(groups=40, per_group=5, prefix_blocks=250, question_blocks=16, rounds=2, rate=8.0)
    shares = {}
    for routing in ("least_loaded", "prefix_aware"):
        done, _ = replay(llmd(**TREATMENT, **{"serving.routing": routing}), trace)
        assert len(done) == len(trace) and not any(r.error for r in done)
        shares[routing] = hit_share(done)
    assert shares["prefix_aware"] > shares["least_loaded"] + 0.1, shares


def test_per_replica_tier_is_each_replicas_own():
    """host_kv_scope=replica: eight tiers of host_kv_tokens each, not one per node shared by its two replicas."""
    sim = cluster_model(llmd(**TREATMENT)).build()
    tiers = [rep.tiers.host for rep in sim.replicas]
    assert len({id(t) for t in tiers}) == 8
    per_token = sim.replicas[0].cfg.kv_bytes_per_token
    assert all(t is not None and t.capacity == pytest.approx(1_312_000 * per_token) for t in tiers)
    node = cluster_model(llmd(**{"serving.kv_offload": "host", "serving.host_kv_tokens": 1_312_000})).build()
    assert len({id(rep.tiers.host) for rep in node.replicas}) == 4  # node scope: the two replicas of a node share


def test_prefix_index_is_an_lru_of_what_was_sent():
    ix = PrefixIndex(4)
    ix.add((1, 2, 3))
    assert ix.match((1, 2, 3, 9)) == 3 and ix.match((2, 3)) == 2 and ix.match((9, 1)) == 0
    ix.add((4, 5))  # five entries in a four-entry index: the oldest (1) goes
    assert ix.match((1, 2)) == 0 and ix.match((2, 3, 4, 5)) == 4


@pytest.mark.parametrize("overrides, says", [
    ({"serving.host_kv_scope": "replica", "serving.kv_offload": "host"}, "needs its size"),
    ({"serving.host_kv_scope": "replica"}, "has none"),
    ({"serving.host_kv_tokens": 1000}, "has none"),
    ({"serving.kv_offload": "host", "serving.host_kv_tokens": 1000, "serving.host_kv_capacity": "1GiB"},
     "give one"),
])
def test_bad_host_tier_is_one_line(overrides, says):
    with pytest.raises(InputError) as err:
        llmd(**overrides)
    assert says in str(err.value) and "\n" not in str(err.value)
