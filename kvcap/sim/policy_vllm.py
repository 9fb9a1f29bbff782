"""vLLM's scheduling rules as a :class:`~kvcap.sim.policy.SchedulingPolicy` (continuous batching over paged KV).

The real rules it follows (vLLM's scheduler, V1 with the V0 swap queue for offload tiers):

1. running requests first, oldest first: a decode takes one token of the ``max_num_batched_tokens`` budget
   and, when its last block is full, one more KV block; a partially prefilled prompt takes its next chunk
   (chunked prefill) or its whole rest;
2. a request that cannot get its block preempts the most recently admitted running request (vLLM pops the
   end of its running queue); the replica then recomputes it later (V1's only mode) or, with an offload
   tier, copies its KV out (V0's swap) — the step waits for that copy;
3. preempted requests parked in a lower tier come back first, oldest arrival first, and nothing new is
   admitted while one waits (V0's swapped queue has priority over the waiting one);
4. waiting requests are admitted in arrival order (FCFS) while blocks, ``max_num_seqs`` and the token budget
   allow; blocks for the whole prompt are taken at admission (a cached prefix counts as held); without
   chunked prefill a prompt longer than the budget left waits for a step of its own;
5. a request over ``max_model_len``, or whose whole sequence exceeds the KV pool, is refused (vLLM refuses
   to start with a ``max_model_len`` whose KV does not fit; such a request could only preempt itself).

Not vLLM's: offload admission ``tiers`` (``ReplicaConfig.park_after_prefill``), kvcap's model of "KV may
spill": requests are admitted past HBM; a finished prefill decodes only if HBM has room for its whole
sequence (a *commitment*), else its KV is parked in a tier until such room frees up; admission keeps the
committed decoders' future growth out of reach.
"""

from __future__ import annotations

import heapq

from kvcap.sim.policy import Batch
from kvcap.sim.replica_state import ReplicaState
from kvcap.sim.request import SimRequest


