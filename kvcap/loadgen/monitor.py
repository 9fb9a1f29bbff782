"""The load generator watches itself: event-loop lag and CPU, so a client-bound run is never mistaken for a
server-bound one."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import numpy as np

from kvcap.aio import cancel_and_wait

LAG_WARN_MS = 10.0
CPU_WARN = 0.85


@dataclass
class LoopMonitor:
    """Samples how late a periodic timer fires (lag) and the process CPU share over a window."""

    interval_s: float = 0.01
    lags_ms: list[float] = field(default_factory=list)
    _task: asyncio.Task | None = None
    _cpu0: float = 0.0
    _wall0: float = 0.0

    def start(self) -> None:
        self.lags_ms = []
        self._cpu0, self._wall0 = time.process_time(), time.perf_counter()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            self.lags_ms.append(max(0.0, (time.perf_counter() - t - self.interval_s) * 1e3))

    async def stop(self) -> dict[str, float | list[str]]:
        await cancel_and_wait(self._task)
        wall = max(time.perf_counter() - self._wall0, 1e-9)
        cpu = (time.process_time() - self._cpu0) / wall
        lags = np.asarray(self.lags_ms) if self.lags_ms else np.zeros(1)
        out: dict[str, float | list[str]] = {
            "loop_lag_p50_ms": round(float(np.percentile(lags, 50)), 3),
            "loop_lag_p99_ms": round(float(np.percentile(lags, 99)), 3),
            "loop_lag_max_ms": round(float(lags.max()), 3),
            "cpu_fraction": round(cpu, 3),
        }
        warnings = []
        if out["loop_lag_p99_ms"] > LAG_WARN_MS:
            warnings.append(f"client event-loop lag p99 {out['loop_lag_p99_ms']:.1f} ms > {LAG_WARN_MS:g} ms: "
                            "client-side delays may inflate latencies (use --workers)")
        if cpu > CPU_WARN:
            warnings.append(f"client used {cpu:.0%} of a core: it may be the bottleneck (use --workers)")
        out["warnings"] = warnings
        return out
