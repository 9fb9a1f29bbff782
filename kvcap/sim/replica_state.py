"""What a replica is (:class:`ReplicaConfig`) and the state its scheduling policy reads and acts on
(:class:`ReplicaState`): queues, counters, the KV pool, and the operations a policy may call.

Why below the replica: a policy (:mod:`kvcap.sim.policy_vllm`, :mod:`kvcap.sim.policy_llamacpp`) decides from this
state alone; the replica (:mod:`kvcap.sim.replica`) is this state plus the steps it runs and the copies it makes.
With the state here a policy needs nothing from the replica module, so the replica imports its policy and
nothing imports the replica back.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvcap.sim.kv import BlockPool
from kvcap.sim.links import Link
from kvcap.sim.request import SimRequest
from kvcap.sim.step_cost import StepCostModel


@dataclass(frozen=True)
class ReplicaConfig:
    """What a replica is: its KV pool, batch limits, cost model, and the node and links it may offload over."""

    blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    chunked_prefill: bool
    cost: StepCostModel
    """The roofline, or a measured step time (``serving.step_cost``)."""
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


class ReplicaState:
    """A replica's queues, counters and HBM block pool, and the operations that move its requests: what a
    :class:`~kvcap.sim.policy.SchedulingPolicy` reads and calls. The copy operations are the replica's."""

    def __init__(self, index: int, cfg: ReplicaConfig) -> None:
        self.index, self.cfg = index, cfg
        self.hbm = BlockPool(cfg.blocks, cfg.block_size, cfg.hash_block_tokens, cfg.blocks_for)
        self.running: list[SimRequest] = []
        self.waiting: deque[SimRequest] = deque()
        self.parked: list[tuple[float, int, SimRequest]] = []
        """A heap of parked requests by (arrival, rid)."""
        self.moving = 0
        """Requests in a copy (swap out/in, prefix load): held, not decoding."""
        self.incoming = 0
        """Requests whose KV is being copied into HBM (swap-in, prefix load): they hold a running slot."""
        self.stalled = 0
        """Swap-outs the replica waits for before its next step."""
        self.committed = 0
        """HBM blocks promised to committed decoders at their full length (offload admission ``tiers``)."""
        self.parking = cfg.park_after_prefill

    # ------------------------------------------------------------------ decode promises (offload admission "tiers")
    def commit(self, req: SimRequest) -> None:
        """Promise the request HBM room for its whole sequence."""
        req.committed = self.hbm.final_blocks(req)
        self.committed += req.committed

    def uncommit(self, req: SimRequest) -> None:
        self.committed -= req.committed
        req.committed = 0

    # ------------------------------------------------------------------ KV copies (the replica's)
    def preempt(self, victim: SimRequest, now: float) -> None:
        """Take a running request off: its KV is copied out to a tier with room, else dropped (recomputed)."""
        raise NotImplementedError

    def park(self, req: SimRequest, now: float) -> bool:
        """Copy a just-prefilled request's KV out to a tier; False if no tier has room."""
        raise NotImplementedError

    def swap_in(self, req: SimRequest, now: float) -> None:
        """Copy a parked request's KV back into HBM (its blocks are taken); it runs again when it is in."""
        raise NotImplementedError

    def tier_prefix_tokens(self, req: SimRequest) -> int:
        """Tokens of the prefix after the HBM hit that the offload tier holds (loaded instead of recomputed)."""
        raise NotImplementedError

    def load_prefix(self, req: SimRequest, tokens: int, now: float) -> None:
        """Copy ``tokens`` of an admitted request's prefix from the tier (its blocks are taken)."""
        raise NotImplementedError
