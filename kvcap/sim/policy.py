"""The seam between a replica and its engine's scheduling rules: what the replica asks, what a policy answers.

Why a seam: a replica's mechanics (KV blocks, copies to tiers, timing a step or a decode span with the cost
model) are the same whatever the engine; what differs between engines is who runs, who is admitted and who
is preempted. A :class:`SchedulingPolicy` makes those decisions and only those, so another engine profile
(e.g. fixed slots) is a new class beside :class:`kvcap.sim.policy_vllm.VllmPolicy`, not an edit of it.

Each replica has a policy of its own (the cluster makes one per replica): what it reads or changes of the
replica is its :class:`~kvcap.sim.replica_state.ReplicaState` (queues, counters, block pool); what only the engine
keeps (llama.cpp's slot table) the policy keeps itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from kvcap.sim.replica_state import ReplicaState
from kvcap.sim.request import SimRequest


@dataclass(slots=True)
class Batch:
    """One step's work as a policy chose it. Every request in it is on the replica's running list."""

    decoders: list[SimRequest] = field(default_factory=list)
    """Requests that sample one token this step."""
    prefills: list[tuple[SimRequest, int]] = field(default_factory=list)
    """(request, prompt tokens computed this step): prefill chunks and recomputations."""
    reserved: dict[int, int] = field(default_factory=dict)
    """rid → HBM blocks taken for this step (a span cut short gives back what it did not fill)."""
    passes: int = 1
    """Forward passes the step runs (llama.cpp's split KV runs several; see ``BatchShape.passes``)."""


class SchedulingPolicy(Protocol):
    """The decisions a replica asks its engine for. Each method may change the replica's queues through its
    public operations (``preempt``, ``swap_in``, ``load_prefix``, ``park``, ``commit``) and its block pool."""

    def rejects(self, rep: ReplicaState, req: SimRequest) -> bool:
        """On arrival: is this request refused outright (HTTP 4xx) — it could never run on this replica?"""
        ...

    def next_batch(self, rep: ReplicaState, now: float) -> Batch:
        """What runs next step: which running requests continue (preempting others if they must), which
        parked ones come back, which waiting ones are admitted. If a preemption leaves the replica stalled
        (a copy out in flight), the policy gives back what it reserved and returns an empty batch."""
        ...

    def should_cut_span(self, rep: ReplicaState, spare: int = 0) -> bool:
        """Mid decode span (an arrival, a finished copy): would something new run at the next step boundary?
        ``spare``: KV blocks the span holds for its later steps, which a cut gives back."""
        ...

    def may_admit_arrival(self, rep: ReplicaState) -> bool:
        """Could a request arriving now, whatever its length, be admitted at the next step boundary? (False only
        where none could: the span need not stop after one step for it.)"""
        ...

    def admits_after_one_step(self, rep: ReplicaState) -> bool:
        """Before a pure-decode span: could something be admitted after just one step? (Then the span is one
        step long; otherwise it runs until the first request finishes or a block runs out.)"""
        ...

    def on_prefilled(self, rep: ReplicaState, completed: list[SimRequest], now: float) -> None:
        """These requests' prompts (or recomputations) completed in the step that just ended."""
        ...
