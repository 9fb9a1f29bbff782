"""When the weights do not fit: the smallest tensor/pipeline parallelism per weights dtype that does, and what one
replica of it then holds — by the same memory arithmetic as `plan` (:mod:`kvcap.plan.memory`)."""

from __future__ import annotations

from pydantic import BaseModel

from kvcap.plan.inputs import PlanInputs
from kvcap.plan.memory import kv_blocks, kv_bytes_per_sequence, kv_bytes_per_token, kv_element_bytes, memory_budget
from kvcap.specs.model import ModelSpec


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
