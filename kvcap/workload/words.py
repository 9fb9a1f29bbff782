"""The word list prompts are built from, and the text of one shared prefix block: the lowest module of the
workload package, so prompt generation and trace replay can both use it without importing each other."""

from __future__ import annotations

import numpy as np

from kvcap.specs.load import MOONCAKE_BLOCK_TOKENS

WORDS = tuple([
    "the", "of", "and", "to", "in", "is", "was", "for", "on", "are", "with", "as", "by", "at", "be", "this", "from",
    "or", "have", "an", "they", "which", "one", "you", "were", "all", "we", "her", "she", "there", "would", "their",
    "will", "when", "who", "him", "been", "has", "more", "if", "no", "out", "do", "so", "can", "what", "up", "said",
    "about", "other", "into", "than", "its", "time", "only", "could", "new", "them", "man", "some", "these", "then",
    "two", "first", "may", "any", "like", "now", "my", "such", "make", "over", "our", "even", "most", "me", "state",
    "after", "also", "made", "many", "did", "must", "before", "back", "see", "through", "way", "where", "get", "much",
    "go", "well", "your", "know", "should", "down", "work", "year", "because", "come", "people", "just", "say", "each",
    "those", "take", "day", "good", "how", "long", "very", "great", "old", "little", "world", "own", "off", "last",
    "right", "still", "might", "while", "high", "us", "life", "every", "never", "under", "last", "city", "water",
    "house", "small", "found", "part", "place", "case", "point", "group", "number", "land"])


def block_text(seed: int, block_id: int, tokens: int = MOONCAKE_BLOCK_TOKENS) -> str:
    """The text of one prefix block: the same (seed, block id) always gives the same words."""
    rng = np.random.default_rng((seed, 7_777_777, block_id))
    return " ".join(np.array(WORDS)[rng.integers(len(WORDS), size=tokens)])
