"""A dead or failing endpoint ends a `kvcap bench` run quickly, cheaply and with a non-zero exit — never a 100%-CPU
spin of connection errors that exits 0 (issue 11 item 8). Real HTTP over loopback to the project's test server."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from kvcap.rundir import RunDir
from kvcap.serve.app import Handler, RunningServer, make_app, start_server
from kvcap.serve.protocol import ApiConfig
from kvcap.testing.engines import FixedTimingEngine
from tests.conftest import ROOT, run_cli
from tests.servers import start_fake_server
from tests.waiting import wait_until

TINY = ("--input-tokens", "8", "--output-tokens", "4", "--warmup", "0s", "--quiet")


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released): connecting to it is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_cli(url: str, out: Path, *args: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess[str], float]:
    t0 = time.monotonic()
    proc = run_cli("bench", "--url", url, "--out", str(out), *TINY, *args, timeout=timeout)
    return proc, time.monotonic() - t0


def summary_of(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def records(out: Path) -> list[dict]:
    return RunDir(out).records() if (out / "requests.jsonl").exists() else []


# ---------------------------------------------------------------- preflight: before any load is sent

def test_dead_port_is_one_line_exit_1_within_3_s(tmp_path):
    port = closed_port()
    proc, took = bench_cli(f"http://127.0.0.1:{port}", tmp_path / "run", "--concurrency", "2", "--duration", "2s")
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"127.0.0.1:{port}" in lines[0] and "refused" in lines[0], lines[0]
    assert took < 3.0, took
    assert records(tmp_path / "run") == []  # not one request was sent, let alone thousands


def test_unresolvable_host_is_one_line_exit_1(tmp_path):
    proc, _ = bench_cli("http://no-such-host.invalid:8000", tmp_path / "run", "--concurrency", "1",
                        "--requests", "2")
    assert proc.returncode == 1, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "no-such-host.invalid" in proc.stderr, proc.stderr


def test_wrong_model_lists_the_served_models_and_sends_nothing(tmp_path):
    with start_fake_server(model_name="served-a", ttft="5ms", itl="1ms") as srv:
        proc, took = bench_cli(srv.url, tmp_path / "run", "--model", "nope", "--concurrency", "2",
                               "--duration", "2s")
        started = srv.stats()["requests_started"]
    assert proc.returncode == 1, proc.stderr
    line = proc.stderr.strip()
    assert len(line.splitlines()) == 1, line
    assert "'nope'" in line and "served-a" in line and srv.url in line, line
    assert started == 0 and took < 3.0


class NoModelsServer:
    """The project's serving front end and fixed-timing engine, minus ``/v1/models`` (some servers lack it), in a
    thread of this process: the preflight then has to send one tiny real request."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.server: RunningServer | None = None
        ready = threading.Event()

        @web.middleware
        async def no_models(request: web.Request, handler: Handler) -> web.StreamResponse:
            if request.path == "/v1/models":
                raise web.HTTPNotFound()
            return await handler(request)

        async def start() -> None:
            app = make_app(ApiConfig(model_name="only-model"), FixedTimingEngine(0.005, 0.001),
                           middlewares=[no_models])
            self.server = await start_server(app)
            ready.set()

        self.thread = threading.Thread(target=lambda: (self.loop.run_until_complete(start()), self.loop.run_forever()),
                                       daemon=True)
        self.thread.start()
        assert ready.wait(10)

    @property
    def url(self) -> str:
        assert self.server is not None
        return self.server.url

    @property
    def started(self) -> int:
        assert self.server is not None
        return self.server.state.counters.requests_started

    def close(self) -> None:
        assert self.server is not None
        asyncio.run_coroutine_threadsafe(self.server.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def no_models_server() -> Iterator[NoModelsServer]:
    srv = NoModelsServer()
    yield srv
    srv.close()


def test_without_models_listing_a_tiny_request_checks_the_model(tmp_path, no_models_server):
    proc, _ = bench_cli(no_models_server.url, tmp_path / "bad", "--model", "nope", "--concurrency", "2",
                        "--duration", "2s")
    assert proc.returncode == 1, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "404" in proc.stderr and "nope" in proc.stderr, proc.stderr
    assert no_models_server.started == 0  # the model was refused before generation: nothing started
    # the right model: the 404 on /v1/models is not fatal, the probe is one request and the run goes ahead
    proc, _ = bench_cli(no_models_server.url, tmp_path / "good", "--model", "only-model", "--concurrency", "2",
                        "--requests", "6", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["levels"][0]["ok"] == 6
    assert no_models_server.started == 6 + 1


# ---------------------------------------------------------------- during the run: back off, then stop by the rule

def test_server_failing_everything_is_stopped_by_the_error_rule(tmp_path):
    with start_fake_server(ttft="5ms", itl="1ms", fault=["http_500:every=1"]) as srv:
        proc, took = bench_cli(srv.url, tmp_path / "run", "--concurrency", "4", "--duration", "30s", timeout=25)
        sent = srv.stats()["requests_started"]
    assert proc.returncode == 1, proc.stderr
    assert took < 15, took
    s = summary_of(tmp_path / "run")
    stopped = s["stopped"]
    assert stopped["level"] == 4 and stopped["mode"] == "concurrency" and stopped["errors"] >= 45
    assert stopped["error_classes"] == {"http_5xx": stopped["errors"]}
    assert "stopped" in proc.stderr and "http_5xx" in proc.stderr and "Traceback" not in proc.stderr
    assert s["failed"] and "no request succeeded" in s["failed"]
    # each user backs off (10 ms, doubling, 1 s cap) instead of re-sending at once: the window of 50 fills in a few
    # seconds with at most a few requests more than it, and the client stays mostly idle
    assert 50 <= sent <= 50 + 4 * 2, sent
    assert s["client"]["cpu_fraction_max"] < 0.5, s["client"]
    level = s["levels"][0]
    assert level["ok"] == 0 and level["errors"] == sent
    # analysed again later, the run still says why it failed (and keeps it in summary.json)
    again = run_cli("analyze", str(tmp_path / "run"))
    assert again.returncode == 0 and "stopped" in again.stderr and "http_5xx" in again.stderr, again.stderr
    assert summary_of(tmp_path / "run")["failed"] == s["failed"]


def test_open_loop_against_a_failing_server_stops_by_the_rule(tmp_path):
    with start_fake_server(ttft="5ms", itl="1ms", fault=["http_500:every=1"]) as srv:
        proc, took = bench_cli(srv.url, tmp_path / "run", "--rate", "40", "--arrival", "constant",
                               "--duration", "30s", timeout=25)
        sent = srv.stats()["requests_started"]
    assert proc.returncode == 1, proc.stderr
    s = summary_of(tmp_path / "run")
    # the schedule is kept (arrivals are the independent variable): 50 failures at 40/s take ~1.25 s
    assert s["stopped"]["mode"] == "rate" and 50 <= sent <= 55 and took < 10, (sent, took)
    level = s["levels"][0]
    assert level["achieved_rate"] == pytest.approx(40, rel=0.15)  # over the window that ran, not the planned one


def test_server_dying_mid_run_stops_the_run_without_spinning(tmp_path):
    srv = start_fake_server(ttft="20ms", itl="5ms")
    try:
        out = tmp_path / "run"
        proc = subprocess.Popen([sys.executable, "-m", "kvcap", "bench", "--url", srv.url, "--out", str(out), *TINY,
                                 "--concurrency", "8,16", "--duration", "30s"], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # the run is under way, well inside level 8's 30 s, when the server dies
        assert wait_until(lambda: proc.poll() is not None or srv.stats()["requests_finished"] >= 50, 25)
        assert proc.poll() is None, proc.communicate()[1]
        served = srv.stats()["requests_finished"]
        killed_at = time.monotonic()
    finally:
        srv.stop()
    _, err = proc.communicate(timeout=30)
    stopped_in = time.monotonic() - killed_at
    assert proc.returncode == 1, err
    s = summary_of(out)
    assert s["stopped"]["level"] == 8 and [lv["level"] for lv in s["levels"]] == [8]  # level 16 never ran
    assert s["stopped"]["error_classes"].keys() <= {"connection", "http_5xx"}
    assert "no request succeeded" not in (s["failed"] or "")
    assert s["levels"][0]["ok"] >= served - 8 > 0
    failed = [r for r in records(out) if not r["ok"] and r["error"] != "cancelled"]
    assert 45 <= len(failed) <= 50 + 8 * 2, len(failed)
    assert stopped_in < 10, stopped_in
    assert s["client"]["cpu_fraction_max"] < 0.5, s["client"]
    assert "stopped" in err and "Traceback" not in err, err


def test_a_few_faults_do_not_trip_the_default_rule(tmp_path):
    faults = ["http_500:every=5,offset=1", "reset:every=7,offset=3"]
    with start_fake_server(ttft="5ms", itl="1ms", fault=faults) as srv:
        proc, _ = bench_cli(srv.url, tmp_path / "run", "--concurrency", "4", "--requests", "140", "--json")
    assert proc.returncode == 0, proc.stderr
    s = json.loads(proc.stdout)
    assert s["stopped"] is None and s["failed"] is None
    level = s["levels"][0]
    assert level["requests"] == 140 and 0.25 <= level["error_rate"] <= 0.40


def test_error_rule_can_be_tightened_or_switched_off(tmp_path):
    with start_fake_server(ttft="5ms", itl="1ms", fault=["http_500:every=2"]) as srv:
        tight, _ = bench_cli(srv.url, tmp_path / "tight", "--concurrency", "4", "--requests", "200",
                             "--max-error-rate", "40%", "--error-window", "20")
        off, _ = bench_cli(srv.url, tmp_path / "off", "--concurrency", "4", "--requests", "60",
                           "--max-error-rate", "off", "--json")
    assert tight.returncode == 1, tight.stderr
    stopped = summary_of(tmp_path / "tight")["stopped"]
    assert stopped["window"] == 20 and stopped["errors"] >= 8 and stopped["max_error_rate"] == 0.4
    assert off.returncode == 0, off.stderr
    assert json.loads(off.stdout)["levels"][0]["requests"] == 60


@pytest.mark.parametrize(("args", "fragment"), [
    (["--max-error-rate", "150%"], "between 0 and 1"),
    (["--max-error-rate", "0"], "--max-error-rate"),
    (["--error-window", "0"], "positive integer"),
])
def test_error_rule_bad_input(tmp_path, args, fragment):
    p = run_cli("bench", "--url", "http://127.0.0.1:9", "--concurrency", "1", "--out", str(tmp_path / "x"), *args)
    assert p.returncode == 2, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and fragment in p.stderr, p.stderr


def test_workers_stop_together_when_one_trips(tmp_path):
    with start_fake_server(ttft="5ms", itl="1ms", fault=["http_500:every=1"]) as srv:
        proc, took = bench_cli(srv.url, tmp_path / "run", "--workers", "2", "--concurrency", "8,16",
                               "--duration", "30s", timeout=30)
    assert proc.returncode == 1, proc.stderr
    s = summary_of(tmp_path / "run")
    assert s["stopped"]["level"] == 8 and [lv["level"] for lv in s["levels"]] == [8]
    assert took < 20 and "Traceback" not in proc.stderr, (took, proc.stderr)


@pytest.mark.llamacpp
def test_llamacpp_serves_a_model_it_does_not_list(tmp_path):
    """llama.cpp lists its one model under the file's path yet answers any name: the listing alone must not refuse
    it; the 1-token request decides (and the manifest says so)."""
    from tests.llamacpp import llama_server
    from tests.tiny_gguf import write_tiny_llama_gguf

    gguf = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    with llama_server(gguf, parallel=2, ctx_size=2 * 256) as url:
        proc, _ = bench_cli(url, tmp_path / "run", "--model", "any-name", "--concurrency", "2", "--requests", "4",
                            timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    server = RunDir(tmp_path / "run").manifest.server
    assert "any-name" not in server["models"] and server["preflight"]["check"] == "1-token request"
    assert server["preflight"]["status"] == 200 and "accepted" in server["preflight"]["note"]
    assert all(r["ok"] for r in records(tmp_path / "run"))


def _experiment(tmp_path: Path, url_a: str, url_b: str) -> Path:
    import yaml

    exp = {"name": "dead", "arms": [{"name": "a", "url": url_a, "vary": {"serving.x": 1}},
                                    {"name": "b", "url": url_b, "vary": {"serving.x": 2}}],
           "load": {"concurrency": [4], "warmup": "0s", "duration": "20s"},
           "workload": {"input_tokens": 8, "output_tokens": 4}}
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(exp))
    return path


def test_ab_with_a_dead_arm_is_one_line_exit_1(tmp_path):
    path = _experiment(tmp_path, f"http://127.0.0.1:{closed_port()}", f"http://127.0.0.1:{closed_port()}")
    p = run_cli("ab", str(path), "--out", str(tmp_path / "ab"), "--quiet", timeout=30)
    assert p.returncode == 1 and len(p.stderr.strip().splitlines()) == 1 and "cannot reach" in p.stderr, p.stderr


def test_ab_stops_when_an_arm_fails_as_a_whole(tmp_path):
    with start_fake_server(ttft="5ms", itl="1ms", fault=["http_500:every=1"]) as bad, \
            start_fake_server(ttft="5ms", itl="1ms") as good:
        path = _experiment(tmp_path, bad.url, good.url)
        p = run_cli("ab", str(path), "--out", str(tmp_path / "ab"), "--quiet", timeout=40)
        b_started = good.stats()["requests_started"]
    assert p.returncode == 1, p.stderr
    line = p.stderr.strip()
    assert len(line.splitlines()) == 1 and "arm a, repeat 0: stopped at concurrency 4" in line, line
    assert b_started == 0 and not (tmp_path / "ab" / "compare.json").exists()  # no verdict on a broken arm
    assert summary_of(tmp_path / "ab" / "a")["stopped"]["error_classes"] == {"http_5xx": 50}


def test_backoff_and_rule_arithmetic():
    from kvcap.loadgen.guard import ErrorRule, backoff_s

    assert [backoff_s(k) for k in range(10)] == [0.0, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.0, 1.0]
    assert backoff_s(10_000) == 1.0
    watch = ErrorRule(max_error_rate=0.9, window=10).watch()
    ok, bad, ours = {"ok": True, "error": None}, {"ok": False, "error": "connection"}, {"ok": False,
                                                                                          "error": "cancelled"}
    assert not any(watch.add(r) for r in [bad] * 8 + [ok] + [ours] * 20)  # 8 of 9 counted: window not full
    assert watch.add(bad)  # 9 of the last 10 failed: 90%
    v = watch.verdict("concurrency", 4, 0, 1.5)
    assert v["errors"] == 9 and v["error_classes"] == {"connection": 9} and "9 of the last 10" in v["reason"]
    assert not ErrorRule(max_error_rate=None, window=10).watch().add(bad)


def test_a_dead_endpoint_keeps_the_run_that_overwrite_would_replace(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "requests.jsonl").write_text('{"kept": true}\n')
    p = run_cli("bench", "--url", "http://127.0.0.1:1", "--concurrency", "1", "--requests", "1", "--out", str(out),
                "--overwrite", "--quiet")
    assert p.returncode == 1
    assert (out / "requests.jsonl").read_text() == '{"kept": true}\n'
