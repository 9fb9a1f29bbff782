"""Smoke test: a REAL llama.cpp llama-server, on 127.0.0.1, serving a tiny GGUF.

Pins down the wire behaviour that kvcap's load generator depends on (SSE shape,
``ignore_eos``, usage, ``timings``, ``/metrics`` names, how errors surface), so
a llama.cpp upgrade that changes any of it fails here first. Uses only urllib /
http.client so it tests the server, not kvcap's client. Requires the binary
built by ``scripts/install-llama-server``; without it every test FAILS.
"""

from __future__ import annotations

import http.client
import json
import re
import subprocess
import threading
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.llamacpp import MISSING_BINARY_HINT, llama_server, llama_server_binary, pinned_version
from tests.tiny_gguf import TINY_VOCAB, words_prompt, write_tiny_llama_gguf

pytestmark = pytest.mark.llamacpp

PARALLEL = 2
CTX_SIZE = 1024  # -> 512 tokens per slot (KV is not unified with an explicit --parallel)
SLOT_CTX = CTX_SIZE // PARALLEL

TIMINGS_KEYS = {
    "cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second",
    "predicted_n", "predicted_ms", "predicted_per_token_ms", "predicted_per_second",
}
METRIC_NAMES = {
    # counters
    "llamacpp:prompt_tokens_total", "llamacpp:prompt_tokens_cached_total", "llamacpp:prompt_seconds_total",
    "llamacpp:tokens_predicted_total", "llamacpp:tokens_predicted_seconds_total", "llamacpp:n_decode_total",
    "llamacpp:n_tokens_max", "llamacpp:spec_decode_num_draft_tokens_total",
    "llamacpp:spec_decode_num_accepted_tokens_total", "llamacpp:spec_decode_num_drafts_total",
    # gauges
    "llamacpp:prompt_tokens_seconds", "llamacpp:predicted_tokens_seconds", "llamacpp:requests_processing",
    "llamacpp:requests_deferred", "llamacpp:n_busy_slots_per_decode",
}


def _require_binary() -> Path:
    binary = llama_server_binary()
    if binary is None:
        pytest.fail(MISSING_BINARY_HINT, pytrace=False)
    return binary


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # EOS is made the overwhelmingly likely next token, so every request that
    # reaches max_tokens proves that ignore_eos is honoured.
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", eos_logit_bias=50.0)


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    _require_binary()
    log = tmp_path_factory.mktemp("llama") / "server.log"
    with llama_server(tiny_model, parallel=PARALLEL, ctx_size=CTX_SIZE, log_path=log) as url:
        yield url


# --------------------------------------------------------------------------- HTTP helpers


def _post(url: str, body: dict[str, Any], timeout: float = 30) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def _sse(raw: bytes) -> list[str]:
    """The payloads of an SSE body's ``data:`` lines, in order. Only ``data:``
    lines, blank separators and ``:`` comments (pings) are allowed."""
    out = []
    for line in raw.decode().split("\n"):
        if line.startswith("data: "):
            out.append(line[len("data: "):])
        else:
            assert line == "" or line.startswith(":"), f"unexpected SSE line {line!r}"
    return out


def _stream(url: str, body: dict[str, Any]) -> tuple[dict[str, str], list[str]]:
    status, headers, raw = _post(url, {**body, "stream": True})
    assert status == 200, raw[:500]
    assert headers["Content-Type"].startswith("text/event-stream")
    return headers, _sse(raw)


# --------------------------------------------------------------------------- tests


def test_binary_is_installed_and_pinned():
    binary = _require_binary()
    proc = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0
    build = pinned_version().split(".")[0]
    assert f"build {build}" in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_health_and_tiny_vocab_tokenize(server):
    assert json.loads(_get(server + "/health")) == {"status": "ok"}
    words = ["the", "cat", "water", "people", "sentence"]
    status, _, raw = _post(server + "/tokenize", {"content": " ".join(words)})
    assert status == 200
    assert json.loads(raw)["tokens"] == [TINY_VOCAB.word_id(w) for w in words]


