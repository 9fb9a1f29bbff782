"""How kvcap writes numbers and words for people, in one place so the HTML report, the Markdown summary and the
charts say the same thing the same way: escaping, number formatting, level names, the verdict's meaning.

Pure functions of their arguments; nothing here reads a run.
"""

from __future__ import annotations

import html
import json
import math
from typing import Any, TypeGuard

from kvcap.rundir.summary import Summary

ARMS = ("control", "treatment")
"""The two arms of a compare, in the order every report shows them."""
VERDICT_MEANING = {
    "performance-scaling": "More memory bought more SLO-bounded concurrency and more goodput, beyond the noise.",
    "performance-only": "Faster at the same stable concurrency: goodput higher and latency lower, beyond the noise, "
                        "with effective capacity unchanged — a performance gain, not a capacity gain.",
    "capacity-only": "More requests reside in memory, but effective capacity and goodput are not higher beyond "
                     "the noise: the extra memory holds requests, it does not serve more of them within the SLO.",
    "no-gain": "Neither resident requests, effective capacity nor goodput rose beyond the noise.",
    "regression": "The treatment is worse: effective capacity fell, or goodput fell beyond the noise.",
}
MODE_PREFIX = {"concurrency": "c", "rate": "λ", "trace": "trace×"}
"""How a load level is named per mode: ``c=8``, ``λ=2.50``, ``trace×=2``."""


def esc(value: Any) -> str:
    """HTML-escape anything (quotes too): run data is untrusted and may land in attributes."""
    return html.escape("" if value is None else str(value), quote=True)


def is_finite(v: Any) -> TypeGuard[float]:
    """A real number that can be plotted or printed as one (not a bool, not NaN or ±inf)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def fmt(v: Any, digits: int | None = None) -> str:
    """Numbers for people: few digits, thousands separators; None → an en dash."""
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        if digits is not None:
            return f"{v:,.{digits}f}"
        if v.is_integer() and abs(v) < 1e15:
            return f"{int(v):,}"
        a = abs(v)
        return f"{v:,.0f}" if a >= 100 else f"{v:.1f}" if a >= 10 else f"{v:.2f}" if a >= 0.1 else f"{v:.3g}"
    return str(v)


def fmtm(v: Any) -> str:
    """A measurement (tok/s, ms): three significant-ish digits, never collapsed to an integer look."""
    if not is_finite(v):
        return fmt(v)
    a = abs(v)
    if a == 0:
        return "0"
    return f"{v:,.0f}" if a >= 100 else f"{v:.1f}" if a >= 10 else f"{v:.2f}"


def signed(v: Any) -> str:
    """A difference with its sign and one decimal (``+12.3``); anything not a finite number → an en dash."""
    return f"{v:+,.1f}" if is_finite(v) else "–"


def level_name(mode: Any, level: Any) -> str:
    """A load level as people read it: ``c=8``, ``λ=2.50``."""
    return f"{MODE_PREFIX.get(str(mode), str(mode))}={fmt(level)}"


def value_text(v: Any) -> str:
    """A manifest value as text: strings as they are, everything else as JSON (lists, null, numbers)."""
    if isinstance(v, str):
        return v
    try:
        return json.dumps(v, default=str)
    except (TypeError, ValueError):
        return str(v)


def pair(v: Any) -> list[Any]:
    """A compare's ``[control, treatment]`` value, padded with None (anything not a list → two Nones)."""
    return list(v) + [None] * (2 - len(v)) if isinstance(v, list) else [None, None]


INTERRUPTED = "interrupted: the summary covers the requests that finished"


def run_notes(summary: Summary) -> list[str]:
    """A run's own warnings and how it ended early — failed or stopped by the error rule, interrupted — one line
    each, as the reports list them beside the client's warnings; empty for a run that ended well."""
    notes = list(summary.warnings)
    if summary.failed:
        notes.append(f"run failed: {summary.failed}")
    elif summary.stopped is not None:
        notes.append(f"run stopped: {summary.stopped.reason}")
    if summary.interrupted:
        notes.append(INTERRUPTED)
    return notes
