"""Two step times read straight from a level's records: the pure decode step, and what a prompt adds to a step.

Why: a closed loop's TPOT mixes both — each request's gaps include the steps that carried other requests'
prompts — so a line through TPOT cannot tell the cost per sequence from the cost of a prompt, nor a prompt's
cost from the front end's (TTFT holds both). The records can: a running request's gap that ends at the instant
another request got its first token is a step that carried that prompt (the first token comes out of the step
that finished the prompt); a gap that ends at no one's first token is a pure decode step. The median of each,
over every running request, gives both steps as the server ran them, whatever the loop's phase. The simulator's
records go through the same function, so the fit compares like with like.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

EDGE = 0.25
"""A gap ends at another request's first token when the two instants are within this share of the median gap
(tokens of one step reach the client within a fraction of a step of each other)."""
MIN_MIXED = 5
MIN_PURE = 20
"""Fewer gaps than these of either kind: that step is not told (None)."""
ITL_SANE = 0.5
"""A median gap under this share of TPOT p50 is not a step: the stream sent tokens in chunks (a zero gap for all
but the first of each), so neither step is read from such a level."""


@dataclass(frozen=True)
class StepSplit:
    pure_s: float | None
    """Median gap that carried no one's prompt: a pure decode step."""
    prompt_s: float | None
    """Median gap that carried exactly one other request's prompt, less ``pure_s``: what one prompt adds."""


def _level_split(records: list[dict[str, Any]]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(pure gaps, one-prompt gaps) in ms of one repeat of one level."""
    first = np.array([r["start_s"] + r["ttft_ms"] / 1e3 for r in records])
    gaps = [np.asarray(r["itl_ms"], dtype=float) for r in records]
    lens = np.array([g.size for g in gaps])
    if not lens.sum():
        return [], []
    itl = np.concatenate(gaps)
    owner = np.repeat(np.arange(len(records)), lens)
    ends = first[owner] + np.concatenate([np.cumsum(g) for g in gaps]) / 1e3
    order = np.argsort(ends, kind="stable")
    ends, owner, itl = ends[order], owner[order], itl[order]
    tol = EDGE * float(np.median(itl)) / 1e3
    carried = np.zeros(ends.size, dtype=int)
    lo = np.searchsorted(ends, first - tol)
    hi = np.searchsorted(ends, first + tol, side="right")
    for j in range(len(records)):
        if hi[j] > lo[j]:
            idx = np.arange(lo[j], hi[j])
            carried[idx[owner[idx] != j]] += 1
    return [itl[carried == 0]], [itl[carried == 1]]


def step_splits(records: Iterable[dict[str, Any]], tpot_p50_ms: dict[tuple[str, float], float]
                ) -> dict[tuple[str, float], StepSplit]:
    """Per (mode, level) of ``tpot_p50_ms``: the two steps (seconds) from the successful records with per-token
    gaps, each repeat read on its own (its clock), then pooled."""
    groups: dict[tuple[str, float, int], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        if r.get("ok") and r.get("itl_ms") and r.get("ttft_ms") is not None:
            groups[(str(r["mode"]), float(r["level"]), int(r.get("repeat", 0)))].append(r)
    pooled: dict[tuple[str, float], tuple[list[np.ndarray], list[np.ndarray]]] = defaultdict(lambda: ([], []))
    for (mode, level, _), recs in groups.items():
        pure, mixed = _level_split(recs)
        pooled[(mode, level)][0].extend(pure)
        pooled[(mode, level)][1].extend(mixed)
    out = {}
    for k, tpot in tpot_p50_ms.items():
        pure_parts, mixed_parts = pooled.get(k, ([], []))
        pure = np.concatenate(pure_parts) if pure_parts else np.zeros(0)
        mixed = np.concatenate(mixed_parts) if mixed_parts else np.zeros(0)
        if pure.size < MIN_PURE or float(np.median(pure)) < ITL_SANE * tpot:
            out[k] = StepSplit(None, None)
            continue
        base = float(np.median(pure))
        extra = float(np.median(mixed)) - base if mixed.size >= MIN_MIXED else None
        out[k] = StepSplit(base / 1e3, extra / 1e3 if extra is not None and extra > 0 else None)
    return out
