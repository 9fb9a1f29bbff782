"""`kvcap plan`: capacity arithmetic from flags or a scenario file, printed as a table or JSON.

Its flags are shortcuts for scenario keys: they become `--set`-style overrides of the scenario (or of the
defaults), so the arithmetic itself lives in kvcap.plan and sees one validated scenario.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from kvcap.cli import common

PLAN_EXAMPLES = """
examples:
  kvcap plan --model llama-3.1-8b --gpu rtx4090 --nodes 4 --input-tokens 1024 --output-tokens 256
  kvcap plan --model llama-2-7b --gpu-mem 24GiB --nodes 4 --input-tokens 1024 --output-tokens 256 \\
             --host-mem 128GiB --remote-mem 256GiB --link 100Gbps --rate 3 --response-time 12s
  kvcap plan --model ./my-model/config.json --gpu h100-sxm --tp 2 --weights-dtype fp8 --json
  kvcap plan --scenario scenarios/seed-reference.yaml --set serving.kv_offload=remote
"""


def register(sub: common.Subparsers) -> None:
    p = sub.add_parser(
        "plan", help="capacity arithmetic: KV bytes, what fits per GPU and tier, token rates, link budget",
        description=common.doc("""
            How many requests of a given length fit in each memory tier, what remains for the KV cache after
            weights, activations and reserve, the token rates a request rate implies, and the link bandwidth
            parked sequences need to be brought back. Flags override the scenario file's values. When the
            model does not fit it says so (exit 0) and gives the smallest tensor/pipeline parallelism that fits,
            at the scenario's weights dtype and at int8 and int4, with the KV each then holds.
        """), epilog=PLAN_EXAMPLES, formatter_class=common.formatter)
    p.add_argument("--scenario", metavar="FILE", help="scenario YAML (flags below override it)")
    p.add_argument("--model", help="preset name (e.g. llama-3.1-8b) or path to an HF config.json")
    p.add_argument("--num-parameters", type=common.positive_int, help="parameter count (for configs that lack it)")
    p.add_argument("--gpu", action=common.StoreWithPresets, presets=_gpu_names, help="GPU preset (%(presets)s)")
    p.add_argument("--gpu-mem", metavar="SIZE", help="GPU memory, overrides the preset (e.g. 24GiB)")
    p.add_argument("--nodes", type=common.positive_int)
    p.add_argument("--gpus-per-node", type=common.positive_int)
    p.add_argument("--tp", "--tensor-parallel", dest="tp", type=common.positive_int, help="tensor-parallel size")
    p.add_argument("--pp", "--pipeline-parallel", dest="pp", type=common.positive_int, help="pipeline-parallel size")
    p.add_argument("--weights-dtype", choices=["int4", "int8", "fp8", "fp16", "bf16", "fp32"])
    p.add_argument("--kv-dtype", choices=["auto", "fp16", "bf16", "fp8", "fp32"])
    p.add_argument("--gpu-memory-utilization", metavar="F", help="fraction of GPU memory the engine may use (0.9)")
    p.add_argument("--max-num-batched-tokens", type=common.positive_int, help="tokens per step (sizes activations)")
    p.add_argument("--max-num-seqs", type=common.positive_int, help="running sequences per replica (256)")
    p.add_argument("--block-size", type=common.positive_int, help="KV block size in tokens (16)")
    p.add_argument("--runtime-overhead", metavar="SIZE", help="non-torch GPU memory per GPU (650MiB)")
    p.add_argument("--reserve", metavar="SIZE", help="extra safety margin per GPU (0)")
    p.add_argument("--input-tokens", type=common.positive_int)
    p.add_argument("--output-tokens", type=common.positive_int)
    p.add_argument("--host-mem", metavar="SIZE", help="host RAM per node (half goes to KV unless --host-kv)")
    p.add_argument("--host-kv", metavar="SIZE", help="host RAM per node given to offloaded KV")
    p.add_argument("--remote-mem", metavar="SIZE", help="remote/distributed memory pool for KV, whole cluster")
    p.add_argument("--link", metavar="BW|PRESET", help="node interconnect: 100Gbps, 12.5GB/s or a preset "
                                                      "(eth-100g, rdma-200g…)")
    p.add_argument("--host-link", metavar="BW|PRESET", help="GPU↔host link (default: the GPU's PCIe x16)")
    p.add_argument("--kv-offload", choices=["none", "host", "remote", "host+remote"],
                   help="tiers that hold KV (default: those whose memory you gave)")
    p.add_argument("--concurrency", type=common.positive_int, help="requests in flight (sizes the link budget)")
    p.add_argument("--rate", type=common.positive_float, help="peak request rate, req/s")
    p.add_argument("--response-time", metavar="DURATION", help="mean response time for Little's law (e.g. 12s)")
    common.add_set_flag(p)
    common.add_json_flag(p, help="print the result as JSON")
    p.set_defaults(func=cmd_plan)


def _gpu_names() -> tuple[str, ...]:
    from kvcap.specs.hardware import gpu_names

    return gpu_names()


def cmd_plan(a: argparse.Namespace) -> int:
    from kvcap.plan import plan, resolve
    from kvcap.report.console import render_plan
    from kvcap.specs.scenario import load_scenario
    from kvcap.units import parse_duration

    overrides = _plan_overrides(a)
    _default_kv_offload(a, overrides)
    scenario = load_scenario(a.scenario, overrides)
    response = parse_duration(a.response_time, "--response-time") if a.response_time else None
    # not fitting is a finding, not bad input: the result says so and what would fit
    result = plan(resolve(scenario, rate=a.rate, response_time_s=response, concurrency=a.concurrency),
                  allow_unfit=True)
    if a.json:
        common.print_json(result.model_dump(mode="json"))
    else:
        render_plan(result)
    return 0


def _plan_overrides(a: argparse.Namespace) -> dict[str, Any]:
    from kvcap.specs.scenario import parse_set

    out: dict[str, Any] = parse_set(a.set)
    model = a.model
    if model is not None:
        is_path = model.endswith(".json") or os.sep in model or os.path.isdir(model)
        out["model.config" if is_path else "model.preset"] = model
        out["model.preset" if is_path else "model.config"] = None
    flags = {
        "model.num_parameters": a.num_parameters, "cluster.gpu.preset": a.gpu, "cluster.gpu.memory": a.gpu_mem,
        "cluster.nodes": a.nodes, "cluster.gpus_per_node": a.gpus_per_node, "serving.tensor_parallel": a.tp,
        "serving.pipeline_parallel": a.pp, "model.weights_dtype": a.weights_dtype, "model.kv_dtype": a.kv_dtype,
        "serving.gpu_memory_utilization": a.gpu_memory_utilization,
        "serving.max_num_batched_tokens": a.max_num_batched_tokens, "serving.max_num_seqs": a.max_num_seqs,
        "serving.block_size": a.block_size, "serving.runtime_overhead": a.runtime_overhead,
        "serving.reserve": a.reserve, "workload.input_tokens": a.input_tokens,
        "workload.output_tokens": a.output_tokens, "cluster.host_memory": a.host_mem,
        "serving.host_kv_capacity": a.host_kv, "cluster.remote_memory": a.remote_mem,
        "serving.kv_offload": a.kv_offload,
    }
    out.update({k: v for k, v in flags.items() if v is not None})
    _link_override("cluster.interconnect", a.link, out)
    _link_override("cluster.host_link", a.host_link, out)
    return out


def _link_override(prefix: str, value: str | None, out: dict[str, Any]) -> None:
    """--link/--host-link: a bandwidth (starts with a digit) replaces the preset, anything else names one."""
    if value is None:
        return
    from kvcap.units import parse_bandwidth

    if any(ch.isdigit() for ch in value[:1]):
        out[f"{prefix}.bandwidth"] = parse_bandwidth(value, f"--{prefix.split('.')[-1].replace('_', '-')}")
        out[f"{prefix}.preset"] = None
    else:
        out[f"{prefix}.preset"] = value


def _default_kv_offload(a: argparse.Namespace, overrides: dict[str, Any]) -> None:
    """No --kv-offload or --set for it, and KV in VRAM only: KV goes to the tiers whose memory the flags gave."""
    from kvcap.specs.scenario import load_scenario

    if a.kv_offload is None and "serving.kv_offload" not in overrides:
        base = load_scenario(a.scenario).serving.kv_offload if a.scenario else "none"
        if base == "none":
            tiers = [t for t, flag in (("host", a.host_mem or a.host_kv), ("remote", a.remote_mem)) if flag]
            if tiers:
                overrides["serving.kv_offload"] = "+".join(tiers)
