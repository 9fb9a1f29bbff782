"""``kvcap serve-sim``: the simulator in real time behind an OpenAI-compatible streaming API.

Why: so that ``kvcap bench`` — or guidellm, ``vllm bench serve``, the ``openai`` package — can be pointed at a
simulated cluster and measured exactly like a real one. The HTTP side (completions and chat, SSE chunks,
``usage``, ``[DONE]``, validation errors) is the shared front end (:mod:`kvcap.serve`); the engine behind it
is the simulator, advanced to the wall clock, one engine step per event so every token leaves when its step ends.
``/metrics`` speaks vLLM's names (plus ``kvcap:num_requests_parked``), summed over replicas; the prefix-reuse
counters (``vllm:prefix_cache_*``, ``vllm:external_prefix_cache_*``) and the offload bytes per tier link are per
replica, labelled ``engine`` as data-parallel vLLM engines label theirs. Prompts are hashed into blocks of
``serving.hash_block_tokens`` (:mod:`kvcap.workload.blocks`), so a shared prefix is a shared prefix here too.
vLLM's ``prompt_tokens_by_source`` splits the prompt tokens the same way (computed, HBM hit, loaded from a tier).
With ``serving.kv_tier_profile`` ``lmcache`` or ``kvbm`` the tiers are also shown under that connector's own names
(:mod:`kvcap.sim.connector_metrics`). ``--log`` appends the simulator's own record of each request (bench's
record format), to check a client's figures against.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
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
from kvcap.sim.connector_metrics import CONNECTOR_PROFILES, ConnectorMetrics
from kvcap.sim.records import record_of
from kvcap.sim.request import SimRequest
from kvcap.sim.sampler import ReuseCounters, looks_up_prefixes
from kvcap.specs.scenario import VLLM_NULL_BLOCKS


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
        self.reuse = ReuseCounters(len(self.sim.replicas))
        """Prompt tokens looked up and found per replica, counted as each request completes."""
        self.hbm_lookup, self.tier_lookup = looks_up_prefixes(self.sim)
        serving = cm.scenario.serving
        self.connector = (ConnectorMetrics(self.sim, serving.kv_tier_profile, serving.hash_block_tokens)
                          if self.tier_lookup and serving.kv_tier_profile in CONNECTOR_PROFILES else None)
        """The tier profile's connector, whose own names ``/metrics`` also speaks (None: vLLM's only)."""

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
        return self.submit_blocks(t_arrival, prompt_tokens, n_out, ())

    @property
    def prefix_block_tokens(self) -> int | None:
        """The simulator's hash block size where its replicas cache prefixes (the front end then hashes)."""
        return self.cm.scenario.serving.hash_block_tokens if self.hbm_lookup else None

    def submit_blocks(self, t_arrival: float, prompt_tokens: int, n_out: int, block_hashes: Sequence[int]) -> _Handle:
        """A request with its prompt's block hashes (none: it shares nothing with any other)."""
        self.rid += 1
        t = max(t_arrival - self.t0, self.sim.now)
        req = SimRequest(rid=self.rid, arrival=t, prompt=max(1, prompt_tokens), max_out=n_out,
                         hashes=tuple(block_hashes),
                         tags={"mode": "serve", "level": 0, "repeat": 0, "phase": "measure"})
        h = _Handle(req)
        self.handles[req.rid] = h
        self.sim.submit(req, t)
        assert self._wake is not None
        self._wake.set()
        return h

    def cached_tokens(self, h: _Handle) -> int:
        """Prompt tokens the request found in HBM or loaded from the tier (0 until it was admitted)."""
        return h.req.hit_hbm + h.req.hit_tier

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
        self.reuse.count(req)
        if self.connector is not None:
            self.connector.count(req)
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
            *self._reuse(),
            *(self.connector.families() if self.connector is not None else ()),
        ]

    def _reuse(self) -> list[MetricFamily]:
        """Per replica (``engine``): vLLM's prefix-cache token counters, HBM and, with a tier, the connector's, and
        its prompt tokens by source (computed, found in HBM, loaded from a tier); the bytes each tier link carried,
        per direction — vLLM's offloading connector's ``kv_offload_total_bytes`` for a replica's host link,
        ``kvcap:kv_link_bytes`` for every tier link (a NIC or the pool serves several)."""
        r, reps = self.reuse, self.sim.replicas
        out: list[MetricFamily] = []
        if self.hbm_lookup:
            out += [Counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                            [(f'engine="{i}",', r.queries[i]) for i in range(len(reps))]),
                    Counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                            [(f'engine="{i}",', r.hits[i]) for i in range(len(reps))]),
                    Counter("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", [
                        (f'engine="{i}",source="{source}",', n) for i in range(len(reps)) for source, n in (
                            ("local_compute", r.queries[i] - r.hits[i] - r.tier_hits[i]),
                            ("local_cache_hit", r.hits[i]), ("external_kv_transfer", r.tier_hits[i]))])]
        if self.tier_lookup:
            out += [Counter("vllm:external_prefix_cache_queries",
                            "External prefix cache queries from KV connector cross-instance cache sharing, in terms "
                            "of number of queried tokens.",
                            [(f'engine="{i}",', r.tier_queries[i]) for i in range(len(reps))]),
                    Counter("vllm:external_prefix_cache_hits",
                            "External prefix cache hits from KV connector cross-instance cache sharing, in terms of "
                            "number of cached tokens.",
                            [(f'engine="{i}",', r.tier_hits[i]) for i in range(len(reps))])]
        links = self.sim.links
        kinds = {"host"} if "host" in self.sim.tiers else set()
        if "remote" in self.sim.tiers:
            kinds |= {"nic", "pool"}  # as the sampler: the links a tier's copies cross
        tier_links = [link for link in links.links if link.kind in kinds]
        if not tier_links:
            return out
        links.advance(self.sim.now)
        host = [(i, rep.cfg.host_link) for i, rep in enumerate(reps) if rep.cfg.host_link is not None
                and "host" in self.sim.tiers]
        if host:
            out.append(Counter("vllm:kv_offload_total_bytes", "Number of bytes offloaded by KV connector.", [
                (f'engine="{i}",transfer_type="{kind}",', round(b, 1)) for i, link in host
                for kind, b in (("GPU_to_CPU", link.tx_bytes), ("CPU_to_GPU", link.moved_bytes - link.tx_bytes))]))
        out.append(Counter("kvcap:kv_link_bytes", "Bytes of KV a tier link carried, out of the GPUs or back in.", [
            (f'link="{link.name}",kind="{link.kind}",direction="{d}",', round(b, 1)) for link in tier_links
            for d, b in (("out", link.tx_bytes), ("in", link.moved_bytes - link.tx_bytes))]))
        return out

    def _cache_config(self) -> list[MetricFamily]:
        """vLLM's ``cache_config_info`` (facts in labels, value 1), one series per replica labelled ``engine`` as
        data-parallel vLLM engines report theirs: what ``kvcap bench`` records and ``kvcap calibrate`` reads. vLLM's
        ``num_gpu_blocks`` counts the null block it holds back, so it is the usable pool plus one."""
        if self.cm.scenario.serving.engine != "vllm":
            return []
        out: list[MetricFamily] = []
        for i, r in enumerate(self.sim.replicas):
            cfg = r.cfg
            out.append(Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", 1.0,
                             f'block_size="{cfg.block_size}",enable_prefix_caching="{cfg.prefix_caching}",'
                             f'engine="{i}",num_gpu_blocks="{cfg.blocks + VLLM_NULL_BLOCKS}",'))
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
