"""Telling a broken truth from a starved host, for tests that judge what a ``kvcap bench`` run measured.

A run measures the server only while the host keeps up with both sides. The bench watches its own event loop
(``kvcap.loadgen.monitor``: the summary's ``client``) and the project's test server counts how late its timers
fired (``/stats`` ``timer``, as :func:`tests.streams.truth_check` reads it). A check that fails on a run where
neither was starved fails the test at once; one that fails on a starved run is measured again, and if every
attempt was starved the test is skipped, saying why: the truth was never delivered, so it cannot be judged.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from kvcap.loadgen.monitor import LAG_WARN_MS
from tests.servers import FakeServer

T = TypeVar("T")


class ServerTimers:
    """How many of a test server's timed sends woke over 5 ms late since this was made."""

    def __init__(self, srv: FakeServer) -> None:
        self.srv = srv
        self.before = srv.stats()["timer"]["late_over_5ms"]

    def late(self) -> int:
        return self.srv.stats()["timer"]["late_over_5ms"] - self.before


def starved(summary: dict[str, Any], late_server_wakeups: int = 0) -> str | None:
    """Why this run did not measure the server alone, or None: the bench's event loop lagging past the bench's
    own warning threshold, or the test server's timers waking late."""
    why = []
    lag = (summary.get("client") or {}).get("loop_lag_p99_ms_max") or 0.0
    if lag > LAG_WARN_MS:
        why.append(f"client event-loop lag p99 {lag:.1f} ms")
    if late_server_wakeups:
        why.append(f"{late_server_wakeups} server wake-ups > 5 ms late")
    return ", ".join(why) or None


def judge_unless_starved(measure: Callable[[int], tuple[T, str | None]], check: Callable[[T], None],
                         attempts: int = 3) -> T:
    """``measure(attempt)`` gives the data and why its host was starved (None: it was not); ``check`` asserts."""
    why: list[str] = []
    for attempt in range(attempts):
        data, starved_by = measure(attempt)
        try:
            check(data)
            return data
        except AssertionError as e:
            if starved_by is None:
                raise
            lines = [line.strip() for line in str(e).splitlines() if line.strip()]
            said = next((line for line in lines if "error" in line.lower()), lines[0] if lines else "an assertion")
            why.append(f"{starved_by}; then failed: {said[:200]}")
            print(f"attempt {attempt + 1} of {attempts} starved: {why[-1]}")
    pytest.skip(f"host too loaded to judge: all {attempts} attempts starved ({' | '.join(why)})")


class OtherCpu:
    """CPU time other processes took on this host since this was made, in cores on average: the host's busy
    time (``/proc/stat``) less this process's and its waited-for children's (the servers and benches a test
    started and stopped). A test whose truth needs the host's cores to itself reads it after its measurement."""

    def __init__(self) -> None:
        self.t0, self.busy0, self.own0 = time.monotonic(), _host_busy_s(), _own_s()

    def cores(self) -> float:
        wall = time.monotonic() - self.t0
        if wall <= 0:
            return 0.0
        return max(0.0, (_host_busy_s() - self.busy0) - (_own_s() - self.own0)) / wall


def _host_busy_s() -> float:
    """Seconds of CPU the whole host spent busy (every core), from the first line of ``/proc/stat``."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_s() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system
