"""Start the fake LLM server (kvcap.testing.server) in a subprocess, so it never shares the client's loop or GIL.

    with start_fake_server(ttft="50ms", itl="20ms", fault=["reset:every=2"]) as srv:
        srv.url        # http://127.0.0.1:PORT
        srv.stats()    # GET /stats as a dict

Keyword options map to CLI flags (``tokens_per_chunk=4`` → ``--tokens-per-chunk 4``; ``True`` → bare flag;
``False``/``None`` → omitted; a list or tuple → the flag repeated). The process is started and stopped by
kvcap.procs (its own process group; stopped at the latest when the interpreter exits).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcap import procs

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 20.0
STOP_GRACE_S = 5.0
LISTENING = r"^listening on (http://\S+)\s*$"


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

    def __init__(self, process: procs.Process, url: str, stderr_path: str, args: list[str]) -> None:
        self.process, self.url, self.args = process, url, args
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

    def stop(self, timeout: float = STOP_GRACE_S) -> None:
        """SIGTERM, then SIGKILL if it lingers past ``timeout``; idempotent."""
        self.process.stop(grace_s=timeout)
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
    os.close(fd)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    process = procs.start([sys.executable, "-m", "kvcap.testing.server", "--port", "0", *args],
                          name=f"fake server {args}", log=Path(stderr_path), pipe_stdout=True, cwd=ROOT, env=env,
                          grace_s=STOP_GRACE_S)
    server = FakeServer(process, "", stderr_path, args)
    try:
        server.url = process.wait_for_line(LISTENING, START_TIMEOUT_S).group(1)
    except BaseException:  # StartError (it says why, with the server's stderr tail) or an interrupt
        server.stop()
        raise
    return server


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
