"""llama.cpp server's scheduling rules as a :class:`~kvcap.sim.policy.SchedulingPolicy` (fixed slots).

The rules it follows (llama.cpp ``tools/server``: ``update_slots``, ``process_single_task``,
``get_available_slot``; split KV, i.e. an explicit ``--parallel N`` without ``--kv-unified``):

1. ``max_num_seqs`` slots (``--parallel``), each with its own context of ``slot_ctx`` tokens
   (``serving.kv_tokens`` / slots: ``--ctx-size`` / ``--parallel``); a slot's cells are its own, so there is no
   paging, no sharing between slots, and the KV pool never runs out: a running request is never preempted;
2. a request arriving when every slot is busy is deferred and takes the next slot freed, in arrival order
   (FIFO); a slot is taken at once when free (its first step may compute only part of its prompt);
3. each step (one ``llama_decode`` batch) first takes one token for every slot that is generating, then adds
   prompt tokens of the slots still prefilling, in slot order, while the batch holds fewer than ``n_batch``
   tokens (``serving.max_num_batched_tokens``, llama.cpp's ``-b``, default 2048): prompts are chunked across
   steps and batched with the decodes;
4. a prompt of ``slot_ctx`` tokens or more is refused (llama.cpp: "the request exceeds the available context
   size"); with context shift off (the default) generation stops when the context is full, so a request's
   output is capped at ``slot_ctx - prompt`` tokens (finish reason ``length``, ``truncated``).

Not modelled: unified KV (``--kv-unified``, one shared pool; the default when ``--parallel`` is left to auto),
context shift, speculative decoding, and prompt caching (``cache_prompt`` reuses a prefix only within the same
slot; the profile leaves prefix caching off). Slot order is admission order (llama.cpp picks a free slot by
prompt similarity, else least recently used; with no prompt cache the choice changes nothing but the order).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcap.sim.policy import Batch
from kvcap.sim.request import SimRequest

if TYPE_CHECKING:
    from kvcap.sim.replica import Replica

REQUESTED_OUT = "requested_output_tokens"
"""``SimRequest.tags`` key: the output the client asked for, when a full slot context cut it short."""


class LlamaCppPolicy:
    """llama.cpp's rules (see the module docstring) for slots of ``slot_ctx`` tokens; stateless otherwise, so
    one instance serves every replica."""

    __slots__ = ("slot_ctx",)

    def __init__(self, slot_ctx: int) -> None:
        self.slot_ctx = slot_ctx

    # ------------------------------------------------------------------ the SchedulingPolicy decisions
    def rejects(self, rep: Replica, req: SimRequest) -> bool:
        """Rule 4: refuse a prompt that fills the slot; cap the output at what the slot's context leaves."""
        if req.prompt >= self.slot_ctx:
            return True
        room = self.slot_ctx - req.prompt
        if req.max_out > room:
            req.tags[REQUESTED_OUT] = req.max_out
            req.max_out = room
        return False

    def next_batch(self, rep: Replica, now: float) -> Batch:
        batch = Batch()
        self._admit(rep, now)
        n_batch = rep.cfg.max_num_batched_tokens
        for req in rep.running:  # rule 3, first: one token for each generating slot
            if req.out:
                batch.decoders.append(req)
                batch.reserved[req.rid] = 0
        room = n_batch - len(batch.decoders)
        for req in rep.running:  # then prompt chunks, in slot order, while the batch has room
            if room <= 0:
                break
            if req.out:
                continue
            chunk = min(req.prompt - req.kv, room)
            batch.prefills.append((req, chunk))
            batch.reserved[req.rid] = 0
            room -= chunk
        return batch

    def should_cut_span(self, rep: Replica) -> bool:
        return self._slot_for_head(rep)

    def admits_after_one_step(self, rep: Replica) -> bool:
        """Also when a slot's prompt got no room in this step (more generating slots than ``n_batch``)."""
        return self._slot_for_head(rep) or any(not r.out for r in rep.running)

    def on_prefilled(self, rep: Replica, completed: list[SimRequest], now: float) -> None:
        """Nothing to decide: a prefilled slot decodes in its own cells."""

    # ------------------------------------------------------------------ slots
    def _slot_for_head(self, rep: Replica) -> bool:
        return bool(rep.waiting) and len(rep.running) < rep.cfg.max_num_seqs

    def _admit(self, rep: Replica, now: float) -> None:
        """Rules 1–2: deferred requests take free slots in arrival order; a slot's cells are taken whole."""
        waiting, hbm = rep.waiting, rep.hbm
        per_slot = hbm.blocks_for(self.slot_ctx)
        while waiting and len(rep.running) < rep.cfg.max_num_seqs:
            req = waiting.popleft()
            taken = hbm.take(per_slot)
            assert taken, "the pool holds one context per slot"
            req.blocks = per_slot
            if req.t_sched is None:
                req.t_sched = now
            req.state = "running"
            rep.running.append(req)
