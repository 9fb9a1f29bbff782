"""Start a child process, wait until it is ready, stop it — one way, for ``kvcap ab``'s server commands and for the
test and benchmark helpers that run servers and clients.

A process is started in its own session, hence its own process group, so stopping it reaches everything it spawned
(a shell's children too) and nothing else: SIGTERM to the group, a grace period for the leader to exit, then SIGKILL
to whatever is left, then the leader is reaped. Until then the leader is never reaped (its exit is only peeked at),
so the group id cannot have been reused by an unrelated process when it is signalled.

Ready means a line on stdout matching a pattern, an HTTP URL answering 200, or a TCP port accepting connections. A
process that dies first, or is not ready in time, is stopped and reported by :class:`StartError`: one line with its
exit code and the tail of its output.

    with start([sys.executable, "-m", "kvcap.testing.server", "--port", "0"], pipe_stdout=True) as proc:
        url = proc.wait_for_line(r"listening on (\\S+)", timeout_s=20).group(1)
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import http.client
import os
import re
import select
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, NoReturn

KILL_WAIT_S = 5.0
"""How long the leader gets to vanish after SIGKILL before ``stop`` gives up waiting for it."""
TAIL_LINES = 20
ONE_LINE_TAIL = 5
"""Lines of output an error message carries (joined on one line)."""

_live: set[Process] = set()
"""Started and not yet stopped; stopped at the latest when the interpreter exits."""


class StartError(RuntimeError):
    """A process died, or was not ready in time, while being waited for. It has been stopped."""

    def __init__(self, name: str, reason: str, returncode: int | None, tail: str, log: Path | None) -> None:
        self.name, self.reason, self.returncode, self.tail, self.log = name, reason, returncode, tail, log
        super().__init__(f"{name} {reason}; {one_line(tail)}")


def one_line(tail: str, lines: int = ONE_LINE_TAIL, chars: int = 800) -> str:
    """The last non-empty lines of some output on one line (``a | b | c``), for an error message."""
    kept = [ln.strip() for ln in tail.splitlines() if ln.strip()][-lines:]
    if not kept:
        return "no output"
    text = " | ".join(kept)
    return "last output: " + (text if len(text) <= chars else "…" + text[-chars:])


def log_tail(path: Path, lines: int = TAIL_LINES, missing: str = "") -> str:
    """The last ``lines`` lines of a log file, or ``missing`` when it cannot be read."""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return missing


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (another process may take it before the caller binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def answers_200(url: str, timeout_s: float = 2.0) -> bool:
    """Whether ``GET url`` answers 200 (errors, refusals and other statuses: no)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status == 200
    except (OSError, http.client.HTTPException):
        return False


