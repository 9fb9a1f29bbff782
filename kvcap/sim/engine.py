"""The cluster's event loop: replicas, their offload tiers and links, and one heap of timed events.

Why apart from the replicas: routing a request, finding the tier a copy goes to and the links it crosses,
and ordering every replica's step ends, arrivals and copy completions in time are cluster matters, the
same whatever engine each replica runs (:mod:`kvcap.sim.replica`, its policy in :mod:`kvcap.sim.policy`).
A load driver (:mod:`kvcap.sim.run`, serve-sim) submits requests and runs the clock.

Events, in time order (ties in push order), are of the kinds :data:`kvcap.sim.events.EventKind` lists; the
hooks a replica calls (:class:`kvcap.sim.events.ClusterHooks`) are implemented here.
"""

from __future__ import annotations

import heapq
import math
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from kvcap.sim.events import ClusterHooks, EventKind
from kvcap.sim.kv import Tier
from kvcap.sim.links import Link, LinkSet, Transfer
from kvcap.sim.policy import SchedulingPolicy
from kvcap.sim.replica import Replica
from kvcap.sim.replica_state import ReplicaConfig
from kvcap.sim.request import SimRequest
from kvcap.sim.tiers import ReplicaTiers

ROUTER_BLOCK_TOKENS = 16
"""Tokens per block the llm-d prefix index hashes (``blockSizeTokens``: vLLM's block)."""
ROUTER_MAX_PREFIX_BLOCKS = 256
"""Leading blocks of a prompt the index looks at (``maxPrefixBlocksToMatch``); the rest is never indexed."""


class PrefixIndex:
    """The router's guess of the prefixes one replica holds in one tier, as llm-d's approximate prefix-cache
    producer keeps it: an LRU of the block hashes the router itself sent there (no word from the engine), at
    most ``capacity`` entries. Its score for a prompt is the share of the prompt's indexed blocks that match
    from the start."""

    __slots__ = ("capacity", "lru")

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.lru: OrderedDict[int, None] = OrderedDict()

    def match(self, hashes: Sequence[int]) -> int:
        """Leading hashes present (looking does not refresh them)."""
        lru, n = self.lru, 0
        for h in hashes:
            if h not in lru:
                break
            n += 1
        return n

    def add(self, hashes: Sequence[int]) -> None:
        """The router sent these here: each becomes the newest entry, the oldest go past ``capacity``."""
        lru = self.lru
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
        while len(lru) > self.capacity:
            lru.popitem(last=False)


