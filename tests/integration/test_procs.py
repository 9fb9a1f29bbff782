"""kvcap.procs with real processes: small ``python -c`` scripts that print a line, serve HTTP, listen on a port,
ignore SIGTERM, die early or leave children behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvcap.procs import StartError, free_port, log_tail, one_line, start, terminate
from tests.conftest import ROOT

PY = sys.executable


def script(code: str) -> list[str]:
    return [PY, "-c", textwrap.dedent(code)]


def gone(pid: int, within_s: float = 5.0) -> bool:
    """Whether ``pid`` has no live process (absent, or a zombie nobody reaped yet) within ``within_s``."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.02)
    return False


def test_one_line_and_log_tail(tmp_path):
    assert one_line("a\n\n  b  \nc\n") == "last output: a | b | c"
    assert one_line("\n \n") == "no output"
    assert one_line("\n".join(f"l{i}" for i in range(1, 8))) == "last output: l3 | l4 | l5 | l6 | l7"
    assert one_line("x" * 900, chars=10) == "last output: …" + "x" * 10
    log = tmp_path / "log"
    log.write_text("".join(f"line {i}\n" for i in range(30)))
    assert log_tail(log) == "\n".join(f"line {i}" for i in range(10, 30))
    assert log_tail(log, lines=2) == "line 28\nline 29"
    assert log_tail(tmp_path / "absent", missing="<no log>") == "<no log>"


def test_free_port_can_be_bound():
    import socket

    port = free_port()
    assert 1024 <= port <= 65535
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_ready_line_and_sigterm_stop():
    code = """
        import time
        print("loading weights", flush=True)
        time.sleep(0.2)
        print("listening on http://127.0.0.1:4321", flush=True)
        time.sleep(60)
    """
    with start(script(code), pipe_stdout=True) as proc:
        m = proc.wait_for_line(r"listening on (http://\S+)", timeout_s=20)
        assert m.group(1) == "http://127.0.0.1:4321"
        assert proc.alive() and proc.returncode is None
    assert proc.returncode == -15  # SIGTERM ended it, within the grace
    assert gone(proc.pid)


def test_shell_string_runs_in_a_shell(tmp_path):
    with start("echo $((6 * 7)); sleep 60", pipe_stdout=True) as proc:
        assert proc.wait_for_line(r"^\d+$", timeout_s=10).group(0) == "42"
        assert proc.name == "echo"


def test_http_ready_only_once_it_answers_200(tmp_path):
    """The server answers 503 three times, then 200: the wait asks four times and returns."""
    port = free_port()
    code = f"""
        import http.server
        asked = 0
        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                global asked
                if self.path == "/asked":
                    body = str(asked).encode()
                else:
                    asked += 1
                    body = b"loading" if asked <= 3 else b"ok"
                self.send_response(503 if self.path == "/health" and asked <= 3 else 200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            def log_message(self, *a):
                pass
        http.server.HTTPServer(("127.0.0.1", {port}), H).serve_forever()
    """
    import urllib.request

    with start(script(code), log=tmp_path / "server.log") as proc:
        proc.wait_for_http(f"http://127.0.0.1:{port}/health", timeout_s=20, interval_s=0.05)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/asked", timeout=5) as r:
            assert r.read() == b"4"


def test_port_ready_once_it_listens():
    port = free_port()
    code = f"""
        import socket, time
        time.sleep(0.4)
        s = socket.socket()
        s.bind(("127.0.0.1", {port}))
        s.listen()
        time.sleep(60)
    """
    with start(script(code)) as proc:
        t0 = time.monotonic()
        proc.wait_for_port(port, timeout_s=20)
        assert time.monotonic() - t0 >= 0.3  # it waited for the bind, not for the process


def test_ignoring_sigterm_gets_sigkill_after_the_grace():
    code = """
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ready", flush=True)
        time.sleep(60)
    """
    proc = start(script(code), pipe_stdout=True, grace_s=0.5)
    proc.wait_for_line("^ready$", timeout_s=20)
    t0 = time.monotonic()
    assert proc.stop() == -9
    took = time.monotonic() - t0
    assert 0.45 <= took < 4.0, took
    assert proc.stop() == -9  # idempotent: nothing signalled again, same answer
    assert gone(proc.pid)


