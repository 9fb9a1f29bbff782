"""Shared-prefix groups (kvcap.workload.reuse): inference-perf's order, lengths that add up, and hash ids that
share exactly the blocks a prefix cache can share."""

from __future__ import annotations

import pytest

from kvcap.errors import InputError
from kvcap.specs.lengths import parse_length
from kvcap.specs.load import WorkloadSpec
from kvcap.workload.reuse import SharedPrefixPlan, shared_prefix_plan


def plan(per_group: int | None = 5, question: str = "256") -> SharedPrefixPlan:
    p = shared_prefix_plan(7, 1000, 4, parse_length(question), parse_length(32), per_group)
    assert p is not None
    return p


def test_every_prompt_once_per_cycle_in_one_shuffled_order():
    p = plan()
    cycle = [p.slot_of(i) for i in range(20)]
    assert sorted(slot for _, slot in cycle) == list(range(20))  # 4 groups x 5 prompts, each once
    assert all(group == slot // 5 for group, slot in cycle)
    assert [p.slot_of(i) for i in range(20, 40)] == cycle  # then the same order again
    assert cycle != sorted(cycle) and cycle == [plan().slot_of(i) for i in range(20)]  # shuffled, by the seed


def test_without_prompts_per_group_every_request_is_its_own():
    p = plan(None)
    assert [p.slot_of(i) for i in range(6)] == [(0, 0), (1, 1), (2, 2), (3, 3), (0, 4), (1, 5)]
    assert p.distinct_prompts() is None and plan().distinct_prompts() == 20


def test_prefix_and_question_add_up_and_only_whole_prefix_blocks_are_shared():
    p = plan(None, question="uniform:10,300")
    a, b, c = p.prompt(0), p.prompt(4), p.prompt(1)  # a, b: group 0; c: group 1
    assert a.input_tokens == 1000 + a.question_tokens and 10 <= a.question_tokens <= 300
    ha, hb, hc = p.hash_ids(a, 64), p.hash_ids(b, 64), p.hash_ids(c, 64)
    assert len(ha) == -(-a.input_tokens // 64)  # the last block partial
    assert ha[:15] == hb[:15] and ha[15] != hb[15]  # 1000 // 64 = 15 whole blocks inside the system prompt
    assert not set(ha) & set(hc)
    assert max(ha) < 2**63


def test_lengths_of_a_slot_are_its_own_whatever_the_request():
    p = plan(question="uniform:10,300")
    first = {p.prompt(i).slot: p.prompt(i).question_tokens for i in range(20)}
    assert all(p.prompt(i).question_tokens == first[p.prompt(i).slot] for i in range(20, 60))


def test_prompts_per_group_needs_groups():
    with pytest.raises((InputError, ValueError), match="prompts_per_group"):
        WorkloadSpec(prompts_per_group=3)
    assert shared_prefix_plan(0, 0, 0, parse_length(1), parse_length(1)) is None
