"""Chained prompt block hashes (kvcap.workload.blocks): shared leading blocks share hashes, a change inside block j
changes every hash from j on, a partial last block is not hashed, and the values are the same in every process.
Also: the token sequence the test server hashes is exactly the one it counts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvcap.serve.protocol import ApiConfig, count_prompt, prompt_token_words
from kvcap.workload.blocks import ROOT_HASH, block_hash, prompt_block_hashes
from tests.conftest import ROOT


def words(n: int, tag: str = "w") -> list[str]:
    return [f"{tag}{i}" for i in range(n)]


def test_prompts_sharing_k_full_blocks_share_exactly_k_hashes() -> None:
    shared = words(8, "s")  # two blocks of 4
    a = prompt_block_hashes([*shared, *words(9, "a")], 4)
    b = prompt_block_hashes([*shared, *words(9, "b")], 4)
    assert len(a) == len(b) == 4  # 17 words: 4 full blocks, the 17th word is a partial block
    assert a[:2] == b[:2] and all(x != y for x, y in zip(a[2:], b[2:]))


def test_a_difference_inside_block_j_changes_hashes_from_j_on() -> None:
    base = words(20)
    before = prompt_block_hashes(base, 4)
    for j in range(5):
        for pos in (4 * j, 4 * j + 3):  # first and last token of block j
            changed = list(base)
            changed[pos] = "other"
            after = prompt_block_hashes(changed, 4)
            assert after[:j] == before[:j], (j, pos)
            assert all(x != y for x, y in zip(after[j:], before[j:], strict=True)), (j, pos)


def test_partial_last_block_is_not_hashed() -> None:
    assert prompt_block_hashes(words(11), 4) == prompt_block_hashes(words(8), 4)
    assert len(prompt_block_hashes(words(11), 4)) == 2
    assert prompt_block_hashes(words(3), 4) == []
    assert prompt_block_hashes(words(12), 4)[:2] == prompt_block_hashes(words(8), 4)


def test_chain_is_parent_then_own_tokens_and_63_bit() -> None:
    w = words(12)
    h = prompt_block_hashes(w, 4)
    assert h[0] == block_hash(ROOT_HASH, w[:4])
    assert h[1] == block_hash(h[0], w[4:8]) and h[2] == block_hash(h[1], w[8:12])
    assert all(0 <= x < 2**63 for x in h)
    # the same block of tokens after a different parent is a different block
    assert block_hash(h[0], w[:4]) != h[0]
    # token boundaries count: ["ab", "c"] is not ["a", "bc"]
    assert block_hash(ROOT_HASH, ["ab", "c"]) != block_hash(ROOT_HASH, ["a", "bc"])
    with pytest.raises(ValueError):
        prompt_block_hashes(w, 0)


def test_hashes_are_the_same_in_another_process() -> None:
    here = prompt_block_hashes(words(40), 16)
    code = "from kvcap.workload.blocks import prompt_block_hashes as p; print(p([f'w{i}' for i in range(40)], 16))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PYTHONHASHSEED": "12345"}, check=True)
    assert out.stdout.strip() == str(here)


@pytest.mark.parametrize(("body", "chat", "api", "expect"), [
    ({"prompt": "a b  c\nd"}, False, ApiConfig(), ["a", "b", "c", "d"]),
    ({"prompt": ["x y"]}, False, ApiConfig(prompt_overhead=2), ["<|special0|>", "<|special1|>", "x", "y"]),
    ({"prompt": [5, 7, 9]}, False, ApiConfig(prompt_overhead=2), ["5", "7", "9"]),
    ({"prompt": "abcdefghi jk"}, False, ApiConfig(tokenizer="chars4"), ["abcd", "efgh", "i", "jk"]),
    ({"messages": [{"role": "system", "content": "be brief"},
                   {"role": "user", "content": [{"type": "text", "text": "hi there"}, {"type": "image"}]},
                   {"role": "assistant", "content": None}]}, True, ApiConfig(prompt_overhead=1),
     ["<|special0|>", "be", "brief", "hi", "there"]),
])
def test_server_hashes_the_tokens_it_counts(body: dict, chat: bool, api: ApiConfig, expect: list[str]) -> None:
    tokens = prompt_token_words(body, chat, api)
    assert tokens == expect and len(tokens) == count_prompt(body, chat, api)