def test_completions_stream_runs_to_max_tokens(server):
    headers, events = _stream(server + "/v1/completions", {
        "prompt": words_prompt(8), "max_tokens": 16, "ignore_eos": True,
        "stream_options": {"include_usage": True},
    })
    assert headers.get("Transfer-Encoding") == "chunked"
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    # one chunk per generated token, then a final chunk with empty text that
    # carries finish_reason, usage and timings together
    *tokens, final = chunks
    assert len(tokens) == 16 and all(c["choices"][0]["text"] for c in tokens)
    assert all(c["choices"][0]["finish_reason"] is None for c in tokens)
    assert final["choices"][0]["text"] == ""
    assert final["choices"][0]["finish_reason"] == "length"
    usage = final["usage"]
    assert usage["completion_tokens"] == 16
    assert usage["prompt_tokens"] == 8 + 1  # 8 one-token words + BOS
    assert usage["total_tokens"] == 25
    assert set(final["timings"]) == TIMINGS_KEYS
    assert final["timings"]["predicted_n"] == 16
    assert final["timings"]["prompt_n"] + final["timings"]["cache_n"] == 9
    assert "usage" not in tokens[0] and "timings" not in tokens[0]


def test_eos_stops_generation_unless_ignore_eos(server):
    body = {"prompt": words_prompt(4, offset=3), "max_tokens": 16}
    status, _, raw = _post(server + "/v1/completions", body)
    assert status == 200
    stopped = json.loads(raw)
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] == 1  # the EOS itself is counted

    status, _, raw = _post(server + "/v1/completions", {**body, "ignore_eos": True})
    full = json.loads(raw)
    assert full["choices"][0]["finish_reason"] == "length"
    assert full["usage"]["completion_tokens"] == 16
    assert set(full["timings"]) == TIMINGS_KEYS  # non-streamed responses carry timings too


def test_chat_completions_stream(server):
    _, events = _stream(server + "/v1/chat/completions", {
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": words_prompt(6)}],
        "max_tokens": 16, "ignore_eos": True, "stream_options": {"include_usage": True},
    })
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    role, *tokens, finish, usage_chunk = chunks
    # 1. role-only first chunk (content null), 2. one chunk per token,
    # 3. finish chunk with an empty delta, 4. usage chunk with choices == []
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert len(tokens) == 16 and all(c["choices"][0]["delta"].get("content") for c in tokens)
    assert finish["choices"][0] == {"finish_reason": "length", "index": 0, "delta": {}}
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 16
    assert set(usage_chunk["timings"]) == TIMINGS_KEYS  # timings move to the usage chunk


