"""`kvcap -v`: what kvcap works around (a server without /tokenize, a metrics URL that does not answer) is logged on
stderr with -v, before or after the command, and not at all without it (normal output unchanged)."""

from __future__ import annotations

import json

from tests.conftest import run_cli
from tests.ray_cluster import free_ports
from tests.servers import start_fake_server

NO_TOKENIZE = "/tokenize answered HTTP 404: not this way of counting"


def bench(url: str, out, *args: str, before: tuple[str, ...] = ()):
    return run_cli(*before, "bench", "--url", url, "--out", str(out), "--quiet", "--json", "--concurrency", "1",
                   "--requests", "4", "--input-tokens", "16", "--output-tokens", "4", "--warmup", "0s", *args)


def test_verbose_logs_the_worked_around_paths_and_quiet_does_not(tmp_path):
    dead = f"http://127.0.0.1:{free_ports(1)[0]}/metrics"  # nothing listens there
    with start_fake_server(ttft="1ms", itl="1ms", no_tokenize=True) as srv:
        quiet = bench(srv.url, tmp_path / "quiet", "--metrics-url", dead)
        before = bench(srv.url, tmp_path / "before", "--metrics-url", dead, before=("-v",))
        after = bench(srv.url, tmp_path / "after", "--metrics-url", dead, "--verbose")
    for proc in (quiet, before, after):
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert len(json.loads(proc.stdout)["levels"]) == 1
    assert "DEBUG" not in quiet.stderr and NO_TOKENIZE not in quiet.stderr
    for proc in (before, after):
        lines = proc.stderr.splitlines()
        assert any(line.startswith("kvcap: DEBUG: kvcap.loadgen.lengths: ") and NO_TOKENIZE in line
                   for line in lines), proc.stderr[-2000:]
        assert any(line.startswith("kvcap: DEBUG: kvcap.telemetry.scrape: ") and f"scrape of {dead} failed" in line
                   for line in lines), proc.stderr[-2000:]
