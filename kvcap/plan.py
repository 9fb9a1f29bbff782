"""Capacity arithmetic: KV bytes, what fits per GPU and per memory tier, token rates, Little's law, link budget.

The article's sizing method made exact: per-layer KV rules (GQA/MHA, MLA latents, sliding windows, SSM
state), the memory a serving engine keeps out of the KV pool (weights, activation peak, runtime overhead,
reserve — the way vLLM profiles it), block rounding, and the link traffic that parked sequences cost when
they are brought back to HBM to decode. Pure functions; the simulator's tiers call them too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pydantic import BaseModel

from kvcap.errors import InputError
from kvcap.specs.hardware import GpuSpec, LinkSpec, host_link_for, load_gpu, load_link
from kvcap.specs.model import ModelSpec, load_model
from kvcap.specs.scenario import Scenario, ServingSpec
from kvcap.units import bytes_s_to_gbps

DTYPE_BYTES: dict[str, float] = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp8": 1.0, "int8": 1.0,
                                 "int4": 0.5 + 2.5 / 128}
"""int4 includes a 16-bit scale and a 4-bit zero point per group of 128 (AWQ/GPTQ style)."""

SAMPLER_COPIES = 2
"""vLLM's profiling run samples max_num_seqs rows of fp32 logits; logits plus one working copy."""
ASSUMED_TPOT_S = 0.05
ASSUMED_TTFT_S = 0.5


def kv_element_bytes(model: ModelSpec, kv_dtype: str, weights_dtype: str) -> float:
    """'auto' means the model's 16-bit dtype (vLLM's default), also for fp8/int4 checkpoints."""
    if kv_dtype == "auto":
        return 4.0 if weights_dtype == "fp32" else 2.0
    return DTYPE_BYTES[kv_dtype]


def kv_heads_per_gpu(model: ModelSpec, tp: int) -> int:
    """KV heads one tensor-parallel rank holds (heads are replicated when tp exceeds them)."""
    return max(1, math.ceil(model.num_kv_heads / tp))


def kv_layer_bytes_per_token(model: ModelSpec, elem_bytes: float, tp: int = 1) -> float:
    """Bytes one attention layer stores per token on one GPU of a tp group (tp=1: the whole layer).

    GQA/MHA: K and V, one vector per KV head. MLA: one latent (kv_lora_rank + rope dims), no ×2, and every
    rank keeps the whole latent (it is not split by tensor parallelism).
    """
    if model.attention == "mla":
        return (model.mla_kv_lora_rank + model.mla_rope_head_dim) * elem_bytes
    return 2 * kv_heads_per_gpu(model, tp) * model.head_dim * elem_bytes


def kv_bytes_per_token(model: ModelSpec, elem_bytes: float, tp: int = 1, pp: int = 1) -> float:
    """Full-context rate: every attention layer holds this token (before any window is reached)."""
    return kv_layer_bytes_per_token(model, elem_bytes, tp) * model.attention_layers / pp


def ssm_state_bytes(model: ModelSpec, tp: int = 1, pp: int = 1, state_bytes: float = 2.0) -> float:
    """Fixed per-sequence state of SSM/linear layers (16-bit), split across tp ranks and pp stages."""
    n = sum(k in ("ssm", "linear") for k in model.layer_kinds)
    return n * model.ssm_state_elements * state_bytes / tp / pp


