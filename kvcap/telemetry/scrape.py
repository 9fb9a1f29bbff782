"""Sampling Prometheus ``/metrics`` endpoints during a run into telemetry rows (normalised names, per-node labels).

``--metrics-url NAME=URL`` labels a target's rows with ``node=NAME`` (default: the URL's host:port); the engine
is detected from the names the page exposes. Counters the catalog marks as rates (node exporter's byte
counters) become per-second rates between successive scrapes, across resets.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvcap.aio import cancel_and_wait
from kvcap.errors import InputError
from kvcap.telemetry.catalog import counter_increase, detect_engine, entry

log = logging.getLogger(__name__)


def parse_target(text: str) -> tuple[str, str]:
    """``NAME=URL`` or ``URL`` → (node label, URL)."""
    name, sep, url = text.partition("=")
    if not sep or name.startswith(("http://", "https://")):
        name, url = "", text
    if not url.startswith(("http://", "https://")):
        raise InputError(f"--metrics-url expects URL or NAME=URL with http(s)://, got {text!r}")
    return (name or urlsplit(url).netloc), url


def parse_metrics(text: str, t_s: float, source: str, node: str | None = None) -> list[dict[str, Any]]:
    """Known samples of a Prometheus text page as telemetry rows ``{t_s, source, name, labels, value}`` (values
    scaled to the normalised unit; counters marked ``rate`` still raw — :class:`RateTracker` turns them)."""
    rows: list[dict[str, Any]] = []
    try:
        families = list(text_string_to_metric_families(text))
    except Exception as exc:  # one page lost, not the run: the next scrape may parse
        log.debug("unparsable metrics page from %s, no rows from it: %s: %s", source, type(exc).__name__, exc)
        return rows
    names = [s.name for fam in families for s in fam.samples]
    engine = detect_engine(names)
    for fam in families:
        for s in fam.samples:
            if s.name.endswith(("_created", "_bucket")):
                continue
            e = entry(s.name, s.labels)
            if e is None:
                continue
            labels = {k: v for k, v in s.labels.items()}
            labels["raw"] = s.name
            if node is not None:
                labels.setdefault("node", node)
            if engine:
                labels["engine"] = engine
            rows.append({"t_s": round(t_s, 4), "source": source, "name": e.name, "labels": labels,
                         "value": float(s.value) * e.scale})
    return rows


class RateTracker:
    """Replaces counter rows (catalog ``rate: true``) by their per-second rate since the previous sample of the
    same series; a counter that went down was reset, so its increase is its new value."""

    def __init__(self) -> None:
        self._last: dict[tuple[Any, ...], tuple[float, float]] = {}

    def apply(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for row in rows:
            e = entry(row["labels"].get("raw", ""), row["labels"])
            if e is None or not e.rate:
                out.append(row)
                continue
            key = (row["source"], tuple(sorted(row["labels"].items())))
            t, v = row["t_s"], row["value"]
            prev = self._last.get(key)
            self._last[key] = (t, v)
            if prev is None or t <= prev[0]:
                continue
            out.append({**row, "value": round(counter_increase(prev[1], v) / (t - prev[0]), 3)})
        return out


class MetricsSampler:
    """Polls one or more /metrics targets every ``interval_s`` and hands rows to ``sink``."""

    def __init__(self, urls: list[str], sink: Callable[[list[dict[str, Any]]], None],
                 clock: Callable[[], float], interval_s: float = 1.0):
        self.targets = [parse_target(u) for u in urls]
        self.urls = [u for _, u in self.targets]
        self.sink = sink
        self.clock = clock
        self.interval_s = interval_s
        self.samples = 0
        self.failures = 0
        self.rates = RateTracker()
        self._task: asyncio.Task | None = None

    async def start(self, session: aiohttp.ClientSession) -> None:
        """Take the first round now (a baseline before any request is sent: a counter's first sample must not
        already hold the run's first requests), then one round every ``interval_s``."""
        await self._round(session)
        self._task = asyncio.get_running_loop().create_task(self._run(session))

    async def _round(self, session: aiohttp.ClientSession) -> None:
        t = self.clock()  # one time per round, so every target's sample of a round sums at the same t
        await asyncio.gather(*(self._one(session, n, u, t) for n, u in self.targets))

    async def _one(self, session: aiohttp.ClientSession, node: str, url: str, t: float) -> None:
        try:
            # identity: the run's session does not decompress (exporters such as node_exporter gzip by default)
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=max(self.interval_s, 2.0)),
                                   headers={"Accept-Encoding": "identity"}) as resp:
                text = await resp.text()
            rows = self.rates.apply(parse_metrics(text, t, source=f"metrics:{url}", node=node))
            self.sink(rows)
            self.samples += 1
        except Exception as exc:  # counted (summary's telemetry failures); the next round tries again
            self.failures += 1
            log.debug("scrape of %s failed (%d so far): %s: %s", url, self.failures, type(exc).__name__, exc)

    async def _run(self, session: aiohttp.ClientSession) -> None:
        next_t = time.perf_counter()
        while True:
            next_t += self.interval_s
            await asyncio.sleep(max(0.0, next_t - time.perf_counter()))
            await self._round(session)

    async def stop(self, session: aiohttp.ClientSession | None = None) -> None:
        await cancel_and_wait(self._task)
        if session is not None:  # one last sample so counters cover the whole run
            await self._round(session)
