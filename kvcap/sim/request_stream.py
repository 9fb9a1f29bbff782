"""What the next request of a level is, in send order: its input and output lengths and its prompt's block hash
ids — drawn from the workload's length distributions, or a shared-prefix workload's plan
(:mod:`kvcap.workload.reuse`, the same requests ``bench`` sends).
"""

from __future__ import annotations

import numpy as np

from kvcap.specs.lengths import parse_length
from kvcap.specs.scenario import Scenario
from kvcap.workload.reuse import SharedPrefixPlan, shared_prefix_plan


def request_stream(scenario: Scenario, seed: int, repeat: int) -> DrawnLengths | SharedPrefixRequests:
    """The stream a level draws its requests from (a shared-prefix plan where the workload has groups)."""
    wl = scenario.workload
    shared = shared_prefix_plan(seed, wl.prefix_tokens, wl.prefix_groups, wl.input_dist, wl.output_dist,
                                wl.prompts_per_group)
    if shared is None:
        return DrawnLengths(wl.input_tokens, wl.output_tokens, (seed, repeat))
    return SharedPrefixRequests(shared, scenario.serving.hash_block_tokens)


class SharedPrefixRequests:
    """Lengths and hash ids of a shared-prefix workload's requests in send order (request ``i`` of a level is
    ``bench``'s request ``i``: :mod:`kvcap.workload.reuse`), hashed at the replicas' ``hash_block_tokens``."""

    def __init__(self, plan: SharedPrefixPlan, block_tokens: int):
        self.plan, self.block_tokens, self.i = plan, block_tokens, 0
        self.hashes: dict[int, tuple[int, ...]] = {}
        """A slot's hash ids, kept while its prompts cycle (a workload without a cycle keeps none)."""

    def next(self) -> tuple[int, int, tuple[int, ...]]:
        plan = self.plan
        p = plan.prompt(self.i)
        self.i += 1
        hashes = self.hashes.get(p.slot)
        if hashes is None:
            hashes = plan.hash_ids(p, self.block_tokens)
            if plan.prompts_per_group:
                self.hashes[p.slot] = hashes
        return p.input_tokens, p.output_tokens, hashes


class DrawnLengths:
    """Input/output lengths per request from the workload's distributions, seeded per repeat and not per level:
    request i has the same lengths at every level (``bench`` sends the same prompt set at every level too), so
    levels differ by load alone; repeats draw afresh (a simulator has no other run-to-run variation)."""

    def __init__(self, input_spec: int | str, output_spec: int | str, seed: tuple[int, ...]):
        self.i, self.o = parse_length(input_spec, "workload.input_tokens"), parse_length(output_spec,
                                                                                        "workload.output_tokens")
        self.rng = np.random.default_rng(seed)
        self.buf: list[tuple[int, int, tuple[int, ...]]] = []

    def next(self) -> tuple[int, int, tuple[int, ...]]:
        """(input tokens, output tokens, hash ids: none)."""
        if not self.buf:
            n = 4096
            none: tuple[int, ...] = ()
            self.buf = [(i, o, none) for i, o in zip(self.i.sample(n, self.rng).tolist(),
                                                     self.o.sample(n, self.rng).tolist())][::-1]
        return self.buf.pop()
