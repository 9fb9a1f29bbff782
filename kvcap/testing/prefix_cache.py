"""The test server's exact prefix cache: full prompt blocks by chained hash, LRU eviction of unreferenced blocks,
following vLLM v1's rules so a client's shared-prefix workload gives the hits a hand-worked LRU predicts.

Rules (vLLM v1's ``KVCacheManager``/``BlockPool``, as read from its sources):

* A request is looked up once, when the engine admits it. Its hit is the longest chain of leading full blocks
  present, capped so that at least the prompt's last token is computed: at most ``(prompt_tokens - 1) //
  block_tokens`` blocks (vLLM recomputes the last token to get its logits). ``queries`` grows by the prompt's
  tokens, ``hits`` by the hit's tokens — vLLM's ``vllm:prefix_cache_queries``/``_hits``.
* The request then holds its hit blocks (taken out of the LRU if they were free) and stores its other full
  blocks in order, each in a free place or, when ``capacity_blocks`` are stored, in place of the least recently
  freed unreferenced block. A block already stored (another request holds it) is shared. A block that finds no
  place (every stored block is held) is computed but not kept, nor are the blocks after it.
* When the request ends its blocks are released; those no request holds join the LRU's most recent end in
  reverse order (its last block first), so a prefix's tail is evicted before its head, as vLLM frees them.

Unlike vLLM, the capacity counts only full prompt blocks: decode tokens and a prompt's partial last block take
no place, so a hand-worked case needs only the prompts.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass
class PrefixHold:
    """What one request holds in the cache: the block hashes it references and the prompt tokens it found."""

    blocks: list[int]
    cached_tokens: int


class PrefixCache:
    """Stored blocks with their reference counts and the LRU order of the unreferenced ones; token counters."""

    def __init__(self, capacity_blocks: int, block_tokens: int) -> None:
        if capacity_blocks < 1 or block_tokens < 1:
            raise ValueError("a prefix cache needs capacity_blocks >= 1 and block_tokens >= 1")
        self.capacity_blocks = capacity_blocks
        self.block_tokens = block_tokens
        self.refs: dict[int, int] = {}
        """Every stored block's hash → how many running requests hold it."""
        self.free: OrderedDict[int, None] = OrderedDict()
        """Stored blocks no request holds, least recently released first (the next to evict)."""
        self.queries_tokens = 0
        self.hits_tokens = 0
        self.evictions = 0

    def acquire(self, block_hashes: Sequence[int], prompt_tokens: int) -> PrefixHold:
        """Look a request up and hold its blocks (see the module docstring); counts the query and its hit."""
        most = min(len(block_hashes), max(prompt_tokens - 1, 0) // self.block_tokens)
        hit = 0
        while hit < most and block_hashes[hit] in self.refs:
            hit += 1
        self.queries_tokens += prompt_tokens
        self.hits_tokens += hit * self.block_tokens
        held: list[int] = []
        for i, h in enumerate(block_hashes):
            if h in self.refs:
                self.refs[h] += 1
                self.free.pop(h, None)
            elif not self._make_room():
                log.debug("prefix cache full of held blocks: %d of %d blocks not kept", len(block_hashes) - i,
                          len(block_hashes))
                break
            else:
                self.refs[h] = 1
            held.append(h)
        return PrefixHold(held, hit * self.block_tokens)

    def release(self, hold: PrefixHold) -> None:
        """The request ended: drop its references; blocks now unreferenced join the LRU, last block first."""
        for h in reversed(hold.blocks):
            self.refs[h] -= 1
            if self.refs[h] == 0:
                self.free[h] = None
        hold.blocks = []

    def _make_room(self) -> bool:
        """Room for one more stored block, evicting the least recently released one if need be."""
        if len(self.refs) < self.capacity_blocks:
            return True
        if not self.free:
            return False
        victim, _ = self.free.popitem(last=False)
        del self.refs[victim]
        self.evictions += 1
        return True

    @property
    def stored_blocks(self) -> int:
        return len(self.refs)
