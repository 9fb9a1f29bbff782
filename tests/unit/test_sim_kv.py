"""KV accounting on its own: the HBM block pool with its prefix cache, and a tier's bytes (hand-computed cases)."""

from __future__ import annotations

import pytest

from kvcap.sim.kv import BlockPool, Tier
from kvcap.sim.request import SimRequest


def request(rid: int, prompt: int, max_out: int = 10, hashes: tuple[int, ...] = (), kv: int = 0,
            blocks: int = 0) -> SimRequest:
    return SimRequest(rid=rid, arrival=0.0, prompt=prompt, max_out=max_out, hashes=hashes, kv=kv, blocks=blocks)


def test_take_give_free_and_usage():
    pool = BlockPool(capacity=10, block_size=16, hash_block_tokens=0)
    assert pool.blocks_for(1) == 1 and pool.blocks_for(16) == 1 and pool.blocks_for(17) == 2
    assert pool.hash_blocks == 0 and pool.free() == 10
    assert pool.take(4) and pool.used == 4 and pool.free() == 6
    assert not pool.take(7) and pool.used == 4  # a failed take changes nothing
    assert pool.take(0) and pool.take(-3) and pool.used == 4
    assert pool.take(6) and pool.free() == 0
    pool.give(3)
    assert pool.free() == 3 and pool.usage() == pytest.approx(0.7)


def test_private_need_counts_what_a_request_still_has_to_take():
    pool = BlockPool(capacity=10, block_size=16, hash_block_tokens=0)
    req = request(1, prompt=40)
    assert pool.private_need(req, 40) == 3  # ceil(40 / 16)
    req.blocks = 3
    assert pool.private_need(req, 48) == 0 and pool.private_need(req, 49) == 1
    assert pool.private_need(req, 20) == -1  # holds one block more than 20 tokens need
    assert pool.final_blocks(req) == 4  # 40 + 10 tokens


