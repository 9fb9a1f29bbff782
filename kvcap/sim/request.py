"""One simulated request's life: what it asked for, where its KV is, and the times its tokens came out.

Why a module of its own: the replica, its KV accounting, every scheduling policy, the load driver (``run``)
and serve-sim all read and write the same request record; keeping it apart lets each of them depend on it
without depending on one another.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

RequestState = Literal["new", "waiting", "running", "swap_out", "parked", "swap_in", "loading", "done"]
"""waiting → running ⇄ (swap_out → parked → swap_in) … → done; loading while a tier prefix comes in."""


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
    state: RequestState = "new"
    """Where the request is in its life (:data:`RequestState`)."""
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
    chunks: list[np.ndarray] = field(default_factory=list)
    """Token times, in order: each step's or decode span's vector of step ends (shared by its batch, never
    copied per request; one step is a vector of one)."""
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
    loaded_from: tuple[tuple[str, int, int], ...] = ()
    """``hit_tier`` tier by tier, in prompt order: (tier name, first token, tokens) — serve-sim's per-tier counters."""
    committed: int = 0
    """HBM blocks promised to this decoder for its whole length (offload admission ``tiers``)."""
    error: str | None = None

    @property
    def target(self) -> int:
        """Tokens whose KV must exist before the next token can be sampled."""
        return self.prompt + self.out if self.out else self.prompt

    def token_times(self) -> np.ndarray:
        """Every output token's time, in order, as one vector."""
        chunks = self.chunks
        if len(chunks) > 1:
            return np.concatenate(chunks)
        return chunks[0] if chunks else np.zeros(0)
