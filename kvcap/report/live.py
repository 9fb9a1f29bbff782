"""Live progress of a benchmark: one bar per level with requests, errors, running TTFT p50/p95 and tokens/s."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn


class RichProgress:
    """Implements the runner's Progress protocol with rich; cheap per record (numbers only, render at 2 Hz)."""

    def __init__(self, console: Console | None = None):
        self.console = console or Console(stderr=True)
        self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                                 TextColumn("{task.fields[stats]}"), TimeElapsedColumn(), console=self.console,
                                 refresh_per_second=2, transient=False)
        self.task: Any = None
        self._reset()

    def _reset(self) -> None:
        self.done = 0
        self.errors = 0
        self.tokens = 0
        self.ttft: deque[float] = deque(maxlen=2000)
        self.t0 = time.perf_counter()
        self.last = 0.0

    def __enter__(self) -> RichProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def level_start(self, mode: str, level: float, repeat: int, expected_s: float | None) -> None:
        self._reset()
        name = {"concurrency": "c", "rate": "rate", "trace": "trace ×"}.get(mode, mode)
        self.task = self.progress.add_task(f"{name}={level:g} rep {repeat + 1}", total=expected_s or None,
                                           stats="starting")
        self.expected = expected_s

    def on_record(self, rec: dict[str, Any]) -> None:
        self.done += 1
        if not rec.get("ok") and rec.get("error") != "cancelled":
            self.errors += 1
        if rec.get("ttft_ms") is not None:
            self.ttft.append(rec["ttft_ms"])
        self.tokens += rec.get("output_tokens") or 0
        now = time.perf_counter()
        if now - self.last > 0.5 and self.task is not None:
            self.last = now
            elapsed = now - self.t0
            if self.ttft:
                p50, p95 = np.percentile(np.fromiter(self.ttft, float), [50, 95])
                ttft = f"TTFT p50 {p50:.0f} p95 {p95:.0f} ms"
            else:
                ttft = "TTFT –"
            stats = f"{self.done} done, {self.errors} err, {ttft}, {self.tokens / max(elapsed, 1e-9):.0f} tok/s"
            self.progress.update(self.task, completed=min(elapsed, self.expected or elapsed), stats=stats)

    def level_end(self, info: dict[str, Any]) -> None:
        if self.task is not None:
            total = self.expected or 1
            self.progress.update(self.task, completed=total, total=total)