def test_custom_block_cost_is_used_everywhere():
    pool = BlockPool(capacity=10, block_size=16, hash_block_tokens=32, blocks_for=lambda t: min(t, 64) // 16 + 1)
    assert pool.hash_blocks == 3  # 32 // 16 + 1
    assert pool.private_need(request(1, prompt=500), 500) == 5  # a window caps the cost


def test_prefix_blocks_are_shared_ref_counted_and_evicted_last_used_first():
    pool = BlockPool(capacity=10, block_size=16, hash_block_tokens=32)
    assert pool.hash_blocks == 2
    owner = request(1, prompt=100, max_out=20, hashes=(1, 2, 3), kv=100)
    assert pool.take(7)  # ceil(100 / 16) private blocks for its prompt
    owner.blocks = 7
    pool.share_prefix(owner, (1, 2, 3))  # 100 // 32 = 3 full hash blocks become shared
    assert owner.blocks == 1 and owner.shared == (1, 2, 3) and pool.prefix_ref == {1: 1, 2: 1, 3: 1}
    assert pool.used == 7  # moved between accounts, not allocated again

    reuse = request(2, prompt=80, max_out=20, hashes=(1, 2, 9))
    assert pool.hit_blocks(reuse) == 2  # 80 // 32 = 2 full blocks, both cached
    assert pool.attach_prefix(reuse) == 64 and reuse.shared == (1, 2)
    assert pool.prefix_ref == {1: 2, 2: 2, 3: 1}
    assert pool.private_need(reuse, 80) == 1  # ceil(80 / 16) = 5, minus 2 × 2 shared
    assert pool.final_blocks(reuse) == 3  # ceil(100 / 16) = 7, minus 4 shared

    pool.release(owner)  # its unfilled last block free at once (no hash), then the prefix only it referenced
    assert owner.blocks == 0 and owner.shared == ()
    assert pool.used == 6 and pool.prefix_ref == {1: 1, 2: 1, 3: 0} and list(pool.prefix_lru.values()) == [2]
    assert pool.cached_blocks == 2 and pool.free() == 6 and pool.usage() == pytest.approx(0.4)
    assert pool.take(4)  # 4 blocks unallocated, the freed last block among them: prefix 3 kept
    assert pool.used == 10 and pool.prefix_ref[3] == 0 and pool.cached_blocks == 2
    assert pool.take(1)  # now the cached prefix 3 goes
    assert pool.used == 9 and 3 not in pool.prefix_ref and not pool.prefix_lru
    assert pool.hit_blocks(request(3, prompt=100, hashes=(1, 2, 3))) == 2


def test_freed_blocks_are_reused_in_the_order_they_were_freed():
    """vLLM's free-block queue: a prompt freed before a later request's output blocks is evicted before them,
    so a run writing more than its pool keeps only the prompts freed last (a prompt-only LRU kept them all)."""
    pool = BlockPool(capacity=16, block_size=16, hash_block_tokens=32)
    a = request(1, prompt=64, max_out=64, hashes=(10, 11), kv=128)
    b = request(2, prompt=64, max_out=64, hashes=(20, 21), kv=128)
    for r in (a, b):  # 4 prompt blocks shared as 2 hashed prefixes, 4 output blocks private
        assert pool.take(8)
        r.blocks = 8
        pool.share_prefix(r, r.hashes)
    assert pool.used == 16 and pool.free() == 0
    pool.release(a)
    pool.release(b)
    assert list(pool.prefix_lru.values()) == [4, 2, 2, 4, 2, 2] and pool.free() == 16
    assert pool.take(6)  # a's output blocks, then a's last prefix block (vLLM frees a request's blocks tail first)
    assert 11 not in pool.prefix_ref and 10 in pool.prefix_ref and 20 in pool.prefix_ref
    c = request(3, prompt=64, hashes=(20, 21))
    assert pool.hit_blocks(c) == 2 and pool.attach_prefix(c) == 63  # b's prompt still cached
    assert pool.cached_blocks == 2 + 4  # a's first prefix and b's output blocks stay reclaimable


def test_decode_span_reservations_and_their_return():
    pool = BlockPool(capacity=6, block_size=16, hash_block_tokens=0)
    a = request(1, prompt=30, kv=30, blocks=2)  # its 33rd token needs a third block
    b = request(2, prompt=47, kv=47, blocks=3)  # its 49th token needs a fourth
    assert pool.take(5)
    reserved: dict[int, int] = {}
    # 10 steps would need 2 blocks, 1 is free: 2 steps fit (a needs none until step 3, b one at step 2)
    assert pool.reserve_decode_steps([a, b], 10, reserved) == 2
    assert reserved == {2: 1} and b.blocks == 4 and pool.used == 6
    pool.return_unused([a, b], 1, reserved)  # the span was cut to one step: b's block is not needed yet
    assert reserved == {2: 0} and b.blocks == 3 and pool.used == 5
    assert pool.reserve_decode_steps([a, b], 1, reserved) == 1 and pool.used == 5
    pool.give_back([a, b], {1: 0, 2: 2})
    assert b.blocks == 1 and pool.used == 3


def test_tier_holds_parked_bytes_and_evicts_prefixes_for_them():
    tier = Tier("remote", 100.0)
    assert tier.store_prefix(1, 30.0) and tier.store_prefix(2, 30.0) and tier.used == 60.0
    assert not tier.store_prefix(1, 30.0)  # already there: now the most recently used
    assert tier.reserve(50.0)  # 110 > 100: the least recently used prefix (2) goes
    assert tier.parked_bytes == 50.0 and list(tier.prefix) == [1] and tier.used == 80.0
    assert tier.hit(1) and not tier.hit(2)
    assert not tier.reserve(60.0)  # parked sequences never evict each other
    tier.release(50.0)
    tier.release(10.0)
    assert tier.parked_bytes == 0.0
    assert not tier.store_prefix(3, 200.0)  # larger than the tier: evicts what it can and still does not fit
    assert tier.prefix_bytes == 0.0 and not tier.prefix
