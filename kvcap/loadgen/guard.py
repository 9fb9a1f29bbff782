"""When a bench run stops itself, and how long a closed-loop user waits after failures.

Why: against a dead or failing endpoint a closed loop re-sends the moment each request fails, so it records
thousands of instant errors, pins a core and measures nothing. Two defences, both pure arithmetic here:

- **backoff** (closed loop): after its k-th failure in a row a user waits 10 ms · 2^(k-1), at most 1 s, and a
  success resets it. A healthy run with rare faults loses ~10 ms of one user per fault; a dead server costs each
  user about one attempt a second. The open loop keeps its schedule (arrivals are the independent variable, and
  a fixed rate cannot spin), so it never backs off.
- **the error rule**: a level stops — and with it the run — once the last ``window`` (50) finished requests of the
  level include at least ``max_error_rate`` (90%) failures. 45 of 50 failing is not a server under test, it is a
  server that is down or shedding nearly all load: the levels above it would only fail harder. By chance, 45
  failures in 50 have a probability of ~3e-26 per window at one fault in five (~2e-9 at one in two); a short
  level (< 50 finished requests) is never stopped.
  Cancelled requests (our own stop) do not count; warm-up requests do.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

BACKOFF_FIRST_S = 0.010
BACKOFF_CAP_S = 1.0
DEFAULT_MAX_ERROR_RATE = 0.9
DEFAULT_ERROR_WINDOW = 50


def backoff_s(failures_in_a_row: int, first_s: float = BACKOFF_FIRST_S, cap_s: float = BACKOFF_CAP_S) -> float:
    """How long a closed-loop user waits before its next request: 0 after a success, then doubling to the cap."""
    if failures_in_a_row <= 0:
        return 0.0
    return min(cap_s, first_s * 2.0 ** min(failures_in_a_row - 1, 60))


def counts_as_failure(rec: dict[str, Any]) -> bool | None:
    """True/False for a finished request; None for one we cancelled ourselves (the rule ignores those)."""
    if rec.get("error") == "cancelled":
        return None
    return not rec.get("ok")


@dataclass(frozen=True)
class ErrorRule:
    """Stop when at least ``max_error_rate`` of a level's last ``window`` finished requests failed (None: never)."""

    max_error_rate: float | None = DEFAULT_MAX_ERROR_RATE
    window: int = DEFAULT_ERROR_WINDOW

    def watch(self) -> ErrorWatch:
        return ErrorWatch(self)


@dataclass
class ErrorWatch:
    """One level's sliding window of outcomes (one worker's share of it, with ``--workers``)."""

    rule: ErrorRule
    recent: deque[str | None] = field(init=False)
    """Each finished request's error class (None: it succeeded), newest last."""

    def __post_init__(self) -> None:
        self.recent = deque(maxlen=self.rule.window)

    def add(self, rec: dict[str, Any]) -> bool:
        """Count one finished request; True when the rule now says stop."""
        failed = counts_as_failure(rec)
        if failed is None:
            return False
        self.recent.append(str(rec.get("error") or "error") if failed else None)
        return self.tripped()

    def tripped(self) -> bool:
        rate = self.rule.max_error_rate
        if rate is None or len(self.recent) < self.rule.window:
            return False
        return self.errors() >= rate * self.rule.window - 1e-9

    def errors(self) -> int:
        return sum(1 for e in self.recent if e is not None)

    def verdict(self, mode: str, level: float, repeat: int, at_s: float) -> dict[str, Any]:
        """Why the run stopped, for summary["stopped"] and the level line."""
        classes = dict(Counter(e for e in self.recent if e is not None).most_common())
        n, window = self.errors(), self.rule.window
        by_class = ", ".join(f"{k}: {v}" for k, v in classes.items())
        return {"reason": f"{n} of the last {window} requests failed ({by_class}), at or above the "
                          f"{self.rule.max_error_rate:.0%} error-rate limit (--max-error-rate)",
                "mode": mode, "level": level, "repeat": repeat, "at_s": round(at_s, 6), "errors": n,
                "window": window, "max_error_rate": self.rule.max_error_rate, "error_classes": classes}


def run_failure(summary: dict[str, Any]) -> str | None:
    """Why a finished run failed as a whole (exit 1), or None: stopped by the error rule, or nothing succeeded."""
    stopped = summary.get("stopped")
    measured_ok = sum(int(lv.get("ok") or 0) for lv in summary.get("levels") or [])
    where = ""
    if stopped:
        where = f"stopped at {stopped['mode']} {stopped['level']:g} (repeat {stopped['repeat']}): {stopped['reason']}"
    if measured_ok == 0 and not summary.get("interrupted"):
        errors = sum(int(lv.get("errors") or 0) for lv in summary.get("levels") or [])
        nothing = f"no request succeeded ({errors} measured requests failed)"
        return f"{where}; {nothing}" if where else nothing
    return where or None
