"""A counter's increase per level, read through ``kvcap bench``, adds up to the server counter's rise over the run.

The test server's exact prefix cache behind a shared-prefix workload at concurrency 1 then 2: bench samples
``vllm:prefix_cache_hits_total`` about once a second, and each level's ``prefix_reuse.hbm_hit_tokens`` is the
counter's increase over the level's window, its value at each edge interpolated between the samples either side
(``counter_increase``). Summed over the levels, which follow one another, it must come within 5% of the rise read
off the server's /metrics before and after the run — the samples inside each window alone lose up to a sampling
interval at each edge, a large share of windows a few seconds long.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from kvcap.analysis.counter_increase import window_increases
from kvcap.analysis.telemetry import read_telemetry
from kvcap.rundir import RunDir
from tests import servers
from tests.conftest import run_cli
from tests.servers import FakeServer

fake_server = servers.fake_server  # the factory fixture

HITS = "vllm:prefix_cache_hits_total"


def _counter(srv: FakeServer, name: str) -> float:
    """The sum over a family's series on the server's /metrics page."""
    text = srv.get("/metrics").decode()
    values = [float(v) for v in re.findall(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)]
    assert values, f"no {name} on /metrics"
    return sum(values)


def test_levels_hbm_hits_add_up_to_the_counters_rise(fake_server: Callable[..., FakeServer], tmp_path: Path) -> None:
    srv = fake_server(prefix_cache_blocks=256, block_size=16)
    out = tmp_path / "run"
    before = _counter(srv, HITS)
    p = run_cli("bench", "--url", srv.url, "--prefix-tokens", "64", "--prefix-groups", "2", "--input-tokens", "40",
                "--output-tokens", "8", "--concurrency", "1,2", "--requests", "30", "--warmup", "0s",
                "--metrics-url", srv.url + "/metrics", "--out", str(out), "--quiet", "--json", timeout=300)
    assert p.returncode == 0, p.stderr
    rise = _counter(srv, HITS) - before
    assert rise > 0  # the groups' system prompts were found

    levels = json.loads((out / "summary.json").read_text())["levels"]
    assert [lv["level"] for lv in levels] == [1, 2]
    assert all(lv["prefix_reuse"]["source"] == "telemetry" for lv in levels)
    summed = sum(lv["prefix_reuse"]["hbm_hit_tokens"] for lv in levels)

    # what the samples inside each window alone give (the rule this replaces), to show the edges matter here
    run = RunDir(out)
    windows = [(lv.measure_start_s, lv.measure_end_s) for lv in run.levels()]
    t, v = read_telemetry(run).arrays("server.prefix_cache_hits_total")
    inside_only = sum(float(v[(t >= t0) & (t <= t1)][-1] - v[(t >= t0) & (t <= t1)][0]) for t0, t1 in windows)
    figures = f"levels summed {summed}, counter rise {rise} (before {before}), inside samples only {inside_only}"
    assert abs(summed - rise) <= 0.05 * rise, figures
    assert summed == pytest.approx(sum(x or 0.0 for x in window_increases(t, v, windows)), abs=0.01)
    assert inside_only < summed, figures
