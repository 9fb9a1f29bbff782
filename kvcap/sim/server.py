"""``kvcap serve-sim``: the simulator in real time behind an OpenAI-compatible streaming API.

Why: so that ``kvcap bench`` — or guidellm, ``vllm bench serve``, the ``openai`` package — can be pointed at a
simulated cluster and measured exactly like a real one. The HTTP side (completions and chat, SSE chunks,
``usage``, ``[DONE]``, validation errors) is the project's test server; the token clock behind it is the
simulator, advanced to the wall clock, one engine step per event so every token leaves when its step ends.
``/metrics`` speaks vLLM's names (plus ``kvcap:num_requests_parked``), summed over replicas. ``--log`` appends
the simulator's own record of each request (bench's record format), to check a client's figures against.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import orjson

from kvcap.sim.cluster import ClusterModel
from kvcap.sim.engine import SimRequest
from kvcap.sim.run import record_of
from kvcap.testing.server import FakeServerState, RunningServer, ServerConfig, start_server


class _Handle:
    __slots__ = ("produced", "req", "waiter", "want")

    def __init__(self, req: SimRequest) -> None:
        self.req = req
        self.produced = 0
        self.want = 0
        self.waiter: asyncio.Future[None] | None = None


class RealTimeSim:
    """The engine interface the test server expects (submit / wait / cancel / start / stop), backed by the
    simulator; simulated time = loop time since start."""

    def __init__(self, cm: ClusterModel, log: Path | None = None):
        self.cm = cm
        self.sim = cm.build(on_finish=self._finished)
        self.sim.max_span = 1
        self.sim.on_tokens = self._tokens
        self.handles: dict[int, _Handle] = {}
        self.rid = 0
        self.t0 = 0.0
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._log = open(log, "ab") if log is not None else None  # noqa: SIM115 - appended to per request
        self.finished = 0

    # ---- engine interface
    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.t0 = loop.time()
        self._wake = asyncio.Event()
        self._task = loop.create_task(self._drive(), name="kvcap-serve-sim")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._log is not None:
            self._log.close()

    def submit(self, t_arrival: float, prompt_tokens: int, n_out: int) -> _Handle:
        self.rid += 1
        t = max(t_arrival - self.t0, self.sim.now)
        req = SimRequest(rid=self.rid, arrival=t, prompt=max(1, prompt_tokens), max_out=n_out,
                         tags={"mode": "serve", "level": 0, "repeat": 0, "phase": "measure"})
        h = _Handle(req)
        self.handles[req.rid] = h
        self.sim.submit(req, t)
        assert self._wake is not None
        self._wake.set()
        return h

    async def wait(self, h: _Handle, n: int) -> bool:
        if h.produced >= n:
            return False
        loop = asyncio.get_running_loop()
        while h.produced < n:
            if h.req.state == "done" and h.produced < n:
                return True  # failed or cancelled inside the simulator: nothing more will come
            h.want = n
            h.waiter = loop.create_future()
            await h.waiter
        return True

    def cancel(self, h: _Handle) -> None:
        req = h.req
        if (req.state != "done" and 0 <= req.replica < len(self.sim.replicas)
                and self.sim.replicas[req.replica].abort(req, self.sim.now)):
            self.handles.pop(req.rid, None)

    # ---- simulator callbacks
    def _tokens(self, req: SimRequest) -> None:
        h = self.handles.get(req.rid)
        if h is None:
            return
        h.produced = req.out
        w = h.waiter
        if w is not None and h.produced >= h.want and not w.done():
            w.set_result(None)

    def _finished(self, req: SimRequest, now: float) -> None:
        self.finished += 1
        h = self.handles.pop(req.rid, None)
        if h is not None and h.waiter is not None and not h.waiter.done():
            h.waiter.set_result(None)
        if self._log is not None:
            self._log.write(orjson.dumps(record_of(req, 0.0)) + b"\n")
            self._log.flush()

    async def _drive(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._wake is not None
        while True:
            self.sim.run_until(loop.time() - self.t0)
            heap = self.sim.heap
            self._wake.clear()
            timeout = None if not heap else max(0.0, heap[0][0] - (loop.time() - self.t0))
            if timeout == 0.0:
                await asyncio.sleep(0)
                continue
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    # ---- /metrics
    def metrics(self, state: FakeServerState) -> str:
        reps = self.sim.replicas
        label = f'model_name="{state.cfg.model_name}"'
        values: list[tuple[str, str, str, float]] = [
            ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
             sum(len(r.running) for r in reps)),
            ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
             sum(len(r.waiting) for r in reps)),
            ("kvcap:num_requests_parked", "gauge", "Requests whose KV is parked in an offload tier.",
             sum(len(r.parked) + r.moving for r in reps)),
            ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
             sum(r.kv_usage() for r in reps) / len(reps)),
            ("vllm:num_preemptions_total", "counter", "Cumulative number of preemption from the engine.",
             sum(r.preemptions for r in reps)),
            ("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
             sum(r.prompt_tokens for r in reps)),
            ("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.",
             sum(r.generation_tokens for r in reps)),
        ]
        out: list[str] = []
        for name, kind, help_, value in values:
            out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name}{{{label}}} {float(value)!r}"]
        return "\n".join(out) + "\n"


async def serve(cm: ClusterModel, host: str = "127.0.0.1", port: int = 8000, log: Path | None = None,
                model_name: str | None = None) -> tuple[RunningServer, RealTimeSim]:
    """Start serve-sim on the running loop; returns the server (``.url``, ``.close()``) and the engine."""
    engine = RealTimeSim(cm, log)
    name = model_name or cm.inputs.model.name
    max_len = cm.inputs.model.max_position_embeddings or 131072
    cfg = ServerConfig(model_name=name, max_model_len=max_len)
    server = await start_server(cfg, host, port, engine=engine, metrics=engine.metrics)
    return server, engine


def describe(cm: ClusterModel) -> dict[str, Any]:
    p = cm.plan
    return {"model": cm.inputs.model.name, "gpu": p.gpu, "replicas": p.replicas,
            "kv_tokens_per_replica": p.kv_tokens_per_gpu, "kv_offload": cm.scenario.serving.kv_offload}
