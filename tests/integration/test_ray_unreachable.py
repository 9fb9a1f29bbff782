"""`bench --ray` and `search --ray` against an address where no Ray head answers: both exit 1 (an endpoint that
cannot serve the run, as a dead --url) with one line, within seconds — whether nothing listens there, a web server
does (ray.init alone would retry it for minutes), or a port accepts and never answers."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tests.conftest import ROOT, run_cli
from tests.ray_cluster import free_ports, needs_ray
from tests.servers import start_fake_server

SCENARIO = ROOT / "scenarios" / "seed-reference.yaml"


@contextmanager
def silent_port() -> Iterator[int]:
    """A port that accepts connections and never says a word."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield s.getsockname()[1]


def bench_ray(url: str, address: str, out) -> tuple[object, float]:
    t0 = time.monotonic()
    p = run_cli("bench", "--url", url, "--concurrency", "1", "--requests", "2", "--out", str(out), "--ray", address,
                timeout=60)
    return p, time.monotonic() - t0


def search_ray(address: str, out) -> tuple[object, float]:
    t0 = time.monotonic()
    p = run_cli("search", str(SCENARIO), "--grid", "model.kv_dtype=fp16,fp8", "--ray", address, "--out", str(out),
                timeout=60)
    return p, time.monotonic() - t0


@needs_ray
@pytest.mark.parametrize("listener", ["nothing", "web server", "silent"])
def test_no_ray_head_is_exit_1_in_one_line_for_bench_and_search(tmp_path, listener):
    with start_fake_server(ttft="1ms", itl="1ms") as srv, silent_port() as quiet:
        address = {"nothing": f"127.0.0.1:{free_ports(1)[0]}", "web server": f"127.0.0.1:{srv.port}",
                   "silent": f"127.0.0.1:{quiet}"}[listener]
        why = {"nothing": "Connection refused", "web server": "something listens there, but not a Ray head",
               "silent": "no answer within 5 s"}[listener]
        bench, bench_s = bench_ray(srv.url, address, tmp_path / "bench")
        search, search_s = search_ray(address, tmp_path / "search")
    for proc, took, command in ((bench, bench_s, "bench"), (search, search_s, "search")):
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-2000:]
        assert lines[0].startswith(f"kvcap {command}: error: cannot reach the Ray cluster at {address}: {why}")
        assert took < 30, took
    assert not (tmp_path / "bench" / "manifest.json").exists() and not (tmp_path / "search").exists()
