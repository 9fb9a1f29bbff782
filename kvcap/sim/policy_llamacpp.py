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

5. a free slot is chosen least recently used (``get_available_slot`` with no prompt to match: the smallest
   release time; slots never used count as oldest, the highest id first, as its ``<=`` comparison does);
6. a step runs as several forward passes (``llama_batch_allocr::split_equal`` with split KV): a pass takes the
   same number of tokens from each sequence of one run of consecutive busy slot ids, at most ``n_ubatch``
   (512) tokens, so scattered slots decode in a pass per run, and a prompt beside decodes gets passes of its
   own after the pass that took one token from everyone (:func:`forward_passes`): pinned with ``id_slot``, the
   same sequences take longer a step the more runs their slots form. A measured step cost
   (``serving.step_cost``) prices its ``base`` once per pass.

With ``serving.kv_unified`` (``--kv-unified``, one shared pool; llama.cpp's default when ``--parallel`` is left to
auto) a step is one pass per ``n_ubatch`` tokens, whatever slots are busy; slots keep their own context.

Not modelled: context shift, speculative decoding, and prompt caching (``cache_prompt`` reuses a prefix only within
the same slot, and a slot whose cached prompt matches the new one is chosen before the least recently used; the
profile leaves prefix caching off).
"""

from __future__ import annotations

from kvcap.sim.policy import Batch
from kvcap.sim.replica_state import ReplicaState
from kvcap.sim.request import SimRequest

REQUESTED_OUT = "requested_output_tokens"
"""``SimRequest.tags`` key: the output the client asked for, when a full slot context cut it short."""


N_UBATCH = 512
"""llama.cpp's physical batch (``-ub``, default 512): the most tokens one forward pass takes."""


def forward_passes(tokens: list[int], n_ubatch: int = N_UBATCH) -> int:
    """Forward passes of one step whose slot ``i`` contributes ``tokens[i]`` tokens (0: not in the step), by
    rule 6: each pass takes one run of consecutive contributing slots (the lowest first) and as many tokens
    from each as the run's smallest remainder, at most ``n_ubatch`` in all."""
    left = list(tokens)
    passes = 0
    while True:
        start = next((i for i, n in enumerate(left) if n > 0), None)
        if start is None:
            return passes
        end = start
        while end < len(left) and left[end] > 0:
            end += 1
        take = max(1, min(min(left[start:end]), n_ubatch // (end - start)))
        for i in range(start, min(end, start + n_ubatch)):
            left[i] = max(0, left[i] - take)
        passes += 1


class SlotTable:
    """One replica's slots: who holds each and when each was last released (-1: never used)."""

    __slots__ = ("holder", "released")

    def __init__(self, n: int) -> None:
        self.holder: list[SimRequest | None] = [None] * n
        self.released: list[float] = [-1.0] * n

    def free_finished(self, now: float) -> None:
        """Slots whose request finished or left since the last step are released now."""
        for i, req in enumerate(self.holder):
            if req is not None and req.state == "done":
                self.holder[i] = None
                self.released[i] = now

    def take(self, req: SimRequest) -> int:
        """Rule 5: the least recently released free slot (never used first, the highest id among those)."""
        free = [i for i, r in enumerate(self.holder) if r is None]
        sid = min(free, key=lambda i: (self.released[i], i) if self.released[i] >= 0 else (-1.0, -i))
        self.holder[sid] = req
        return sid


class LlamaCppPolicy:
    """llama.cpp's rules (see the module docstring) for ``slots`` slots of ``slot_ctx`` tokens each; one replica's
    policy, keeping that replica's slot table."""

    __slots__ = ("slot_ctx", "split_kv", "table")

    def __init__(self, slot_ctx: int, slots: int, split_kv: bool = True) -> None:
        self.slot_ctx = slot_ctx
        self.split_kv = split_kv
        self.table = SlotTable(slots)

    # ------------------------------------------------------------------ the SchedulingPolicy decisions
    def rejects(self, rep: ReplicaState, req: SimRequest) -> bool:
        """Rule 4: refuse a prompt that fills the slot; cap the output at what the slot's context leaves."""
        if req.prompt >= self.slot_ctx:
            return True
        room = self.slot_ctx - req.prompt
        if req.max_out > room:
            req.tags[REQUESTED_OUT] = req.max_out
            req.max_out = room
        return False

    def next_batch(self, rep: ReplicaState, now: float) -> Batch:
        batch = Batch()
        table = self._admit(rep, now)
        n_batch = rep.cfg.max_num_batched_tokens
        tokens = [0] * len(table.holder)
        for sid, req in enumerate(table.holder):  # rule 3, first: one token for each generating slot
            if req is not None and req.out:
                batch.decoders.append(req)
                batch.reserved[req.rid] = 0
                tokens[sid] = 1
        room = n_batch - len(batch.decoders)
        for sid, req in enumerate(table.holder):  # then prompt chunks, in slot order, while the batch has room
            if room <= 0:
                break
            if req is None or req.out:
                continue
            chunk = min(req.prompt - req.kv, room)
            batch.prefills.append((req, chunk))
            batch.reserved[req.rid] = 0
            tokens[sid] = chunk
            room -= chunk
        batch.passes = forward_passes(tokens) if self.split_kv else -(-sum(tokens) // N_UBATCH)
        return batch

    def should_cut_span(self, rep: ReplicaState, spare: int = 0) -> bool:
        return self._slot_for_head(rep)

    def may_admit_arrival(self, rep: ReplicaState) -> bool:
        return len(rep.running) < rep.cfg.max_num_seqs

    def admits_after_one_step(self, rep: ReplicaState) -> bool:
        """Also when a slot's prompt got no room in this step (more generating slots than ``n_batch``)."""
        return self._slot_for_head(rep) or any(not r.out for r in rep.running)

    def on_prefilled(self, rep: ReplicaState, completed: list[SimRequest], now: float) -> None:
        """Nothing to decide: a prefilled slot decodes in its own cells."""

    # ------------------------------------------------------------------ slots
    def _slot_for_head(self, rep: ReplicaState) -> bool:
        return bool(rep.waiting) and len(rep.running) < rep.cfg.max_num_seqs

    def _admit(self, rep: ReplicaState, now: float) -> SlotTable:
        """Rules 1, 2 and 5: deferred requests take free slots in arrival order, each the least recently used;
        a slot's cells are taken whole."""
        table = self.table
        table.free_finished(now)
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
            table.take(req)
        return table
