"""Input lengths as the server counted them (records take ``usage.prompt_tokens``), against what was asked.

Why: the asked length is a spec, the server's count is the fact — a run whose prompts the server counted 20%
longer than asked measured another workload, and two arms may only be compared on the lengths they really sent.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvcap.errors import InputError
from kvcap.rundir.manifest import Manifest
from kvcap.rundir.summary import LevelSummary
from kvcap.specs.lengths import parse_length

TOLERANCE = 0.05
"""Relative gap between asked and measured mean input lengths (or between two arms' measured ones) that counts."""


def levels_input_mean(levels: Iterable[LevelSummary]) -> float | None:
    """Mean input tokens of the measured requests that succeeded, from a summary's levels (each level's
    ``input_tokens_mean`` weighted by its ``ok``); None without any."""
    pairs = [(lv.input_tokens_mean, lv.ok or 0) for lv in levels if lv.input_tokens_mean is not None]
    n = sum(k for _, k in pairs)
    return round(sum(m * k for m, k in pairs) / n, 2) if n else None


def asked_mean(manifest: Manifest | None) -> float | None:
    """The mean of the asked input length distribution, a shared prefix added where the manifest says prompts are
    prefix + input (``workload.prompt``), and for sessions of T turns the mean history, (T − 1) / 2 earlier
    questions and answers; None for a dataset, a trace or an unreadable spec."""
    fixed = manifest.fixed if manifest is not None else {}
    spec = fixed.get("workload.input_tokens")
    if spec is None or fixed.get("load.mode") == "trace":
        return None
    prefix = int(fixed.get("workload.prefix_tokens") or 0) if "workload.prompt" in fixed else 0
    turns = fixed.get("workload.turns")
    try:
        question = parse_length(spec).mean
        history = 0.0
        if isinstance(turns, int) and turns > 1:
            history = (turns - 1) / 2 * (question + parse_length(fixed.get("workload.output_tokens") or 0).mean)
        return question + prefix + history
    except InputError:
        return None


def relative_gap(a: float, b: float) -> float:
    """|a − b| relative to the larger of the two."""
    top = max(abs(a), abs(b))
    return abs(a - b) / top if top else 0.0


def input_length_warnings(manifest: Manifest | None, levels: Iterable[LevelSummary]) -> list[str]:
    """A warning when the mean input length the server counted is more than :data:`TOLERANCE` from the asked."""
    asked, measured = asked_mean(manifest), levels_input_mean(levels)
    if asked is None or measured is None or relative_gap(asked, measured) <= TOLERANCE:
        return []
    return [f"input length: the server counted {measured:g} tokens per prompt on average, "
            f"{100 * (measured / asked - 1):+.1f}% from the asked {asked:g} (workload.input_tokens); "
            f"compare runs by their measured lengths"]
