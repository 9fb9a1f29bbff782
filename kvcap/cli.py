"""The command line: parse flags, turn them into spec overrides, call the library, print. Nothing else.

Bad input of any kind ends in one line on stderr and exit code 2; a refused comparison exits 3.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from kvcap import __version__
from kvcap.errors import InputError, RefusedComparison


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error in one line (exit 2) instead of usage + message."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _formatter(prog: str) -> argparse.HelpFormatter:
    return argparse.RawDescriptionHelpFormatter(prog, max_help_position=34, width=100)


def _doc(text: str) -> str:
    return textwrap.dedent(text).strip("\n")


# ---------------------------------------------------------------- plan

PLAN_EXAMPLES = """
examples:
  kvcap plan --model llama-3.1-8b --gpu rtx4090 --nodes 4 --input-tokens 1024 --output-tokens 256
  kvcap plan --model llama-2-7b --gpu-mem 24GiB --nodes 4 --input-tokens 1024 --output-tokens 256 \\
             --host-mem 128GiB --remote-mem 256GiB --link 100Gbps --rate 3 --response-time 12s
  kvcap plan --model ./my-model/config.json --gpu h100-sxm --tp 2 --weights-dtype fp8 --json
  kvcap plan --scenario scenarios/seed-reference.yaml --set serving.kv_offload=remote
"""


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan", help="capacity arithmetic: KV bytes, what fits per GPU and tier, token rates, link budget",
        description=_doc("""
            How many requests of a given length fit in each memory tier, what remains for the KV cache after
            weights, activations and reserve, the token rates a request rate implies, and the link bandwidth
            parked sequences need to be brought back. Flags override the scenario file's values.
        """), epilog=PLAN_EXAMPLES, formatter_class=_formatter)
    p.add_argument("--scenario", metavar="FILE", help="scenario YAML (flags below override it)")
    p.add_argument("--model", help="preset name (e.g. llama-3.1-8b) or path to an HF config.json")
    p.add_argument("--num-parameters", type=_positive_int, help="parameter count (for configs that lack it)")
    p.add_argument("--gpu", help="GPU preset (rtx4090, l4, a10, l40s, a100-40gb, a100-80gb, h100-sxm, h200, b200, "
                                 "mi300x)")
    p.add_argument("--gpu-mem", metavar="SIZE", help="GPU memory, overrides the preset (e.g. 24GiB)")
    p.add_argument("--nodes", type=_positive_int)
    p.add_argument("--gpus-per-node", type=_positive_int)
    p.add_argument("--tp", "--tensor-parallel", dest="tp", type=_positive_int, help="tensor-parallel size")
    p.add_argument("--pp", "--pipeline-parallel", dest="pp", type=_positive_int, help="pipeline-parallel size")
    p.add_argument("--weights-dtype", choices=["int4", "int8", "fp8", "fp16", "bf16", "fp32"])
    p.add_argument("--kv-dtype", choices=["auto", "fp16", "bf16", "fp8", "fp32"])
    p.add_argument("--gpu-memory-utilization", metavar="F", help="fraction of GPU memory the engine may use (0.9)")
    p.add_argument("--max-num-batched-tokens", type=_positive_int, help="tokens per step (sizes activations)")
    p.add_argument("--max-num-seqs", type=_positive_int, help="running sequences per replica (256)")
    p.add_argument("--block-size", type=_positive_int, help="KV block size in tokens (16)")
    p.add_argument("--runtime-overhead", metavar="SIZE", help="non-torch GPU memory per GPU (650MiB)")
    p.add_argument("--reserve", metavar="SIZE", help="extra safety margin per GPU (0)")
    p.add_argument("--input-tokens", type=_positive_int)
    p.add_argument("--output-tokens", type=_positive_int)
    p.add_argument("--host-mem", metavar="SIZE", help="host RAM per node (half goes to KV unless --host-kv)")
    p.add_argument("--host-kv", metavar="SIZE", help="host RAM per node given to offloaded KV")
    p.add_argument("--remote-mem", metavar="SIZE", help="remote/distributed memory pool for KV, whole cluster")
    p.add_argument("--link", metavar="BW|PRESET", help="node interconnect: 100Gbps, 12.5GB/s or a preset "
                                                      "(eth-100g, rdma-200g…)")
    p.add_argument("--host-link", metavar="BW|PRESET", help="GPU↔host link (default: the GPU's PCIe x16)")
    p.add_argument("--kv-offload", choices=["none", "host", "remote", "host+remote"],
                   help="tiers that hold KV (default: those whose memory you gave)")
    p.add_argument("--concurrency", type=_positive_int, help="requests in flight (sizes the link budget)")
    p.add_argument("--rate", type=_positive_float, help="peak request rate, req/s")
    p.add_argument("--response-time", metavar="DURATION", help="mean response time for Little's law (e.g. 12s)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override any scenario key (repeatable)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_cmd_plan)


def _link_override(prefix: str, value: str | None, out: dict[str, Any]) -> None:
    if value is None:
        return
    from kvcap.units import parse_bandwidth

    if any(ch.isdigit() for ch in value[:1]):
        out[f"{prefix}.bandwidth"] = parse_bandwidth(value, f"--{prefix.split('.')[-1].replace('_', '-')}")
        out[f"{prefix}.preset"] = None
    else:
        out[f"{prefix}.preset"] = value


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


def _cmd_plan(a: argparse.Namespace) -> int:
    from kvcap.plan import plan, resolve
    from kvcap.report.console import render_plan
    from kvcap.specs.scenario import load_scenario
    from kvcap.units import parse_duration

    overrides = _plan_overrides(a)
    if a.kv_offload is None and "serving.kv_offload" not in overrides:
        base = load_scenario(a.scenario).serving.kv_offload if a.scenario else "none"
        if base == "none":
            tiers = [t for t, flag in (("host", a.host_mem or a.host_kv), ("remote", a.remote_mem)) if flag]
            if tiers:
                overrides["serving.kv_offload"] = "+".join(tiers)
    scenario = load_scenario(a.scenario, overrides)
    response = parse_duration(a.response_time, "--response-time") if a.response_time else None
    result = plan(resolve(scenario, rate=a.rate, response_time_s=response, concurrency=a.concurrency))
    if a.json:
        print(json.dumps(result.model_dump(mode="json"), indent=2))
    else:
        render_plan(result)
    return 0


# ---------------------------------------------------------------- shared helpers

def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_add_plan]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvcap",
        description=_doc("""
            kvcap: does more memory (VRAM, host RAM, distributed memory for the KV cache) buy more *stable*
            concurrency within latency targets, or only more *resident* requests?
        """),
        epilog="run 'kvcap COMMAND --help' for each command's flags and examples",
        formatter_class=_formatter)
    parser.add_argument("--version", action="version", version=f"kvcap {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except InputError as exc:
        print(f"kvcap {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except RefusedComparison as exc:
        print(f"kvcap {args.command}: refused: {exc}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print(f"kvcap {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
