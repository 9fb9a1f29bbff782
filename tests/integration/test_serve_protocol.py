"""The front end (kvcap.serve) speaks vLLM's OpenAI dialect: SSE framing, usage blocks, validation errors, the info
endpoints and /metrics — checked byte for byte in process, and over real loopback HTTP against the test server.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import pytest

from kvcap.serve.app import make_app, start_server
from kvcap.serve.engine import Engine, EngineLoad
from kvcap.serve.metrics import Counter, Gauge, MetricFamily, RequestCounters, render_metrics
from kvcap.serve.protocol import (
    DONE,
    ApiConfig,
    BadRequest,
    Job,
    SseFrames,
    completion_body,
    count_prompt,
    error_body,
    parse_job,
    token_text,
    tokens_text,
    usage_block,
)
from tests import servers, streams
from tests.servers import FakeServer
from tests.streams import ITL_MS, TOL_MS, TTFT_MS, Stream, arun, near, session, stream, truth_check

fake_server = servers.fake_server  # the factory fixture
fixed_srv = streams.fixed_srv


# ------------------------------------------------------------------------------------------ over loopback HTTP

@arun
async def test_completion_stream_format_and_usage(fixed_srv: FakeServer) -> None:
    async with session() as s:
        r = await stream(s, fixed_srv.url, prompt="one two three four", max_tokens=5,
                         stream_options={"include_usage": True}, model="fake-model")
        plain = await stream(s, fixed_srv.url, prompt=["one two"], max_tokens=3)
    assert r.headers["Content-Type"] == "text/event-stream"
    assert r.texts == ["w0 ", "w1 ", "w2 ", "w3 ", "w4 "]
    assert r.finish_reasons == [None, None, None, None, "length"]
    objs = r.objs()
    chunk = objs[0]
    assert set(chunk) == {"id", "object", "created", "model", "choices"}
    assert chunk["object"] == "text_completion" and chunk["model"] == "fake-model"
    assert chunk["choices"][0] == {"index": 0, "text": "w0 ", "logprobs": None, "finish_reason": None}
    assert objs[-2]["choices"] == [] and objs[-2]["usage"] == {"prompt_tokens": 4, "completion_tokens": 5,
                                                                "total_tokens": 9}
    assert r.done and len(r.events) == 5 + 2
    assert plain.done and plain.usage is None and len(plain.events) == 3 + 1


@arun
async def test_chat_usage_counts_all_message_words(fixed_srv: FakeServer) -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "count these five words"}]
    async with session() as s:
        r = await stream(s, fixed_srv.url, chat=True, messages=msgs, max_tokens=3,
                         stream_options={"include_usage": True})
    assert r.usage == {"prompt_tokens": 6, "completion_tokens": 3, "total_tokens": 9}
    assert r.texts == ["w0 ", "w1 ", "w2 "] and r.finish_reasons[-1] == "length"


@arun
async def test_non_stream_both_apis(fixed_srv: FakeServer) -> None:
    async def measure() -> tuple[list[float], dict[str, Any], dict[str, Any]]:
        async with session() as s:
            await stream(s, fixed_srv.url, max_tokens=1)
            elapsed = []
            for _ in range(2):
                t0 = time.perf_counter()
                async with s.post(fixed_srv.url + "/v1/completions", json={"prompt": "a b c", "max_tokens": 6}) as r:
                    comp = await r.json()
                elapsed.append((time.perf_counter() - t0) * 1e3)
            async with s.post(fixed_srv.url + "/v1/chat/completions",
                              json={"messages": [{"role": "user", "content": "a b"}], "max_tokens": 2}) as r:
                chat = await r.json()
        return elapsed, comp, chat

    def check(data: tuple[list[float], dict[str, Any], dict[str, Any]]) -> None:
        elapsed = data[0]  # the body goes out when the last token is due
        assert near(min(elapsed), TTFT_MS + 5 * ITL_MS, 3.0), elapsed

    _, comp, chat = await truth_check(fixed_srv, measure, check)
    assert comp["object"] == "text_completion" and comp["choices"][0]["text"] == "w0 w1 w2 w3 w4 w5 "
    assert comp["choices"][0]["finish_reason"] == "length"
    assert comp["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": "w0 w1 "}
    assert chat["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}


@arun
async def test_tokens_per_chunk(fake_server: Callable[..., FakeServer]) -> None:
    srv = fake_server(ttft="30ms", itl="10ms", tokens_per_chunk=4)

    async def measure() -> list[Stream]:
        async with session() as s:
            await stream(s, srv.url, max_tokens=1)
            rs = [await stream(s, srv.url, max_tokens=10, stream_options={"include_usage": True}) for _ in range(3)]
        for r in rs:
            assert r.texts == ["w0 w1 w2 w3 ", "w4 w5 w6 w7 ", "w8 w9 "]
            assert r.finish_reasons == [None, None, "length"] and r.usage["completion_tokens"] == 10
        return rs

    def check(rs: list[Stream]) -> None:
        times = [min((r.content()[j][0] - r.t0) * 1e3 for r in rs) for j in range(3)]
        for t, last_token in zip(times, (3, 7, 9), strict=True):  # a chunk leaves when its last token is due
            assert 30 + 10 * last_token - 0.2 <= t <= 30 + 10 * last_token + TOL_MS, times

    await truth_check(srv, measure, check)


@arun
async def test_eos_after_and_ignore_eos(fake_server: Callable[..., FakeServer]) -> None:
    srv = fake_server(ttft="0", itl="1ms", eos_after=5)
    async with session() as s:
        eos = await stream(s, srv.url, max_tokens=12, stream_options={"include_usage": True})
        forced = await stream(s, srv.url, max_tokens=12, ignore_eos=True)
        floor = await stream(s, srv.url, max_tokens=12, min_tokens=8)
        short = await stream(s, srv.url, max_tokens=4)
    assert eos.n_tokens == 5 and eos.finish_reasons[-1] == "stop" and eos.usage["completion_tokens"] == 5
    assert forced.n_tokens == 12 and forced.finish_reasons[-1] == "length"
    assert floor.n_tokens == 8 and floor.finish_reasons[-1] == "stop"
    assert short.n_tokens == 4 and short.finish_reasons[-1] == "length"
    st = srv.stats()
    assert st["finished_by_reason"] == {"stop": 2, "length": 2} and st["completion_tokens_total"] == 29


@arun
async def test_info_endpoints_and_errors(fake_server: Callable[..., FakeServer]) -> None:
    srv = fake_server(model_name="tiny", max_model_len=64)
    async with session() as s:
        async with s.get(srv.url + "/v1/models") as r:
            models = await r.json()
        async with s.get(srv.url + "/health") as r:
            assert r.status == 200
        async with s.get(srv.url + "/version") as r:
            assert (await r.json())["version"].startswith("kvcap-fake-")
        for body, status in (({"prompt": "a", "model": "other"}, 404), ({"max_tokens": 2}, 400),
                             ({"prompt": "a", "max_tokens": 0}, 400), ({"prompt": "a " * 60, "max_tokens": 8}, 400)):
            async with s.post(srv.url + "/v1/completions", json=body) as r:
                assert r.status == status and "message" in (await r.json())["error"], body
        async with s.post(srv.url + "/v1/completions", data=b"{not json",
                          headers={"Content-Type": "application/json"}) as r:
            assert r.status == 400
        ok = await stream(s, srv.url, model="tiny", max_tokens=2)
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 64
    assert ok.done
    st = srv.stats()
    assert st["requests_rejected"] == 5 and st["requests_started"] == 1  # rejected ones take no arrival index
    assert set(st["timer"]) == {"wakeups", "late_over_1ms", "late_over_5ms", "max_late_ms"}
    assert st["timer"]["wakeups"] >= 2 and st["engine_steps"] is None and st["config"]["mode"] == "fixed"


@arun
async def test_metrics_exposition(fake_server: Callable[..., FakeServer]) -> None:
    srv = fake_server(ttft="0", itl="1ms")
    async with session() as s:
        for _ in range(3):
            await stream(s, srv.url, prompt="a b c d", max_tokens=5)
        async with s.get(srv.url + "/metrics") as r:
            assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            text = await r.text()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            assert re.fullmatch(r"# (HELP|TYPE) vllm:[a-z_]+ .+", line), line
            continue
        m = re.fullmatch(r'(vllm:[a-z_]+)\{((?:[a-z_]+="[^"]*",?)+)\} (\S+)', line)
        assert m, line
        if not m.group(1).endswith("_created"):
            samples[m.group(1)] = samples.get(m.group(1), 0.0) + float(m.group(3))
    assert samples["vllm:num_requests_running"] == 0 and samples["vllm:num_requests_waiting"] == 0
    assert samples["vllm:kv_cache_usage_perc"] == 0 and samples["vllm:num_preemptions_total"] == 0
    assert samples["vllm:prompt_tokens_total"] == 12 and samples["vllm:generation_tokens_total"] == 15
    assert samples["vllm:request_success_total"] == 3
    assert 'model_name="fake-model"' in text


# ------------------------------------------------------------------------------------------------ in process

def _job(chat: bool, **kw: Any) -> Job:
    fields: dict[str, Any] = {"stream": True, "model": "m", "prompt_tokens": 3, "max_tokens": 2, "n_out": 2,
                              "finish_reason": "length", "include_usage": True, "t_arrival": 0.0,
                              "created": 1700000000, "index": 7, **kw}
    return Job(chat=chat, **fields)


def test_count_prompt_one_token_per_word() -> None:
    assert count_prompt({"prompt": "one two  three"}, chat=False) == 3
    assert count_prompt({"prompt": [5, 6, 7, 8]}, chat=False) == 4  # token ids
    assert count_prompt({"prompt": ["a b"]}, chat=False) == 2
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a b c"}, {"type": "image_url"}]},
                {"role": "assistant", "content": None}]
    assert count_prompt({"messages": messages}, chat=True) == 2 + 3
    for body, chat in (({"prompt": ["a", "b"]}, False), ({"prompt": 5}, False), ({}, False),
                       ({"messages": []}, True), ({"messages": ["x"]}, True),
                       ({"messages": [{"content": 5}]}, True)):
        with pytest.raises(BadRequest) as exc:
            count_prompt(body, chat)
        assert exc.value.status == 400 and exc.value.err_type == "BadRequestError", body


def test_parse_job_plans_length_and_finish_reason() -> None:
    api = ApiConfig(model_name="m", eos_after=5, max_model_len=20)

    def plan(**body: Any) -> Job:
        return parse_job(api, {"prompt": "a b c", **body}, chat=False, t_arrival=1.5)

    eos = plan(max_tokens=12)
    assert (eos.n_out, eos.finish_reason, eos.prompt_tokens, eos.max_tokens) == (5, "stop", 3, 12)
    assert (eos.model, eos.t_arrival, eos.stream, eos.include_usage, eos.index) == ("m", 1.5, False, False, -1)
    assert (plan(max_tokens=12, ignore_eos=True).n_out, plan(max_tokens=12, ignore_eos=True).finish_reason) == (
        12, "length")
    assert (plan(max_tokens=12, min_tokens=8).n_out, plan(max_tokens=12, min_tokens=8).finish_reason) == (8, "stop")
    assert (plan(max_tokens=4).n_out, plan(max_tokens=4).finish_reason) == (4, "length")  # EOS would come later
    assert plan().max_tokens == 16  # vLLM's default for completions
    streamed = plan(stream=True, stream_options={"include_usage": True}, model="m")
    assert streamed.stream and streamed.include_usage
    chat = parse_job(api, {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3}, True, 0.0)
    assert chat.chat and chat.max_tokens == 3 and chat.n_out == 3 and chat.prompt_tokens == 1


def test_parse_job_refuses_like_vllm() -> None:
    api = ApiConfig(model_name="m", max_model_len=20)
    cases = [({"prompt": "a", "model": "other"}, 404, "The model `other` does not exist."),
             ({"prompt": "a", "n": 2}, 400, "n > 1 is not supported by the fake server"),
             ({"prompt": "a", "max_tokens": True}, 400, "max_tokens must be an integer"),
             ({"prompt": "a", "max_tokens": 0}, 400, "max_tokens must be at least 1, got 0."),
             ({"prompt": "a", "max_tokens": 2, "min_tokens": 3}, 400, "min_tokens must be in [0, max_tokens], got 3"),
             ({"prompt": "a b c d e"}, 400, "This model's maximum context length is 20 tokens. However, you "
                                            "requested 21 tokens (5 in the messages, 16 in the completion). Please "
                                            "reduce the length of the messages or completion.")]
    for body, status, message in cases:
        with pytest.raises(BadRequest) as exc:
            parse_job(api, body, chat=False, t_arrival=0.0)
        assert (exc.value.status, exc.value.message) == (status, message), body
    with pytest.raises(BadRequest, match="JSON object"):
        parse_job(api, ["a"], chat=False, t_arrival=0.0)
    assert parse_job(api, {"prompt": "a b c d"}, chat=False, t_arrival=0.0).max_tokens == 16  # 4 + 16 fits


def test_token_text_and_usage_block() -> None:
    assert token_text(0) == "w0 " and token_text(1500) == "w1500 "
    assert tokens_text(2, 5) == "w2 w3 w4 " and tokens_text(3, 3) == ""
    assert usage_block(3, 2) == {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2}
    assert error_body(404, "nope", "NotFoundError") == {
        "error": {"message": "nope", "type": "NotFoundError", "param": None, "code": 404}}


def test_sse_frames_are_vllm_bytes() -> None:
    head = b'data: {"id":"cmpl-fake000000000000000000000007","object":"text_completion","created":1700000000,' \
           b'"model":"m",'
    frames = SseFrames(_job(chat=False))
    assert frames.chunk("w0 ", None) == head + b'"choices":[{"index":0,"text":"w0 ","logprobs":null,' \
                                               b'"finish_reason":null}]}\n\n'
    assert frames.chunk("w1 ", "length").endswith(b'"text":"w1 ","logprobs":null,"finish_reason":"length"}]}\n\n')
    assert frames.usage(_job(chat=False), 2) == head + b'"choices":[],"usage":{"prompt_tokens":3,' \
                                                       b'"total_tokens":5,"completion_tokens":2}}\n\n'
    chat = SseFrames(_job(chat=True))
    chat_head = b'data: {"id":"chatcmpl-fake000000000000000000000007","object":"chat.completion.chunk",' \
                b'"created":1700000000,"model":"m",'
    assert chat.role() == chat_head + b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},' \
                                      b'"logprobs":null,"finish_reason":null}]}\n\n'
    assert chat.chunk("w0 w1 ", "stop") == chat_head + b'"choices":[{"index":0,"delta":{"content":"w0 w1 "},' \
                                                       b'"logprobs":null,"finish_reason":"stop"}]}\n\n'
    assert DONE == b"data: [DONE]\n\n"


def test_completion_body_both_apis() -> None:
    assert completion_body(_job(chat=False, finish_reason="stop"), 2) == {
        "id": "cmpl-fake000000000000000000000007", "object": "text_completion", "created": 1700000000,
        "model": "m", "choices": [{"index": 0, "text": "w0 w1 ", "logprobs": None, "finish_reason": "stop",
                                   "stop_reason": None}],
        "usage": {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2}}
    chat = completion_body(_job(chat=True), 1)
    assert chat["id"] == "chatcmpl-fake000000000000000000000007" and chat["object"] == "chat.completion"
    assert chat["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "w0 "}, "logprobs": None,
                                "finish_reason": "length", "stop_reason": None}]
    assert chat["usage"] == {"prompt_tokens": 3, "total_tokens": 4, "completion_tokens": 1}


def test_render_metrics_text() -> None:
    families = [Gauge("a:g", "G help", 2), Counter("a:c", "C help", [("", 3), ('r="x",', 1.5)], created=100.25),
                Counter("a:d", "D", [("", 0)])]
    assert render_metrics(families, "m") == "\n".join([
        "# HELP a:g G help", "# TYPE a:g gauge", 'a:g{model_name="m"} 2.0',
        "# HELP a:c_total C help", "# TYPE a:c_total counter",
        'a:c_total{model_name="m"} 3.0', 'a:c_total{r="x",model_name="m"} 1.5',
        "# HELP a:c_created C help", "# TYPE a:c_created gauge",
        'a:c_created{model_name="m"} 100.25', 'a:c_created{r="x",model_name="m"} 100.25',
        "# HELP a:d_total D", "# TYPE a:d_total counter", 'a:d_total{model_name="m"} 0.0']) + "\n"


class InstantEngine:
    """An Engine whose tokens are all there at once, with a fixed load: the front end must report what it says."""

    def __init__(self) -> None:
        self.started = self.stopped = False
        self.submitted: list[tuple[int, int]] = []
        self.released: list[int] = []

    def start(self) -> None:
        self.started = True

    async def stop(self) -> None:
        self.stopped = True

    def submit(self, t_arrival: float, prompt_tokens: int, n_out: int) -> int:
        self.submitted.append((prompt_tokens, n_out))
        return len(self.submitted)

    async def wait(self, handle: int, n: int) -> bool:
        return False

    def release(self, handle: int) -> None:
        self.released.append(handle)

    def load(self) -> EngineLoad:
        return EngineLoad(running=2, waiting=1, max_running=5, max_waiting=3, steps=10)

    def metric_families(self, served: RequestCounters, started_wall: float) -> list[MetricFamily]:
        return [Gauge("x:served", "Generation tokens the front end sent.", served.completion_tokens_total)]


def test_front_end_over_any_engine() -> None:
    engine = InstantEngine()
    assert isinstance(engine, Engine)
    api = ApiConfig(model_name="stub", max_model_len=64)

    async def scenario() -> tuple[Stream, dict[str, Any], dict[str, Any], str, int]:
        srv = await start_server(make_app(api, engine), "127.0.0.1", 0)
        try:
            async with session() as s:
                streamed = await stream(s, srv.url, prompt="a b c", max_tokens=4, model="stub")
                async with s.post(srv.url + "/v1/chat/completions", json={
                        "messages": [{"role": "user", "content": "x y"}], "max_tokens": 2}) as r:
                    whole = await r.json()
                async with s.post(srv.url + "/v1/completions", json={"prompt": "a", "model": "other"}) as r:
                    refused = r.status
                async with s.get(srv.url + "/stats") as r:
                    stats = await r.json()
                async with s.get(srv.url + "/metrics") as r:
                    metrics = await r.text()
        finally:
            await srv.close()
        return streamed, whole, stats, metrics, refused

    streamed, whole, stats, metrics, refused = asyncio.run(asyncio.wait_for(scenario(), timeout=30))
    assert engine.started and engine.stopped
    assert engine.submitted == [(3, 4), (2, 2)] and engine.released == [1, 2]
    assert streamed.done and streamed.texts == ["w0 ", "w1 ", "w2 ", "w3 "]
    assert whole["choices"][0]["message"]["content"] == "w0 w1 " and refused == 404
    assert {k: stats[k] for k in ("running", "waiting", "max_running", "max_waiting", "engine_steps",
                                  "engine_resyncs")} == {"running": 2, "waiting": 1, "max_running": 5,
                                                         "max_waiting": 3, "engine_steps": 10, "engine_resyncs": None}
    assert (stats["requests_started"], stats["requests_finished"], stats["requests_rejected"]) == (2, 2, 1)
    assert (stats["prompt_tokens_total"], stats["completion_tokens_total"]) == (5, 6)
    assert stats["faults_injected"] == {} and stats["config"] == asdict(api)
    assert metrics == ('# HELP x:served Generation tokens the front end sent.\n# TYPE x:served gauge\n'
                       'x:served{model_name="stub"} 6.0\n')
