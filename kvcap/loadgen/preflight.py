"""Before any load is sent: is the endpoint there, and does it serve the model asked for? And the facts about the
server the manifest keeps (models, version, engine, llama.cpp props).

Why: a sweep against a dead port would record an instant connection error per request and exit 0; a wrong
model name, a 404 per request. One cheap check up front turns both into one line and exit 1 (:class:`EndpointError`):
``GET /v1/models`` answers both questions when it lists the model. A server without it (a 404 there is not
fatal), or one that does not list the model asked for, gets one tiny real request (``max_tokens=1``, the run's own
request shape): the listing is a hint, the server's answer decides (llama.cpp lists its one model under a path yet
serves any name). A refusal (400/401/403/404/405/422) is what every request of the run would have met; a 429 or 5xx
is left to the run's error rule, since it may be transient.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvcap.errors import EndpointError
from kvcap.loadgen.client import Outcome, Target, stream_request
from kvcap.workload.prompts import RequestSpec

PROBE_TIMEOUT = aiohttp.ClientTimeout(total=10, sock_connect=5)
REFUSED_STATUSES = frozenset({400, 401, 403, 404, 405, 422})
"""Answers to the tiny request that every request of the run would get too."""
ENGINES = {"vllm": "vllm", "sglang": "sglang", "llamacpp": "llama.cpp"}

log = logging.getLogger(__name__)


def server_base(url: str) -> str:
    """``http://h:8000/v1/completions`` (or ``…/v1``) → ``http://h:8000``: where /v1/models, /version live."""
    base = url.rstrip("/")
    for suffix in ("/v1/chat/completions", "/v1/completions", "/chat/completions", "/completions", "/v1"):
        if base.endswith(suffix):
            return base[: -len(suffix)]
    return base


def unreachable(exc: BaseException) -> str | None:
    """Why a request never reached a server (refused, unresolvable, no connection or answer in time), or None."""
    if isinstance(exc, aiohttp.ClientConnectorDNSError):
        return f"cannot resolve host {exc.host!r}"
    if isinstance(exc, aiohttp.ClientConnectorError):
        errno = getattr(exc.os_error, "errno", None)
        return (os.strerror(errno) if errno else str(exc.os_error) or type(exc.os_error).__name__).lower()
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return f"no connection within {PROBE_TIMEOUT.sock_connect:g} s"
    if isinstance(exc, (asyncio.TimeoutError, aiohttp.ServerTimeoutError)):
        return f"no answer within {PROBE_TIMEOUT.total:g} s"
    return None


async def probe_server(target: Target) -> dict[str, Any]:
    """The manifest's facts about the server, once it is known to serve ``target``; raises EndpointError if not."""
    base = server_base(target.url)
    info: dict[str, Any] = {}
    async with aiohttp.ClientSession(timeout=PROBE_TIMEOUT, headers=target.headers) as s:
        for path in ("/v1/models", "/version", "/props"):
            try:
                async with s.get(base + path) as r:
                    if r.status != 200:
                        continue
                    if r.headers.get("Server"):
                        info["server_header"] = r.headers["Server"]
                    data = await r.json(content_type=None)
            except Exception as exc:
                why = unreachable(exc)
                if why is not None and path == "/v1/models":  # nothing answers there: skip the other paths
                    raise EndpointError(f"cannot reach {base}: {why}") from None
                # a fact the manifest goes without: the model check below still decides
                log.debug("no server facts from %s%s: %s: %s", base, path, type(exc).__name__, exc)
                continue
            _read_facts(info, path, data)
        await _pool_facts(s, base, info)
        if "engine" not in info:
            owned = str(info.get("owned_by", ""))
            info["engine"] = ENGINES.get(owned, owned or "unknown")
        models = [str(m) for m in info.get("models") or []]
        if models and (target.model is None or target.model in models):
            info["preflight"] = {"check": "/v1/models"}
        else:
            info["preflight"] = await _tiny_request(s, target, base, models)
    return info


def _read_facts(info: dict[str, Any], path: str, data: Any) -> None:
    """What one probe path's JSON says about the server, into ``info``."""
    if not isinstance(data, dict):
        return
    if path == "/v1/models":
        listed = [m for m in data.get("data") or [] if isinstance(m, dict)]
        info["models"] = [m.get("id") for m in listed]
        first = listed[0] if listed else {}
        if first.get("max_model_len"):
            info["max_model_len"] = first["max_model_len"]
        if first.get("owned_by"):
            info["owned_by"] = first["owned_by"]
    elif path == "/version":
        info["version"] = data.get("version")
    elif path == "/props":
        info["engine"] = "llama.cpp"
        info["version"] = info.get("version") or data.get("build_info")
        info["total_slots"] = data.get("total_slots")
        gen = data.get("default_generation_settings") or {}
        info["n_ctx"] = gen.get("n_ctx") or data.get("n_ctx")


