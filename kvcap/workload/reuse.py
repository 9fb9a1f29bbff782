"""Shared-prefix groups: which prompt request ``i`` sends, its lengths, and the hash ids of its blocks — one
definition for ``bench`` (which writes the words) and ``sim`` (which reads the hash ids), so both run the same
prompts and the simulator's prefix cache sees the reuse the server's does.

The groups follow inference-perf's ``shared_prefix`` generator: ``groups`` system prompts of ``prefix_tokens``
each; ``prompts_per_group`` questions per group, so ``groups × prompts_per_group`` distinct prompts, shuffled once
(by the seed) and then sent in that order, over and over. A prompt is its group's system prompt followed by its
question: ``prefix_tokens + input_tokens`` tokens, as the flags read (SGLang's ``generated-shared-prefix`` and
vLLM's ``prefix_repetition`` add them the same way). Without ``prompts_per_group`` every request has a question of
its own (no prompt ever repeats; request ``i`` is in group ``i mod groups``).

Hash ids name ``block_tokens``-token blocks as a prefix cache chains them: a block wholly inside the system prompt
is its group's (shared), any later block depends on the question too (the prompt's own).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from kvcap.specs.lengths import LengthDist

HASH_MASK = (1 << 63) - 1
"""Hash ids stay below 2⁶³ (the simulator's block pool keys freed blocks from 2⁶⁴ up)."""
SHUFFLE_STREAM = 7_919
"""Seeds the one shuffle of the prompt slots, apart from the per-slot length draws."""


def block_id(*parts: int) -> int:
    """A 63-bit id for a block named by ``parts``, the same in every process."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & HASH_MASK


@dataclass(frozen=True)
class SharedPrompt:
    """Request ``index``'s prompt: its group, its slot (the question's identity) and its lengths."""

    index: int
    group: int
    slot: int
    question_tokens: int
    output_tokens: int
    prefix_tokens: int

    @property
    def input_tokens(self) -> int:
        return self.prefix_tokens + self.question_tokens


@dataclass(frozen=True)
class SharedPrefixPlan:
    """The shared-prefix workload of one seed: request index → prompt, and a prompt's block hash ids."""

    seed: int
    groups: int
    prefix_tokens: int
    question_dist: LengthDist
    output_dist: LengthDist
    prompts_per_group: int | None = None

    @cached_property
    def _order(self) -> np.ndarray | None:
        if not self.prompts_per_group:
            return None
        return np.random.default_rng((self.seed, SHUFFLE_STREAM)).permutation(self.groups * self.prompts_per_group)

    def slot_of(self, index: int) -> tuple[int, int]:
        """(group, slot) of request ``index``."""
        order = self._order
        if order is None:
            return index % self.groups, index
        slot = int(order[index % len(order)])
        assert self.prompts_per_group is not None
        return slot // self.prompts_per_group, slot

    def lengths(self, slot: int) -> tuple[int, int]:
        """(question tokens, output tokens) of a slot: drawn from (seed, slot) — output first, as
        :meth:`kvcap.workload.prompts.PromptFactory.body` draws a request's lengths."""
        rng = np.random.default_rng((self.seed, slot))
        out_t = int(self.output_dist.sample(1, rng)[0])
        return int(self.question_dist.sample(1, rng)[0]), out_t

    def prompt(self, index: int) -> SharedPrompt:
        group, slot = self.slot_of(index)
        question, out_t = self.lengths(slot)
        return SharedPrompt(index=index, group=group, slot=slot, question_tokens=question, output_tokens=out_t,
                            prefix_tokens=self.prefix_tokens)

    def hash_ids(self, p: SharedPrompt, block_tokens: int) -> tuple[int, ...]:
        """Ids of the prompt's ``block_tokens``-token blocks, the last one partial: a block that ends within the
        system prompt is the group's, every later one the slot's."""
        n = -(-p.input_tokens // block_tokens)
        shared = min(n, self.prefix_tokens // block_tokens)
        return (tuple(block_id(self.seed, 1, p.group, j) for j in range(shared))
                + tuple(block_id(self.seed, 2, p.slot, j) for j in range(shared, n)))

    def distinct_prompts(self) -> int | None:
        """How many different prompts the workload sends (None: every request its own)."""
        return self.groups * self.prompts_per_group if self.prompts_per_group else None


def shared_prefix_plan(seed: int, prefix_tokens: int, groups: int, question_dist: LengthDist,
                       output_dist: LengthDist, prompts_per_group: int | None = None) -> SharedPrefixPlan | None:
    """The plan of a workload with shared-prefix groups, None without them."""
    if not (groups and prefix_tokens):
        return None
    return SharedPrefixPlan(seed=seed, groups=groups, prefix_tokens=prefix_tokens, question_dist=question_dist,
                            output_dist=output_dist, prompts_per_group=prompts_per_group)


def prompt_parts(prefix_tokens: int, prompts_per_group: int | None) -> dict[str, object]:
    """Manifest keys stating what a shared-prefix prompt is made of (both ``bench`` and ``sim`` write them)."""
    return {"workload.prompts_per_group": prompts_per_group,
            "workload.prompt": f"{prefix_tokens} shared prefix tokens + workload.input_tokens of its own"}
