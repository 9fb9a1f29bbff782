"""The serving engine of one replica and the cluster's event loop: continuous batching over paged KV in tiers.

Each replica follows vLLM's scheduler: every step, running requests first (each decode takes one token of the
``max_num_batched_tokens`` budget and, when its last block is full, one more KV block); a request that cannot
get its block preempts the most recently admitted running request; then preempted requests parked in a lower
tier are swapped back in (oldest first), then waiting requests are admitted in arrival order while blocks,
``max_num_seqs`` and the token budget allow (chunked prefill splits a long prompt across steps). Without an
offload tier a preempted request loses its KV and recomputes it later (vLLM V1); with one, its KV is copied
out (the step waits for the copy, as vLLM's swap did) and copied back before it decodes again — the copy back
is on that request's critical path, never on the replica's. Decoding KV always lives in HBM: a parked
sequence does not decode.

Speed: when the batch is pure decode and nothing can be admitted, the replica runs as many steps as it can
until the first request finishes or a block runs out, in one event, timed in closed form by the cost model
(one numpy vector of step times); an arrival or a finished copy cuts such a span at the next step boundary.

Prefix caching (requests that carry ``hash_ids``, e.g. Mooncake traces): blocks of a hashed prefix are shared
and reference-counted in HBM; unreferenced ones stay cached until their blocks are needed (LRU). With an
offload tier, a finished prefill writes its new prefix blocks to the tier (asynchronously), and a request
whose prefix misses HBM but hits the tier loads it over the link instead of recomputing it.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvcap.sim.cost import BatchShape, CostModel
from kvcap.sim.links import Link, LinkSet, Transfer


@dataclass(eq=False, slots=True)
class SimRequest:
    """One request's life in the simulator; times are seconds on the level's clock."""

    rid: int
    arrival: float
    prompt: int
    max_out: int
    hashes: tuple[int, ...] = ()
    tags: dict[str, Any] = field(default_factory=dict)
    replica: int = -1
    state: str = "new"
    """waiting → running ⇄ (swap_out → parked → swap_in) … → done; loading while a tier prefix comes in."""
    kv: int = 0
    """Tokens whose KV is in HBM."""
    out: int = 0
    """Output tokens generated."""
    blocks: int = 0
    """Private HBM blocks held (shared prefix blocks are counted by the replica's prefix cache)."""
    shared: tuple[int, ...] = ()
    """Hash ids whose HBM blocks this request references."""
    t_sched: float | None = None
    t_first: float | None = None
    t_last: float | None = None
    chunks: list[Any] = field(default_factory=list)
    """Token times: floats (single steps) and numpy vectors (decode spans), in order."""
    preemptions: int = 0
    recomputed: int = 0
    t_parked: float = 0.0
    parked_s: float = 0.0
    copy_s: float = 0.0
    """Seconds this request's KV spent on a link (copies out and back in): the transfer part of its latency."""
    tier: str | None = None
    tier_bytes: float = 0.0
    hit_hbm: int = 0
    hit_tier: int = 0
    committed: int = 0
    """HBM blocks promised to this decoder for its whole length (offload admission ``tiers``)."""
    error: str | None = None

    @property
    def target(self) -> int:
        """Tokens whose KV must exist before the next token can be sampled."""
        return self.prompt + self.out if self.out else self.prompt

    def token_times(self) -> np.ndarray:
        parts: list[np.ndarray] = []
        singles: list[float] = []
        for c in self.chunks:
            if type(c) is float:
                singles.append(c)
                continue
            if singles:
                parts.append(np.array(singles))
                singles = []
            parts.append(c)
        if singles:
            parts.append(np.array(singles))
        return np.concatenate(parts) if len(parts) > 1 else (parts[0] if parts else np.zeros(0))


@dataclass(frozen=True)
class ReplicaConfig:
    """What a replica is: its KV pool, batch limits, cost model, and the tiers/links it may offload over."""

    blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    chunked_prefill: bool
    cost: CostModel
    kv_bytes_per_token: float
    """Whole replica (every layer, every tp rank): the bytes a copy of one token's KV moves."""
    hash_block_tokens: int
    prefix_caching: bool
    park_after_prefill: bool
    """Offload admission ``tiers``: admit past HBM — prefill, emit the first token, park the KV in a tier until a
    decode slot (HBM room for the whole sequence) frees up. ``hbm``: vLLM's rule (tiers hold preempted KV only)."""
    node: int
    host_link: Link | None
    nic_links: tuple[Link, ...]
    max_model_len: int | None = None
    """Longest prompt + output the engine accepts (the model's context); longer requests get a 400."""
    blocks_for: Callable[[int], int] | None = None
    """Blocks a sequence of T tokens needs (None: ceil(T / block_size), full-attention models)."""


class Tier:
    """Host RAM of one node or the remote pool: capacity shared by parked sequences and stored prefixes."""

    def __init__(self, name: str, capacity: float):
        self.name, self.capacity = name, capacity
        self.parked_bytes = 0.0
        self.prefix: OrderedDict[int, float] = OrderedDict()
        self.prefix_bytes = 0.0

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
        self.parked_bytes += nbytes
        return True

    def release(self, nbytes: float) -> None:
        self.parked_bytes = max(0.0, self.parked_bytes - nbytes)

    def store_prefix(self, h: int, nbytes: float) -> bool:
        if h in self.prefix:
            self.prefix.move_to_end(h)
            return False
        while self.used + nbytes > self.capacity and self.prefix:
            _, b = self.prefix.popitem(last=False)
            self.prefix_bytes -= b
        if self.used + nbytes > self.capacity:
            return False
        self.prefix[h] = nbytes
        self.prefix_bytes += nbytes
        return True

    def hit(self, h: int) -> bool:
        if h in self.prefix:
            self.prefix.move_to_end(h)
            return True
        return False


@dataclass(slots=True)
class Span:
    """What a replica is computing now: one mixed step, or k pure-decode steps."""

    t0: float
    ends: np.ndarray
    """Absolute end time of each step."""
    decoders: list[SimRequest]
    prefills: list[tuple[SimRequest, int]]
    reserved: dict[int, int]
    """rid → blocks reserved for the planned steps (a cut span gives the excess back)."""


class Replica:
    """One serving-engine instance (tp × pp GPUs) with its scheduler, KV pool and counters."""

    def __init__(self, index: int, cfg: ReplicaConfig, sim: Simulation):
        self.index, self.cfg, self.sim = index, cfg, sim
        self.B = cfg.block_size
        self.blocks_for = cfg.blocks_for or (lambda t, b=cfg.block_size: -(-t // b))
        self.hash_blocks = self.blocks_for(cfg.hash_block_tokens) if cfg.hash_block_tokens else 0
        self.used = 0
        """Blocks allocated: private + shared prefix blocks (referenced or cached)."""
        self.prefix_ref: dict[int, int] = {}
        self.prefix_lru: OrderedDict[int, None] = OrderedDict()
        self.running: list[SimRequest] = []
        self.waiting: deque[SimRequest] = deque()
        self.parked: list[tuple[float, int, SimRequest]] = []
        self.moving = 0
        self.incoming = 0
        """Requests whose KV is being copied into HBM (swap-in, prefix load): they hold a running slot."""
        """Requests in a copy (swap out/in, prefix load): held, not decoding."""
        self.stalled = 0
        self.span: Span | None = None
        self.version = 0
        self.preemptions = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.busy_done = 0.0
        self.committed = 0
        self.parking = cfg.park_after_prefill
        self.running_peak = 0

    # ------------------------------------------------------------------ accounting
    @property
    def cached_blocks(self) -> int:
        return len(self.prefix_lru) * self.hash_blocks

    def free_blocks(self) -> int:
        return self.cfg.blocks - self.used + self.cached_blocks

    def _take(self, n: int) -> bool:
        if n <= 0:
            return True
        if self.cfg.blocks - self.used + self.cached_blocks < n:
            return False
        while self.cfg.blocks - self.used < n and self.prefix_lru:
            h, _ = self.prefix_lru.popitem(last=False)
            del self.prefix_ref[h]
            self.used -= self.hash_blocks
        self.used += n
        return True

    def _give(self, n: int) -> None:
        self.used -= n

    def kv_usage(self) -> float:
        return (self.used - self.cached_blocks) / self.cfg.blocks

    def load(self) -> int:
        return len(self.running) + len(self.waiting) + len(self.parked) + self.moving

    def hbm_hit_blocks(self, req: SimRequest) -> int:
        n = 0
        for h in req.hashes[: req.prompt // self.cfg.hash_block_tokens] if self.cfg.hash_block_tokens else ():
            if h not in self.prefix_ref:
                break
            n += 1
        return n

    def _private_need(self, req: SimRequest, tokens: int) -> int:
        """Blocks the request must still take to hold ``tokens`` (negative: it holds more than that)."""
        if req.shared:
            return max(0, self.blocks_for(tokens) - len(req.shared) * self.hash_blocks) - req.blocks
        return self.blocks_for(tokens) - req.blocks

    def _release(self, req: SimRequest) -> None:
        self._give(req.blocks)
        req.blocks = 0
        for h in req.shared:
            ref = self.prefix_ref.get(h, 0) - 1
            if ref <= 0:
                self.prefix_ref[h] = 0
                self.prefix_lru[h] = None
            else:
                self.prefix_ref[h] = ref
        req.shared = ()

    def abort(self, req: SimRequest, now: float) -> bool:
        """The client left: drop a waiting or running request (others finish their copy first)."""
        if req.state == "waiting" and req in self.waiting:
            self.waiting.remove(req)
        elif req.state == "running" and req in self.running and (self.span is None or (
                req not in self.span.decoders and all(r is not req for r, _ in self.span.prefills))):
            self.running.remove(req)
            self._release(req)
            if req.committed:
                self._uncommit(req)
        else:
            return False
        req.error = "cancelled"
        req.state = "done"
        return True

    # ------------------------------------------------------------------ arrivals and interrupts
    def enqueue(self, req: SimRequest, now: float) -> None:
        req.replica, req.state = self.index, "waiting"
        too_long = self.cfg.max_model_len is not None and req.prompt + req.max_out > self.cfg.max_model_len
        if self.blocks_for(req.prompt + req.max_out) > self.cfg.blocks or too_long:
            # over the context, or a whole sequence larger than the KV pool (vLLM refuses to start with a
            # max_model_len that does not fit): it could only ever preempt itself, so it is refused
            req.error = "http_4xx"
            self.sim.finish(req, now)
            return
        self.waiting.append(req)
        self.poke(now)

    def poke(self, now: float, force: bool = False) -> None:
        """Something changed (arrival, a copy finished): start a step if idle, else cut a decode span short."""
        if self.stalled:
            return
        if self.span is None:
            self.schedule(now)
            return
        ends = self.span.ends
        if ends.size <= 1 or not (force or self._could_admit()):
            return
        j = int(np.searchsorted(ends, now, side="left"))
        if j >= ends.size - 1:
            return
        self._cut(j + 1)

    def _could_admit(self) -> bool:
        if self.parked and self.parked[0][2].state == "parked":
            return True
        if not self.waiting or len(self.running) + self.incoming >= self.cfg.max_num_seqs:
            return False
        return self.free_blocks() >= self._head_need(self.waiting[0])

    def _head_need(self, head: SimRequest) -> int:
        """Free blocks the head of the waiting queue needs to be admitted (its cached prefix is already there;
        a parking engine keeps the decoders' growth out of reach)."""
        need = self.blocks_for(head.target) - head.blocks
        if (head.kv == 0 and not head.shared and head.hashes and self.cfg.prefix_caching
                and self.cfg.hash_block_tokens):
            need -= self.hbm_hit_blocks(head) * self.hash_blocks
        if self.parking:
            need += self._growth_reserve()
        return need

    def _cut(self, k: int) -> None:
        """Keep the first k steps of the current decode span."""
        span = self.span
        assert span is not None
        span.ends = span.ends[:k]
        for req in span.decoders:
            excess = min(-self._private_need(req, req.kv + k), span.reserved.get(req.rid, 0))
            if excess > 0:
                self._give(excess)
                req.blocks -= excess
                span.reserved[req.rid] -= excess
        self.version += 1
        self.sim.push(float(span.ends[-1]), "step", self, self.version)

    # ------------------------------------------------------------------ the scheduler
    def schedule(self, now: float) -> None:
        cfg = self.cfg
        if self.stalled or self.span is not None:
            return
        budget = cfg.max_num_batched_tokens
        decoders: list[SimRequest] = []
        prefills: list[tuple[SimRequest, int]] = []
        reserved: dict[int, int] = {}
        # 1. running requests, oldest first; preempt from the newest when a block is missing
        i = 0
        plain = cfg.blocks_for is None
        bs = self.B
        while i < len(self.running):
            req = self.running[i]
            kv = req.kv
            if req.out and kv >= req.prompt + req.out - 1:
                chunk = 1
            else:
                chunk = min(req.target - kv, budget) if cfg.chunked_prefill else req.target - kv
            if chunk <= 0 or budget <= 0:
                i += 1
                continue
            if plain and not req.shared:  # the common case, inlined: ceil((kv + chunk) / block) - held
                need = -(-(kv + chunk) // bs) - req.blocks
                need = need if need > 0 else 0
            else:
                need = max(0, self._private_need(req, kv + chunk))
            lost = False
            while need > 0 and not self._take(need):
                victim = self.running[-1]
                self._preempt(victim, now, decoders, prefills, reserved)
                if victim is req or self.stalled:
                    lost = True
                    break
            if self.stalled:
                break
            if lost:
                continue  # req itself was preempted: the list shifted, index i is already the next one
            req.blocks += need
            reserved[req.rid] = max(need, 0)
            budget -= chunk
            if chunk == 1 and req.out:
                decoders.append(req)
            else:
                prefills.append((req, chunk))
            i += 1
        if self.stalled:
            # swap-outs in flight: give back this step's reservations and wait for the copies
            for req in decoders + [r for r, _ in prefills]:
                self._give(reserved.get(req.rid, 0))
                req.blocks -= reserved.get(req.rid, 0)
            return
        # 2. parked requests come back first (oldest arrival first); nothing new is admitted while one waits
        while self.parked and self.parked[0][2].state == "parked":
            req = self.parked[0][2]
            if len(self.running) + self.incoming >= cfg.max_num_seqs:
                break
            if self.parking and not self._can_commit(req):
                break
            need = self._private_need(req, req.kv + 1)
            if not self._take(need):
                break
            heapq.heappop(self.parked)
            req.blocks += need
            if self.parking:
                self._commit(req)
            self._swap_in(req, now)
        # 3. waiting requests, in order (parking engines admit past parked ones while the tier has room)
        while (self.waiting and (self.parking or not self.parked) and budget > 0
               and len(self.running) + self.incoming < cfg.max_num_seqs):
            req = self.waiting[0]
            if req.kv == 0 and not req.shared and req.hashes and cfg.prefix_caching and cfg.hash_block_tokens:
                hit = self._attach_prefix(req)
            else:
                hit = 0
            need = self._private_need(req, req.target)
            whole = not cfg.chunked_prefill and req.target - req.kv > budget and (decoders or prefills)
            if self.parking and need > self.free_blocks() - self._growth_reserve():
                whole = True  # the blocks left are promised to the decoders' growth
            if whole or not self._take(need):
                if hit:
                    self._release(req)
                    req.kv = 0
                break
            self.waiting.popleft()
            req.blocks += need
            if req.t_sched is None:
                req.t_sched = now
            if hit and req.out == 0:
                req.hit_hbm = req.kv
            tier_tokens = self._tier_prefix(req) if req.out == 0 else 0
            if tier_tokens:
                self._load_prefix(req, tier_tokens, now)
                continue
            req.state = "running"
            self.running.append(req)
            chunk = min(req.target - req.kv, budget) if cfg.chunked_prefill else req.target - req.kv
            prefills.append((req, chunk))
            reserved[req.rid] = 0
            budget -= chunk
        self.running_peak = max(self.running_peak, len(self.running))
        if not decoders and not prefills:
            return
        self._start(now, decoders, prefills, reserved)

    def _start(self, now: float, decoders: list[SimRequest], prefills: list[tuple[SimRequest, int]],
               reserved: dict[int, int]) -> None:
        cost = self.cfg.cost
        window = cost.model.sliding_window
        if prefills:
            shape = BatchShape.of(prefill=[(c, r.kv) for r, c in prefills], decode=[r.kv for r in decoders],
                                  window=window)
            ends = np.asarray([now + cost.iteration_time(shape).total_s])
        else:
            k = min(r.max_out - r.out for r in decoders)
            if (self.waiting and (self.parking or not self.parked)
                    and len(self.running) + self.incoming < self.cfg.max_num_seqs
                    and self.free_blocks() >= self._head_need(self.waiting[0])):
                k = 1  # something could be admitted next step (blocks free up only at a finish)
            if self.sim.max_span is not None:
                k = min(k, self.sim.max_span)
            k = self._block_limit(decoders, k, reserved)
            shape = BatchShape.of(decode=[r.kv for r in decoders], window=window)
            ends = now + np.cumsum(cost.decode_step_times(shape, k))
        self.span = Span(t0=now, ends=ends, decoders=decoders, prefills=prefills, reserved=reserved)
        self.version += 1
        self.sim.push(float(ends[-1]), "step", self, self.version)

    def _block_limit(self, decoders: list[SimRequest], k: int, reserved: dict[int, int]) -> int:
        """Most decode steps (≤ k, ≥ 1) for which every decoder gets its blocks; reserves them."""
        free = self.free_blocks()

        def extra(steps: int) -> int:
            return sum(max(0, self._private_need(r, r.kv + steps)) for r in decoders)

        if k > 1 and extra(k) > free:
            lo, hi = 1, k
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if extra(mid) <= free:
                    lo = mid
                else:
                    hi = mid - 1
            k = lo
        for r in decoders:
            more = max(0, self._private_need(r, r.kv + k))
            if more:
                self._take(more)
                r.blocks += more
                reserved[r.rid] = reserved.get(r.rid, 0) + more
        return k

    def _preempt(self, victim: SimRequest, now: float, decoders: list[SimRequest],
                 prefills: list[tuple[SimRequest, int]], reserved: dict[int, int]) -> None:
        """vLLM's rule: the newest running request gives its blocks back (recompute), or is copied out."""
        self.running.remove(victim)
        if victim.committed:
            self._uncommit(victim)
        if victim in decoders:
            decoders.remove(victim)
        prefills[:] = [(r, c) for r, c in prefills if r is not victim]
        reserved.pop(victim.rid, None)
        victim.preemptions += 1
        self.preemptions += 1
        tier, lanes, caps = (self.sim.tier_for(self, victim.kv * self.cfg.kv_bytes_per_token)
                             if victim.out and self.sim.tiers_enabled else (None, [], []))
        if tier is not None:
            nbytes = victim.kv * self.cfg.kv_bytes_per_token
            victim.state, victim.tier, victim.tier_bytes = "swap_out", tier.name, nbytes
            self.stalled += 1
            self.moving += 1

            def done(t: float, v: SimRequest = victim, t0: float = now) -> None:
                v.copy_s += t - t0
                self.stalled -= 1
                self.moving -= 1
                self._release(v)  # HBM blocks are reusable once the copy is out
                v.state, v.t_parked = "parked", t
                heapq.heappush(self.parked, (v.arrival, v.rid, v))
                if not self.stalled:
                    self.schedule(t)

            self.sim.links.start(now, nbytes, lanes, caps, outbound=True, on_done=done)
            self.sim.watch_links()
            return
        victim.recomputed += victim.kv
        self._release(victim)
        victim.kv = 0
        victim.state = "waiting"
        self.waiting.appendleft(victim)

    def _swap_in(self, req: SimRequest, now: float) -> None:
        tier = self.sim.tier_by_name(self, req.tier)
        _, lanes, caps = self.sim.tier_for(self, 0.0, name=req.tier, reserve=False)
        req.state = "swap_in"
        self.moving += 1
        self.incoming += 1

        def done(t: float, r: SimRequest = req, tr: Tier | None = tier, t0: float = now) -> None:
            r.copy_s += t - t0
            self.moving -= 1
            self.incoming -= 1
            if tr is not None:
                tr.release(r.tier_bytes)
            r.parked_s += t - r.t_parked
            r.state, r.tier, r.tier_bytes = "running", None, 0.0
            self.running.append(r)
            self.poke(t, force=True)

        self.sim.links.start(now, req.tier_bytes, lanes, caps, outbound=False, on_done=done)
        self.sim.watch_links()

    # ------------------------------------------------------------------ prefixes
    def _attach_prefix(self, req: SimRequest) -> int:
        """Reference the HBM blocks of the request's cached prefix; returns the tokens it need not compute."""
        n = self.hbm_hit_blocks(req)
        hashes = req.hashes[:n]
        for h in hashes:
            self.prefix_ref[h] = self.prefix_ref.get(h, 0) + 1
            self.prefix_lru.pop(h, None)
        req.shared = tuple(hashes)
        req.kv = min(n * self.cfg.hash_block_tokens, req.prompt - 1)
        return req.kv

    def _tier_prefix(self, req: SimRequest) -> int:
        """Tokens of the prefix after the HBM hit that the offload tier holds (loaded instead of recomputed)."""
        hbt = self.cfg.hash_block_tokens
        if not (req.hashes and hbt and self.cfg.prefix_caching and self.sim.tiers_enabled):
            return 0
        start = len(req.shared)
        n = 0
        for h in req.hashes[start: req.prompt // hbt]:
            if not self.sim.tier_has_prefix(self, h):
                break
            n += 1
        return min(n * hbt, req.prompt - 1 - req.kv)

    def _load_prefix(self, req: SimRequest, tokens: int, now: float) -> None:
        nbytes = tokens * self.cfg.kv_bytes_per_token
        name = self.sim.prefix_tier_name(self)
        _, lanes, caps = self.sim.tier_for(self, 0.0, name=name, reserve=False)
        req.state = "loading"
        self.moving += 1
        self.incoming += 1

        def done(t: float, r: SimRequest = req, n: int = tokens, t0: float = now) -> None:
            r.copy_s += t - t0
            self.moving -= 1
            self.incoming -= 1
            r.kv += n
            r.hit_tier = n
            r.state = "running"
            self.running.append(r)
            self.poke(t, force=True)

        self.sim.links.start(now, nbytes, lanes, caps, outbound=False, on_done=done)
        self.sim.watch_links()

    def _register_prefix(self, req: SimRequest, now: float) -> None:
        """After a prefill: its full hash blocks become shared HBM prefix blocks (and go to the tier)."""
        hbt = self.cfg.hash_block_tokens
        if not (req.hashes and hbt and self.cfg.prefix_caching):
            return
        full = req.hashes[: req.prompt // hbt]
        new = [h for h in full[len(req.shared):] if h not in self.prefix_ref]
        take = len(new) * self.hash_blocks
        if take and req.blocks >= take:
            req.blocks -= take  # move those blocks from private to shared accounting
            for h in new:
                self.prefix_ref[h] = 1
            req.shared = req.shared + tuple(new)
        self.sim.store_prefixes(self, full, hbt * self.cfg.kv_bytes_per_token, now)

    # ------------------------------------------------------------------ a step (or span) ends
    def on_step(self, now: float) -> None:
        span = self.span
        assert span is not None
        self.span = None
        self.busy_done += float(span.ends[-1] - span.t0)
        k = span.ends.size
        gen = 0
        for req in span.decoders:
            req.kv += k
            req.out += k
            req.chunks.append(span.ends if k > 1 else float(span.ends[0]))
            req.t_last = float(span.ends[-1])
            gen += k
            if self.sim.on_tokens is not None:
                self.sim.on_tokens(req)
        completed: list[SimRequest] = []
        for req, chunk in span.prefills:
            req.kv += chunk
            self.prompt_tokens += chunk
            if req.kv >= req.target:
                completed.append(req)
                req.out += 1
                gen += 1
                t = float(span.ends[-1])
                if req.t_first is None:
                    req.t_first = t
                    self._register_prefix(req, now)
                req.chunks.append(t)
                req.t_last = t
                if self.sim.on_tokens is not None:
                    self.sim.on_tokens(req)
        self.generation_tokens += gen
        done = [r for r in self.running if r.out >= r.max_out]
        for req in done:
            self.running.remove(req)
            self._release(req)
            if req.committed:
                self._uncommit(req)
            self.sim.finish(req, now)
        if self.parking:
            for req in completed:  # first prefills and recomputations alike: decode in HBM only if promised room
                if req.state == "running" and not req.committed and req.out < req.max_out:
                    if self._can_commit(req):
                        self._commit(req)
                    elif not self._park(req, now):
                        self._commit(req)  # no tier room: it decodes in HBM (vLLM's rule from here on)
        self.schedule(now)

    # ------------------------------------------------------------------ parking (offload admission "tiers")
    def _final_blocks(self, req: SimRequest) -> int:
        return max(0, self.blocks_for(req.prompt + req.max_out) - len(req.shared) * self.hash_blocks)

    def _can_commit(self, req: SimRequest) -> bool:
        """HBM room for this request's whole sequence, after the other decoders' promises, the prefills in
        progress and room to prefill the next waiting request (parking needs somewhere to compute KV)."""
        prefilling = sum(r.blocks for r in self.running if not r.out)
        workspace = self.blocks_for(self.waiting[0].target) if self.waiting else 0
        return self.committed + self._final_blocks(req) + prefilling + workspace <= self.cfg.blocks

    def _growth_reserve(self) -> int:
        """Blocks committed decoders will still allocate as they grow (not to be lent to prefills)."""
        return max(0, self.committed - sum(r.blocks for r in self.running if r.committed))

    def _commit(self, req: SimRequest) -> None:
        req.committed = self._final_blocks(req)
        self.committed += req.committed

    def _uncommit(self, req: SimRequest) -> None:
        self.committed -= req.committed
        req.committed = 0

    def _park(self, req: SimRequest, now: float) -> bool:
        """Copy a just-prefilled request's KV out to a tier (its blocks are freed when the copy is through)."""
        nbytes = req.kv * self.cfg.kv_bytes_per_token
        tier, lanes, caps = self.sim.tier_for(self, nbytes)
        if tier is None:
            return False
        self.running.remove(req)
        req.state, req.tier, req.tier_bytes = "swap_out", tier.name, nbytes
        self.moving += 1

        def done(t: float, r: SimRequest = req, t0: float = now) -> None:
            r.copy_s += t - t0
            self.moving -= 1
            self._release(r)
            r.state, r.t_parked = "parked", t
            heapq.heappush(self.parked, (r.arrival, r.rid, r))
            self.poke(t, force=True)

        self.sim.links.start(now, nbytes, lanes, caps, outbound=True, on_done=done)
        self.sim.watch_links()
        return True

    def busy_at(self, t: float) -> float:
        """GPU-busy seconds up to ``t`` (a span in progress counts up to ``t``)."""
        span = self.span
        if span is None:
            return self.busy_done
        return self.busy_done + min(max(t - span.t0, 0.0), float(span.ends[-1] - span.t0))


class Simulation:
    """The cluster: replicas, tiers, links and the event heap; a load driver feeds it requests."""

    def __init__(self, configs: list[ReplicaConfig], tiers: dict[str, list[Tier]], links: LinkSet,
                 routing: str = "least_loaded", pool_links: tuple[Link, ...] = (),
                 on_finish: Callable[[SimRequest, float], None] | None = None):
        self.links = links
        self.tiers = tiers
        """``host``: one Tier per node; ``remote``: one shared Tier (the pool)."""
        self.tiers_enabled = bool(tiers)
        self.pool_links = pool_links
        self.replicas = [Replica(i, c, self) for i, c in enumerate(configs)]
        self.routing = routing
        self.heap: list[tuple[float, int, str, Any, int]] = []
        self.seq = 0
        self.now = 0.0
        self.rr = 0
        self.link_version = 0
        self.on_finish = on_finish
        self.finished = 0
        self.events = 0
        self.max_span: int | None = None
        """Longest decode span in steps (1 when serving in real time, so every token is an event)."""
        self.on_tokens: Callable[[SimRequest], None] | None = None

    # ------------------------------------------------------------------ events
    def push(self, t: float, kind: str, obj: Any, version: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, obj, version))

    def watch_links(self) -> None:
        """(Re)arm the event for the next transfer to get its bytes through."""
        nxt = self.links.next_done()
        self.link_version += 1
        if nxt is not None:
            self.push(max(nxt[0], self.now), "link", nxt[1], self.link_version)

    def submit(self, req: SimRequest, t: float) -> None:
        self.push(t, "arrival", req)

    def run_until(self, t_end: float, stop: Callable[[], bool] | None = None,
                  on_time: Callable[[float], None] | None = None) -> None:
        """Process events in time order up to ``t_end`` (``on_time`` sees the clock before each event)."""
        heap = self.heap
        while heap and heap[0][0] <= t_end:
            t, _, kind, obj, version = heapq.heappop(heap)
            if on_time is not None:
                on_time(t)
            self.now = t
            self.events += 1
            if kind == "step":
                if version == obj.version and obj.span is not None:
                    obj.on_step(t)
            elif kind == "arrival":
                self.route(obj).enqueue(obj, t)
            elif kind == "link":
                if version == self.link_version:
                    self.links.advance(t)
                    tr: Transfer = obj
                    if tr in self.links.transfers and tr.remaining <= max(1.0, 1e-9 * tr.nbytes):
                        self.links.finish(tr)
                        self.push(t + tr.latency_s, "copied", tr)
                    self.watch_links()
            elif kind == "copied":
                obj.on_done(t)
            elif kind == "call":
                obj(t)
            if stop is not None and stop():
                return

    # ------------------------------------------------------------------ routing
    def route(self, req: SimRequest) -> Replica:
        reps = self.replicas
        if len(reps) == 1:
            return reps[0]
        if self.routing == "round_robin":
            self.rr = (self.rr + 1) % len(reps)
            return reps[self.rr]
        if self.routing == "kv_aware" and req.hashes:
            return max(reps, key=lambda r: (r.hbm_hit_blocks(req), -r.load(), -r.index))
        return min(reps, key=lambda r: (r.load(), r.index))

    # ------------------------------------------------------------------ tiers
    def _order(self) -> list[str]:
        return [n for n in ("host", "remote") if n in self.tiers]

    def tier_by_name(self, rep: Replica, name: str | None) -> Tier | None:
        if name is None or name not in self.tiers:
            return None
        group = self.tiers[name]
        return group[rep.cfg.node] if name == "host" else group[0]

    def tier_for(self, rep: Replica, nbytes: float, name: str | None = None,
                 reserve: bool = True) -> tuple[Tier | None, list[Link], list[Link]]:
        """The tier (host first, then remote) with room for ``nbytes``, and the links a copy to it crosses."""
        for n in ([name] if name else self._order()):
            tier = self.tier_by_name(rep, n)
            if tier is None:
                continue
            if reserve and not tier.reserve(nbytes):
                continue
            if n == "host":
                assert rep.cfg.host_link is not None
                return tier, [rep.cfg.host_link], []
            return tier, list(rep.cfg.nic_links), list(self.pool_links)
        return None, [], []

    def prefix_tier_name(self, rep: Replica) -> str | None:
        order = self._order()
        return order[0] if order else None

    def tier_has_prefix(self, rep: Replica, h: int) -> bool:
        name = self.prefix_tier_name(rep)
        tier = self.tier_by_name(rep, name)
        return tier is not None and tier.hit(h)

    def store_prefixes(self, rep: Replica, hashes: tuple[int, ...], bytes_each: float, now: float) -> None:
        name = self.prefix_tier_name(rep)
        tier = self.tier_by_name(rep, name)
        if tier is None:
            return
        new = sum(1 for h in hashes if tier.store_prefix(h, bytes_each))
        if new:
            _, lanes, caps = self.tier_for(rep, 0.0, name=name, reserve=False)
            self.links.start(now, new * bytes_each, lanes, caps, outbound=True, on_done=lambda t: None)
            self.watch_links()

    def finish(self, req: SimRequest, now: float) -> None:
        req.state = "done"
        if req.t_last is None:
            req.t_last = now
        self.finished += 1
        if self.on_finish is not None:
            self.on_finish(req, now)

