"""Offload tiers for prompt prefixes, driven through real simulations of the reference cluster with hand-made
requests that carry their prompts' block hashes: the tier is an exact LRU, a shared storage tier is shared
across replicas, each engine profile's store rule holds, and a hit is loaded only where that beats computing it."""

from __future__ import annotations

import math
from collections import OrderedDict
from itertools import pairwise

import pytest

from kvcap.errors import InputError
from kvcap.sim.cluster import cluster_model
from kvcap.sim.kv import BlockPool, Tier
from kvcap.sim.links import Link
from kvcap.sim.request import SimRequest
from kvcap.sim.tiers import ReplicaTiers, tier_rules
from kvcap.specs.scenario import apply_overrides, build_scenario, read_yaml
from tests.conftest import ROOT

SCENARIO = ROOT / "scenarios" / "seed-reference.yaml"
HBT = 16
"""Tokens per hash block (vLLM's block size)."""
BLOCKS = 4
"""Hash blocks of each hand-made prompt (its prompt has a partial block more)."""
PROMPT, OUT = BLOCKS * HBT + 8, 8
STORAGE = {"capacity": "64GiB", "read_bandwidth": "40GB/s", "write_bandwidth": "20GB/s", "latency": "1ms"}


def scenario(**overrides: object):
    data = read_yaml(SCENARIO)
    data.pop("workload", None)
    base = {"serving.hash_block_tokens": HBT, "serving.offload_admission": "hbm"}
    return build_scenario(apply_overrides(data, {**base, **overrides}))


def run(sc, prompts: list[tuple[int, ...]], prompt: int = PROMPT, gap: float = 100.0) -> list[SimRequest]:
    """Each prompt (its hash ids) as one request, ``gap`` seconds apart (each finishes before the next arrives);
    the finished requests in arrival order."""
    done: list[SimRequest] = []
    sim = cluster_model(sc).build(on_finish=lambda r, now: done.append(r))
    sim.feed([i * gap for i in range(len(prompts))],
             lambda i: SimRequest(rid=i, arrival=i * gap, prompt=prompt, max_out=OUT, hashes=prompts[i]))
    sim.run_until(math.inf)
    assert len(done) == len(prompts) and not any(r.error for r in done)
    return sorted(done, key=lambda r: r.rid)


def letter(name: str) -> tuple[int, ...]:
    """A prompt's chained block hash ids (one prompt per letter)."""
    return tuple(1000 * (ord(name) - ord("A") + 1) + b for b in range(BLOCKS))


def reference_lru(sequence: str, capacity: int) -> list[bool]:
    """Hit or miss of each prompt in an LRU of ``capacity`` prompts: a hit is touched, a miss stored afterwards."""
    lru: OrderedDict[str, None] = OrderedDict()
    out = []
    for name in sequence:
        out.append(name in lru)
        lru[name] = None
        lru.move_to_end(name)
        while len(lru) > capacity:
            lru.popitem(last=False)
    return out


def one_replica_lru(profile: str = "default"):
    """One replica whose HBM holds exactly one request (so every prompt but the previous one misses HBM) and a
    host tier of two prompts' blocks."""
    return scenario(**{"cluster.nodes": 1, "serving.kv_tokens": PROMPT + OUT, "serving.kv_offload": "host",
                       "serving.host_kv_scope": "replica", "serving.host_kv_tokens": 2 * BLOCKS * HBT,
                       "serving.kv_tier_profile": profile})


@pytest.mark.parametrize("profile", ["default", "vllm_cpu", "hicache", "kvbm"])
def test_tier_hits_are_an_exact_lru(profile):
    """Hand-worked, a two-prompt LRU over A B A C B C A: A miss [A]; B miss [A B]; A hit [B A]; C miss, evicts B
    [A C]; B miss, evicts A [C B]; C hit [B C]; A miss [C A]. The simulated tier serves exactly those hits, each
    the prompt's whole hashed part."""
    sequence = "ABACBCA"
    expected = [False, False, True, False, False, True, False]
    assert reference_lru(sequence, 2) == expected
    done = run(one_replica_lru(profile), [letter(c) for c in sequence])
    assert [r.hit_hbm for r in done] == [0] * len(sequence)
    assert [r.hit_tier for r in done] == [BLOCKS * HBT if hit else 0 for hit in expected]


def test_longer_lru_sequence_matches_the_reference():
    """A longer sequence (no prompt twice in a row: the previous prompt is in HBM) against the reference LRU."""
    sequence = "ABCABDADCBCEAEBDBA"
    assert all(a != b for a, b in pairwise(sequence))
    done = run(one_replica_lru(), [letter(c) for c in sequence])
    assert [r.hit_tier > 0 for r in done] == reference_lru(sequence, 2)


def two_replicas(offload: str, profile: str = "default", **extra: object):
    return scenario(**{"cluster.nodes": 2, "serving.routing": "round_robin", "serving.kv_offload": offload,
                       "cluster.shared_storage": STORAGE, "serving.kv_tier_profile": profile, **extra})


@pytest.mark.parametrize("profile", ["default", "lmcache", "kvbm", "hicache"])
def test_shared_storage_is_shared(profile):
    """Round robin sends the first request to replica 1 and the second, the same prompt, to replica 0: replica 0
    finds in the shared store what replica 1 wrote (with host tiers per node, replica 0's own host misses)."""
    prompt = 40 * HBT + 8
    hashes = tuple(range(1, 41))
    for offload in ("storage", "host+storage"):
        done = run(two_replicas(offload, profile), [hashes, hashes], prompt=prompt)
        assert (done[0].replica, done[1].replica) == (1, 0)
        assert done[0].hit_tier == 0
        chunk = 256 if profile == "lmcache" else HBT  # LMCache stores whole 256-token chunks only
        assert done[1].hit_tier == (prompt - 8) // chunk * chunk, (profile, offload)