CACHE_CONFIG = "vllm:cache_config_info"
"""vLLM's info gauge: the KV pool's ``num_gpu_blocks``, ``block_size`` and ``enable_prefix_caching`` as labels."""
SERVER_INFO = ("/get_server_info", "/server_info")
"""SGLang's server facts (``max_total_num_tokens``: the KV pool in tokens; ``max_running_requests``); the second
is the newer name."""


async def _pool_facts(session: aiohttp.ClientSession, base: str, info: dict[str, Any]) -> None:
    """The KV pool and the running limit, where the engine says them: vLLM's ``/metrics`` info gauge, SGLang's
    server info. Only the numbers are kept: SGLang's answer also holds the server's API keys in clear."""
    if "total_slots" in info:  # llama.cpp said it at /props
        return
    try:
        async with session.get(base + "/metrics") as r:
            text = await r.text() if r.status == 200 else ""
        info.update(cache_config(text))
    except Exception as exc:  # the pool facts are optional: the manifest goes without them
        log.debug("no KV pool facts from %s/metrics: %s: %s", base, type(exc).__name__, exc)
    if "num_gpu_blocks" in info:
        return
    for path in SERVER_INFO:
        try:
            async with session.get(base + path) as r:
                data = await r.json(content_type=None) if r.status == 200 else None
        except Exception as exc:  # not SGLang, or it did not answer: the pool facts are optional
            log.debug("no server info from %s%s: %s: %s", base, path, type(exc).__name__, exc)
            continue
        if isinstance(data, dict):
            info.update(sglang_facts(data))
            return


def cache_config(text: str) -> dict[str, Any]:
    """``num_gpu_blocks``, ``block_size``, ``enable_prefix_caching`` from vLLM's ``cache_config_info`` (engine
    0's series) and ``kv_engines``, how many engines report one (data-parallel engines: a pool each); {} when
    absent or unparsable."""
    if CACHE_CONFIG not in text:
        return {}
    try:
        families = list(text_string_to_metric_families(text))
    except Exception as exc:  # a page Prometheus' parser refuses: the pool facts are optional
        log.debug("unparsable /metrics page, no KV pool facts read from it: %s: %s", type(exc).__name__, exc)
        return {}
    samples = [smp for fam in families if fam.name == CACHE_CONFIG for smp in fam.samples]
    if not samples:
        return {}
    labels = min(samples, key=lambda smp: smp.labels.get("engine", "")).labels
    out: dict[str, Any] = {"kv_engines": len({smp.labels.get("engine", "") for smp in samples})}
    for key in ("num_gpu_blocks", "block_size"):
        v = labels.get(key, "")
        if v.isdigit() and int(v) > 0:
            out[key] = int(v)
    if labels.get("enable_prefix_caching") in ("True", "False"):
        out["enable_prefix_caching"] = labels["enable_prefix_caching"] == "True"
    if "num_gpu_blocks" not in out:
        return {}
    out["engine"] = "vllm"
    return out


def sglang_facts(data: dict[str, Any]) -> dict[str, Any]:
    """``max_total_num_tokens`` and ``max_running_requests`` from SGLang's server info, at the top level or in its
    first scheduler's ``internal_states``; {} when it says neither (not SGLang)."""
    states = data.get("internal_states")
    inner = states[0] if isinstance(states, list) and states and isinstance(states[0], dict) else {}
    out: dict[str, Any] = {}
    for key in ("max_total_num_tokens", "max_running_requests"):
        v = data.get(key, inner.get(key))
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            out[key] = v
    if out:
        out["engine"] = "sglang"
    return out


async def _tiny_request(session: aiohttp.ClientSession, target: Target, base: str,
                        models: list[str]) -> dict[str, Any]:
    """One ``max_tokens=1`` request in the run's shape, for a server that does not list the model asked for."""
    o = Outcome(t_sched=0.0)
    await stream_request(session, target, RequestSpec(index=-1, prompt="Hello", input_tokens=1, output_tokens=1),
                         o, time.perf_counter)
    if o.status is None and o.error in ("connection", "timeout"):
        raise EndpointError(f"{target.endpoint} did not answer a 1-token request: {o.detail}")
    if o.status in REFUSED_STATUSES:
        if models:
            raise EndpointError(f"model {target.model!r} not served by {base}; it serves: {', '.join(models)} "
                                f"(a 1-token request got HTTP {o.status})")
        raise EndpointError(f"{target.endpoint} refused a 1-token request"
                            f"{f' for model {target.model!r}' if target.model else ''}: {o.detail}")
    return {"check": "1-token request", "status": o.status, "error": o.error,
            **({"note": "the model is not in /v1/models, but the server accepted it"} if models else {})}
