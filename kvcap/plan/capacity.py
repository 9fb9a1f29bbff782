"""Capacity arithmetic: what fits per GPU and per memory tier, token rates, Little's law, link budget.

The article's sizing method made exact: the memory a serving engine keeps out of the KV pool and the per-layer KV
rules (:mod:`kvcap.plan.memory`), block rounding, whole requests per tier, and the link traffic that parked
sequences cost when they are brought back to HBM to decode. Pure functions; the simulator's tiers call them too.
"""

from __future__ import annotations

from pydantic import BaseModel

from kvcap.errors import InputError
from kvcap.plan.fit import FIT_RULE, FitOption, fit_options
from kvcap.plan.inputs import PlanInputs
from kvcap.plan.memory import (
    given_pool,
    kv_blocks,
    kv_bytes_per_sequence,
    kv_bytes_per_token,
    kv_element_bytes,
    memory_budget,
    no_room_problem,
    resolved_kv_dtype,
    slot_tokens,
    ssm_state_bytes,
)
from kvcap.specs.model import ModelSpec
from kvcap.units import bytes_s_to_gbps

ASSUMED_TPOT_S = 0.05
ASSUMED_TTFT_S = 0.5


class Tier(BaseModel):
    name: str
    capacity_bytes: float
    """Bytes given to KV in this tier, whole cluster."""
    requests: int
    link: str | None = None


class LinkBudget(BaseModel):
    tier: str
    link_name: str
    parked_requests: int
    parked_per_link: float
    required_bytes_s: float
    capacity_bytes_s: float
    required_gbps: float
    capacity_gbps: float
    utilization: float
    decode_in_place_s_per_step: float
    """Time to stream the parked sequences' KV over the link once: what one decode step would wait."""


class PlanResult(BaseModel):
    model: str
    model_source: str
    attention_kind: str
    gpu: str
    nodes: int
    gpus_per_node: int
    gpus: int
    tensor_parallel: int
    pipeline_parallel: int
    replicas: int
    weights_dtype: str
    kv_dtype: str
    kv_element_bytes: float
    num_parameters: int
    parameters_source: str
    kv_bytes_per_token: float
    kv_bytes_per_token_per_gpu: float
    weights_bytes: float
    weights_bytes_per_gpu: float
    gpu_memory_bytes: float
    gpu_memory_utilization: float
    activation_peak_bytes_per_gpu: float
    runtime_overhead_bytes_per_gpu: float
    reserve_bytes_per_gpu: float
    usable_kv_bytes_per_gpu: float
    block_size: int
    kv_blocks_per_gpu: int
    kv_tokens_per_gpu: int
    input_tokens: int
    output_tokens: int
    tokens_per_request: int
    kv_bytes_per_request: float
    kv_bytes_per_request_per_gpu: float
    max_num_seqs: int
    slot_context_tokens: int | None = None
    """llamacpp: each slot's context (the KV pool split over ``max_num_seqs`` slots); None for paged engines."""
    resident_requests: dict[str, int]
    resident_requests_per_gpu: dict[str, float]
    tiers: list[Tier]
    rate: float | None = None
    input_tok_s: float | None = None
    output_tok_s: float | None = None
    response_time_s: float | None = None
    response_time_assumed: bool = False
    active_sequences: float | None = None
    in_flight: float | None = None
    in_flight_source: str | None = None
    link: dict[str, float | str] | None = None
    links: list[LinkBudget] = []
    fits: bool = True
    """Weights, activations, overhead and reserve fit on one GPU with KV room for at least one request."""
    fit_problem: str | None = None
    fit_options: list[FitOption] = []
    assumptions: list[str] = []
    warnings: list[str] = []


