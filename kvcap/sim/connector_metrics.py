"""serve-sim's offload tiers under the names the connectors' own servers give them: LMCache's multiprocess server
(``lmcache_mp_*``) with ``serving.kv_tier_profile: lmcache``, NVIDIA Dynamo's KV block manager (``kvbm_*``) with
``kvbm``; the vLLM-named counters stay beside them (the engine in front is vLLM).

Why a module apart from the server: which simulated tier each connector calls what, and in which unit, is a mapping
of its own. LMCache's L1 is its host memory (kvcap's ``host`` tier), its L2 whatever lies below (``remote``,
``storage``); it counts tokens and chunks (the profile's stored unit: 256 tokens where the hash block divides
them). KVBM's G2 is host memory and its G3 disk (the tiers below host); it counts blocks (a hash block each). The
values are the simulator's own: tokens loaded from each tier are counted as each request completes successfully,
as the vLLM-named reuse counters are, so over the tiers they sum to the records' ``tier_hit_tokens``; chunks or
blocks read are the units those tokens touch; writes, evictions and fill are each tier's own counts.

Unlike LMCache, whose lookup counts its hit from the prompt's first token, the hit counted here starts where vLLM's
own GPU prefix hit ends: the part the engine loaded, which is what the simulator knows.
"""

from __future__ import annotations

from collections import defaultdict

from kvcap.serve.metrics import Counter, Gauge, MetricFamily
from kvcap.sim.engine import Simulation
from kvcap.sim.kv import Tier
from kvcap.sim.request import SimRequest

CONNECTOR_PROFILES = ("lmcache", "kvbm")
"""The tier profiles whose connectors' names serve-sim also speaks."""
HOST = "host"


class TierLoads:
    """Per replica and tier, prompt tokens loaded and the ``unit_tokens`` units they touched, counted when a request
    completes successfully (the rule of :class:`kvcap.sim.sampler.ReuseCounters`, so the sums match its)."""

    def __init__(self, replicas: int, unit_tokens: int) -> None:
        self.unit = max(1, unit_tokens)
        self.tokens: list[dict[str, int]] = [defaultdict(int) for _ in range(replicas)]
        self.units: list[dict[str, int]] = [defaultdict(int) for _ in range(replicas)]

    def count(self, req: SimRequest) -> None:
        i = req.replica
        if req.error is not None or req.out < req.max_out or i < 0:
            return
        u = self.unit
        for tier, first, n in req.loaded_from:
            self.tokens[i][tier] += n
            self.units[i][tier] += -(-(first + n) // u) - first // u  # the units [first, first + n) reaches into

    def per_engine(self, of: list[dict[str, int]], host: bool) -> list[tuple[str, float]]:
        """One series per replica: the host tier's figure (``host``) or the tiers' below it."""
        return [(f'engine="{i}",', sum(v for t, v in d.items() if (t == HOST) == host)) for i, d in enumerate(of)]


class ConnectorMetrics:
    """The families of one profile's connector, from a running simulation (:meth:`families`)."""

    def __init__(self, sim: Simulation, profile: str, hash_block_tokens: int) -> None:
        self.sim, self.profile = sim, profile
        unit = hash_block_tokens
        if profile == "lmcache" and sim.replicas:
            unit *= sim.replicas[0].tiers.chunk_blocks(hash_block_tokens)
        self.loads = TierLoads(len(sim.replicas), unit)

    def count(self, req: SimRequest) -> None:
        self.loads.count(req)

    def families(self) -> list[MetricFamily]:
        return self._lmcache() if self.profile == "lmcache" else self._kvbm()

    def _tiers(self, host: bool) -> list[tuple[str, Tier]]:
        """(label, tier) of the host tiers (``host``) or of the ones below them: ``host0``, ``remote``, ..."""
        out: list[tuple[str, Tier]] = []
        for kind, group in self.sim.tiers.items():
            if (kind == HOST) == host:
                out += [(f"{kind}{i}" if kind == HOST else kind, t) for i, t in enumerate(group)]
        return out

    def _lmcache(self) -> list[MetricFamily]:
        loads = self.loads
        out: list[MetricFamily] = [
            Counter("lmcache_mp_lookup_hit_l1_tokens", "Prompt tokens found in L1 (host memory) and loaded.",
                    loads.per_engine(loads.tokens, host=True)),
            Counter("lmcache_mp_lookup_hit_l2_tokens", "Prompt tokens found below L1 and loaded.",
                    loads.per_engine(loads.tokens, host=False)),
        ]
        l1 = self._tiers(host=True)
        if not l1:
            return out
        out += [
            Counter("lmcache_mp_l1_read_chunks", "Chunks copied from L1 to the GPUs.",
                    loads.per_engine(loads.units, host=True)),
            Counter("lmcache_mp_l1_write_chunks", "Chunks stored in L1.",
                    [(f'tier="{name}",', t.stored) for name, t in l1]),
            Counter("lmcache_mp_l1_evicted_chunks", "Chunks dropped from L1 to make room.",
                    [(f'tier="{name}",', t.evicted) for name, t in l1]),
        ]
        out += [Gauge("lmcache_mp_l1_usage_ratio", "Part of L1 holding chunks.",
                      t.prefix_bytes / t.capacity if t.capacity else 0.0, f'tier="{name}",') for name, t in l1]
        return out

    def _kvbm(self) -> list[MetricFamily]:
        loads = self.loads
        host, below = self._tiers(host=True), self._tiers(host=False)
        matched = [(f'engine="{i}",', sum(d.values())) for i, d in enumerate(loads.tokens)]
        out: list[MetricFamily] = [
            Counter("kvbm_matched_tokens", "Prompt tokens found in the offload tiers and loaded.", matched, suffix=""),
            Counter("kvbm_onboard_blocks_h2d", "Blocks copied from host memory to the GPUs.",
                    loads.per_engine(loads.units, host=True), suffix=""),
            Counter("kvbm_onboard_blocks_d2d", "Blocks copied from disk to the GPUs.",
                    loads.per_engine(loads.units, host=False), suffix=""),
        ]
        if host:
            out.append(Counter("kvbm_offload_blocks_d2h", "Blocks copied from the GPUs to host memory.",
                               [(f'tier="{name}",', t.stored) for name, t in host], suffix=""))
        if below:  # with host memory in front a block reaches disk from there (h2d); without, straight from the GPU
            name, what = ("kvbm_offload_blocks_h2d", "host memory to disk") if host else (
                "kvbm_offload_blocks_d2d", "the GPUs to disk")
            out.append(Counter(name, f"Blocks copied from {what}.",
                               [(f'tier="{label}",', t.stored) for label, t in below], suffix=""))
        return out
