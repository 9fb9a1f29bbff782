"""Real Prometheus and node exporter (Debian's packages, installed by scripts/test) on 127.0.0.1 for tests, plus a
fixture exporter that serves recorded DCGM-format series with known values.

    with dcgm_fixture() as dcgm, node_exporter() as node, prometheus({"engine": [url], "dcgm": [dcgm.url], …}) as prom:
        prom.url

Each process gets a free port, a temporary config and data directory, and is always stopped (kvcap.procs).
"""

from __future__ import annotations

import contextlib
import http.server
import json
import shutil
import socket
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvcap import procs

PROMETHEUS = shutil.which("prometheus")
NODE_EXPORTER = shutil.which("prometheus-node-exporter") or shutil.which("node_exporter")
MISSING = "Debian's prometheus and prometheus-node-exporter are not installed: ./scripts/test installs them"

# what the DCGM fixture serves: two nodes, one GPU each, a hot one and a cold one
DCGM_NODES = {"node-a": {"util": 91, "fb_used_mib": 20_000, "pcie_tx": 2.5e9},
              "node-b": {"util": 37, "fb_used_mib": 12_000, "pcie_tx": 0.5e9}}
FAKE_NIC_RATE = 1.25e9
"""Bytes/s the fixture's ``node_network_receive_bytes_total{device="fake0"}`` grows by (10 Gbps); it resets."""
RESET_EVERY_S = 4.0


def require() -> None:
    if not (PROMETHEUS and NODE_EXPORTER):
        pytest.fail(MISSING)


@dataclass
class Served:
    """A running exporter or Prometheus: its base URL."""

    url: str


def dcgm_page(t: float) -> str:
    """DCGM exporter text format (dcgm-exporter's default field names and labels) at fixture time ``t``."""
    lines = ["# HELP DCGM_FI_DEV_GPU_UTIL GPU utilization (in %).", "# TYPE DCGM_FI_DEV_GPU_UTIL gauge"]
    for i, (host, v) in enumerate(DCGM_NODES.items()):
        lab = f'gpu="0",UUID="GPU-{i:08d}",device="nvidia0",modelName="NVIDIA GeForce RTX 4090",Hostname="{host}"'
        lines.append(f"DCGM_FI_DEV_GPU_UTIL{{{lab}}} {v['util']}")
    lines += ["# HELP DCGM_FI_DEV_FB_USED Framebuffer memory used (in MiB).", "# TYPE DCGM_FI_DEV_FB_USED gauge"]
    for i, (host, v) in enumerate(DCGM_NODES.items()):
        lab = f'gpu="0",UUID="GPU-{i:08d}",device="nvidia0",modelName="NVIDIA GeForce RTX 4090",Hostname="{host}"'
        lines.append(f"DCGM_FI_DEV_FB_USED{{{lab}}} {v['fb_used_mib']}")
    lines += ["# HELP DCGM_FI_PROF_PCIE_TX_BYTES The rate of data transmitted over the PCIe bus, in bytes per second.",
              "# TYPE DCGM_FI_PROF_PCIE_TX_BYTES gauge"]
    for i, (host, v) in enumerate(DCGM_NODES.items()):
        lab = f'gpu="0",UUID="GPU-{i:08d}",device="nvidia0",modelName="NVIDIA GeForce RTX 4090",Hostname="{host}"'
        lines.append(f"DCGM_FI_PROF_PCIE_TX_BYTES{{{lab}}} {v['pcie_tx']:.0f}")
    since_reset = t % RESET_EVERY_S
    lines += ["# TYPE node_network_receive_bytes_total counter",
              f'node_network_receive_bytes_total{{device="fake0"}} {FAKE_NIC_RATE * since_reset:.0f}']
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def dcgm_fixture() -> Iterator[Served]:
    started = time.time()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = dcgm_page(time.time() - started).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield Served(f"http://127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def _process(args: list[str], ready_url: str, log: Path) -> Iterator[None]:
    """Run ``args`` (output to ``log``) until the block ends, once ``ready_url`` answers 200 (30 s at most)."""
    with procs.start(args, log=log) as proc:
        proc.wait_for_http(ready_url, 30.0)
        yield


@contextlib.contextmanager
def node_exporter() -> Iterator[Served]:
    require()
    port = procs.free_port()
    tmp = Path(tempfile.mkdtemp(prefix="kvcap-node-exporter-"))
    args = [str(NODE_EXPORTER), f"--web.listen-address=127.0.0.1:{port}", "--collector.disable-defaults",
            "--collector.netdev", "--collector.netdev.device-exclude=^$", "--collector.meminfo"]  # keep lo
    try:
        with _process(args, f"http://127.0.0.1:{port}/metrics", tmp / "log"):
            yield Served(f"http://127.0.0.1:{port}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def prometheus(jobs: dict[str, list[str]], interval: str = "1s") -> Iterator[Served]:
    """Prometheus scraping each job's targets (base URLs; /metrics) every ``interval``, until all are up."""
    require()
    port = procs.free_port()
    tmp = Path(tempfile.mkdtemp(prefix="kvcap-prometheus-"))
    scrape = [{"job_name": job, "static_configs": [{"targets": [u.split("://", 1)[1].rstrip("/") for u in urls]}]}
              for job, urls in jobs.items()]
    (tmp / "prometheus.yml").write_text(json.dumps({"global": {"scrape_interval": interval,
                                                               "evaluation_interval": interval},
                                                    "scrape_configs": scrape}))
    args = [str(PROMETHEUS), f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"]
    url = f"http://127.0.0.1:{port}"
    try:
        with _process(args, url + "/-/ready", tmp / "log"):
            wanted = sum(len(u) for u in jobs.values())
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                with urllib.request.urlopen(url + "/api/v1/query?query=up", timeout=5) as r:
                    up = json.load(r)["data"]["result"]
                if sum(1 for s in up if s["value"][1] == "1") >= wanted:
                    break
                time.sleep(0.3)
            else:
                raise RuntimeError(f"Prometheus targets not all up: {up}")
            yield Served(url)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class LoopbackTraffic:
    """Sends a known number of bytes per second over a loopback TCP connection (node exporter's ``lo`` sees it)."""

    def __init__(self, rate_bytes_s: float, chunk: int = 256 * 1024):
        self.rate, self.chunk = rate_bytes_s, chunk
        self.sent = 0
        self.t0 = self.t1 = 0.0
        self._stop = threading.Event()
        self._server = socket.socket()
        self._server.bind(("127.0.0.1", 0))
        self._server.listen(1)
        self._threads: list[threading.Thread] = []

    def _sink(self) -> None:
        conn, _ = self._server.accept()
        with conn:
            while conn.recv(1 << 20):
                pass

    def _send(self) -> None:
        with socket.create_connection(self._server.getsockname()) as s:
            payload = b"\0" * self.chunk
            self.t0 = time.monotonic()
            while not self._stop.is_set():
                due = self.t0 + (self.sent + self.chunk) / self.rate
                delay = due - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                s.sendall(payload)
                self.sent += self.chunk
            self.t1 = time.monotonic()

    def __enter__(self) -> LoopbackTraffic:
        self._threads = [threading.Thread(target=self._sink, daemon=True), threading.Thread(target=self._send,
                                                                                              daemon=True)]
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._threads[1].join(timeout=5)
        self._server.close()

    @property
    def achieved(self) -> float:
        return self.sent / max(self.t1 - self.t0, 1e-9)
