"""A scenario turned into simulator parts: replicas (KV blocks from :mod:`kvcap.plan`, a cost model), memory
tiers and the links between them. KV arithmetic is not redone here: blocks per replica and bytes per token
are the plan's, so the simulator's residency is the plan's by construction (a test holds them together)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from kvcap.plan import PlanInputs, PlanResult, kv_bytes_per_sequence, plan, resolve
from kvcap.sim.cost import cost_model
from kvcap.sim.cost_empirical import EmpiricalCost
from kvcap.sim.engine import Simulation
from kvcap.sim.kv import Tier
from kvcap.sim.links import Link, LinkSet
from kvcap.sim.policy import SchedulingPolicy
from kvcap.sim.policy_llamacpp import LlamaCppPolicy
from kvcap.sim.policy_vllm import VllmPolicy
from kvcap.sim.replica_state import ReplicaConfig
from kvcap.sim.request import SimRequest
from kvcap.sim.step_cost import StepCostModel
from kvcap.sim.tiers import tier_rules
from kvcap.specs.scenario import Scenario


@dataclass(frozen=True)
class ClusterModel:
    """Everything needed to build a fresh :class:`Simulation` for one level (state never leaks across)."""

    scenario: Scenario
    inputs: PlanInputs
    plan: PlanResult
    max_span: int | None = None
    """Longest decode span in steps (1: one event per step, as step-level simulators advance; a benchmark's
    baseline). None: as long as nothing changes."""

    @property
    def replicas(self) -> int:
        return self.plan.replicas

    def build(self, on_finish: Callable[[SimRequest, float], None] | None = None) -> Simulation:
        sc, p, inputs = self.scenario, self.plan, self.inputs
        sv, cl = sc.serving, sc.cluster
        per_replica = sv.tensor_parallel * sv.pipeline_parallel
        links = LinkSet()
        inter = inputs.interconnect
        nics = [links.add(Link(f"nic{n}", "nic", inter.bytes_s, inter.effective_bytes_s, inter.latency_s, node=n))
                for n in range(cl.nodes)]
        pool: tuple[Link, ...] = ()
        if cl.remote_memory_bandwidth is not None and "remote" in sv.tiers:
            bw = cl.remote_memory_bandwidth
            pool = (links.add(Link("pool", "pool", bw, bw * inter.efficiency, inter.latency_s)),)
        tiers: dict[str, list[Tier]] = {}
        host_per_replica = sv.host_kv_scope == "replica"
        for t in p.tiers:
            if t.name == "host" and host_per_replica:
                tiers["host"] = [Tier("host", replica_host_bytes(sc, p.kv_bytes_per_token)) for _ in range(p.replicas)]
            elif t.name == "host":
                per_node = (sv.host_kv_tokens * p.kv_bytes_per_token if sv.host_kv_tokens is not None
                            else t.capacity_bytes / cl.nodes)
                tiers["host"] = [Tier("host", per_node) for _ in range(cl.nodes)]
            elif t.name == "remote":
                tiers["remote"] = [Tier("remote", t.capacity_bytes)]
        cost = _cost(self)
        blocks_for = _blocks_for(self)
        policy, blocks = _policy(self, blocks_for)
        configs = []
        for r in range(p.replicas):
            first, last = r * per_replica, (r + 1) * per_replica - 1
            nodes = sorted({g // cl.gpus_per_node for g in range(first, last + 1)})
            host = inputs.host_link
            host_link = links.add(Link(f"pcie{r}", "host", host.bytes_s * per_replica,
                                       host.effective_bytes_s * per_replica, host.latency_s, node=nodes[0]))
            configs.append(ReplicaConfig(
                blocks=blocks, block_size=sv.block_size, max_num_seqs=sv.max_num_seqs,
                max_num_batched_tokens=sv.max_num_batched_tokens, chunked_prefill=sv.chunked_prefill, cost=cost,
                kv_bytes_per_token=p.kv_bytes_per_token, hash_block_tokens=sv.hash_block_tokens,
                prefix_caching=sv.enable_prefix_caching and sv.engine == "vllm",
                park_after_prefill=bool(tiers) and sv.offload_admission == "tiers",  # storage parks nothing
                node=nodes[0], host_link=host_link,
                nic_links=tuple(nics[n] for n in nodes), blocks_for=blocks_for,
                max_model_len=inputs.model.max_position_embeddings or None))
        overhead = sv.step_cost.per_request if sv.step_cost is not None else 0.0
        sim = Simulation(configs, tiers, links, policy, routing=sv.routing, pool_links=pool, on_finish=on_finish,
                         request_overhead_s=overhead, host_per_replica=host_per_replica)
        sim.max_span = self.max_span
        _configure_tiers(self, sim, links)
        return sim


def _configure_tiers(cm: ClusterModel, sim: Simulation, links: LinkSet) -> None:
    """Give every replica the profile's prefix rules and, with ``storage`` in ``kv_offload``, the one storage tier
    they all share (reached over each node's NICs, capped by the store's read and write bandwidths). It joins
    ``sim.tiers`` after the replicas took their host and remote views, so parking never goes there; telemetry
    and the warm carry across levels see it as a tier like the others."""
    sv, cl = cm.scenario.serving, cm.scenario.cluster
    rules = tier_rules(sv.kv_tier_profile, sv.hicache_write_policy)
    store = cl.shared_storage if "storage" in sv.tiers else None
    if store is None:
        if sv.kv_tier_profile != "default":
            for rep in sim.replicas:
                rep.tiers.configure(rules)
        return
    storage = Tier("storage", float(store.capacity))
    eff = cm.inputs.interconnect.efficiency
    read = links.add(Link("storage-read", "storage", store.read_bandwidth, store.read_bandwidth * eff, store.latency))
    write = links.add(Link("storage-write", "storage", store.write_bandwidth, store.write_bandwidth * eff,
                           store.latency))
    sim.tiers["storage"] = [storage]
    for rep in sim.replicas:
        rep.tiers.configure(rules, storage, (read,), (write,))
    sim.tiers_changed()


def replica_host_bytes(sc: Scenario, kv_bytes_per_token: float) -> float:
    """One replica's own host tier (``host_kv_scope: replica``): ``host_kv_tokens`` of the replica's KV, or
    ``host_kv_capacity`` bytes (the spec refuses a per-replica tier with neither)."""
    sv = sc.serving
    if sv.host_kv_tokens is not None:
        return sv.host_kv_tokens * kv_bytes_per_token
    assert sv.host_kv_capacity is not None
    return float(sv.host_kv_capacity)


def _cost(cm: ClusterModel) -> StepCostModel:
    """``serving.step_cost`` when measured, else the roofline for the model on the GPU."""
    sc, inputs = cm.scenario, cm.inputs
    sv = sc.serving
    if sv.step_cost is not None:
        c = sv.step_cost
        return EmpiricalCost(inputs.model, base=c.base, per_decode=c.per_decode,
                             per_prefill_token=c.per_prefill_token, per_context_token=c.per_context_token,
                             floor=c.floor, per_waiting=c.per_waiting)
    return cost_model(inputs.model, inputs.gpu, tp=sv.tensor_parallel, weights_dtype=cm.plan.weights_dtype,
                      kv_dtype=sc.model.kv_dtype)


def slot_context(cm: ClusterModel) -> int:
    """llama.cpp's per-slot context: the pool split evenly over the slots, capped at the model's context (the
    server caps ``n_ctx_seq`` at ``n_ctx_train``)."""
    ctx = cm.plan.slot_context_tokens or 0
    limit = cm.inputs.model.max_position_embeddings
    return min(ctx, limit) if limit else ctx


def _policy(cm: ClusterModel, blocks_for: Callable[[int], int] | None
            ) -> tuple[Callable[[], SchedulingPolicy], int]:
    """The engine profile's scheduling rules (a new policy per replica) and the replica's KV blocks (llamacpp: one
    context per slot)."""
    sv = cm.scenario.serving
    if sv.engine == "llamacpp":
        ctx, slots, split_kv = slot_context(cm), sv.max_num_seqs, not sv.kv_unified
        per_slot = blocks_for(ctx) if blocks_for is not None else -(-ctx // sv.block_size)

        def llamacpp() -> SchedulingPolicy:
            return LlamaCppPolicy(ctx, slots, split_kv=split_kv)

        return llamacpp, per_slot * slots
    return VllmPolicy, cm.plan.kv_blocks_per_gpu


def _blocks_for(cm: ClusterModel) -> Callable[[int], int] | None:
    """Block cost of a T-token sequence: ceil(T / block) for full attention; for sliding-window or hybrid
    models the plan's per-sequence bytes in block units (windowed layers stop growing, SSM state is fixed)."""
    model = cm.inputs.model
    if all(k == "full" for k in model.layer_kinds):
        return None
    p, sv = cm.plan, cm.scenario.serving
    block_bytes = p.kv_bytes_per_token_per_gpu * sv.block_size
    elem = p.kv_element_bytes
    cache: dict[int, int] = {}

    def blocks(tokens: int) -> int:
        hit = cache.get(tokens)
        if hit is None:
            hit = math.ceil(kv_bytes_per_sequence(model, tokens, elem, sv.block_size, sv.tensor_parallel,
                                                  sv.pipeline_parallel) / block_bytes - 1e-9)
            if len(cache) < 1_000_000:
                cache[tokens] = hit
        return hit

    return blocks


def cluster_model(scenario: Scenario) -> ClusterModel:
    inputs = resolve(scenario)
    return ClusterModel(scenario=scenario, inputs=inputs, plan=plan(inputs))