def test_chat_stream_without_include_usage_has_no_usage(server):
    _, events = _stream(server + "/v1/chat/completions", {
        "messages": [{"role": "user", "content": words_prompt(3)}], "max_tokens": 4, "ignore_eos": True,
    })
    chunks = [json.loads(e) for e in events[:-1]]
    assert not any("usage" in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert set(chunks[-1]["timings"]) == TIMINGS_KEYS  # ...then timings ride on the finish chunk


def test_generation_is_cut_at_the_slot_context(server):
    # prompt fits the slot, prompt + max_tokens does not: silently truncated
    # to the slot size with finish_reason "length", even with ignore_eos
    n_prompt = SLOT_CTX - 8
    status, _, raw = _post(server + "/v1/completions", {
        "prompt": words_prompt(n_prompt - 1), "max_tokens": 32, "ignore_eos": True,
    })
    assert status == 200
    out = json.loads(raw)
    assert out["usage"]["prompt_tokens"] == n_prompt
    assert out["usage"]["completion_tokens"] < 32
    assert out["usage"]["total_tokens"] == SLOT_CTX
    assert out["choices"][0]["finish_reason"] == "length"


def test_prompt_longer_than_slot_context_is_http_400_even_when_streaming(server):
    status, headers, raw = _post(server + "/v1/completions", {
        "prompt": words_prompt(SLOT_CTX + 10), "max_tokens": 16, "stream": True, "ignore_eos": True,
    })
    assert status == 400
    assert headers["Content-Type"].startswith("application/json")
    assert headers.get("Connection") == "close"
    err = json.loads(raw)["error"]
    assert err["type"] == "exceed_context_size_error"
    assert err["code"] == 400
    assert err["n_ctx"] == SLOT_CTX
    assert err["n_prompt_tokens"] == SLOT_CTX + 11


def test_connection_is_closed_after_a_stream_despite_keep_alive(server):
    u = urllib.parse.urlsplit(server)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    body = json.dumps({"prompt": "the cat", "max_tokens": 2, "ignore_eos": True})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = conn.getresponse()
    r.read()
    assert r.getheader("Keep-Alive") and not r.will_close  # non-streamed: really kept alive
    conn.request("POST", "/v1/completions", body.replace("}", ', "stream": true}'),
                 {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.getheader("Keep-Alive")  # advertised...
    r.read()
    with pytest.raises((http.client.RemoteDisconnected, ConnectionError)):
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        conn.getresponse()  # ...but the server has closed the socket after the last chunk
    conn.close()


def test_metrics_expose_llamacpp_names(server):
    def scrape() -> dict[str, float]:
        return {m[0]: float(m[1]) for m in re.findall(r"^(llamacpp:\w+) (\S+)$", _get(server + "/metrics"), re.M)}

    before = scrape()
    assert set(before) == METRIC_NAMES
    _post(server + "/v1/completions", {"prompt": words_prompt(5), "max_tokens": 7, "ignore_eos": True})
    after = scrape()
    assert after["llamacpp:tokens_predicted_total"] - before["llamacpp:tokens_predicted_total"] == 7
    assert after["llamacpp:n_decode_total"] > before["llamacpp:n_decode_total"]
    assert after["llamacpp:requests_processing"] == 0
    assert after["llamacpp:requests_deferred"] == 0
    slots = json.loads(_get(server + "/slots"))
    assert len(slots) == PARALLEL and all(s["n_ctx"] == SLOT_CTX for s in slots)


def test_kv_exhaustion_is_an_error_event_inside_a_200_stream(tiny_model):
    """With a unified KV pool smaller than the concurrent demand, decode fails
    mid-generation: every in-flight stream gets ``data: {"error": ...}`` as its
    last event, with HTTP 200 and no ``[DONE]``."""
    _require_binary()
    n = 4
    with llama_server(tiny_model, parallel=n, ctx_size=256, extra_args=("--kv-unified",)) as url:
        for _attempt in range(3):  # needs the requests to overlap in time; retry if the box was too slow
            barrier = threading.Barrier(n)
            results: list[tuple[int, list[str]]] = [(0, [])] * n

            def run(i: int, url: str = url, barrier: threading.Barrier = barrier,
                    results: list[tuple[int, list[str]]] = results) -> None:
                barrier.wait()
                status, _, raw = _post(url + "/v1/completions", {
                    "prompt": words_prompt(50, offset=50 * i), "max_tokens": 200, "stream": True,
                    "ignore_eos": True, "cache_prompt": False,
                })
                results[i] = (status, _sse(raw) if status == 200 else [raw.decode()])

            threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
            errored = [ev for status, ev in results if status == 200 and ev and ev[-1] != "[DONE]"]
            if errored:
                break
        assert errored, f"no stream hit the KV limit: {results!r}"
        for ev in errored:
            last = json.loads(ev[-1])
            assert last == {"error": {"code": 500, "message": "Context size has been exceeded.",
                                      "type": "server_error"}}
            assert "[DONE]" not in ev
        assert json.loads(_get(url + "/health")) == {"status": "ok"}  # the server survives
