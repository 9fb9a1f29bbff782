"""Sampling a server's Prometheus ``/metrics`` endpoint during a run into telemetry rows."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvcap.aio import cancel_and_wait
from kvcap.telemetry.catalog import normalise


def parse_metrics(text: str, t_s: float, source: str) -> list[dict[str, Any]]:
    """Known samples of a Prometheus text page as telemetry rows ``{t_s, source, name, labels, value}``."""
    rows: list[dict[str, Any]] = []
    try:
        families = list(text_string_to_metric_families(text))
    except Exception:
        return rows
    for fam in families:
        for s in fam.samples:
            if s.name.endswith(("_created", "_bucket", "_sum", "_count")):
                continue
            name = normalise(s.name)
            if name is None:
                continue
            labels = {k: v for k, v in s.labels.items()}
            labels["raw"] = s.name
            rows.append({"t_s": round(t_s, 4), "source": source, "name": name, "labels": labels,
                         "value": float(s.value)})
    return rows


class MetricsSampler:
    """Polls one or more /metrics URLs every ``interval_s`` and hands rows to ``sink``."""

    def __init__(self, urls: list[str], sink: Callable[[list[dict[str, Any]]], None],
                 clock: Callable[[], float], interval_s: float = 1.0):
        self.urls = urls
        self.sink = sink
        self.clock = clock
        self.interval_s = interval_s
        self.samples = 0
        self.failures = 0
        self._task: asyncio.Task | None = None

    def start(self, session: aiohttp.ClientSession) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(session))

    async def _one(self, session: aiohttp.ClientSession, url: str) -> None:
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=max(self.interval_s, 2.0))) as resp:
                text = await resp.text()
            t = self.clock()
            rows = parse_metrics(text, t, source=f"metrics:{url}")
            self.sink(rows)
            self.samples += 1
        except Exception:
            self.failures += 1

    async def _run(self, session: aiohttp.ClientSession) -> None:
        next_t = time.perf_counter()
        while True:
            await asyncio.gather(*(self._one(session, u) for u in self.urls))
            next_t += self.interval_s
            await asyncio.sleep(max(0.0, next_t - time.perf_counter()))

    async def stop(self, session: aiohttp.ClientSession | None = None) -> None:
        await cancel_and_wait(self._task)
        if session is not None:  # one last sample so counters cover the whole run
            await asyncio.gather(*(self._one(session, u) for u in self.urls))