class PrefixAwareRouter:
    """llm-d's endpoint picker as its tiered-prefix-cache guide configures it (llm-d/llm-d
    ``guides/tiered-prefix-cache/router/single-host/tiered-prefix-cache-cpu.values.yaml``; scorers from
    gateway-api-inference-extension and llm-d-inference-scheduler): every replica gets the sum, each at weight 1
    (the guide's 1:1:1:1:1), of

    * queue: (longest waiting queue − its own) / (longest − shortest), 1 where all are equal;
    * KV utilisation: 1 − the share of its HBM blocks held by requests;
    * GPU prefix: leading indexed blocks matched / blocks indexed, from a :class:`PrefixIndex` as large as the
      replica's HBM pool (the producer's ``autoTune`` reads ``num_gpu_blocks``);
    * tier prefix (only where the replica has an offload tier): the same from an index as large as the replica's
      share of the tier (the guide sets ``lruCapacityPerServer`` to the CPU pool);
    * no-hit LRU: for a request no index matches at all, 1 for the replica least recently sent such a request
      down to 0 for the most recent (cold prefills spread out); 0.5 for every replica otherwise;

    and the highest sum wins (lowest index among equals, where llm-d's picker draws at random). The chosen
    replica's indexes then record the request's indexed blocks."""

    def __init__(self, replicas: list[Replica], tier_tokens: list[float]) -> None:
        self.replicas = replicas
        self.gpu = [PrefixIndex(r.cfg.blocks * r.cfg.block_size // max(1, r.cfg.hash_block_tokens))
                    for r in replicas]
        self.tier = [PrefixIndex(int(t) // max(1, r.cfg.hash_block_tokens)) if t > 0 else None
                     for r, t in zip(replicas, tier_tokens)]
        self.cold_order = list(range(len(replicas)))
        """Replicas by the last time they got a request no index matched: least recent first."""

    def indexed(self, req: SimRequest, hbt: int) -> tuple[int, ...]:
        """The request's hashes the index sees: whole prompt blocks, at most the match limit's tokens."""
        if not req.hashes or hbt <= 0:
            return ()
        limit = max(1, ROUTER_MAX_PREFIX_BLOCKS * ROUTER_BLOCK_TOKENS // hbt)
        return req.hashes[: min(req.prompt // hbt, limit)]

    def pick(self, req: SimRequest) -> Replica:
        reps = self.replicas
        hashes = self.indexed(req, reps[0].cfg.hash_block_tokens)
        total = len(hashes)
        queues = [len(r.waiting) for r in reps]
        lo, hi = min(queues), max(queues)
        gpu = [ix.match(hashes) / total if total else 0.0 for ix in self.gpu]
        tier = [ix.match(hashes) / total if total and ix is not None else 0.0 for ix in self.tier]
        cold = not any(gpu) and not any(tier)
        n = len(reps)
        no_hit = [0.5] * n
        if cold:
            for pos, i in enumerate(self.cold_order):
                no_hit[i] = 1.0 - pos / (n - 1) if n > 1 else 1.0
        best, best_score = 0, -math.inf
        for i, rep in enumerate(reps):
            score = (1.0 if hi == lo else (hi - queues[i]) / (hi - lo)) + (1.0 - rep.hbm.usage()) \
                + gpu[i] + tier[i] + no_hit[i]
            if score > best_score:
                best, best_score = i, score
        if hashes:
            self.gpu[best].add(hashes)
            ix = self.tier[best]
            if ix is not None:
                ix.add(hashes)
        if cold:
            self.cold_order.remove(best)
            self.cold_order.append(best)
        return reps[best]


class Simulation(ClusterHooks):
    """The cluster: replicas, tiers, links and the event heap; a load driver feeds it requests. Each replica gets
    a policy of its own from ``policy()``."""

    def __init__(self, configs: list[ReplicaConfig], tiers: dict[str, list[Tier]], links: LinkSet,
                 policy: Callable[[], SchedulingPolicy], routing: str = "least_loaded",
                 pool_links: tuple[Link, ...] = (), on_finish: Callable[[SimRequest, float], None] | None = None,
                 request_overhead_s: float = 0.0, host_per_replica: bool = False):
        self.links = links
        self.request_overhead_s = request_overhead_s
        """Each request reaches its replica's scheduler this long after it arrives (``step_cost.per_request``)."""
        self.tiers = tiers
        """``host``: one Tier per node; ``remote``: one shared Tier (the pool)."""
        self.pool_links = pool_links
        self.host_per_replica = host_per_replica
        """``tiers["host"]`` holds one Tier per replica (vLLM's per-instance CPU pool), not one per node."""
        self.replicas = [Replica(i, c, policy(), self._tiers_of(i, c), self) for i, c in enumerate(configs)]
        self.routing = routing
        self.prefix_router = PrefixAwareRouter(self.replicas, self._tier_tokens()) \
            if routing == "prefix_aware" else None
        self.heap: list[tuple[float, int, EventKind, Any, int]] = []
        self.seq = 0
        self.now = 0.0
        self.rr = 0
        self.link_version = 0
        self.on_finish = on_finish
        self.finished = 0
        self.events = 0
        self.max_span = None
        self.on_tokens = None
        self._feed_keys: Sequence[float] = []
        self._feed_order: Sequence[int] = []
        self._feed_pos = 0
        self._feed_make: Callable[[int], SimRequest] | None = None
        self._submitted: list[float] = []
        """Times of the ``submit``-ted arrivals still in the heap (a min-heap: ``arrival_due`` reads its head)."""

    def _tiers_of(self, index: int, cfg: ReplicaConfig) -> ReplicaTiers:
        """A replica's view of the tiers: its node's host RAM (or its own), the remote pool, and its links."""
        host = self.tiers["host"][index if self.host_per_replica else cfg.node] if "host" in self.tiers else None
        remote = self.tiers["remote"][0] if "remote" in self.tiers else None
        return ReplicaTiers(host, remote, cfg.host_link, cfg.nic_links, self.pool_links)

    def tiers_changed(self) -> None:
        """The replicas' prefix tiers were set after the cluster was built (a shared storage tier): the
        prefix-aware router sizes its tier indexes again, so it scores hits in that tier too."""
        if self.prefix_router is not None:
            self.prefix_router = PrefixAwareRouter(self.replicas, self._tier_tokens())

    def _tier_tokens(self) -> list[float]:
        """Each replica's share, in KV tokens, of the tier its prefixes go to (0: none): a tier several replicas
        share is split evenly between them."""
        sharing: dict[int, int] = {}
        for rep in self.replicas:
            tier = rep.tiers.prefix_tier()
            if tier is not None:
                sharing[id(tier)] = sharing.get(id(tier), 0) + 1
        out = []
        for rep in self.replicas:
            tier = rep.tiers.prefix_tier()
            per_token = rep.cfg.kv_bytes_per_token
            out.append(tier.capacity / per_token / sharing[id(tier)] if tier is not None and per_token > 0 else 0.0)
        return out

    # ------------------------------------------------------------------ events
    def push(self, t: float, kind: EventKind, obj: Any, version: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, obj, version))

    def watch_links(self) -> None:
        """(Re)arm the event for the next transfer to get its bytes through."""
        nxt = self.links.next_done()
        self.link_version += 1
        if nxt is not None:
            self.push(max(nxt[0], self.now), "link", nxt[1], self.link_version)

    def start_copy(self, now: float, nbytes: float, lanes: list[Link], caps: list[Link], outbound: bool,
                   on_done: Callable[[float], None]) -> None:
        """Put a KV copy on its links (``on_done`` runs when it is through) and re-arm the link event."""
        self.links.start(now, nbytes, lanes, caps, outbound=outbound, on_done=on_done)
        self.watch_links()

    def submit(self, req: SimRequest, t: float) -> None:
        """``req`` arrives at ``t`` (its latencies count from there) and is queued after the front end's time."""
        t += self.request_overhead_s
        heapq.heappush(self._submitted, t)
        self.push(t, "arrival", req)

    def arrival_due(self, t: float) -> bool:
        """An arrival (submitted or fed) is due at or before ``t`` and not yet processed."""
        sub = self._submitted
        return bool(sub and sub[0] <= t) or (self._feed_pos < len(self._feed_keys)
                                              and self._feed_keys[self._feed_pos] <= t)

    def feed(self, arrivals: Sequence[float], make: Callable[[int], SimRequest]) -> None:
        """A whole schedule of arrivals (open loop, trace), each request built only when it arrives: ``make(i)``
        is the request arriving at ``arrivals[i]``. Events come in exactly the order ``submit`` of each, in
        schedule order and before anything else, would give them (at equal times arrivals first, in schedule
        order), but a million-request schedule holds no million requests."""
        o = self.request_overhead_s
        keys = array("d", (t + o for t in arrivals))  # 8 bytes an arrival, not a float object each
        if all(keys[i] <= keys[i + 1] for i in range(len(keys) - 1)):  # an open loop's schedule: in order already
            self._feed_order, self._feed_keys = range(len(keys)), keys
        else:
            self._feed_order = sorted(range(len(keys)), key=keys.__getitem__)  # stable: ties in schedule order
            self._feed_keys = array("d", [keys[i] for i in self._feed_order])
        self._feed_pos = 0
        self._feed_make = make

    @property
    def pending(self) -> bool:
        """Events still to come (the heap's, or arrivals not yet fed)."""
        return bool(self.heap) or self._feed_pos < len(self._feed_keys)

    def unfed(self) -> list[SimRequest]:
        """The fed schedule's requests that never arrived (built now, e.g. to be recorded as cancelled)."""
        make, rest = self._feed_make, list(self._feed_order[self._feed_pos:])
        self._feed_pos = len(self._feed_keys)
        return [make(i) for i in rest] if make is not None else []

    def run_until(self, t_end: float, stop: Callable[[], bool] | None = None,
                  on_time: Callable[[float], None] | None = None, max_events: int | None = None) -> None:
        """Process events in time order up to ``t_end`` (``on_time`` sees the clock before each event); stop early
        once ``stop()`` holds or more than ``max_events`` events were processed (a count needs no call per event)."""
        heap = self.heap
        heappop = heapq.heappop
        keys, n_fed = self._feed_keys, len(self._feed_keys)
        cap = max_events if max_events is not None else math.inf
        obj: Any
        kind: EventKind
        while True:
            if n_fed and self._feed_pos < n_fed and keys[self._feed_pos] <= t_end and (
                    not heap or keys[self._feed_pos] <= heap[0][0]):
                t = keys[self._feed_pos]
                req = self._feed_make(self._feed_order[self._feed_pos])  # type: ignore[misc]
                self._feed_pos += 1
                kind, obj, version = "arrival", req, 0
            elif heap and heap[0][0] <= t_end:
                t, _, kind, obj, version = heappop(heap)
                if kind == "arrival":  # a submitted one (fed ones never enter the heap)
                    heappop(self._submitted)
            else:
                return
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
            if self.events > cap or (stop is not None and stop()):
                return

    # ------------------------------------------------------------------ routing
    def may_route_to(self, index: int) -> bool:
        """Whether a request arriving now could go to replica ``index`` (False only where the routing rule says it
        goes elsewhere: the least loaded replica, or round robin's next, is another one)."""
        reps = self.replicas
        if len(reps) == 1 or self.routing in ("kv_aware", "prefix_aware"):
            return True
        if self.routing == "round_robin":
            return (self.rr + 1) % len(reps) == index
        return self._least_loaded().index == index

    def route(self, req: SimRequest) -> Replica:
        reps = self.replicas
        if len(reps) == 1:
            return reps[0]
        if self.routing == "round_robin":
            self.rr = (self.rr + 1) % len(reps)
            return reps[self.rr]
        if self.routing == "kv_aware" and req.hashes:
            return max(reps, key=lambda r: (r.hbm.hit_blocks(req), -r.load(), -r.index))
        if self.prefix_router is not None:
            return self.prefix_router.pick(req)
        return self._least_loaded()

    def _least_loaded(self) -> Replica:
        """The least loaded replica, the lowest index among equals (min by (load, index), without tuples)."""
        reps = self.replicas
        best, least = reps[0], reps[0].load()
        for rep in reps:
            load = rep.load()
            if load < least:
                best, least = rep, load
        return best

    # ------------------------------------------------------------------ requests
    def finish(self, req: SimRequest, now: float) -> None:
        req.state = "done"
        if req.t_last is None:
            req.t_last = now
        self.finished += 1
        if self.on_finish is not None:
            self.on_finish(req, now)