def test_early_death_reports_exit_code_and_output_tail(tmp_path):
    code = """
        import sys, time
        print("starting up", flush=True)
        print("error: config.yaml missing", file=sys.stderr, flush=True)
        sys.exit(3)
    """
    log = tmp_path / "server.log"
    url = f"http://127.0.0.1:{free_port()}/health"
    t0 = time.monotonic()
    with pytest.raises(StartError) as info:
        start(script(code), name="my-server", log=log).wait_for_http(url, 30)
    assert time.monotonic() - t0 < 10  # noticed the death, did not sit out the timeout
    err = info.value
    assert err.returncode == 3 and err.log == log
    assert str(err) == (f"my-server exited with code 3 while waiting for {url} answering 200; "
                        "last output: starting up | error: config.yaml missing")
    assert err.tail == "starting up\nerror: config.yaml missing"


def test_not_ready_in_time_is_stopped_and_reported(tmp_path):
    code = """
        import time
        print("still loading", flush=True)
        time.sleep(60)
    """
    proc = start(script(code), name="slow", log=tmp_path / "log")
    port = free_port()
    with pytest.raises(StartError) as info:
        proc.wait_for_port(port, timeout_s=0.5)
    assert info.value.returncode is None
    assert str(info.value) == (f"slow not ready after 0.5 s (waiting for 127.0.0.1:{port} accepting connections); "
                               "last output: still loading")
    assert proc.returncode == -15 and gone(proc.pid)


def test_line_wait_when_it_exits_without_the_line():
    code = """
        print("usage: server --port N")
        raise SystemExit(2)
    """
    with pytest.raises(StartError) as info:
        start(script(code), name="srv", pipe_stdout=True).wait_for_line("^listening on ", timeout_s=20)
    assert info.value.returncode == 2
    assert str(info.value) == ("srv exited with code 2 while waiting for a stdout line matching '^listening on '; "
                               "last output: usage: server --port N")


def test_line_wait_needs_a_pipe():
    with start(script("import time; time.sleep(60)")) as proc, pytest.raises(ValueError, match="pipe_stdout"):
        proc.wait_for_line("x", timeout_s=1)


def test_the_whole_group_dies_with_a_shell():
    with start("sleep 60 & echo $!; wait", pipe_stdout=True, grace_s=5) as proc:
        child = int(proc.wait_for_line(r"^\d+$", timeout_s=10).group(0))
        assert not gone(child, within_s=0.2)
    assert gone(child) and gone(proc.pid)


def test_children_left_by_an_exited_shell_die_at_stop():
    proc = start("sleep 60 & echo $!", pipe_stdout=True)
    child = int(proc.wait_for_line(r"^\d+$", timeout_s=10).group(0))
    assert proc.wait(10) == 0  # the shell is done; its child is still in the group
    assert not gone(child, within_s=0.2)
    assert proc.stop() == 0
    assert gone(child)


def test_a_group_whose_leader_was_reaped_elsewhere_is_not_signalled():
    """Once someone else reaped the leader its pid may be reused, so stop must not signal that group id."""
    proc = start("sleep 60 & echo $!", pipe_stdout=True)
    child = int(proc.wait_for_line(r"^\d+$", timeout_s=10).group(0))
    try:
        assert proc.popen.wait(10) == 0  # reaped behind procs' back
        assert proc.stop() == 0
        assert not gone(child, within_s=0.3)
    finally:
        os.kill(child, signal.SIGKILL)
    assert gone(child)


def test_stop_leaves_other_processes_alone():
    bystander = subprocess.Popen([PY, "-c", "import time; time.sleep(60)"], stdin=subprocess.DEVNULL)
    try:
        with start("sleep 60", grace_s=1):
            pass
        assert bystander.poll() is None
    finally:
        terminate(bystander)
    assert bystander.returncode == -15


def test_appending_log_keeps_earlier_runs(tmp_path):
    log = tmp_path / "arm.server.log"
    for run in (1, 2):
        proc = start(script(f"print('run {run}')"), log=log, append=True)
        assert proc.wait(20) == 0
        proc.stop()
    assert log.read_text() == "run 1\nrun 2\n"
    proc = start(script("print('fresh')"), log=log)
    proc.wait(20)
    proc.stop()
    assert log.read_text() == "fresh\n"


def test_processes_left_running_are_stopped_at_interpreter_exit(tmp_path):
    code = """
        from kvcap.procs import start
        proc = start(["sleep", "60"])
        print(proc.pid, flush=True)
    """
    root = ROOT
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(root), os.environ.get("PYTHONPATH"))))}
    out = subprocess.run(script(code), capture_output=True, text=True, timeout=60, env=env, cwd=root)
    assert out.returncode == 0, out.stderr
    assert gone(int(out.stdout))