def round_up(n: int, block: int) -> int:
    return -(-n // block) * block


def kv_bytes_per_sequence(model: ModelSpec, tokens: int, elem_bytes: float, block_size: int = 16,
                          tp: int = 1, pp: int = 1) -> float:
    """KV one sequence of ``tokens`` tokens holds, in whole blocks; sliding layers hold min(T, W) tokens."""
    per_layer = kv_layer_bytes_per_token(model, elem_bytes, tp)
    full_tokens = round_up(tokens, block_size)
    window = model.sliding_window or tokens
    slide_tokens = round_up(min(tokens, window), block_size)
    n_full = sum(k == "full" for k in model.layer_kinds)
    n_slide = sum(k == "sliding" for k in model.layer_kinds)
    return per_layer * (n_full * full_tokens + n_slide * slide_tokens) / pp + ssm_state_bytes(model, tp, pp)


def weights_bytes(model: ModelSpec, dtype: str) -> float:
    """All parameters (MoE: every expert) at ``dtype``; embeddings stay 16-bit in quantized checkpoints."""
    if dtype in ("fp32", "fp16", "bf16"):
        return model.num_parameters * DTYPE_BYTES[dtype]
    emb = min(model.embedding_parameters, model.num_parameters)
    return (model.num_parameters - emb) * DTYPE_BYTES[dtype] + emb * 2.0


def activation_peak_bytes(model: ModelSpec, max_num_batched_tokens: int, max_num_seqs: int,
                          tp: int = 1, act_bytes: float = 2.0) -> float:
    """Peak transient memory of one forward pass over ``max_num_batched_tokens`` (vLLM's profiling run).

    Per token: a few hidden-size residual/norm buffers, the QKV projection, and the MLP's gate+up output plus
    its activation (3 × intermediate; MoE: for each routed expert); plus the sampler's fp32 logits for
    ``max_num_seqs`` rows.
    """
    q_kv = (model.num_attention_heads + 2 * model.num_kv_heads) * model.head_dim
    if model.moe is not None:
        inter = model.moe.experts_per_token * model.moe.expert_intermediate_size + model.moe.shared_intermediate_size
    else:
        inter = model.intermediate_size
    per_token = 4 * model.hidden_size + q_kv / tp + 3 * inter / tp
    sampler = max_num_seqs * model.vocab_size * 4.0 * SAMPLER_COPIES
    return max_num_batched_tokens * per_token * act_bytes + sampler


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


class FitOption(BaseModel):
    """A parallelism and weights dtype that fits on the plan's GPU, and what one replica of it then holds."""

    weights_dtype: str
    tp: int
    pp: int
    gpus: int
    """GPUs per replica (tp × pp)."""
    weights_bytes_per_gpu: float
    usable_kv_bytes_per_gpu: float
    kv_bytes_per_token_per_gpu: float
    kv_tokens_per_replica: int
    """Tokens the replica's KV pool holds (each GPU holds its share of every token, so per GPU = per replica)."""
    requests_fit_per_replica: int
    """Requests of the workload's length whose KV fits in HBM, before max_num_seqs caps them."""
    requests_per_replica: int
    replicas_on_cluster: int
    """Whole replicas the scenario's GPUs make (0: the cluster has fewer GPUs than one replica needs)."""


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


@dataclass(frozen=True)
class PlanInputs:
    """Everything `plan` needs, resolved from a scenario (CLI flags are scenario overrides)."""

    scenario: Scenario
    model: ModelSpec
    gpu: GpuSpec
    host_link: LinkSpec
    interconnect: LinkSpec
    weights_dtype: str
    rate: float | None
    response_time_s: float | None
    concurrency: int | None = None


def resolve_gpu(scenario: Scenario) -> GpuSpec:
    ref = scenario.cluster.gpu
    gpu = load_gpu(ref.preset)
    updates = {k: v for k, v in {"memory_bytes": ref.memory, "memory_bandwidth_bytes_s": ref.memory_bandwidth,
                                 "bf16_tflops": ref.bf16_tflops, "fp8_tflops": ref.fp8_tflops}.items()
               if v is not None}
    return gpu.model_copy(update=updates) if updates else gpu


def resolve_link(ref_preset: str | None, bandwidth: float | None, latency: float | None,
                 default: LinkSpec) -> LinkSpec:
    """A preset (or the default) with explicit bandwidth/latency applied; its efficiency and kind are kept."""
    link = load_link(ref_preset) if ref_preset else default
    if bandwidth is not None:
        link = link.model_copy(update={"bandwidth_bits_s": bandwidth * 8.0, "key": "custom",
                                       "name": f"{bandwidth * 8 / 1e9:g} Gbps {link.kind}"})
    if latency is not None:
        link = link.model_copy(update={"latency_s": latency})
    return link


def resolve(scenario: Scenario, rate: float | None = None, response_time_s: float | None = None,
            concurrency: int | None = None) -> PlanInputs:
    model = load_model(scenario.model.ref, scenario.model.num_parameters)
    gpu = resolve_gpu(scenario)
    c = scenario.cluster
    host_link = resolve_link(c.host_link.preset, c.host_link.bandwidth, c.host_link.latency, host_link_for(gpu))
    inter = resolve_link(c.interconnect.preset, c.interconnect.bandwidth, c.interconnect.latency,
                         load_link("eth-100g"))
    if rate is None and scenario.load.rate:
        rate = max(scenario.load.rate)
    if response_time_s is None:
        response_time_s = scenario.load.response_time
    if concurrency is None and scenario.load.concurrency:
        concurrency = max(scenario.load.concurrency)
    return PlanInputs(scenario=scenario, model=model, gpu=gpu, host_link=host_link, interconnect=inter,
                      weights_dtype=scenario.model.weights_dtype or model.native_dtype, rate=rate,
                      response_time_s=response_time_s, concurrency=concurrency)


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


def resolved_kv_dtype(kv_dtype: str, weights_dtype: str) -> str:
    """The name of the KV dtype 'auto' resolves to (the model's 16-bit dtype, as kv_element_bytes counts it)."""
    if kv_dtype != "auto":
        return kv_dtype
    return weights_dtype if weights_dtype in ("fp32", "fp16", "bf16") else "bf16"


@dataclass(frozen=True)
class MemoryBudget:
    """One GPU's memory as the engine splits it (bytes): what is left for KV is ``usable`` (may be negative)."""

    weights_total: float
    weights_gpu: float
    activation: float
    budget: float
    usable: float


def memory_budget(model: ModelSpec, gpu_memory_bytes: float, sv: ServingSpec, weights_dtype: str,
                  tp: int, pp: int) -> MemoryBudget:
    """GPU memory × utilization − this GPU's share of the weights − activation peak − runtime overhead − reserve."""
    w_total = weights_bytes(model, weights_dtype)
    w_gpu = w_total / (tp * pp)
    act = activation_peak_bytes(model, sv.max_num_batched_tokens, sv.max_num_seqs, tp)
    budget = gpu_memory_bytes * sv.gpu_memory_utilization
    return MemoryBudget(weights_total=w_total, weights_gpu=w_gpu, activation=act, budget=budget,
                        usable=budget - w_gpu - act - sv.runtime_overhead - sv.reserve)


def no_room_problem(model: ModelSpec, gpu: GpuSpec, sv: ServingSpec, weights_dtype: str, tp: int, pp: int,
                    mem: MemoryBudget) -> str | None:
    """Why no KV cache at all can exist on one GPU (weights over the budget, or nothing left after them); None: some."""
    if mem.weights_gpu >= mem.budget:
        return (f"{model.name} weights ({mem.weights_gpu / 2**30:.1f} GiB per GPU at {weights_dtype}, tp={tp}, "
                f"pp={pp}) do not fit in {gpu.memory_bytes / 2**30:.1f} GiB × {sv.gpu_memory_utilization:g} "
                f"utilization on {gpu.name}: use more GPUs per replica, a smaller weights dtype or a bigger GPU")
    if mem.usable <= 0:
        return (f"no memory left for KV cache on {gpu.name}: budget {mem.budget / 2**30:.2f} GiB − weights "
                f"{mem.weights_gpu / 2**30:.2f} GiB − activations {mem.activation / 2**30:.2f} GiB − "
                f"overhead/reserve {(sv.runtime_overhead + sv.reserve) / 2**30:.2f} GiB ≤ 0")
    return None


def given_pool(mem: MemoryBudget, kv_tokens: int, kv_bytes_per_token_per_gpu: float,
               block_size: int) -> MemoryBudget:
    """The budget with ``usable`` set to a pool known in tokens (``serving.kv_tokens``), whole blocks only."""
    usable = (kv_tokens // block_size) * block_size * kv_bytes_per_token_per_gpu
    return MemoryBudget(weights_total=mem.weights_total, weights_gpu=mem.weights_gpu, activation=mem.activation,
                        budget=mem.budget, usable=usable)


def slot_tokens(pool_tokens: int, slots: int) -> int:
    """llama.cpp split KV: each of the slots gets an even share of the pool."""
    return pool_tokens // slots


def kv_blocks(usable_bytes: float, kv_bytes_per_token_per_gpu: float, block_size: int) -> int:
    """Whole KV blocks in the usable bytes of one GPU (none when nothing is usable)."""
    return max(0, int(usable_bytes // (kv_bytes_per_token_per_gpu * block_size)))


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


FIT_DTYPES = ("int8", "int4")
"""Quantized weights the fit options try beside the scenario's own dtype."""
FIT_RULE = ("fit options: tp divides the attention heads, and the KV heads divide tp or tp divides them (vLLM's "
            "rule); pp divides the layers (the plan splits weights and KV evenly over stages); fits = KV room for "
            "at least one request per GPU; per dtype the smallest tp (pp=1), the smallest pp (tp=1), and only if "
            "neither exists the smallest tp×pp; int8/int4 keep embeddings and LM head in 16-bit")


def tp_sizes(model: ModelSpec) -> list[int]:
    """Tensor-parallel sizes an engine accepts for the model: whole query heads per rank, KV heads split or copied."""
    heads, kv = model.num_attention_heads, model.num_kv_heads
    return [t for t in range(1, heads + 1) if heads % t == 0 and (kv % t == 0 or t % kv == 0)]


def pp_sizes(model: ModelSpec) -> list[int]:
    """Pipeline sizes that split the layers evenly (what the plan's per-stage arithmetic assumes)."""
    return [p for p in range(1, model.num_layers + 1) if model.num_layers % p == 0]


def fit_option(inputs: PlanInputs, weights_dtype: str, tp: int, pp: int, tokens_req: int) -> FitOption:
    """What one replica of tp×pp GPUs holds with these weights, by the same arithmetic as `plan`."""
    sc, model = inputs.scenario, inputs.model
    sv = sc.serving
    elem = kv_element_bytes(model, sc.model.kv_dtype, weights_dtype)
    mem = memory_budget(model, inputs.gpu.memory_bytes, sv, weights_dtype, tp, pp)
    tok_gpu = kv_bytes_per_token(model, elem, tp, pp)
    req_gpu = kv_bytes_per_sequence(model, tokens_req, elem, sv.block_size, tp, pp)
    blocks = kv_blocks(mem.usable, tok_gpu, sv.block_size)
    fit = max(0, int(mem.usable // req_gpu))
    return FitOption(weights_dtype=weights_dtype, tp=tp, pp=pp, gpus=tp * pp, weights_bytes_per_gpu=mem.weights_gpu,
                     usable_kv_bytes_per_gpu=mem.usable, kv_bytes_per_token_per_gpu=tok_gpu,
                     kv_tokens_per_replica=blocks * sv.block_size, requests_fit_per_replica=fit,
                     requests_per_replica=min(fit, sv.max_num_seqs),
                     replicas_on_cluster=sc.cluster.gpus // (tp * pp))


def smallest_fit(inputs: PlanInputs, weights_dtype: str, tps: list[int], pps: list[int],
                 tokens_req: int) -> FitOption | None:
    """The fitting (tp, pp) with the fewest GPUs (ties: the smaller pp), or None when none does."""
    for tp, pp in sorted(((t, p) for t in tps for p in pps), key=lambda x: (x[0] * x[1], x[1])):
        option = fit_option(inputs, weights_dtype, tp, pp, tokens_req)
        if option.requests_fit_per_replica >= 1:
            return option
    return None


def fit_options(inputs: PlanInputs, tokens_req: int) -> list[FitOption]:
    """Per weights dtype (the scenario's, then int8 and int4): the smallest tp, the smallest pp (FIT_RULE)."""
    tps, pps = tp_sizes(inputs.model), pp_sizes(inputs.model)
    out: list[FitOption] = []
    for dtype in dict.fromkeys((inputs.weights_dtype, *FIT_DTYPES)):
        found = [smallest_fit(inputs, dtype, tps, [1], tokens_req), smallest_fit(inputs, dtype, [1], pps, tokens_req)]
        if not any(found):
            found = [smallest_fit(inputs, dtype, tps, pps, tokens_req)]
        for option in found:
            if option is not None and option not in out:
                out.append(option)
    return out


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
