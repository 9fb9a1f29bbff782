"""``kvcap serve-sim``: the simulator in real time behind an OpenAI-compatible streaming API.

Why: so that ``kvcap bench`` — or guidellm, ``vllm bench serve``, the ``openai`` package — can be pointed at a
simulated cluster and measured exactly like a real one. The HTTP side (completions and chat, SSE chunks,
``usage``, ``[DONE]``, validation errors) is the shared front end (:mod:`kvcap.serve`); the engine behind it
is the simulator, advanced to the wall clock, one engine step per event so every token leaves when its step ends.
``/metrics`` speaks vLLM's names (plus ``kvcap:num_requests_parked``), summed over replicas. ``--log`` appends
the simulator's own record of each request (bench's record format), to check a client's figures against.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import asdict
from pathlib import Path
from typing import Any

import orjson

from kvcap.aio import cancel_and_wait
from kvcap.serve.app import RunningServer, make_app, start_server
from kvcap.serve.engine import EngineLoad, Occupancy, TokenSlot
from kvcap.serve.metrics import Counter, Gauge, MetricFamily, RequestCounters
from kvcap.serve.protocol import ApiConfig
from kvcap.sim.cluster import ClusterModel
from kvcap.sim.request import SimRequest
from kvcap.sim.run import record_of


class _Handle(TokenSlot):
    __slots__ = ("req",)

    def __init__(self, req: SimRequest) -> None:
        super().__init__()
        self.req = req

    def ended(self) -> bool:
        return self.req.state == "done"  # failed or cancelled inside the simulator: nothing more will come


class RealTimeSim:
    """The front end's :class:`kvcap.serve.engine.Engine`, backed by the simulator; simulated time = loop time
    since start. Running/waiting high-water marks are sampled each time the simulator is advanced."""

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
        self.occupancy = Occupancy()

    # ---- engine interface
    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.t0 = loop.time()
        self._wake = asyncio.Event()
        self._task = loop.create_task(self._drive(), name="kvcap-serve-sim")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
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
        return await h.wait_for(n)

    def release(self, h: _Handle) -> None:
        """Abort the request in the simulator unless it is done (its client left, or a fault cut it)."""
        req = h.req
        if (req.state != "done" and 0 <= req.replica < len(self.sim.replicas)
                and self.sim.replicas[req.replica].abort(req, self.sim.now)):
            self.handles.pop(req.rid, None)

    # ---- simulator callbacks
    def _tokens(self, req: SimRequest) -> None:
        h = self.handles.get(req.rid)
        if h is None:
            return
        h.deliver(req.out)

    def _finished(self, req: SimRequest, now: float) -> None:
        self.finished += 1
        h = self.handles.pop(req.rid, None)
        if h is not None:
            h.wake()
        if self._log is not None:
            self._log.write(orjson.dumps(record_of(req, 0.0)) + b"\n")
            self._log.flush()

    async def _drive(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._wake is not None
        while True:
            self.sim.run_until(loop.time() - self.t0)
            self._observe()
            heap = self.sim.heap
            self._wake.clear()
            timeout = None if not heap else max(0.0, heap[0][0] - (loop.time() - self.t0))
            if timeout == 0.0:
                await asyncio.sleep(0)
                continue
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    # ---- /stats and /metrics
    def _observe(self) -> None:
        reps = self.sim.replicas
        self.occupancy.set_running(sum(len(r.running) for r in reps))
        self.occupancy.set_waiting(sum(len(r.waiting) for r in reps))

    def load(self) -> EngineLoad:
        self._observe()
        return self.occupancy.load()

    def metric_families(self, served: RequestCounters, started_wall: float) -> list[MetricFamily]:
        """vLLM's names summed over replicas, plus ``kvcap:num_requests_parked``; no ``*_created`` series."""
        reps, now = self.sim.replicas, self.load()
        return [
            Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", now.running),
            Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", now.waiting),
            Gauge("kvcap:num_requests_parked", "Requests whose KV is parked in an offload tier.",
                  sum(len(r.parked) + r.moving for r in reps)),
            Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                  sum(r.kv_usage() for r in reps) / len(reps)),
            Counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                    [("", sum(r.preemptions for r in reps))]),
            Counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                    [("", sum(r.prompt_tokens for r in reps))]),
            Counter("vllm:generation_tokens", "Number of generation tokens processed.",
                    [("", sum(r.generation_tokens for r in reps))]),
            *self._cache_config(),
        ]

    def _cache_config(self) -> list[MetricFamily]:
        """vLLM's ``cache_config_info`` (facts in labels, value 1), one series per replica labelled ``engine`` as
        data-parallel vLLM engines report theirs: what ``kvcap bench`` records and ``kvcap calibrate`` reads."""
        if self.cm.scenario.serving.engine != "vllm":
            return []
        out: list[MetricFamily] = []
        for i, r in enumerate(self.sim.replicas):
            cfg = r.cfg
            out.append(Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", 1.0,
                             f'block_size="{cfg.block_size}",enable_prefix_caching="{cfg.prefix_caching}",'
                             f'engine="{i}",num_gpu_blocks="{cfg.blocks}",'))
        return out


async def serve(cm: ClusterModel, host: str = "127.0.0.1", port: int = 8000, log: Path | None = None,
                model_name: str | None = None) -> tuple[RunningServer, RealTimeSim]:
    """Start serve-sim on the running loop; returns the server (``.url``, ``.close()``) and the engine."""
    engine = RealTimeSim(cm, log)
    name = model_name or cm.inputs.model.name
    max_len = cm.inputs.model.max_position_embeddings or 131072
    api = ApiConfig(model_name=name, max_model_len=max_len)
    server = await start_server(make_app(api, engine, config={**asdict(api), "mode": "simulated"}), host, port)
    return server, engine


def describe(cm: ClusterModel) -> dict[str, Any]:
    p = cm.plan
    return {"model": cm.inputs.model.name, "gpu": p.gpu, "replicas": p.replicas,
            "kv_tokens_per_replica": p.kv_tokens_per_gpu, "kv_offload": cm.scenario.serving.kv_offload}
