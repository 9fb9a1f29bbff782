"""Start the fake LLM server (kvcap.testing.server) in a subprocess, so it never shares the client's loop or GIL.

    with start_fake_server(ttft="50ms", itl="20ms", fault=["reset:every=2"]) as srv:
        srv.url        # http://127.0.0.1:PORT
        srv.stats()    # GET /stats as a dict

Keyword options map to CLI flags (``tokens_per_chunk=4`` → ``--tokens-per-chunk 4``; ``True`` → bare flag;
``False``/``None`` → omitted; a list or tuple → the flag repeated). Every started process is killed at the
latest when the interpreter exits.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 20.0

_live: set[FakeServer] = set()


def server_args(**options: Any) -> list[str]:
    """Keyword options → CLI arguments for ``python -m kvcap.testing.server``."""
    args: list[str] = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            args.append(flag)
        elif isinstance(value, (list, tuple)):
            for v in value:
                args.extend((flag, str(v)))
        else:
            args.extend((flag, str(value)))
    return args


class FakeServer:
    """A running fake-server subprocess: its base URL, its counters, and a stop that always kills."""

    def __init__(self, proc: subprocess.Popen[str], url: str, stderr_path: str, args: list[str]) -> None:
        self.proc, self.url, self.args = proc, url, args
        self._stderr_path = stderr_path

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def get(self, path: str, timeout: float = 5.0) -> bytes:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            return r.read()

    def stats(self) -> dict[str, Any]:
        """GET /stats. Blocking; from async code it stalls the loop for about a millisecond."""
        return json.loads(self.get("/stats"))

    def metrics(self) -> str:
        return self.get("/metrics").decode()

    def stderr(self) -> str:
        try:
            return Path(self._stderr_path).read_text(errors="replace")
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL if it lingers; idempotent."""
        _live.discard(self)
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        with contextlib.suppress(OSError):
            os.unlink(self._stderr_path)

    def __enter__(self) -> FakeServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"FakeServer({self.url}, args={self.args})"


def start_fake_server(**options: Any) -> FakeServer:
    """Start ``python -m kvcap.testing.server --port 0 …`` and wait for its ``listening on`` line."""
    args = server_args(**options)
    fd, stderr_path = tempfile.mkstemp(prefix="kvcap-fake-", suffix=".stderr")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    with os.fdopen(fd, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "kvcap.testing.server", "--port", "0", *args],
                                stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, text=True,
                                cwd=ROOT, env=env)
    server = FakeServer(proc, "", stderr_path, args)
    _live.add(server)
    assert proc.stdout is not None
    deadline = time.monotonic() + START_TIMEOUT_S
    line = ""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.1)
        if ready:
            line = proc.stdout.readline()
            break
        if proc.poll() is not None:
            break
    if not line.startswith("listening on http://"):
        stderr = server.stderr()
        server.stop()
        raise RuntimeError(f"fake server {args} did not start (got {line!r}): {stderr[-2000:]}")
    server.url = line.strip().removeprefix("listening on ")
    return server


@atexit.register
def _kill_all() -> None:
    for server in list(_live):
        with contextlib.suppress(Exception):
            server.stop(timeout=2.0)


@pytest.fixture
def fake_server() -> Iterator[Callable[..., FakeServer]]:
    """Factory fixture: ``srv = fake_server(ttft="10ms")``; every server it started is stopped at teardown."""
    started: list[FakeServer] = []

    def _start(**options: Any) -> FakeServer:
        srv = start_fake_server(**options)
        started.append(srv)
        return srv

    yield _start
    for srv in started:
        srv.stop()
