"""``--local-telemetry``: when the client runs on the server host, read the host itself each second —
``/proc/net/dev`` byte counters (as node exporter would) and, when ``nvidia-ml-py`` is installed and finds GPUs,
NVML's utilisation and memory — into the same telemetry rows, labelled ``node`` = this host's name."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvcap.aio import cancel_and_wait
from kvcap.telemetry.scrape import RateTracker

PROC_NET_DEV = Path("/proc/net/dev")

log = logging.getLogger(__name__)


def read_net_dev(text: str) -> dict[str, tuple[int, int]]:
    """``/proc/net/dev`` → {device: (rx bytes, tx bytes)}."""
    out: dict[str, tuple[int, int]] = {}
    for line in text.splitlines()[2:]:
        name, sep, rest = line.partition(":")
        fields = rest.split()
        if sep and len(fields) >= 9:
            out[name.strip()] = (int(fields[0]), int(fields[8]))
    return out


class _Nvml:
    """NVML through nvidia-ml-py, if it is installed and a driver answers; otherwise nothing."""

    def __init__(self) -> None:
        self.handles: list[Any] = []
        try:
            import pynvml  # type: ignore[import-not-found]

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception as exc:  # no package, no driver or no GPU: the host is sampled without GPU rows
            log.debug("no GPU telemetry (NVML): %s: %s", type(exc).__name__, exc)
            self.nvml = None

    def rows(self, t: float, node: str) -> list[dict[str, Any]]:
        out = []
        for i, h in enumerate(self.handles):
            try:
                util = self.nvml.nvmlDeviceGetUtilizationRates(h).gpu / 100.0  # type: ignore[union-attr]
                mem = self.nvml.nvmlDeviceGetMemoryInfo(h).used  # type: ignore[union-attr]
            except Exception as exc:  # this GPU's sample is skipped this second; the others and the next go on
                log.debug("GPU %d not read (NVML): %s: %s", i, type(exc).__name__, exc)
                continue
            lab = {"node": node, "gpu": str(i), "engine": "nvml"}
            out.append({"t_s": round(t, 4), "source": "local:nvml", "name": "gpu.util",
                        "labels": {**lab, "raw": "nvml:utilization.gpu"}, "value": util})
            out.append({"t_s": round(t, 4), "source": "local:nvml", "name": "gpu.mem_used_bytes",
                        "labels": {**lab, "raw": "nvml:memory.used"}, "value": float(mem)})
        return out


class LocalSampler:
    """Samples this host every ``interval_s`` into ``sink`` (network rates per device; GPUs through NVML)."""

    def __init__(self, sink: Callable[[list[dict[str, Any]]], None], clock: Callable[[], float],
                 interval_s: float = 1.0, node: str | None = None, proc_net_dev: Path = PROC_NET_DEV):
        self.sink, self.clock, self.interval_s = sink, clock, interval_s
        self.node = node or socket.gethostname()
        self.path = proc_net_dev
        self.rates = RateTracker()
        self.nvml = _Nvml()
        self.samples = 0
        self._task: asyncio.Task | None = None

    @property
    def gpus(self) -> int:
        return len(self.nvml.handles)

    def sample(self) -> None:
        t = self.clock()
        rows: list[dict[str, Any]] = []
        try:
            devices = read_net_dev(self.path.read_text())
        except OSError as exc:  # not Linux, or no procfs: no network rows, the GPU rows still come
            log.debug("no network telemetry from %s: %s", self.path, exc)
            devices = {}
        for dev, (rx, tx) in devices.items():
            for raw, name, v in (("node_network_receive_bytes_total", "net.rx_bytes_s", rx),
                                 ("node_network_transmit_bytes_total", "net.tx_bytes_s", tx)):
                rows.append({"t_s": round(t, 4), "source": f"local:{self.path}", "name": name,
                             "labels": {"node": self.node, "device": dev, "raw": raw, "engine": "procfs"},
                             "value": float(v)})
        rows = self.rates.apply(rows) + self.nvml.rows(t, self.node)
        self.samples += 1
        self.sink(rows)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        next_t = time.perf_counter()
        while True:
            self.sample()
            next_t += self.interval_s
            await asyncio.sleep(max(0.0, next_t - time.perf_counter()))

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self.sample()
