"""One serving-engine replica: its queues and counters, the steps it runs and the KV copies it makes.

Why apart from the scheduling rules: what a replica *does* is the same for every engine profile — run the
batch its :class:`~kvcap.sim.policy.SchedulingPolicy` chose, time it with the cost model, hand out tokens,
finish requests, copy KV to and from a tier — while who runs is the policy's call. The replica asks its
policy at each decision point and carries the decision out.

Decoding KV always lives in HBM: a parked sequence does not decode. A preempted request loses its KV and
recomputes it later, or, with an offload tier, has it copied out (the replica waits for that copy, as vLLM's
swap did) and copied back before it decodes again — the copy back is on that request's critical path, never
on the replica's.

Speed: when the batch is pure decode and the policy would admit nothing, the replica runs as many steps as it
can until the first request finishes or a block runs out, in one event, timed in closed form by the cost
model (one numpy vector of step times); an arrival or a finished copy cuts such a span at the next step
boundary.

Prefix caching (requests that carry ``hash_ids``): a finished prefill's full hash blocks become shared HBM
prefix blocks; with an offload tier they are also written to it (asynchronously), and a request whose prefix
misses HBM but hits the tier loads it over the link instead of recomputing it.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from kvcap.sim.batch_shape import BatchShape
from kvcap.sim.events import ClusterHooks
from kvcap.sim.kv import Tier
from kvcap.sim.policy import Batch, SchedulingPolicy
from kvcap.sim.replica_state import ReplicaConfig, ReplicaState
from kvcap.sim.request import SimRequest
from kvcap.sim.tiers import ReplicaTiers


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


def _mixed_shape(prefills: list[tuple[SimRequest, int]], decoders: list[SimRequest],
                 window: int | None) -> BatchShape:
    """``BatchShape.of`` for a step with prefill chunks (the same totals), summed in one pass over the requests
    instead of through per-sequence lists; sliding-window models and empty chunks take ``of`` itself."""
    if not window:
        tokens = context = pairs = 0
        for req, chunk in prefills:
            if chunk <= 0:
                break
            kv = req.kv
            tokens += chunk
            context += kv
            pairs += kv * chunk + chunk * (chunk + 1) // 2
        else:
            decode = 0
            for req in decoders:
                decode += req.kv
            return BatchShape(tokens, len(prefills), context, float(pairs), len(decoders), decode)
    return BatchShape.of(prefill=[(c, r.kv) for r, c in prefills], decode=[r.kv for r in decoders], window=window)


class Replica(ReplicaState):
    """One serving-engine instance (tp × pp GPUs): its state, the policy that schedules it, the offload tiers it
    may copy KV to, and the cluster whose clock it runs on."""

    def __init__(self, index: int, cfg: ReplicaConfig, policy: SchedulingPolicy, tiers: ReplicaTiers,
                 cluster: ClusterHooks):
        super().__init__(index, cfg)
        self.policy = policy
        self.tiers = tiers
        self.sim = cluster
        self.span: Span | None = None
        self.version = 0
        self.preemptions = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.busy_done = 0.0
        self.running_peak = 0
        self.waiting_peak = 0
        """The most requests queued here at once past the slots (requests that would wait with every slot taken; a
        calibrated llama.cpp scenario says when it passes its profile's queue)."""
        self.window = cfg.cost.model.sliding_window

    # ------------------------------------------------------------------ what others read
    def kv_usage(self, t: float | None = None) -> float:
        """Fraction of the pool held by requests at ``t``: a decode span takes its later steps' blocks when it is
        planned, vLLM each step's when that step is scheduled, so blocks for steps not yet started at ``t`` are
        not counted (``t`` None: as held, reservations included)."""
        span = self.span
        if t is None or span is None or span.ends.size < 2:
            return self.hbm.usage()
        # started by t: a step ending exactly at t has not yet handed over to the next (that is the event at t)
        steps = min(int(np.searchsorted(span.ends, t, side="left")) + 1, span.ends.size)
        hbm, reserved, bs = self.hbm, span.reserved, self.hbm.block_size
        ahead = 0
        for req in span.decoders:
            held = reserved.get(req.rid, 0)
            if held > 0:  # blocks held beyond what kv + steps tokens need (private_need inlined where it is a ceil)
                excess = req.blocks + (-(req.kv + steps)) // bs if bs and not req.shared else \
                    -hbm.private_need(req, req.kv + steps)
                if excess > 0:
                    ahead += excess if excess < held else held
        return (hbm.used - hbm.cached_blocks - ahead) / hbm.capacity

    def load(self) -> int:
        return len(self.running) + len(self.waiting) + len(self.parked) + self.moving

    def busy_at(self, t: float) -> float:
        """GPU-busy seconds up to ``t`` (a span in progress counts up to ``t``)."""
        span = self.span
        if span is None:
            return self.busy_done
        return self.busy_done + min(max(t - span.t0, 0.0), float(span.ends[-1] - span.t0))

    # ------------------------------------------------------------------ arrivals and interrupts
    def enqueue(self, req: SimRequest, now: float) -> None:
        req.replica, req.state = self.index, "waiting"
        if self.policy.rejects(self, req):
            req.error = "http_4xx"
            self.sim.finish(req, now)
            return
        self.waiting.append(req)
        past = len(self.waiting) + len(self.running) - self.cfg.max_num_seqs
        if past > self.waiting_peak:
            self.waiting_peak = past
        self.poke(now)

    def abort(self, req: SimRequest, now: float) -> bool:
        """The client left: drop a waiting or running request (others finish their copy first)."""
        if req.state == "waiting" and req in self.waiting:
            self.waiting.remove(req)
        elif req.state == "running" and req in self.running and (self.span is None or (
                req not in self.span.decoders and all(r is not req for r, _ in self.span.prefills))):
            self.running.remove(req)
            self.hbm.release(req)
            if req.committed:
                self.uncommit(req)
        else:
            return False
        req.error = "cancelled"
        req.state = "done"
        return True

    def poke(self, now: float, force: bool = False) -> None:
        """Something changed (arrival, a copy finished): start a step if idle, else cut a decode span short —
        when a request joined the running ones (``force``), or when the policy would run something new at the
        next step boundary (counting the blocks the span holds for its later steps as free: a cut gives them
        back). A cut that would change nothing costs a span's planning and no accuracy to skip."""
        if self.stalled:
            return
        span = self.span
        if span is None:
            self.schedule(now)
            return
        ends = span.ends
        if ends.size <= 1 or not (force or self.policy.should_cut_span(self, sum(span.reserved.values()))):
            return
        j = int(ends.searchsorted(now, side="left"))
        if j >= ends.size - 1:
            return
        self._cut(j + 1)

    def _cut(self, k: int) -> None:
        """Keep the first k steps of the current decode span."""
        span = self.span
        assert span is not None
        span.ends = span.ends[:k]
        self.hbm.return_unused(span.decoders, k, span.reserved)
        self.version += 1
        self.sim.push(float(span.ends[-1]), "step", self, self.version)

    # ------------------------------------------------------------------ a step (or span) starts
    def schedule(self, now: float) -> None:
        """Ask the policy for the next batch and start it (nothing while a step runs or a swap-out is out)."""
        if self.stalled or self.span is not None:
            return
        batch = self.policy.next_batch(self, now)
        if self.stalled:
            return
        self.running_peak = max(self.running_peak, len(self.running))
        if not batch.decoders and not batch.prefills:
            return
        self._start(now, batch)

    def _start(self, now: float, batch: Batch) -> None:
        cost = self.cfg.cost
        window = self.window
        decoders, prefills, reserved = batch.decoders, batch.prefills, batch.reserved
        if prefills:
            shape = _mixed_shape(prefills, decoders, window)
            shape.passes = batch.passes
            shape.waiting = len(self.waiting)
            end = now + cost.step_time(shape)
            ends = np.array((end,))
        else:
            k = min([r.max_out - r.out for r in decoders])
            if self.policy.admits_after_one_step(self):
                k = 1  # something could be admitted next step (blocks free up only at a finish)
            elif (k > 1 and not self.waiting and self.sim.arrival_due(now) and self.policy.may_admit_arrival(self)
                  and self.sim.may_route_to(self.index)):
                k = 1  # an arrival at this instant (a closed loop's next request) will cut the span after its
                # first step: planning the rest (blocks, step ends) only to give it back is wasted work.
                # Not when requests already wait (the head could not be admitted, or the policy would have said
                # so): the arrival queues behind them and cuts nothing; nor when it goes to another replica or
                # could not be admitted (no slot, no block)
            if self.sim.max_span is not None:
                k = min(k, self.sim.max_span)
            if k > 1:  # the policy took each decoder's block for its next token: one step needs no more
                k = self.hbm.reserve_decode_steps(decoders, k, reserved)
            shape = BatchShape.decode_only([r.kv for r in decoders], window)
            shape.passes = batch.passes
            shape.waiting = len(self.waiting)  # held over the span: an arrival that could be served cuts it
            ends = cost.decode_step_ends(shape, k, now)
            end = float(ends[-1])
        self.span = Span(t0=now, ends=ends, decoders=decoders, prefills=prefills, reserved=reserved)
        self.version += 1
        self.sim.push(end, "step", self, self.version)

    # ------------------------------------------------------------------ a step (or span) ends
    def on_step(self, now: float) -> None:
        span = self.span
        assert span is not None
        self.span = None
        self.busy_done += float(span.ends[-1] - span.t0)
        completed, finished = self._emit_tokens(span, now)
        done = [r for r in self.running if r.out >= r.max_out] if finished else ()
        for req in done:
            self.running.remove(req)
            self.hbm.release(req)
            if req.committed:
                self.uncommit(req)
            self.sim.finish(req, now)
        if completed:
            self.policy.on_prefilled(self, completed, now)
        self.schedule(now)

    def _emit_tokens(self, span: Span, now: float) -> tuple[list[SimRequest], bool]:
        """Credit the span's tokens: decoders get one per step; a prefill that reached its target samples its
        next token. Returns the requests whose prefill (or recomputation) completed, and whether any request
        of the span has all its tokens now (only then is the running list scanned for finishes)."""
        ends = span.ends
        k = ends.size
        t = float(ends[-1])
        on_tokens = self.sim.on_tokens
        decoders = span.decoders
        gen = k * len(decoders)
        finished = False
        for req in decoders:
            req.kv += k
            req.out += k
            req.chunks.append(ends)
            req.t_last = t
            if req.out >= req.max_out:
                finished = True
        if on_tokens is not None:  # serve-sim hands each its new tokens (it reads only that request)
            for req in decoders:
                on_tokens(req)
        completed: list[SimRequest] = []
        for req, chunk in span.prefills:
            req.kv += chunk
            self.prompt_tokens += chunk
            if req.kv >= req.target:
                completed.append(req)
                req.out += 1
                gen += 1
                if req.t_first is None:
                    req.t_first = t
                    self._register_prefix(req, now)
                req.chunks.append(ends)  # a step with prefills is one step: its end is the token's time
                req.t_last = t
                if req.out >= req.max_out:
                    finished = True
                if on_tokens is not None:
                    on_tokens(req)
        self.generation_tokens += gen
        return completed, finished

    # ------------------------------------------------------------------ KV copies
    def preempt(self, victim: SimRequest, now: float) -> None:
        """Take a running request off: its KV is copied out to a tier with room (the replica stalls until the
        copy is out), else dropped — it waits at the head of the queue to be recomputed."""
        self.running.remove(victim)
        if victim.committed:
            self.uncommit(victim)
        victim.preemptions += 1
        self.preemptions += 1
        tier, lanes, caps = (self.tiers.room_for(victim.kv * self.cfg.kv_bytes_per_token)
                             if victim.out and self.tiers.enabled else (None, [], []))
        if tier is not None:
            nbytes = victim.kv * self.cfg.kv_bytes_per_token
            victim.state, victim.tier, victim.tier_bytes = "swap_out", tier.name, nbytes
            self.stalled += 1
            self.moving += 1

            def done(t: float, v: SimRequest = victim, t0: float = now) -> None:
                v.copy_s += t - t0
                self.stalled -= 1
                self.moving -= 1
                self.hbm.release(v)  # HBM blocks are reusable once the copy is out
                v.state, v.t_parked = "parked", t
                heapq.heappush(self.parked, (v.arrival, v.rid, v))
                if not self.stalled:
                    self.schedule(t)

            self.sim.start_copy(now, nbytes, lanes, caps, outbound=True, on_done=done)
            return
        victim.recomputed += victim.kv
        self.hbm.release(victim)
        victim.kv = 0
        victim.state = "waiting"
        self.waiting.appendleft(victim)

    def park(self, req: SimRequest, now: float) -> bool:
        """Copy a just-prefilled request's KV out to a tier (its blocks are freed when the copy is through);
        False if no tier has room."""
        nbytes = req.kv * self.cfg.kv_bytes_per_token
        tier, lanes, caps = self.tiers.room_for(nbytes)
        if tier is None:
            return False
        self.running.remove(req)
        req.state, req.tier, req.tier_bytes = "swap_out", tier.name, nbytes
        self.moving += 1

        def done(t: float, r: SimRequest = req, t0: float = now) -> None:
            r.copy_s += t - t0
            self.moving -= 1
            self.hbm.release(r)
            r.state, r.t_parked = "parked", t
            heapq.heappush(self.parked, (r.arrival, r.rid, r))
            self.poke(t)  # its blocks are free: a cut only if they let something run

        self.sim.start_copy(now, nbytes, lanes, caps, outbound=True, on_done=done)
        return True

    def swap_in(self, req: SimRequest, now: float) -> None:
        """Copy a parked request's KV back into HBM (its blocks are taken); it runs again when it is in."""
        tier = self.tiers.by_name(req.tier)
        _, lanes, caps = self.tiers.room_for(0.0, name=req.tier, reserve=False)
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

        self.sim.start_copy(now, req.tier_bytes, lanes, caps, outbound=False, on_done=done)

    # ------------------------------------------------------------------ prefixes in the tier
    def tier_prefix_tokens(self, req: SimRequest) -> int:
        """Tokens of the prefix after the HBM hit that the offload tiers hold (loaded instead of recomputed). With a
        tier profile the lookup follows its rules (:meth:`ReplicaTiers.lookup`), the hit's runs per tier are kept
        for :meth:`load_prefix`, and a hit whose copy would cost more than computing it is cut back."""
        hbt = self.cfg.hash_block_tokens
        tiers = self.tiers
        if not (req.hashes and hbt and self.cfg.prefix_caching and tiers.prefix_enabled):
            return 0
        if tiers.plain:
            tier = tiers.prefix_tier()
            start = len(req.shared)
            n = 0
            for h in req.hashes[start: req.prompt // hbt]:
                if tier is None or not tier.hit(h):
                    break
                n += 1
            return min(n * hbt, req.prompt - 1 - req.kv)
        tiers.load_plan = []
        full = req.hashes[: req.prompt // hbt]
        runs = tiers.lookup(full, len(req.shared), hbt)
        room = req.prompt - 1 - req.kv
        plan: list[tuple[Tier, int]] = []
        for tier, blocks in runs:
            tokens = min(blocks * hbt, room)
            if tokens <= 0:
                break
            plan.append((tier, tokens))
            room -= tokens
        if tiers.rules.cheaper_only:
            plan = self._worth_loading(plan, req.kv)
        if plan:
            tiers.promote([(t, n // hbt) for t, n in plan], full, len(req.shared), hbt * self.cfg.kv_bytes_per_token)
        tiers.load_plan = plan
        return sum([n for _, n in plan])

    def _worth_loading(self, plan: list[tuple[Tier, int]], context: int) -> list[tuple[Tier, int]]:
        """The longest leading runs of a hit whose copy costs no more than computing those tokens: the copy's time
        over the links now (:meth:`ReplicaTiers.load_seconds`, the runs one after another) against one prefill
        step of the same tokens after ``context`` cached ones, priced by this replica's own step cost model."""
        per_token = self.cfg.kv_bytes_per_token
        best, load, tokens = 0, 0.0, 0
        for i, (tier, n) in enumerate(plan):
            load += self.tiers.load_seconds(tier, n * per_token)
            tokens += n
            compute = self.cfg.cost.step_time(BatchShape.of(prefill=[(tokens, context)], window=self.window))
            if load <= compute:
                best = i + 1
        return plan[:best]

    def load_prefix(self, req: SimRequest, tokens: int, now: float) -> None:
        """Copy ``tokens`` of an admitted request's prefix from the tiers (its blocks are taken); it runs when
        every tier's part is in (parts from different tiers travel at once, each over its own links)."""
        plan = self.tiers.load_plan
        self.tiers.load_plan = []
        parts = _parts(plan, req.kv) if plan else ((self._prefix_tier_name() or "", req.kv, tokens),)
        req.state = "loading"
        self.moving += 1
        self.incoming += 1

        def done(t: float, r: SimRequest = req, n: int = tokens, t0: float = now) -> None:
            r.copy_s += t - t0
            self.moving -= 1
            self.incoming -= 1
            r.kv += n
            r.hit_tier = n
            r.loaded_from = parts
            r.state = "running"
            self.running.append(r)
            self.poke(t, force=True)

        if not plan:
            nbytes = tokens * self.cfg.kv_bytes_per_token
            _, lanes, caps = self.tiers.room_for(0.0, name=self._prefix_tier_name(), reserve=False)
            self.sim.start_copy(now, nbytes, lanes, caps, outbound=False, on_done=done)
            return
        left = [len(plan)]

        def part_done(t: float) -> None:
            left[0] -= 1
            if left[0] == 0:
                done(t)

        for tier, n in plan:
            lanes, caps = self.tiers.links_to(tier, reading=True)
            self.sim.start_copy(now, n * self.cfg.kv_bytes_per_token, lanes, caps, outbound=False,
                                on_done=part_done)

    def _register_prefix(self, req: SimRequest, now: float) -> None:
        """After a prefill: its full hash blocks become shared HBM prefix blocks (and go to the tiers the profile
        writes to: copies nothing waits for)."""
        hbt = self.cfg.hash_block_tokens
        if not (req.hashes and hbt and self.cfg.prefix_caching):
            return
        full = req.hashes[: req.prompt // hbt]
        self.hbm.share_prefix(req, full)
        tiers = self.tiers
        tier = tiers.prefix_tier()
        if tier is None:
            return
        bytes_each = hbt * self.cfg.kv_bytes_per_token
        if tiers.plain:
            new = sum(1 for h in full if tier.store_prefix(h, bytes_each))
            if new:  # written to the tier asynchronously: nothing waits for the copy
                lanes, caps = tiers.links_to(tier)
                self.sim.start_copy(now, new * bytes_each, lanes, caps, outbound=True, on_done=_nothing)
            return
        unit = bytes_each * tiers.chunk_blocks(hbt)
        for target, units in tiers.store(full, self.hbm, bytes_each):
            lanes, caps = tiers.links_to(target)
            self.sim.start_copy(now, units * unit, lanes, caps, outbound=True, on_done=_nothing)

    def _prefix_tier_name(self) -> str | None:
        tier = self.tiers.prefix_tier()
        return tier.name if tier is not None else None


def _parts(plan: list[tuple[Tier, int]], start: int) -> tuple[tuple[str, int, int], ...]:
    """A load plan as (tier name, first token, tokens), the runs one after another from ``start``."""
    out: list[tuple[str, int, int]] = []
    for tier, n in plan:
        out.append((tier.name, start, n))
        start += n
    return tuple(out)


def _nothing(t: float) -> None:
    """A copy's callback when nothing waits for it."""