class VllmPolicy:
    """vLLM's rules (see the module docstring); everything it decides from is the replica's state."""

    __slots__ = ()

    # ------------------------------------------------------------------ the SchedulingPolicy decisions
    def rejects(self, rep: ReplicaState, req: SimRequest) -> bool:
        cfg = rep.cfg
        too_long = cfg.max_model_len is not None and req.prompt + req.max_out > cfg.max_model_len
        return rep.hbm.blocks_for(req.prompt + req.max_out) > cfg.blocks or too_long

    def next_batch(self, rep: ReplicaState, now: float) -> Batch:
        batch = Batch()
        budget = self._continue_running(rep, now, batch)
        if rep.stalled:
            # swap-outs in flight: give back this step's reservations and wait for the copies
            rep.hbm.give_back(batch.decoders + [r for r, _ in batch.prefills], batch.reserved)
            return Batch()
        self._swap_back(rep, now)
        self._admit_waiting(rep, now, batch, budget)
        return batch

    def should_cut_span(self, rep: ReplicaState, spare: int = 0) -> bool:
        """The parked head could come back (rule 3's test), or the waiting head be admitted, with ``spare`` more
        blocks free than now (what the span holds for its later steps: a cut gives it back)."""
        if len(rep.running) + rep.incoming >= rep.cfg.max_num_seqs:
            return False
        free = rep.hbm.free() + spare
        parked = rep.parked
        if parked and parked[0][2].state == "parked":
            req = parked[0][2]
            if (not rep.parking or self._can_commit(rep, req)) and free >= rep.hbm.private_need(req, req.kv + 1):
                return True
            if not rep.parking:
                return False  # nothing new is admitted while a parked request waits (rule 3)
        return bool(rep.waiting) and free >= self._head_need(rep, rep.waiting[0])

    def may_admit_arrival(self, rep: ReplicaState) -> bool:
        """A slot, no parked request ahead (unless parking), and a block free beyond the decoders' growth (none
        needed where a prompt may be all cached prefix)."""
        if len(rep.running) + rep.incoming >= rep.cfg.max_num_seqs or not (rep.parking or not rep.parked):
            return False
        least = 0 if rep.cfg.prefix_caching and rep.cfg.hash_block_tokens else 1
        return rep.hbm.free() - least >= (self._growth_reserve(rep) if rep.parking else 0)

    def admits_after_one_step(self, rep: ReplicaState) -> bool:
        return bool(rep.waiting and (rep.parking or not rep.parked)
                    and len(rep.running) + rep.incoming < rep.cfg.max_num_seqs
                    and rep.hbm.free() >= self._head_need(rep, rep.waiting[0]))

    def on_prefilled(self, rep: ReplicaState, completed: list[SimRequest], now: float) -> None:
        """Offload admission ``tiers``: first prefills and recomputations alike decode in HBM only if promised
        room for their whole sequence; the others are parked (no tier room: they decode in HBM regardless,
        vLLM's rule from there on)."""
        if not rep.parking:
            return
        for req in completed:
            if req.state != "running" or req.committed or req.out >= req.max_out:
                continue
            if self._can_commit(rep, req) or not rep.park(req, now):  # promised room, or no tier room
                rep.commit(req)

    # ------------------------------------------------------------------ the step, rule by rule
    def _continue_running(self, rep: ReplicaState, now: float, batch: Batch) -> int:
        """Rules 1–2: every running request's next token or chunk, oldest first, preempting from the newest
        when a block is missing; returns the token budget left."""
        cfg = rep.cfg
        budget = cfg.max_num_batched_tokens
        running = rep.running
        hbm = rep.hbm
        take = hbm.take
        decoders, prefills, reserved = batch.decoders, batch.prefills, batch.reserved
        chunked = cfg.chunked_prefill
        plain = cfg.blocks_for is None
        bs = cfg.block_size
        i = 0
        while i < len(running):
            req = running[i]
            kv, out = req.kv, req.out
            if out and kv >= req.prompt + out - 1:
                chunk = 1
            else:
                chunk = min(req.target - kv, budget) if chunked else req.target - kv
            if chunk <= 0 or budget <= 0:
                i += 1
                continue
            if plain and not req.shared:  # the common case, inlined: ceil((kv + chunk) / block) - held
                need = -(-(kv + chunk) // bs) - req.blocks
            else:
                need = hbm.private_need(req, kv + chunk)
            if need > 0:  # a block to take (only here can a preemption, hence a stall, happen)
                lost = False
                while not take(need):
                    victim = running[-1]
                    self._preempt(rep, victim, now, batch)
                    if victim is req or rep.stalled:
                        lost = True
                        break
                if rep.stalled:
                    break
                if lost:
                    continue  # req itself was preempted: the list shifted, index i is already the next one
                req.blocks += need
            reserved[req.rid] = need if need > 0 else 0
            budget -= chunk
            if chunk == 1 and out:
                decoders.append(req)
            else:
                prefills.append((req, chunk))
            i += 1
        return budget

    def _preempt(self, rep: ReplicaState, victim: SimRequest, now: float, batch: Batch) -> None:
        """Rule 2: the victim leaves this step's batch and the running list (the replica recomputes or copies
        its KV out)."""
        if victim in batch.decoders:
            batch.decoders.remove(victim)
        batch.prefills[:] = [(r, c) for r, c in batch.prefills if r is not victim]
        batch.reserved.pop(victim.rid, None)
        rep.preempt(victim, now)

    def _swap_back(self, rep: ReplicaState, now: float) -> None:
        """Rule 3: parked requests come back, oldest arrival first, while a running slot and blocks allow."""
        cfg, hbm, parked = rep.cfg, rep.hbm, rep.parked
        while parked and parked[0][2].state == "parked":
            req = parked[0][2]
            if len(rep.running) + rep.incoming >= cfg.max_num_seqs:
                break
            if rep.parking and not self._can_commit(rep, req):
                break
            need = hbm.private_need(req, req.kv + 1)
            if not hbm.take(need):
                break
            heapq.heappop(parked)
            req.blocks += need
            if rep.parking:
                rep.commit(req)
            rep.swap_in(req, now)

    def _admit_waiting(self, rep: ReplicaState, now: float, batch: Batch, budget: int) -> None:
        """Rule 4: waiting requests in order (parking engines admit past parked ones while the tier has room)."""
        cfg, hbm, waiting = rep.cfg, rep.hbm, rep.waiting
        while (waiting and (rep.parking or not rep.parked) and budget > 0
               and len(rep.running) + rep.incoming < cfg.max_num_seqs):
            req = waiting[0]
            if req.kv == 0 and not req.shared and req.hashes and cfg.prefix_caching and cfg.hash_block_tokens:
                hit = hbm.attach_prefix(req)
            else:
                hit = 0
            need = hbm.private_need(req, req.target)
            whole = not cfg.chunked_prefill and req.target - req.kv > budget and bool(batch.decoders or batch.prefills)
            if rep.parking and need > hbm.free() - self._growth_reserve(rep):
                whole = True  # the blocks left are promised to the decoders' growth
            if whole or not hbm.take(need):
                if hit:
                    hbm.release(req)
                    req.kv = 0
                break
            waiting.popleft()
            req.blocks += need
            if req.t_sched is None:
                req.t_sched = now
            if hit and req.out == 0:
                req.hit_hbm = req.kv
            tier_tokens = rep.tier_prefix_tokens(req) if req.out == 0 else 0
            if tier_tokens:
                rep.load_prefix(req, tier_tokens, now)
                continue
            req.state = "running"
            rep.running.append(req)
            chunk = min(req.target - req.kv, budget) if cfg.chunked_prefill else req.target - req.kv
            batch.prefills.append((req, chunk))
            batch.reserved[req.rid] = 0
            budget -= chunk

    # ------------------------------------------------------------------ admission arithmetic
    def _head_need(self, rep: ReplicaState, head: SimRequest) -> int:
        """Free blocks the head of the waiting queue needs to be admitted (its cached prefix is already there;
        a parking engine keeps the decoders' growth out of reach)."""
        cfg, hbm = rep.cfg, rep.hbm
        need = hbm.blocks_for(head.target) - head.blocks
        if head.kv == 0 and not head.shared and head.hashes and cfg.prefix_caching and cfg.hash_block_tokens:
            need -= hbm.hit_blocks(head) * hbm.hash_blocks
        if rep.parking:
            need += self._growth_reserve(rep)
        return need

    def _can_commit(self, rep: ReplicaState, req: SimRequest) -> bool:
        """HBM room for this request's whole sequence, after the other decoders' promises, the prefills in
        progress and room to prefill the next waiting request (parking needs somewhere to compute KV)."""
        workspace = rep.hbm.blocks_for(rep.waiting[0].target) if rep.waiting else 0
        promised = rep.committed + rep.hbm.final_blocks(req) + workspace
        if promised > rep.cfg.blocks:  # no room even before the prefills (most refusals: no sum over running)
            return False
        return promised + sum([r.blocks for r in rep.running if not r.out]) <= rep.cfg.blocks

    def _growth_reserve(self, rep: ReplicaState) -> int:
        """Blocks committed decoders will still allocate as they grow (not to be lent to prefills)."""
        return max(0, rep.committed - sum([r.blocks for r in rep.running if r.committed]))