def test_node_host_tiers_are_not_shared():
    """The control for the test above: two nodes' host tiers, no storage — replica 0 cannot see replica 1's."""
    hashes = tuple(range(1, 41))
    done = run(scenario(**{"cluster.nodes": 2, "serving.routing": "round_robin", "serving.kv_offload": "host",
                           "cluster.host_memory": "128GiB"}), [hashes, hashes], prompt=40 * HBT + 8)
    assert [r.hit_tier for r in done] == [0, 0]


def test_hit_loaded_only_where_cheaper_than_computing():
    """A store read at a trickle: copying the prefix back costs more than prefilling it, so a profile that weighs
    the two recomputes it; the default rule loads it regardless."""
    slow = {**STORAGE, "read_bandwidth": "10MB/s"}
    hashes = tuple(range(1, 41))
    for profile, loaded in (("default", True), ("kvbm", False)):
        done = run(two_replicas("storage", profile, **{"cluster.shared_storage": slow}), [hashes, hashes],
                   prompt=40 * HBT + 8)
        assert (done[1].hit_tier > 0) == loaded, profile


def fake_tiers(profile: str, policy: str = "write_through") -> tuple[ReplicaTiers, Tier]:
    host = Tier("host", 100.0)
    link = Link("pcie0", "host", 1e9, 1e9, 0.0)
    tiers = ReplicaTiers(host, None, link, (), ())
    tiers.configure(tier_rules(profile, policy))
    return tiers, host


def hbm_holding(held: set[int]) -> BlockPool:
    """An HBM pool whose cached prefixes are these hash ids (what :meth:`ReplicaTiers.store` reads of it)."""
    pool = BlockPool(1000, HBT, HBT)
    for h in held:
        pool.prefix_ref[h] = 1
    return pool


def test_hicache_write_policies():
    """write_through: a block reaches host on first use; write_through_selective: on its second; write_back:
    only once HBM no longer holds it (seen at the next store)."""
    blocks = (1, 2)
    through, host = fake_tiers("hicache")
    through.store(blocks, hbm_holding({1, 2}), 1.0)
    assert list(host.prefix) == [1, 2]

    selective, host = fake_tiers("hicache", "write_through_selective")
    selective.store(blocks, hbm_holding({1, 2}), 1.0)
    assert list(host.prefix) == []
    selective.store(blocks, hbm_holding({1, 2}), 1.0)
    assert list(host.prefix) == [1, 2]

    back, host = fake_tiers("hicache", "write_back")
    back.store(blocks, hbm_holding({1, 2}), 1.0)
    assert list(host.prefix) == []
    back.store((3,), hbm_holding({2, 3}), 1.0)  # HBM evicted block 1
    assert list(host.prefix) == [1]


def test_lmcache_chunks_and_lookup_from_the_first_token():
    """LMCache keys a 256-token chunk by its last block; the partial chunk at the end is not stored, and the hit
    counts whole chunks from the prompt's start, less what HBM holds."""
    tiers, host = fake_tiers("lmcache")
    full = tuple(range(1, 41))  # 40 blocks of 16: two whole chunks and 8 blocks over
    tiers.store(full, hbm_holding(set()), 0.5)
    assert list(host.prefix) == [16, 32]
    assert host.prefix_bytes == 2 * 16 * 0.5
    assert tiers.lookup(full, 0, HBT) == [(host, 32)]
    assert tiers.lookup(full, 20, HBT) == [(host, 12)]  # HBM holds 20 blocks: the tier adds the rest of chunk 2


@pytest.mark.parametrize("sets, message", [
    ({"serving.kv_offload": "storage"}, "describe it in cluster.shared_storage"),
    ({"serving.kv_offload": "storage", "cluster.shared_storage": {"read_bandwidth": "1GB/s",
                                                                  "write_bandwidth": "1GB/s"}}, "capacity"),
    ({"serving.kv_offload": "storage", "cluster.shared_storage": {"capacity": "1TiB"}}, "read_bandwidth"),
    ({"serving.kv_offload": "storage", "cluster.nodes": 1, "cluster.shared_storage": STORAGE}, "one replica"),
    ({"serving.kv_tier_profile": "nope"}, "kv_tier_profile"),
    ({"serving.kv_offload": "remote", "serving.kv_tier_profile": "vllm_cpu"}, "per-instance"),
])
def test_bad_tier_input_is_one_line(sets, message):
    with pytest.raises(InputError) as err:
        scenario(**sets)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_prefix_aware_routing_scores_a_storage_only_tier():
    """With shared storage as the only tier, llm-d's router keeps a tier index per replica sized to its share of
    the store (the store is attached after the cluster is built, so the router must size it then)."""
    from kvcap.sim.cluster import cluster_model

    sim = cluster_model(two_replicas("storage", "lmcache", **{"serving.routing": "prefix_aware"})).build()
    router = sim.prefix_router
    assert router is not None and all(ix is not None for ix in router.tier)
    per_replica = storage_blocks_per_replica(sim)
    assert all(ix is not None and ix.capacity == per_replica for ix in router.tier)


def storage_blocks_per_replica(sim) -> int:
    """The store's KV tokens split over the replicas, in hash blocks (what each replica's index may hold)."""
    rep = sim.replicas[0]
    store = sim.tiers["storage"][0]
    return int(store.capacity / rep.cfg.kv_bytes_per_token / len(sim.replicas)) // rep.cfg.hash_block_tokens
