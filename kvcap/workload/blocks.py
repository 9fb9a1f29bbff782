"""Block hashes of a prompt, chained as vLLM's prefix caching chains them: the one identity of a KV block that the
load generator, the simulator and the test server all agree on.

A prompt's tokens are cut into blocks of ``block_tokens``; block ``j``'s hash covers block ``j - 1``'s hash and
block ``j``'s own tokens, so two prompts share hash ``j`` exactly when they share every token of blocks ``0 … j``.
A partial last block is not hashed (vLLM caches full blocks only). Hashes are 63-bit non-negative ints from
blake2b, so they are the same in every process and run (Python's ``hash()`` of a string is salted per process).

Standard library only: the test server's front end (:mod:`kvcap.serve`) hashes what it receives with it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

ROOT_HASH = 0
"""The parent hash of a prompt's first block."""

_HASH_BYTES = 8
_MASK_63 = (1 << 63) - 1


def block_hash(parent: int, tokens: Sequence[str]) -> int:
    """The hash of one block of ``tokens`` whose preceding block hashed to ``parent`` (:data:`ROOT_HASH` for the
    first block). The tokens are encoded as a JSON list, so no two different token lists share an encoding."""
    h = hashlib.blake2b(parent.to_bytes(_HASH_BYTES, "big"), digest_size=_HASH_BYTES)
    h.update(json.dumps(list(tokens), ensure_ascii=False, separators=(",", ":")).encode())
    return int.from_bytes(h.digest(), "big") & _MASK_63


def prompt_block_hashes(words: Sequence[str], block_tokens: int) -> list[int]:
    """The chained hashes of the full blocks of ``words`` (one word one token), first block first."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    out: list[int] = []
    parent = ROOT_HASH
    for start in range(0, len(words) - block_tokens + 1, block_tokens):
        parent = block_hash(parent, words[start:start + block_tokens])
        out.append(parent)
    return out