def plan(inputs: PlanInputs, *, allow_unfit: bool = False) -> PlanResult:
    """Per-GPU and cluster capacity for the scenario.

    When the weights or the KV pool do not fit on one GPU this raises InputError (the simulator cannot build such
    a cluster), unless ``allow_unfit``: then the result says ``fits: false``, why, and ``fit_options`` (the
    smallest parallelism per weights dtype that fits) — `kvcap plan` answers instead of refusing.
    """
    sc, model, gpu = inputs.scenario, inputs.model, inputs.gpu
    sv, cl, wl = sc.serving, sc.cluster, sc.workload
    tp, pp = sv.tensor_parallel, sv.pipeline_parallel
    replicas = replica_count(cl.gpus, tp, pp)
    elem = kv_element_bytes(model, sc.model.kv_dtype, inputs.weights_dtype)
    mem = memory_budget(model, gpu.memory_bytes, sv, inputs.weights_dtype, tp, pp)
    tok_gpu = kv_bytes_per_token(model, elem, tp, pp)
    assumptions: list[str] = []
    if sv.kv_tokens is not None:
        mem = given_pool(mem, sv.kv_tokens, tok_gpu, sv.block_size)
        assumptions.append(f"serving.kv_tokens={sv.kv_tokens} sets the KV pool per replica; the GPU memory "
                           "arithmetic (weights, activations, overhead) is not used for it")
        problem = None
    else:
        problem = no_room_problem(model, gpu, sv, inputs.weights_dtype, tp, pp, mem)
    if problem and not allow_unfit:
        raise InputError(problem)

    tokens_req = wl.input_mean + wl.output_mean
    req_gpu = kv_bytes_per_sequence(model, tokens_req, elem, sv.block_size, tp, pp)
    req_total = kv_bytes_per_sequence(model, tokens_req, elem, sv.block_size)
    blocks = kv_blocks(mem.usable, tok_gpu, sv.block_size) if sv.kv_tokens is None else sv.kv_tokens // sv.block_size
    slot_ctx = slot_tokens(sv.kv_tokens if sv.kv_tokens is not None else blocks * sv.block_size,
                           sv.max_num_seqs) if sv.engine == "llamacpp" else None
    fits = problem is None and (mem.usable >= req_gpu if slot_ctx is None else tokens_req <= slot_ctx)
    if problem is None and not fits:
        problem = (f"{mem.usable / 2**30:.2f} GiB per GPU left for KV on {gpu.name} is less than one request of "
                   f"{tokens_req} tokens ({req_gpu / 2**30:.2f} GiB per GPU at tp={tp}, pp={pp})"
                   if slot_ctx is None else
                   f"a llamacpp slot holds {slot_ctx} tokens, less than one request of {tokens_req} tokens")
    warnings: list[str] = []
    if model.max_position_embeddings and tokens_req > model.max_position_embeddings:
        warnings.append(f"{tokens_req} tokens per request exceed the model's context of "
                        f"{model.max_position_embeddings}")

    if slot_ctx is None:
        fit_hbm = max(0, int(mem.usable // req_gpu))
    else:
        fit_hbm = sv.max_num_seqs if tokens_req <= slot_ctx else 0
    if slot_ctx is not None:
        assumptions.append(f"llamacpp: {sv.max_num_seqs} slots of {slot_ctx} tokens each (split KV): a slot holds "
                           "one request whatever its length")
    if fit_hbm > sv.max_num_seqs:
        assumptions.append(f"HBM could hold {fit_hbm} requests per replica; max_num_seqs={sv.max_num_seqs} caps it")
    tiers = [Tier(name="hbm", capacity_bytes=max(0.0, mem.usable) * cl.gpus,
                  requests=min(fit_hbm, sv.max_num_seqs) * replicas)]
    tiers += offload_tiers(inputs, req_total, assumptions)
    if not fits:
        tiers = [t.model_copy(update={"requests": 0}) for t in tiers]
        warnings.insert(0, "does not fit (see fit_problem): no tier holds a request until it does; fit_options "
                           "gives the smallest parallelism per weights dtype that fits")
    resident = resident_counts(tiers)

    result = PlanResult(
        model=model.name, model_source=model.source, attention_kind=model.attention_kind, gpu=gpu.name,
        nodes=cl.nodes, gpus_per_node=cl.gpus_per_node, gpus=cl.gpus, tensor_parallel=tp, pipeline_parallel=pp,
        replicas=replicas, weights_dtype=inputs.weights_dtype,
        kv_dtype=resolved_kv_dtype(sc.model.kv_dtype, inputs.weights_dtype), kv_element_bytes=elem,
        num_parameters=model.num_parameters, parameters_source=model.parameters_source,
        kv_bytes_per_token=kv_bytes_per_token(model, elem), kv_bytes_per_token_per_gpu=tok_gpu,
        weights_bytes=mem.weights_total, weights_bytes_per_gpu=mem.weights_gpu, gpu_memory_bytes=gpu.memory_bytes,
        gpu_memory_utilization=sv.gpu_memory_utilization, activation_peak_bytes_per_gpu=mem.activation,
        runtime_overhead_bytes_per_gpu=sv.runtime_overhead, reserve_bytes_per_gpu=sv.reserve,
        usable_kv_bytes_per_gpu=mem.usable, block_size=sv.block_size, kv_blocks_per_gpu=blocks,
        kv_tokens_per_gpu=blocks * sv.block_size, input_tokens=wl.input_mean, output_tokens=wl.output_mean,
        tokens_per_request=tokens_req, kv_bytes_per_request=req_total, kv_bytes_per_request_per_gpu=req_gpu,
        max_num_seqs=sv.max_num_seqs, slot_context_tokens=slot_ctx, resident_requests=resident,
        resident_requests_per_gpu={k: v / cl.gpus for k, v in resident.items()}, tiers=tiers,
        fits=fits, fit_problem=None if fits else problem,
        fit_options=[] if fits else fit_options(inputs, tokens_req), assumptions=assumptions, warnings=warnings,
    )
    _add_rates(result, inputs)
    _add_links(result, inputs)
    _add_model_notes(result, model, inputs)
    if not fits:
        result.assumptions.append(FIT_RULE)
    return result


def replica_count(gpus: int, tp: int, pp: int) -> int:
    """Whole replicas of tp×pp GPUs; a remainder is bad input (the GPUs would sit unused)."""
    if gpus % (tp * pp):
        raise InputError(f"{gpus} GPUs cannot be split into replicas of tp×pp = {tp * pp}")
    return gpus // (tp * pp)


def offload_tiers(inputs: PlanInputs, req_total: float, assumptions: list[str]) -> list[Tier]:
    """Host and remote KV tiers the scenario asks for, whole requests each (a request's KV lives in one tier)."""
    sv, cl = inputs.scenario.serving, inputs.scenario.cluster
    tiers: list[Tier] = []
    host_cap_node = sv.host_kv_capacity
    if host_cap_node is None and cl.host_memory is not None:
        host_cap_node = cl.host_memory // 2
        assumptions.append(f"host memory for KV = 50% of {cl.host_memory / 2**30:.0f} GiB per node "
                           "(set serving.host_kv_capacity to change)")
    if "host" in sv.tiers:
        if host_cap_node is None:
            raise InputError("kv_offload includes host but no host memory is given (--host-mem or "
                             "cluster.host_memory)")
        tiers.append(Tier(name="host", capacity_bytes=host_cap_node * cl.nodes,
                          requests=int(host_cap_node // req_total) * cl.nodes, link=inputs.host_link.name))
    if "remote" in sv.tiers:
        if cl.remote_memory is None:
            raise InputError("kv_offload includes remote but no remote memory is given (--remote-mem or "
                             "cluster.remote_memory)")
        tiers.append(Tier(name="remote", capacity_bytes=cl.remote_memory,
                          requests=int(cl.remote_memory // req_total), link=inputs.interconnect.name))
    return tiers


def resident_counts(tiers: list[Tier]) -> dict[str, int]:
    """Requests per tier name (every tier named, 0 where absent) and their total."""
    resident = {t: 0 for t in ("hbm", "host", "remote")}
    for t in tiers:
        resident[t.name] = t.requests
    resident["total"] = sum(t.requests for t in tiers)
    return resident


def _add_rates(r: PlanResult, inputs: PlanInputs) -> None:
    """Token rates from the request rate; active sequences by Little's law (L = λ·W)."""
    if inputs.response_time_s is not None:
        r.response_time_s = inputs.response_time_s
    if inputs.rate is None:
        return
    if inputs.rate <= 0:
        raise InputError(f"--rate must be positive, got {inputs.rate:g}")
    r.rate = inputs.rate
    r.input_tok_s = inputs.rate * r.input_tokens
    r.output_tok_s = inputs.rate * r.output_tokens
    if inputs.response_time_s is not None:
        r.active_sequences = inputs.rate * inputs.response_time_s
        if r.active_sequences > r.resident_requests["total"]:
            r.warnings.append(
                f"Little's law: {inputs.rate:g} req/s × {inputs.response_time_s:g} s = "
                f"{r.active_sequences:.1f} sequences in flight, more than the {r.resident_requests['total']} "
                "that fit: requests will queue and the response time will grow")


def _add_links(r: PlanResult, inputs: PlanInputs) -> None:
    """Traffic to bring parked sequences back to HBM, against each offload tier's link.

    A parked sequence cannot decode where it is (decode re-reads its whole KV every step); it must be swapped
    in. The least traffic a scheduler can achieve is one swap-in of each parked sequence's KV per response
    time, so the required rate is parked × KV bytes / response time, per link. The in-flight count is the
    given concurrency, else Little's law when a rate and response time are given, else every resident slot.
    """
    offload = [t for t in r.tiers if t.name != "hbm"]
    if not offload:
        return
    resp = r.response_time_s
    if resp is None:
        resp = ASSUMED_TTFT_S + r.output_tokens * ASSUMED_TPOT_S
        r.response_time_assumed = True
        r.assumptions.append(f"response time assumed {resp:g} s (TTFT {ASSUMED_TTFT_S:g} s + "
                             f"{r.output_tokens} × TPOT {ASSUMED_TPOT_S * 1e3:g} ms); give --response-time")
    if inputs.concurrency is not None:
        in_flight, r.in_flight_source = float(inputs.concurrency), "concurrency"
    elif r.active_sequences is not None:
        in_flight, r.in_flight_source = r.active_sequences, "little's law"
    else:
        in_flight, r.in_flight_source = float(r.resident_requests["total"]), "all resident slots"
        r.assumptions.append("in flight = every resident slot (give --concurrency or --rate with --response-time)")
    r.in_flight = in_flight
    if in_flight > r.resident_requests["total"]:
        r.warnings.append(f"{in_flight:g} requests in flight exceed the {r.resident_requests['total']} that can "
                          "reside: the rest queue")
    remaining = max(0.0, in_flight - r.resident_requests["hbm"])
    inter = inputs.interconnect
    for tier in offload:
        parked = min(remaining, float(tier.requests))
        remaining -= parked
        if tier.name == "host":
            link, n_links = inputs.host_link, r.gpus
        else:
            link, n_links = inter, r.nodes
        per_link = parked / n_links
        required = per_link * r.kv_bytes_per_request / resp
        cap = link.bytes_s
        budget = LinkBudget(
            tier=tier.name, link_name=link.name, parked_requests=round(parked), parked_per_link=per_link,
            required_bytes_s=required, capacity_bytes_s=cap, required_gbps=bytes_s_to_gbps(required),
            capacity_gbps=bytes_s_to_gbps(cap), utilization=required / cap,
            decode_in_place_s_per_step=per_link * r.kv_bytes_per_request / link.effective_bytes_s
            + link.latency_s)
        r.links.append(budget)
        where = "per GPU (PCIe)" if tier.name == "host" else "per node (NIC)"
        if required > cap * link.efficiency:
            r.warnings.append(
                f"{tier.name} tier: swapping parked sequences back needs {budget.required_gbps:.1f} Gbps "
                f"{where}, more than the {link.name}'s {budget.capacity_gbps:.0f} Gbps "
                f"× {link.efficiency:g} achievable")
        elif required > 0.7 * cap * link.efficiency:
            r.warnings.append(f"{tier.name} tier: swap-in traffic would use {budget.utilization:.0%} of the "
                              f"{link.name} {where}: little headroom for queueing or other traffic")
    remote = next((b for b in r.links if b.tier == "remote"), None)
    chosen = remote or r.links[0]
    r.link = {"tier": chosen.tier, "required_gbps": chosen.required_gbps, "capacity_gbps": chosen.capacity_gbps,
              "required_gb_s": chosen.required_bytes_s / 1e9, "capacity_gb_s": chosen.capacity_bytes_s / 1e9,
              "decode_in_place_ms_per_step": chosen.decode_in_place_s_per_step * 1e3}


def _add_model_notes(r: PlanResult, model: ModelSpec, inputs: PlanInputs) -> None:
    a = r.assumptions
    if inputs.scenario.serving.kv_tokens is None:
        a.insert(0, f"usable KV per GPU = {r.gpu_memory_bytes / 2**30:.2f} GiB × {r.gpu_memory_utilization:g} − "
                    f"weights {r.weights_bytes_per_gpu / 2**30:.2f} GiB − activation peak "
                    f"{r.activation_peak_bytes_per_gpu / 2**30:.2f} GiB − runtime overhead "
                    f"{r.runtime_overhead_bytes_per_gpu / 2**30:.2f} GiB − reserve "
                    f"{r.reserve_bytes_per_gpu / 2**30:.2f} GiB")
    a.append(f"KV per request = {r.tokens_per_request} tokens ({r.input_tokens} in + {r.output_tokens} out) "
             f"rounded up to blocks of {r.block_size}")
    if model.parameters_source == "estimated":
        a.append(f"parameter count estimated from the config's shapes ({model.num_parameters / 1e9:.2f} B); "
                 "pass model.num_parameters for the exact figure")
    if model.moe is not None:
        a.append(f"MoE: weights count all {model.moe.num_experts} experts "
                 f"({model.active_parameters / 1e9:.1f} B of {model.num_parameters / 1e9:.1f} B active per token)")
    if model.sliding_window:
        n = sum(k == "sliding" for k in model.layer_kinds)
        a.append(f"{n} of {model.num_layers} layers use a {model.sliding_window}-token sliding window: they hold "
                 f"min(T, {model.sliding_window}) tokens")
    if model.ssm_state_elements:
        n = sum(k in ("ssm", "linear") for k in model.layer_kinds)
        a.append(f"{n} SSM/linear-attention layers hold a fixed {ssm_state_bytes(model) / 2**20:.1f} MiB state "
                 "per sequence; only attention layers grow with tokens")
    if model.attention == "mla":
        a.append("MLA: one latent per layer (kv_lora_rank + rope dims), not split by tensor parallelism")
    if inputs.weights_dtype in ("int4", "int8", "fp8"):
        a.append("quantized weights: embeddings and LM head kept in 16-bit")
