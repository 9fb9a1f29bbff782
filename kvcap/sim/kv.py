"""KV capacity accounting: one replica's paged HBM blocks with a ref-counted prefix cache, and the lower tiers.

Why apart from the replica and its scheduler: every engine profile needs to know how many blocks a sequence
holds and what is free, whatever its rules for who gets them (vLLM's paging, a fixed-slot engine's slots).
Nothing here decides anything or moves time: it counts.

* :class:`BlockPool` — HBM blocks: each request's private blocks, plus shared prefix blocks (hashed
  ``hash_block_tokens``-token prompt blocks, e.g. Mooncake ``hash_ids``) reference-counted across requests;
  an unreferenced prefix stays cached until its blocks are needed. Freed blocks are reused as vLLM's free-block
  queue reuses them (``BlockPool.free_blocks``, vLLM 0.32): a finished request's last, unfilled block (it has no
  hash) at once; its full blocks in the order they were freed — its own (output, which vLLM caches too but no
  later prompt matches) before its prompt's, and both before anything freed after them.
* :class:`Tier` — host RAM of a node or the remote pool: bytes of parked sequences and stored prefixes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

from kvcap.sim.request import SimRequest

FREED = 1 << 64
"""Keys of freed private blocks in the reuse order start here, above any 64-bit prefix hash id."""


class BlockPool:
    """One replica's HBM KV blocks. ``used`` counts private blocks and every allocated prefix block (referenced
    or only cached), and while prefixes are kept, the private blocks of finished requests too: cached ones are free
    to whoever needs them (:meth:`take` reuses them oldest freed first).

    Why freed private blocks wait in the order too: without them a pool under pressure kept every prompt until
    all the never-used and output blocks freed after it had been taken, where vLLM reuses whatever was freed
    first; a run writing more than its pool then found prompts cached that the real server recomputed."""

    __slots__ = ("block_size", "blocks_for", "cached_blocks", "capacity", "freed_key", "hash_block_tokens",
                 "hash_blocks", "prefix_lru", "prefix_ref", "used")

    def __init__(self, capacity: int, block_size: int, hash_block_tokens: int,
                 blocks_for: Callable[[int], int] | None = None):
        self.capacity = capacity

        def ceil_blocks(tokens: int) -> int:
            return -(-tokens // block_size)

        self.blocks_for: Callable[[int], int] = blocks_for or ceil_blocks
        """Blocks a sequence of T tokens needs (default ceil(T / block_size): full-attention models)."""
        self.block_size = 0 if blocks_for else block_size
        """Nonzero when ``blocks_for`` is ceil(T / block_size), so hot loops compute it inline."""
        self.hash_block_tokens = hash_block_tokens
        self.hash_blocks = self.blocks_for(hash_block_tokens) if hash_block_tokens else 0
        """Blocks one hashed prefix block occupies."""
        self.used = 0
        self.prefix_ref: dict[int, int] = {}
        """Hash id → requests referencing its blocks (0: cached only, also in ``prefix_lru``)."""
        self.prefix_lru: OrderedDict[int, int] = OrderedDict()
        """Reclaimable blocks in the order they were freed, key → blocks: an unreferenced prefix (its hash id) or
        a finished request's private blocks (a key from :data:`FREED` up)."""
        self.cached_blocks = 0
        """Blocks in ``prefix_lru`` (allocated, but reclaimable)."""
        self.freed_key = FREED

    # ------------------------------------------------------------------ capacity
    def free(self) -> int:
        return self.capacity - self.used + self.cached_blocks  # cached blocks are free

    def usage(self) -> float:
        """Fraction of the pool held by requests (cached prefixes count as free, as vLLM reports)."""
        return (self.used - self.cached_blocks) / self.capacity

    def take(self, n: int) -> bool:
        """Allocate ``n`` blocks, evicting unreferenced prefixes (LRU) if needed; False if they are not there."""
        if n <= 0:
            return True
        if self.capacity - self.used + self.cached_blocks < n:
            return False
        while self.capacity - self.used < n and self.prefix_lru:
            h, b = self.prefix_lru.popitem(last=False)
            if h < FREED:
                del self.prefix_ref[h]
            self.used -= b
            self.cached_blocks -= b
        self.used += n
        return True

    def give(self, n: int) -> None:
        self.used -= n

    # ------------------------------------------------------------------ one request's blocks
    def private_need(self, req: SimRequest, tokens: int) -> int:
        """Blocks the request must still take to hold ``tokens`` (negative: it holds more than that)."""
        if req.shared:
            return max(0, self.blocks_for(tokens) - len(req.shared) * self.hash_blocks) - req.blocks
        return self.blocks_for(tokens) - req.blocks

    def final_blocks(self, req: SimRequest) -> int:
        """Private blocks the request holds at its full length (prompt + every output token)."""
        return max(0, self.blocks_for(req.prompt + req.max_out) - len(req.shared) * self.hash_blocks)

    def release(self, req: SimRequest) -> None:
        """The request gives back its private blocks and drops its prefix references (they stay cached). While
        prefixes are kept, an unfilled last block is free at once, its full private blocks join the reuse order
        first (vLLM frees a request's blocks tail first), then its prefix blocks nobody else references."""
        if req.blocks > 0 and self.prefix_ref:
            # a last block the request did not fill has no hash: vLLM puts it at the front of the free queue
            partial = 1 if self.block_size and req.kv % self.block_size else 0
            self.give(partial)
            if req.blocks > partial:
                self.prefix_lru[self.freed_key] = req.blocks - partial
                self.freed_key += 1
                self.cached_blocks += req.blocks - partial
        else:
            self.give(req.blocks)
        req.blocks = 0
        for h in reversed(req.shared):  # tail first, as vLLM frees them: a prefix is lost from its end
            ref = self.prefix_ref.get(h, 0) - 1
            if ref <= 0:
                self.prefix_ref[h] = 0
                self.prefix_lru[h] = self.hash_blocks
                self.cached_blocks += self.hash_blocks
            else:
                self.prefix_ref[h] = ref
        req.shared = ()

    def give_back(self, reqs: Iterable[SimRequest], reserved: dict[int, int]) -> None:
        """Undo a step's reservations (rid → blocks) for these requests."""
        for req in reqs:
            self.give(reserved.get(req.rid, 0))
            req.blocks -= reserved.get(req.rid, 0)

    # ------------------------------------------------------------------ decode spans
    def reserve_decode_steps(self, decoders: list[SimRequest], k: int, reserved: dict[int, int]) -> int:
        """Most decode steps (≤ k, ≥ 1) for which every decoder gets its blocks; reserves them."""
        free = self.free()
        more = self._more_blocks(decoders, k)
        if k > 1 and sum([m for m in more if m > 0]) > free:
            lo, hi = 1, k
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if sum([m for m in self._more_blocks(decoders, mid) if m > 0]) <= free:
                    lo = mid
                else:
                    hi = mid - 1
            k = lo
            more = self._more_blocks(decoders, k)
        total = 0
        for r, m in zip(decoders, more):
            if m > 0:
                total += m
                r.blocks += m
                reserved[r.rid] = reserved.get(r.rid, 0) + m
        self.take(total)  # one take of the sum evicts exactly the cached prefixes that one take each would
        return k

    def _more_blocks(self, decoders: list[SimRequest], steps: int) -> list[int]:
        """Per decoder, the blocks it still takes for ``steps`` more tokens (≤ 0: none): private_need without a
        call per request, blocks_for(kv + steps) − held, held = its private plus its shared prefix blocks."""
        bs, hb = self.block_size, self.hash_blocks
        if bs:
            return [-(-(r.kv + steps) // bs) - (r.blocks + len(r.shared) * hb if r.shared else r.blocks)
                    for r in decoders]
        bf = self.blocks_for
        return [bf(r.kv + steps) - (r.blocks + len(r.shared) * hb if r.shared else r.blocks) for r in decoders]

    def return_unused(self, decoders: list[SimRequest], steps: int, reserved: dict[int, int]) -> None:
        """A span cut to ``steps``: each decoder gives back the reserved blocks those steps will not fill."""
        bs = self.block_size
        for req in decoders:
            if bs and not req.shared:  # private_need inlined (the common case)
                need = -(-(req.kv + steps) // bs) - req.blocks
            else:
                need = self.private_need(req, req.kv + steps)
            excess = min(-need, reserved.get(req.rid, 0))
            if excess > 0:
                self.give(excess)
                req.blocks -= excess
                reserved[req.rid] -= excess

    # ------------------------------------------------------------------ prefix cache
    def hit_blocks(self, req: SimRequest) -> int:
        """Leading hashed blocks of the request's prompt already in HBM."""
        n = 0
        for h in req.hashes[: req.prompt // self.hash_block_tokens] if self.hash_block_tokens else ():
            if h not in self.prefix_ref:
                break
            n += 1
        return n

    def attach_prefix(self, req: SimRequest) -> int:
        """Reference the HBM blocks of the request's cached prefix; returns the tokens it need not compute."""
        n = self.hit_blocks(req)
        hashes = req.hashes[:n]
        for h in hashes:
            ref = self.prefix_ref.get(h, 0)
            if ref == 0 and self.prefix_lru.pop(h, 0):
                self.cached_blocks -= self.hash_blocks
            self.prefix_ref[h] = ref + 1
        req.shared = tuple(hashes)
        req.kv = min(n * self.hash_block_tokens, req.prompt - 1)
        return req.kv

    def share_prefix(self, req: SimRequest, full: tuple[int, ...]) -> None:
        """After a prefill: the prompt's full hash blocks (``full``) not yet cached move from the request's
        private blocks to shared prefix blocks."""
        new = [h for h in full[len(req.shared):] if h not in self.prefix_ref]
        take = len(new) * self.hash_blocks
        if take and req.blocks >= take:
            req.blocks -= take
            for h in new:
                self.prefix_ref[h] = 1
            req.shared = req.shared + tuple(new)


class Tier:
    """Host RAM of one node or the remote pool: capacity shared by parked sequences and stored prefixes."""

    def __init__(self, name: str, capacity: float):
        self.name, self.capacity = name, capacity
        self.parked_bytes = 0.0
        self.prefix: OrderedDict[int, float] = OrderedDict()
        self.prefix_bytes = 0.0
        self.stored = 0
        """Prefix units written here so far (what serve-sim shows as a connector's write counters)."""
        self.evicted = 0
        """Prefix units dropped so far to make room, least recently used first."""

    @property
    def used(self) -> float:
        return self.parked_bytes + self.prefix_bytes

    def reserve(self, nbytes: float) -> bool:
        """Room for a parked sequence, evicting stored prefixes (LRU) if needed."""
        if self.parked_bytes + nbytes > self.capacity:
            return False
        while self.used + nbytes > self.capacity and self.prefix:
            _, b = self.prefix.popitem(last=False)
            self.prefix_bytes -= b
            self.evicted += 1
        self.parked_bytes += nbytes
        return True

    def release(self, nbytes: float) -> None:
        self.parked_bytes = max(0.0, self.parked_bytes - nbytes)

    def store_prefix(self, h: int, nbytes: float) -> bool:
        """Keep one prefix block (evicting older ones); False if it was already there or cannot fit."""
        if h in self.prefix:
            self.prefix.move_to_end(h)
            return False
        while self.used + nbytes > self.capacity and self.prefix:
            _, b = self.prefix.popitem(last=False)
            self.prefix_bytes -= b
            self.evicted += 1
        if self.used + nbytes > self.capacity:
            return False
        self.prefix[h] = nbytes
        self.prefix_bytes += nbytes
        self.stored += 1
        return True

    def hit(self, h: int) -> bool:
        if h in self.prefix:
            self.prefix.move_to_end(h)
            return True
        return False
