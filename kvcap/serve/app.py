"""The OpenAI-compatible HTTP app: routes, handlers and startup, with connection counting.

Routes (mimicking vLLM's OpenAI server): ``POST /v1/completions`` and ``POST /v1/chat/completions`` with
``stream`` true or false; ``POST /tokenize`` (vLLM's: ``prompt`` or chat ``messages`` → ``count``, ``tokens``);
``GET /v1/models``, ``/health``, ``/version``, ``/metrics`` (Prometheus text, the engine's families) and ``/stats``
(JSON counters for tests, :meth:`ServerState.snapshot`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from kvcap import __version__
from kvcap.serve.engine import AnyEngine
from kvcap.serve.faults import FaultPlan
from kvcap.serve.generation import Generation
from kvcap.serve.metrics import METRICS_CONTENT_TYPE, render_metrics
from kvcap.serve.protocol import ApiConfig, BadRequest, count_prompt, error_body, parse_job, prompt_token_words
from kvcap.serve.state import ServerState
from kvcap.workload.blocks import prompt_block_hashes

STATE: web.AppKey[ServerState] = web.AppKey("kvcap_serve_state")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _make_generation_handler(chat: bool) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        t_arrival = asyncio.get_running_loop().time()
        state = request.app[STATE]
        try:
            try:
                body = await request.json()
            except ValueError as exc:
                raise BadRequest(400, f"invalid JSON body: {exc}") from None
            job = parse_job(state.api, body, chat, t_arrival)
        except BadRequest as exc:
            state.counters.requests_rejected += 1
            return web.json_response(error_body(exc.status, exc.message, exc.err_type), status=exc.status)
        if state.prefix_block_tokens is not None:
            job.block_hashes = prompt_block_hashes(prompt_token_words(body, chat, state.api),
                                                   state.prefix_block_tokens)
        job.index = state.next_index
        state.next_index += 1
        state.counters.requests_started += 1
        return await Generation(state, request, job).run()
    return handler


async def _models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    api = state.api
    return web.json_response({"object": "list", "data": [{
        "id": api.model_name, "object": "model", "created": int(state.started_wall), "owned_by": "vllm",
        "root": api.model_name, "parent": None, "max_model_len": api.max_model_len}]})


async def _tokenize(request: web.Request) -> web.Response:
    """vLLM's ``/tokenize``: the count the generation endpoints would put in ``usage.prompt_tokens`` — special
    tokens (the overhead) with ``add_special_tokens`` (default true) for a prompt, the template's for messages."""
    api = request.app[STATE].api
    try:
        try:
            body = await request.json()
        except ValueError as exc:
            raise BadRequest(400, f"invalid JSON body: {exc}") from None
        if not isinstance(body, dict):
            raise BadRequest(400, "request body must be a JSON object")
        if body.get("model") is not None and body["model"] != api.model_name:
            raise BadRequest(404, f"The model `{body['model']}` does not exist.", "NotFoundError")
        chat = "messages" in body
        n = count_prompt(body, chat, api)
        if not chat and not body.get("add_special_tokens", True) and not isinstance(body.get("prompt"), list):
            n -= api.prompt_overhead
    except BadRequest as exc:
        return web.json_response(error_body(exc.status, exc.message, exc.err_type), status=exc.status)
    return web.json_response({"count": n, "max_model_len": api.max_model_len, "tokens": list(range(n))})


async def _health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def _version(request: web.Request) -> web.Response:
    return web.json_response({"version": f"kvcap-fake-{__version__}"})


async def _stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[STATE].snapshot())


async def _metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    families = state.engine.metric_families(state.counters, state.started_wall)
    return web.Response(text=render_metrics(families, state.api.model_name),
                        headers={"Content-Type": METRICS_CONTENT_TYPE})


def make_app(api: ApiConfig, engine: AnyEngine, faults: FaultPlan | None = None,
             config: Mapping[str, Any] | None = None, middlewares: Iterable[Any] = (),
             prompt_tokens_details: bool = False) -> web.Application:
    """The aiohttp application over ``engine``; start it with :func:`start_server` to get connection counting.
    ``config`` is what /stats reports under ``config``; ``middlewares`` wrap every handler;
    ``prompt_tokens_details``: usage reports cached prompt tokens (vLLM's ``--enable-prompt-tokens-details``)."""
    app = web.Application(client_max_size=256 * 2**20, middlewares=list(middlewares))
    state = ServerState(api, engine, faults, config, prompt_tokens_details)
    app[STATE] = state
    app.router.add_post("/v1/completions", _make_generation_handler(chat=False))
    app.router.add_post("/v1/chat/completions", _make_generation_handler(chat=True))
    if api.tokenize:
        app.router.add_post("/tokenize", _tokenize)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/version", _version)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/stats", _stats)

    async def on_startup(app: web.Application) -> None:
        state.engine.start()

    async def on_cleanup(app: web.Application) -> None:
        await state.engine.stop()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


@dataclass
class RunningServer:
    """A started server: its URL, state, and how to stop it."""

    url: str
    port: int
    state: ServerState
    runner: web.AppRunner
    server: asyncio.base_events.Server

    async def close(self) -> None:
        self.server.close()
        await self.runner.cleanup()


async def start_server(app: web.Application, host: str = "127.0.0.1", port: int = 0) -> RunningServer:
    """Start ``app`` (from :func:`make_app`) on the running loop. The protocol factory counts each accepted TCP
    connection for /stats."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    state = app[STATE]
    http = runner.server
    assert http is not None

    def factory() -> asyncio.Protocol:
        state.counters.connections_opened += 1
        return http()

    loop = asyncio.get_running_loop()
    server = await loop.create_server(factory, host, port, backlog=4096, reuse_address=True)
    bound = server.sockets[0].getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    return RunningServer(url=f"http://{shown}:{bound}", port=bound, state=state, runner=runner, server=server)