def accepts(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """Whether ``host:port`` accepts a TCP connection."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def start(command: Sequence[str] | str, *, name: str | None = None, log: Path | None = None, append: bool = False,
          pipe_stdout: bool = False, env: Mapping[str, str] | None = None, cwd: Path | str | None = None,
          grace_s: float = 10.0) -> Process:
    """Start ``command`` (an argv list, or a string run by ``/bin/sh``) in its own process group.

    Output goes to ``log`` (stdout and stderr; appended to with ``append``) or nowhere; with ``pipe_stdout`` stdout
    is a pipe for :meth:`Process.wait_for_line` and only stderr goes to ``log``. stdin is ``/dev/null``. ``grace_s``
    is how long :meth:`Process.stop` waits after SIGTERM before SIGKILL.
    """
    shell = isinstance(command, str)
    argv: str | list[str] = command if isinstance(command, str) else list(command)
    first = (command.split() or ["sh"])[0] if isinstance(command, str) else Path(argv[0]).name
    out: IO[bytes] | int = subprocess.DEVNULL
    if log is not None:
        out = open(log, "ab" if append else "wb")  # noqa: SIM115 - the child holds its own copy once started
    try:
        popen = subprocess.Popen(argv, shell=shell, stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE if pipe_stdout else out,
                                 stderr=out if pipe_stdout else subprocess.STDOUT,
                                 env=dict(env) if env is not None else None, cwd=cwd, start_new_session=True)
    finally:
        if not isinstance(out, int):
            out.close()
    return Process(popen, name or first, log, grace_s)


def terminate(popen: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Stop a process the caller started itself without :func:`start` (not in a group of its own): SIGTERM, then
    SIGKILL if it is still there after ``grace_s``. Only that process is signalled."""
    if popen.poll() is not None:
        return
    popen.terminate()
    try:
        popen.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        popen.kill()
        popen.wait(timeout=KILL_WAIT_S)


def _peek_exit(pid: int) -> int | None:
    """The exit code of an exited, not yet reaped child (``-N`` for signal N), without reaping it; None if running.
    Raises ChildProcessError when it has been reaped already."""
    info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


class Process(contextlib.AbstractContextManager["Process"]):
    """A started process group: readiness waits, the leader's exit code, and an idempotent stop. A context manager
    (``with start(...) as proc:``) that stops it on exit."""

    def __init__(self, popen: subprocess.Popen[bytes], name: str, log: Path | None, grace_s: float) -> None:
        self.popen, self.name, self.log, self.grace_s = popen, name, log, grace_s
        self._stopped = False
        self._stdout_tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._pending = b""
        self._exit_fd: int | None = None
        with contextlib.suppress(AttributeError, OSError):  # Linux ≥ 5.3: wake up the moment it exits
            self._exit_fd = os.pidfd_open(popen.pid)
        _live.add(self)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        """The leader's exit code once it has exited (``-N``: killed by signal N), else None."""
        if self.popen.returncode is not None or not hasattr(os, "waitid"):
            return self.popen.poll()
        try:
            return _peek_exit(self.popen.pid)
        except ChildProcessError:  # reaped by someone else
            return self.popen.poll()

    def alive(self) -> bool:
        return self.returncode is None

    def wait(self, timeout_s: float) -> int | None:
        """Wait up to ``timeout_s`` for the leader to exit (without reaping it); its exit code, or None."""
        deadline = time.monotonic() + timeout_s
        while (rc := self.returncode) is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            if self._exit_fd is not None:
                select.select([self._exit_fd], [], [], remaining)
            else:
                time.sleep(min(remaining, 0.02))
        return rc

    # ---------------------------------------------------------------------------------------------------- readiness

    def wait_for_line(self, pattern: str | re.Pattern[str], timeout_s: float) -> re.Match[str]:
        """Read stdout (``pipe_stdout=True``) until a line matches ``pattern`` (``re.search``); the match."""
        if self.popen.stdout is None:
            raise ValueError(f"{self.name}: wait_for_line needs start(..., pipe_stdout=True)")
        regex = re.compile(pattern)
        what = f"a stdout line matching {regex.pattern!r}"
        fd = self.popen.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._fail(what, timeout_s)
            if not select.select([fd], [], [], min(remaining, 0.1))[0]:
                continue
            chunk = os.read(fd, 1 << 16)
            lines = self._take_lines(chunk)
            for line in lines:
                if m := regex.search(line):
                    return m
            # stdout closed: it is exiting (or will never print the line)
            if not chunk and self.wait(max(0.0, deadline - time.monotonic())) is not None:
                self._fail(what, timeout_s)

    def _take_lines(self, chunk: bytes) -> list[str]:
        """Complete lines from what stdout gave so far (all of it once ``chunk`` is empty: end of file)."""
        self._pending += chunk
        *raw, self._pending = self._pending.split(b"\n")
        if not chunk and self._pending:
            raw.append(self._pending)
            self._pending = b""
        lines = [r.decode(errors="replace").rstrip("\r") for r in raw]
        self._stdout_tail.extend(lines)
        return lines

    def wait_for_http(self, url: str, timeout_s: float, *, interval_s: float = 0.1) -> None:
        """Poll ``GET url`` until it answers 200."""
        self._poll_until(lambda: answers_200(url), timeout_s, interval_s, f"{url} answering 200")

    def wait_for_port(self, port: int, timeout_s: float, *, host: str = "127.0.0.1", interval_s: float = 0.1) -> None:
        """Poll ``host:port`` until it accepts a TCP connection."""
        self._poll_until(lambda: accepts(host, port), timeout_s, interval_s, f"{host}:{port} accepting connections")

    def _poll_until(self, ready: Callable[[], bool], timeout_s: float, interval_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.returncode is not None:  # before asking: something else may answer on its port
                self._fail(what, timeout_s)
            if ready():
                return
            self.wait(interval_s)
        self._fail(what, timeout_s)

    def _fail(self, what: str, timeout_s: float) -> NoReturn:
        rc = self.returncode
        if rc is not None:
            reason = f"exited with code {rc} while waiting for {what}"
        else:
            reason = f"not ready after {timeout_s:g} s (waiting for {what})"
        tail = log_tail(self.log) if self.log is not None else ""
        if self._stdout_tail:
            tail = "\n".join([*self._stdout_tail, tail]).strip("\n")
        self.stop()
        raise StartError(self.name, reason, rc, tail, self.log)

    # --------------------------------------------------------------------------------------------------------- stop

    def _group_is_ours(self) -> bool:
        """Whether the leader is still unreaped (running, or exited and waiting to be reaped): then its pid, which is
        the group's id, cannot have been given to another process."""
        if self.popen.returncode is not None:
            return False
        if not hasattr(os, "waitid"):
            return True
        try:
            _peek_exit(self.popen.pid)
        except ChildProcessError:  # reaped by someone else
            return False
        return True

    def _signal_group(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)

    def stop(self, grace_s: float | None = None) -> int | None:
        """SIGTERM to the group, up to ``grace_s`` (default: the one given to :func:`start`) for the leader to exit,
        SIGKILL to whatever of the group is left, then reap the leader. Idempotent; the leader's exit code."""
        if self._stopped:
            return self.popen.returncode
        self._stopped = True
        _live.discard(self)
        if self._group_is_ours():
            self._signal_group(signal.SIGTERM)
            self.wait(self.grace_s if grace_s is None else grace_s)
            self._signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=KILL_WAIT_S)
        if self.popen.stdout is not None:
            self.popen.stdout.close()
        if self._exit_fd is not None:
            os.close(self._exit_fd)
            self._exit_fd = None
        return self.popen.returncode

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"Process({self.name}, pid={self.popen.pid}, returncode={self.returncode})"


@atexit.register
def _stop_leftovers() -> None:
    for proc in list(_live):
        with contextlib.suppress(Exception):
            proc.stop(grace_s=2.0)
