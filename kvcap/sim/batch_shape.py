"""One engine iteration's work described by totals (:class:`BatchShape`), the cost model's input.

Why totals and not per-sequence lists: the simulator prices a step millions of times per run, and every
term of the cost model is linear in a few sums (tokens, chunks, contexts, causal query-key pairs), so a step
costs O(1) whatever the batch size and a pure-decode span advances by adding constants.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


def _window_sum(context: int, tokens: int, window: int) -> int:
    """Σ_{i=1..tokens} min(context + i, window): query-key pairs of a chunk on a sliding-window layer."""
    lo, hi = context + 1, context + tokens
    if hi <= window:
        return (lo + hi) * tokens // 2
    if lo > window:
        return tokens * window
    inside = window - lo + 1
    return (lo + window) * inside // 2 + (tokens - inside) * window


@dataclass(slots=True)
class BatchShape:
    """One iteration's work as totals, so a step costs O(1) whatever the batch size.

    Prefill chunks: ``n_prefill_tokens`` new tokens in ``n_prefill_seqs`` chunks, which attend to
    ``prefill_context_tokens`` earlier tokens (chunked prefill, prefix-cache hits) and form
    ``prefill_attn_pairs`` = Σ (context × tokens + tokens(tokens+1)/2) causal query-key pairs. Decode:
    ``n_decode`` sequences, one token each, attending to ``decode_context_tokens`` cached tokens in all.
    The ``*_window_*`` fields are the same sums with every context capped at the sliding window (None: no
    sliding layers, or equal to the uncapped sums). Treat instances as values; build them with :meth:`of`.
    """

    n_prefill_tokens: int = 0
    n_prefill_seqs: int = 0
    prefill_context_tokens: int = 0
    prefill_attn_pairs: float = 0.0
    n_decode: int = 0
    decode_context_tokens: int = 0
    prefill_window_context_tokens: int | None = None
    prefill_window_attn_pairs: float | None = None
    decode_window_tokens: int | None = None
    passes: int = 1
    """Forward passes the engine runs for this step: 1 for vLLM; llama.cpp's split KV runs one per run of
    consecutive busy slots and more for a prompt beside decodes (:func:`kvcap.sim.policy_llamacpp.forward_passes`).
    A measured step cost pays its fixed part per pass; the roofline prices one pass (vLLM)."""
    waiting: int = 0
    """Requests waiting at the server while the step runs (a measured step cost's ``per_waiting``; the roofline
    prices the engine alone)."""

    @classmethod
    def of(cls, prefill: Iterable[tuple[int, int]] = (), decode: Iterable[int] = (),
           window: int | None = None) -> BatchShape:
        """From per-sequence lists: ``prefill`` as (chunk tokens, context before the chunk), ``decode`` as
        each decoding sequence's cached context; ``window`` is the model's sliding window, if any."""
        chunks = [(int(t), int(c)) for t, c in prefill if t > 0]
        contexts = [int(c) for c in decode]
        shape = cls(n_prefill_tokens=sum(t for t, _ in chunks), n_prefill_seqs=len(chunks),
                    prefill_context_tokens=sum(c for _, c in chunks),
                    prefill_attn_pairs=float(sum(c * t + t * (t + 1) // 2 for t, c in chunks)),
                    n_decode=len(contexts), decode_context_tokens=sum(contexts))
        if window:
            shape.prefill_window_context_tokens = sum(min(c, window) for _, c in chunks)
            shape.prefill_window_attn_pairs = float(sum(_window_sum(c, t, window) for t, c in chunks))
            shape.decode_window_tokens = sum(min(c, window) for c in contexts)
        return shape

    @classmethod
    def decode_only(cls, contexts: list[int], window: int | None = None) -> BatchShape:
        """``of(decode=contexts, window=window)`` for a pure-decode step (every decode span prices one), without
        the per-sequence conversions; ``contexts`` are ints already."""
        shape = cls(n_decode=len(contexts), decode_context_tokens=sum(contexts))
        if window:
            shape.prefill_window_context_tokens = 0
            shape.prefill_window_attn_pairs = 0.0
            shape.decode_window_tokens = sum(min(c, window) for c in contexts)
        return shape

    @property
    def n_tokens(self) -> int:
        return self.n_prefill_tokens + self.n_decode

    @property
    def n_sampled(self) -> int:
        """Rows of logits: one per decoding sequence and one per prefill chunk (engines compute them all)."""
        return self.n_decode + self.n_prefill_seqs

    def __add__(self, other: BatchShape) -> BatchShape:
        def win(a: BatchShape, field: str, full: str) -> Any:
            value = getattr(a, field)
            return getattr(a, full) if value is None else value

        windowed = any(getattr(s, f) is not None for s in (self, other)
                       for f in ("prefill_window_context_tokens", "prefill_window_attn_pairs",
                                 "decode_window_tokens"))
        out = BatchShape(self.n_prefill_tokens + other.n_prefill_tokens, self.n_prefill_seqs + other.n_prefill_seqs,
                         self.prefill_context_tokens + other.prefill_context_tokens,
                         self.prefill_attn_pairs + other.prefill_attn_pairs, self.n_decode + other.n_decode,
                         self.decode_context_tokens + other.decode_context_tokens)
        if windowed:
            for field, full in (("prefill_window_context_tokens", "prefill_context_tokens"),
                                ("prefill_window_attn_pairs", "prefill_attn_pairs"),
                                ("decode_window_tokens", "decode_context_tokens")):
                setattr(out, field, win(self, field, full) + win(other, field, full))
        return out


def windowed_totals(batch: BatchShape) -> tuple[int, float]:
    """(KV tokens read, query-key pairs) on a sliding-window layer; uncapped sums where no window was given."""
    pc = batch.prefill_window_context_tokens
    pp = batch.prefill_window_attn_pairs
    dw = batch.decode_window_tokens
    if dw is None:
        dw = batch.decode_context_tokens
    return ((batch.prefill_context_tokens if pc is None else pc) + dw,
            (batch.prefill_attn_pairs if pp is None else pp) + dw)
