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



# ---------------------------------------------------------------- bench

BENCH_EXAMPLES = """
examples:
  kvcap bench --url http://127.0.0.1:8000 --concurrency 1,2,4,8,16,24 --input-tokens 1024 --output-tokens 256 \\
              --warmup 10s --duration 60s --repeats 3 --slo ttft_p95=500ms,tpot_p95=80ms --out runs/control
  kvcap bench --url http://127.0.0.1:8000/v1 --api chat --rate 0.5,1,2,4 --arrival gamma:cv=2 \\
              --input-tokens lognormal:1024,400 --output-tokens uniform:128,256 --requests 200 --out runs/rate
  kvcap bench --url http://127.0.0.1:8080 --trace ../shared/data/traces/splitwise_conv.csv --trace-speed 2 \\
              --duration 120s --metrics-url http://127.0.0.1:8080/metrics --out runs/trace
  kvcap bench --url http://gpu-host:8000 --concurrency 256,512,1024 --workers 2 --requests 2000 \\
              --tokenizer ./tokenizer.json --prefix-tokens 512 --prefix-groups 8 --out runs/big
"""


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench", help="load an OpenAI-compatible streaming endpoint: fixed concurrency, fixed rate or a trace",
        description=_doc("""
            Sweeps load levels against a real endpoint and records every request (requests.jsonl, appended as each
            finishes), the level windows (levels.jsonl), server metrics (telemetry.jsonl), the fixed variables
            (manifest.json) and per-level statistics (summary.json). Open-loop latency counts from the scheduled
            send time. Ctrl-C stops within seconds and still writes the summary.
        """), epilog=BENCH_EXAMPLES, formatter_class=_formatter)
    g = p.add_argument_group("target")
    g.add_argument("--url", required=True, help="server base URL (…:8000, …/v1) or full endpoint URL")
    g.add_argument("--api", choices=["completions", "chat"], default="completions", help="OpenAI API (completions)")
    g.add_argument("--model", help="model name to send (default: the first of the server's /v1/models)")
    g.add_argument("--header", action="append", metavar="NAME:VALUE", help="extra HTTP header (repeatable)")
    g.add_argument("--api-key", help="bearer token (default: $KVCAP_API_KEY or $OPENAI_API_KEY); never stored")
    g.add_argument("--timeout", default="120s", metavar="DURATION", help="per-request limit (120s)")
    g.add_argument("--stall-timeout", metavar="DURATION", help="longest silence inside a stream (default: none)")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0)")
    g.add_argument("--no-force-length", action="store_true",
                   help="do not send ignore_eos/min_tokens (for servers that reject them)")
    g.add_argument("--extra-body", metavar="JSON", help="extra JSON fields merged into every request body")
    g = p.add_argument_group("load (one of --concurrency, --rate, --trace)")
    m = g.add_mutually_exclusive_group(required=True)
    m.add_argument("--concurrency", metavar="LIST", help="closed loop: concurrent streams per level, e.g. 1,2,4,8")
    m.add_argument("--rate", metavar="LIST", help="open loop: arrivals per second per level, e.g. 0.5,1,2,4")
    m.add_argument("--trace", metavar="FILE", help="replay a trace: Mooncake JSONL, Splitwise/Azure CSV, kvcap JSONL")
    g.add_argument("--arrival", default="poisson", help="open-loop process: poisson | constant | gamma:cv=X")
    g.add_argument("--trace-speed", type=_positive_float, default=1.0, help="trace time compression (2 = twice as fast)")
    g.add_argument("--warmup", default="10s", metavar="DURATION", help="per level, not measured (10s)")
    g.add_argument("--duration", metavar="DURATION", help="measured time per level (60s unless --requests)")
    g.add_argument("--requests", type=_positive_int, help="measured requests per level (instead of --duration)")
    g.add_argument("--repeats", type=_positive_int, default=1, help="repeat the whole sweep N times (1)")
    g.add_argument("--seed", type=int, default=0, help="prompt, length and arrival seed (0)")
    g.add_argument("--max-inflight", type=_positive_int, default=20_000, help="open-loop cap on streams in flight")
    g.add_argument("--workers", type=_positive_int, default=1, help="client processes on this host (1)")
    g = p.add_argument_group("requests")
    g.add_argument("--input-tokens", default="1024", metavar="DIST", help="N | uniform:a,b | normal:m,sd | lognormal:m,sd")
    g.add_argument("--output-tokens", default="256", metavar="DIST", help="same forms; forced with max_tokens+ignore_eos")
    g.add_argument("--dataset", metavar="FILE.jsonl", help="rows with 'prompt' or 'messages' (+ optional output_tokens)")
    g.add_argument("--tokenizer", metavar="PATH", help="local HF tokenizer.json: exact prompt token counts")
    g.add_argument("--prefix-tokens", type=int, default=0, help="shared prefix length per group (0: none)")
    g.add_argument("--prefix-groups", type=int, default=0, help="number of shared-prefix groups")
    g.add_argument("--no-unique-prefix", action="store_true",
                   help="do not make prompts unique per run/level (lets a prompt cache hit across runs)")
    g = p.add_argument_group("output")
    g.add_argument("--out", required=True, metavar="DIR", help="run directory to write")
    g.add_argument("--overwrite", action="store_true", help="replace a run already in --out")
    g.add_argument("--slo", metavar="SPEC", help="e.g. ttft_p95=500ms,tpot_p95=80ms,error_rate=1%%")
    g.add_argument("--metrics-url", action="append", metavar="[NODE=]URL",
                   help="a /metrics to sample each second (repeatable; NODE labels its rows, e.g. node1=http://…)")
    g.add_argument("--local-telemetry", action="store_true",
                   help="also sample this host each second: /proc/net/dev per device, and GPUs through NVML when "
                        "nvidia-ml-py is installed (for a client running on the server host)")
    g.add_argument("--prometheus", metavar="URL",
                   help="Prometheus to query after the run for every known series in its window (DCGM, node "
                        "exporter, engines): query_range, step 1 s")
    g.add_argument("--arm", help="arm name for A/B (stored in the manifest)")
    g.add_argument("--fixed", action="append", metavar="KEY=VALUE",
                   help="declare a fixed variable for compare, e.g. cluster.gpus=4 (repeatable)")
    g.add_argument("--vary", action="append", metavar="KEY=VALUE",
                   help="the variable under test and its value in this arm, e.g. serving.kv_offload=host")
    g.add_argument("--record-text", action="store_true", help="store generated text in each record")
    g.add_argument("--quiet", action="store_true", help="no live progress")
    g.add_argument("--json", action="store_true", help="print summary.json at the end")
    p.set_defaults(func=_cmd_bench)


def _levels(text: str, what: str, integer: bool) -> tuple[float, ...]:
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            v = int(part) if integer else float(part)
        except ValueError:
            raise InputError(f"{what}: {part!r} is not a {'whole number' if integer else 'number'}") from None
        if v <= 0:
            raise InputError(f"{what}: levels must be positive, got {part!r}")
        out.append(v)
    if not out:
        raise InputError(f"{what}: give at least one level")
    return tuple(out)


def _bench_config(a: argparse.Namespace) -> Any:
    from pathlib import Path

    from kvcap.analysis.slo import parse_slo
    from kvcap.loadgen.bench import BenchConfig
    from kvcap.loadgen.client import Target
    from kvcap.loadgen.runner import LoadPlan
    from kvcap.specs.scenario import parse_set
    from kvcap.units import parse_duration
    from kvcap.workload.arrivals import parse_arrival
    from kvcap.workload.lengths import parse_length
    from kvcap.workload.trace import read_trace

    if not a.url.startswith(("http://", "https://")):
        raise InputError(f"--url must start with http:// or https://, got {a.url!r}")
    headers: dict[str, str] = {}
    for h in a.header or []:
        name, sep, value = h.partition(":")
        if not sep or not name.strip():
            raise InputError(f"--header expects NAME:VALUE, got {h!r}")
        headers[name.strip()] = value.strip()
    key = a.api_key or os.environ.get("KVCAP_API_KEY") or os.environ.get("OPENAI_API_KEY")
    if key:
        headers["Authorization"] = f"Bearer {key}"
    extra: dict[str, Any] = {}
    if a.extra_body:
        try:
            extra = json.loads(a.extra_body)
        except json.JSONDecodeError:
            raise InputError("--extra-body is not valid JSON") from None
        if not isinstance(extra, dict):
            raise InputError("--extra-body must be a JSON object")
    timeout = parse_duration(a.timeout, "--timeout")
    if timeout <= 0:
        raise InputError("--timeout must be positive")
    target = Target(url=a.url, api=a.api, model=a.model, headers=headers, timeout_s=timeout,
                    stall_timeout_s=parse_duration(a.stall_timeout, "--stall-timeout") if a.stall_timeout else None,
                    force_length=not a.no_force_length, temperature=a.temperature, extra_body=extra)
    parse_arrival(a.arrival)
    if a.concurrency:
        mode, levels = "concurrency", _levels(a.concurrency, "--concurrency", True)
    elif a.rate:
        mode, levels = "rate", _levels(a.rate, "--rate", False)
    else:
        mode, levels = "trace", (a.trace_speed,)
    duration = parse_duration(a.duration, "--duration") if a.duration else (None if a.requests else 60.0)
    if duration is not None and duration <= 0:
        raise InputError("--duration must be positive")
    trace = tuple(read_trace(a.trace)) if a.trace else ()
    plan = LoadPlan(mode=mode, levels=levels, warmup_s=parse_duration(a.warmup, "--warmup"), duration_s=duration,
                    requests=a.requests, repeats=a.repeats, arrival=a.arrival, seed=a.seed,
                    max_inflight=a.max_inflight, drain_timeout_s=timeout, trace=trace, trace_speed=a.trace_speed)
    if a.prefix_tokens < 0 or a.prefix_groups < 0 or (a.prefix_tokens > 0) != (a.prefix_groups > 0):
        raise InputError("--prefix-tokens and --prefix-groups go together and must be positive")
    from kvcap.telemetry.scrape import parse_target

    for spec in a.metrics_url or []:
        parse_target(spec)
    fixed = parse_set(a.fixed)
    vary = parse_set(a.vary)
    fixed.update(vary)
    return BenchConfig(target=target, plan=plan, out=Path(a.out), input_dist=parse_length(a.input_tokens, "--input-tokens"),
                       output_dist=parse_length(a.output_tokens, "--output-tokens"), tokenizer=a.tokenizer,
                       dataset=a.dataset, prefix_tokens=a.prefix_tokens, prefix_groups=a.prefix_groups,
                       unique_prefix=not a.no_unique_prefix, metrics_urls=list(a.metrics_url or []),
                       prometheus=_prometheus_url(a.prometheus), local_telemetry=a.local_telemetry,
                       slo=parse_slo(a.slo), workers=a.workers, overwrite=a.overwrite, arm=a.arm, fixed=fixed,
                       record_text=a.record_text, under_test=sorted(vary))


def _prometheus_url(url: str | None) -> str | None:
    if url is not None and not url.startswith(("http://", "https://")):
        raise InputError(f"--prometheus must be an http(s):// URL, got {url!r}")
    return url


def _cmd_bench(a: argparse.Namespace) -> int:
    import asyncio
    import signal

    from kvcap.loadgen.bench import run_bench
    from kvcap.report.console import render_levels
    from kvcap.report.live import RichProgress

    cfg = _bench_config(a)
    if cfg.dataset:
        from kvcap.workload.prompts import load_dataset

        load_dataset(cfg.dataset)
    if cfg.tokenizer:
        from kvcap.workload.prompts import TokenCounter

        TokenCounter(cfg.tokenizer)

    async def main() -> dict:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        hits = {"n": 0}

        def on_signal() -> None:
            hits["n"] += 1
            stop.set()
            if hits["n"] == 1:
                print("kvcap bench: stopping — cancelling in-flight requests, writing the summary "
                      "(Ctrl-C again to abort)", file=sys.stderr)
            else:
                os._exit(130)

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        quiet = a.quiet or a.json or not sys.stderr.isatty()
        if quiet:
            return await run_bench(cfg, None, stop)
        with RichProgress() as progress:
            return await run_bench(cfg, progress, stop)

    summary = asyncio.run(main())
    if a.json:
        print(json.dumps(summary, indent=2))
    else:
        render_levels(summary, title=f"kvcap bench → {cfg.out}")
    return 130 if summary.get("interrupted") else 0



# ---------------------------------------------------------------- sim, demo

SIM_EXAMPLES = """
examples:
  kvcap sim scenarios/seed-reference.yaml --out runs/sim-control
  kvcap sim scenarios/seed-reference.yaml --set serving.kv_offload=remote --arm treatment --out runs/sim-treatment
  kvcap sim scenarios/seed-reference.yaml --set cluster.interconnect.bandwidth=400Gbps --concurrency 48,64,96 \\
            --duration 30s --repeats 1 --out runs/sim-400g
  kvcap sim scenarios/seed-reference.yaml --trace ../shared/data/traces/mooncake_conversation_trace.jsonl \\
            --set serving.kv_offload=remote --duration 300s --out runs/sim-mooncake
"""


def _add_load_overrides(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("load (override the scenario's load section)")
    m = g.add_mutually_exclusive_group()
    m.add_argument("--concurrency", metavar="LIST", help="closed-loop levels, e.g. 8,16,24")
    m.add_argument("--rate", metavar="LIST", help="open-loop levels in req/s, e.g. 0.5,1,2")
    m.add_argument("--trace", metavar="FILE", help="replay a trace: Mooncake JSONL, Splitwise/Azure CSV, kvcap JSONL")
    g.add_argument("--trace-speed", type=_positive_float, default=1.0, help="trace time compression (1)")
    g.add_argument("--arrival", help="open-loop process: poisson | constant | gamma:cv=X")
    g.add_argument("--warmup", metavar="DURATION")
    g.add_argument("--duration", metavar="DURATION")
    g.add_argument("--requests", type=_positive_int, help="measured requests per level (instead of --duration)")
    g.add_argument("--repeats", type=_positive_int)
    g.add_argument("--input-tokens", metavar="DIST", help="N | uniform:a,b | normal:m,sd | lognormal:m,sd")
    g.add_argument("--output-tokens", metavar="DIST")
    g.add_argument("--seed", type=int, default=0, help="length and arrival seed (0)")
    g.add_argument("--slo", metavar="SPEC", help="e.g. ttft_p95=500ms,tpot_p95=80ms (default: the scenario's)")
    g.add_argument("--set", action="append", metavar="KEY=VALUE", help="override any scenario key (repeatable)")


def _add_sim(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sim", help="simulate a cluster (replicas, KV tiers, links, vLLM-style batching) and write a run directory",
        description=_doc("""
            Runs the scenario's load plan (or --trace) against a simulated cluster and writes the same run directory
            as bench — requests.jsonl, levels.jsonl, telemetry.jsonl (running/waiting/parked, KV and tier usage,
            preemptions, GPU and link utilisation), manifest.json (source "sim") and summary.json — so analyze,
            compare and report work unchanged. Each level starts from an empty cluster.
        """), epilog=SIM_EXAMPLES, formatter_class=_formatter)
    p.add_argument("scenario", metavar="SCENARIO.yaml")
    p.add_argument("--out", required=True, metavar="DIR", help="run directory to write")
    p.add_argument("--overwrite", action="store_true", help="replace a run already in --out")
    p.add_argument("--arm", help="arm name for A/B (stored in the manifest)")
    p.add_argument("--no-itl", action="store_true", help="do not store per-token gaps (smaller records)")
    p.add_argument("--json", action="store_true", help="print summary.json at the end")
    p.add_argument("--quiet", action="store_true", help="no per-level lines")
    _add_load_overrides(p)
    p.set_defaults(func=_cmd_sim)


def _sim_overrides(a: argparse.Namespace) -> dict[str, Any]:
    from kvcap.specs.scenario import parse_set

    out: dict[str, Any] = parse_set(a.set)
    if a.concurrency:
        out["load.concurrency"] = [int(x) for x in _levels(a.concurrency, "--concurrency", True)]
        out["load.rate"] = None
    if a.rate:
        out["load.rate"] = list(_levels(a.rate, "--rate", False))
        out["load.concurrency"] = None
    flags = {"load.arrival": a.arrival, "load.warmup": a.warmup, "load.duration": a.duration,
             "load.requests": a.requests, "load.repeats": a.repeats, "workload.input_tokens": a.input_tokens,
             "workload.output_tokens": a.output_tokens}
    out.update({k: v for k, v in flags.items() if v is not None})
    if a.requests and not a.duration:
        out["load.duration"] = None
    return out


def _sim_config(a: argparse.Namespace) -> Any:
    from dataclasses import replace
    from pathlib import Path

    from kvcap.analysis.slo import parse_slo
    from kvcap.sim.run import SimConfig, load_plan_from
    from kvcap.specs.scenario import load_scenario
    from kvcap.workload.trace import read_trace

    scenario = load_scenario(a.scenario, _sim_overrides(a))
    if a.trace:
        ld = scenario.load
        plan = load_plan_from(scenario.model_copy(update={"load": ld.model_copy(update={"concurrency": [1]})}), a.seed)
        plan = replace(plan, mode="trace", levels=(a.trace_speed,), trace=tuple(read_trace(a.trace)),
                       trace_speed=a.trace_speed, duration_s=None if a.requests and not a.duration else plan.duration_s)
    else:
        plan = load_plan_from(scenario, a.seed)
    slo = parse_slo(a.slo) if a.slo else parse_slo(scenario.slo)
    return SimConfig(scenario=scenario, plan=plan, out=Path(a.out), slo=slo, arm=a.arm, overwrite=a.overwrite,
                     record_itl=not a.no_itl, trace_file=a.trace)


def _level_line(prefix: str = "") -> Callable[[dict[str, Any]], None]:
    def show(info: dict[str, Any]) -> None:
        s = info["sim"]
        print(f"{prefix}{info['mode']} {info['level']:g} (repeat {info['repeat']}): {s['finished']} requests, "
              f"{s['simulated_s']:.0f} s simulated in {s['wall_s']:.2f} s", file=sys.stderr)
    return show


def _cmd_sim(a: argparse.Namespace) -> int:
    from kvcap.report.console import render_levels
    from kvcap.sim.run import run_sim

    cfg = _sim_config(a)
    summary = run_sim(cfg, progress=None if (a.quiet or a.json) else _level_line())
    if a.json:
        print(json.dumps(summary, indent=2))
    else:
        render_levels(summary, title=f"kvcap sim → {cfg.out}")
        s = summary["sim"]
        rt = f" ({s['realtime_factor']:,.0f}× real time)" if s.get("realtime_factor") else ""
        print(f"{s['requests']:,} requests, {s['simulated_s']:,.0f} s simulated in {s['engine_wall_s']:.2f} s{rt}"
              + (" — interrupted: the levels that finished and every finished request are kept"
                 if summary.get("interrupted") else ""))
    return 130 if summary.get("interrupted") else 0


SERVE_SIM_EXAMPLES = """
examples:
  kvcap serve-sim scenarios/seed-reference.yaml --port 8000
  kvcap serve-sim scenarios/seed-reference.yaml --set serving.kv_offload=remote --log sim-log.jsonl
  # then, in another shell:
  kvcap bench --url http://127.0.0.1:8000 --concurrency 8,16 --input-tokens 1024 --output-tokens 256 \\
              --metrics-url http://127.0.0.1:8000/metrics --duration 30s --out runs/against-sim
"""


def _add_serve_sim(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve-sim", help="serve the simulated cluster in real time behind an OpenAI-compatible streaming API",
        description=_doc("""
            Runs the scenario's cluster in real time behind /v1/completions and /v1/chat/completions (streaming,
            usage, [DONE]), /v1/models, /health and a vLLM-style /metrics, so any client can benchmark a simulated
            cluster. Prompt length = whitespace-separated words; output length = max_tokens. Binds 127.0.0.1 by
            default. Stops on Ctrl-C.
        """), epilog=SERVE_SIM_EXAMPLES, formatter_class=_formatter)
    p.add_argument("scenario", metavar="SCENARIO.yaml")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (8000; 0 picks a free one)")
    p.add_argument("--model-name", help="model id to serve (default: the scenario's model)")
    p.add_argument("--log", metavar="FILE.jsonl", help="append the simulator's record of each request")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override any scenario key (repeatable)")
    p.set_defaults(func=_cmd_serve_sim)


def _cmd_serve_sim(a: argparse.Namespace) -> int:
    import asyncio
    import signal
    from pathlib import Path

    from kvcap.sim.cluster import cluster_model
    from kvcap.sim.server import describe, serve
    from kvcap.specs.scenario import load_scenario, parse_set

    if not 0 <= a.port <= 65535:
        raise InputError(f"--port must be 0-65535, got {a.port}")
    cm = cluster_model(load_scenario(a.scenario, parse_set(a.set)))

    async def main() -> None:
        server, _ = await serve(cm, a.host, a.port, Path(a.log) if a.log else None, a.model_name)
        d = describe(cm)
        print(f"kvcap serve-sim: {d['model']} on {d['replicas']} × {d['gpu']} (KV offload {d['kv_offload']}) at "
              f"{server.url}/v1", file=sys.stderr, flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            await server.close()

    asyncio.run(main())
    return 0


DEMO_EXAMPLES = """
examples:
  kvcap demo
  kvcap demo --out runs/demo --set cluster.interconnect.bandwidth=400Gbps
  kvcap demo --set load.repeats=1 --set load.duration=30s
"""


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo", help="the article's reference A/B, simulated (no GPU): verdict, table and report.html",
        description=_doc("""
            Simulates the article's reference cluster (4 nodes x one 24 GB GPU, 100 Gbps, a 7B model, ~1024 in /
            256 out) twice — KV in VRAM only, and KV allowed to spill to a distributed memory pool — at every
            level with repeats, then prints the side-by-side table and the verdict and writes DIR/control/,
            DIR/treatment/, DIR/compare.json and DIR/report.html. The scenario is seed-reference-ab.yaml.
        """), epilog=DEMO_EXAMPLES, formatter_class=_formatter)
    p.add_argument("--out", default="kvcap-demo", metavar="DIR", help="where to write (kvcap-demo; replaced)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a scenario key for both arms")
    p.add_argument("--json", action="store_true", help="print compare.json")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=_cmd_demo)


def _cmd_demo(a: argparse.Namespace) -> int:
    from kvcap.experiment import load_any_experiment, packaged_scenario

    exp = load_any_experiment(str(packaged_scenario("seed-reference-ab.yaml")))
    return _run_sim_ab(exp, a.out, a.set, a.json, a.quiet)


def _run_sim_ab(exp: Any, out_dir: str, sets: list[str] | None, as_json: bool, quiet: bool) -> int:
    import time
    from pathlib import Path

    from kvcap.experiment import run_sim_experiment
    from kvcap.report.console import render_compare
    from kvcap.specs.scenario import parse_set

    out = Path(out_dir)
    t0 = time.perf_counter()
    show = None if (quiet or as_json) else (lambda arm, info: _level_line(f"{arm}: ")(info))
    result = run_sim_experiment(exp, out, parse_set(sets), progress=show)
    _write_report(result, out)
    if as_json:
        print(json.dumps({k: v for k, v in result.items() if k != "summaries"}, indent=2))
    else:
        render_compare(result)
        print(f"simulated both arms in {time.perf_counter() - t0:.1f} s; report: {out / 'report.html'}")
    return 0


# ---------------------------------------------------------------- analyze

ANALYZE_EXAMPLES = """
examples:
  kvcap analyze runs/control
  kvcap analyze runs/control --slo ttft_p95=500ms,tpot_p95=80ms --json
"""


def _add_analyze(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("analyze", help="per-level statistics, the three conditions and capacities of a run directory",
                       description=_doc("""
                           Reads a run directory (from bench or sim), judges every level by the article's three
                           conditions — throughput still grows, p95/p99 within the SLO, no sustained queueing,
                           timeouts or preemptions — and writes DIR/summary.json with the effective, resident
                           and stress-limit capacities.
                       """), epilog=ANALYZE_EXAMPLES, formatter_class=_formatter)
    p.add_argument("dir", metavar="DIR", help="run directory")
    p.add_argument("--slo", metavar="SPEC", help="override the run's SLO, e.g. ttft_p95=500ms,tpot_p95=80ms")
    p.add_argument("--json", action="store_true", help="print summary.json")
    p.set_defaults(func=_cmd_analyze)


def _cmd_analyze(a: argparse.Namespace) -> int:
    from kvcap.analysis.slo import parse_slo
    from kvcap.analysis.summary import build_summary
    from kvcap.report.console import render_levels
    from kvcap.rundir import SUMMARY, RunDir, write_json_atomic

    run = RunDir(a.dir)
    old = run.summary or {}
    summary = build_summary(run, slo=parse_slo(a.slo) if a.slo else None)
    for key in ("client", "interrupted", "telemetry_samples", "sim", "prometheus"):
        if key in old:
            summary[key] = old[key]
    write_json_atomic(run.dir / SUMMARY, summary)
    if a.json:
        print(json.dumps(summary, indent=2))
    else:
        render_levels(summary, title=f"kvcap analyze {a.dir}")
    return 0



# ---------------------------------------------------------------- compare

COMPARE_EXAMPLES = """
examples:
  kvcap compare runs/control runs/treatment --slo ttft_p95=500ms,tpot_p95=80ms
  kvcap compare runs/vram-only runs/offload --allow-diff serving.kv_offload --json
"""


def _add_compare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="A/B verdict: performance scaling, capacity only, no gain or regression",
                       description=_doc("""
                           Checks that the two runs are of the same caliber (every fixed variable equal but the
                           one under test; exit 3 listing the differences otherwise), then compares resident and
                           effective capacity and goodput, with bootstrap confidence, and gives the verdict.
                       """), epilog=COMPARE_EXAMPLES, formatter_class=_formatter)
    p.add_argument("control", metavar="CONTROL_DIR")
    p.add_argument("treatment", metavar="TREATMENT_DIR")
    p.add_argument("--slo", metavar="SPEC", help="SLO (default: the control run's)")
    p.add_argument("--allow-diff", metavar="KEY,...", help="fixed variables allowed to differ")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_compare)


def _cmd_compare(a: argparse.Namespace) -> int:
    from kvcap.analysis.slo import parse_slo
    from kvcap.analysis.verdict import compare
    from kvcap.report.console import render_compare

    allow = {k.strip() for k in (a.allow_diff or "").split(",") if k.strip()}
    result = compare(a.control, a.treatment, slo=parse_slo(a.slo) if a.slo else None, allow=allow)
    if not result["fixed_variables"]["equal"]:
        diffs = "; ".join(f"{d['key']}: {d['control']!r} vs {d['treatment']!r}"
                          for d in result["fixed_variables"]["differences"])
        raise RefusedComparison(f"fixed variables differ — {diffs} (pass --allow-diff KEY to accept)")
    if a.json:
        out = {k: v for k, v in result.items() if k != "summaries"}
        print(json.dumps(out, indent=2))
    else:
        render_compare(result)
    return 0



# ---------------------------------------------------------------- audit

AUDIT_EXAMPLES = """
examples:
  kvcap audit tests/data/article_table.csv --output-tokens 256 --slo ttft_p95=500ms,tpot_p95=80ms
  kvcap audit table.csv --output-tokens 256 --input-tokens 1024 --model llama-3.1-8b --gpu rtx4090 --nodes 4 \\
              --claimed-effective 16 --json
"""


def _add_audit(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("audit", help="check a capacity table someone hands you for internal consistency",
                       description=_doc("""
                           Reads a CSV (concurrency, output_tok_s, ttft_ms[, tpot_ms, output_tokens, arm, …]) and
                           checks it against itself: the TPOT its throughput implies, Little's law, scaling
                           efficiency, the SLO, and — with --model and --gpu/--gpu-mem — whether the claimed
                           concurrency is really VRAM-bound for that model.
                       """), epilog=AUDIT_EXAMPLES, formatter_class=_formatter)
    p.add_argument("table", metavar="TABLE.csv")
    p.add_argument("--output-tokens", type=_positive_int, help="output tokens per request (the table's cap)")
    p.add_argument("--input-tokens", type=_positive_int, help="input tokens per request (for the VRAM check)")
    p.add_argument("--slo", metavar="SPEC", help="e.g. ttft_p95=500ms,tpot_p95=80ms")
    p.add_argument("--claimed-effective", type=float, help="the effective capacity the table's author claims")
    p.add_argument("--model", help="model preset or config.json, for the VRAM check")
    p.add_argument("--gpu", help="GPU preset, for the VRAM check")
    p.add_argument("--gpu-mem", metavar="SIZE", help="GPU memory, for the VRAM check")
    p.add_argument("--nodes", type=_positive_int, help="nodes (one GPU each unless --gpus-per-node)")
    p.add_argument("--gpus-per-node", type=_positive_int)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_audit)


def _cmd_audit(a: argparse.Namespace) -> int:
    from kvcap.analysis.audit import audit_table, read_table
    from kvcap.analysis.slo import parse_slo

    rows = read_table(a.table)
    plan_result = None
    if a.model:
        from kvcap.plan import plan, resolve
        from kvcap.specs.scenario import load_scenario

        over: dict[str, Any] = {"model.preset": a.model} if not a.model.endswith(".json") else {"model.config": a.model}
        for key, val in (("cluster.gpu.preset", a.gpu), ("cluster.gpu.memory", a.gpu_mem), ("cluster.nodes", a.nodes),
                         ("cluster.gpus_per_node", a.gpus_per_node), ("workload.input_tokens", a.input_tokens),
                         ("workload.output_tokens", a.output_tokens)):
            if val is not None:
                over[key] = val
        plan_result = plan(resolve(load_scenario(None, over)))
    result = audit_table(rows, output_tokens=a.output_tokens, input_tokens=a.input_tokens,
                         slo=parse_slo(a.slo) if a.slo else None, plan=plan_result,
                         claimed_effective=a.claimed_effective)
    if a.json:
        print(json.dumps(result, indent=2))
        return 0
    from kvcap.report.console import make_console

    con = make_console()
    colour = {"error": "red", "warn": "yellow", "info": "white"}
    for f in result["findings"]:
        where = f"{f.get('arm') or ''} c={f.get('level')}".strip() if f.get("level") is not None else "table"
        con.print(f"[{colour.get(f['severity'], 'white')}]{f['severity']:5}[/] {where} · {f['check']}: {f['message']}")
    con.print(f"\n[bold]{result['summary']}[/bold]")
    return 0



# ---------------------------------------------------------------- ab

AB_EXAMPLES = """
examples:
  kvcap ab experiments/offload.yaml --out runs/offload-ab

experiment file:
  name: kv-offload
  fixed: {model.name: llama-3.1-8b, cluster.gpus: 4}
  arms:
    - {name: control, url: "http://127.0.0.1:8000", command: "vllm serve … --port 8000",
       vary: {serving.kv_offload: none}}
    - {name: treatment, url: "http://127.0.0.1:8000", command: "vllm serve … --kv-offloading-size 64",
       vary: {serving.kv_offload: host}}
  load: {concurrency: [8, 16, 24], warmup: 10s, duration: 60s, repeats: 3}
  workload: {input_tokens: 1024, output_tokens: 256}
  slo: {ttft_p95: 500ms, tpot_p95: 80ms}
"""


def _add_ab(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ab", help="run a same-caliber A/B (interleaved repeats), compare and report",
                       description=_doc("""
                           Runs both arms of an experiment with interleaved repeats (A B A B …) so drift on the
                           machine cancels, starting and stopping each arm's server command if it has one, then
                           writes DIR/<arm>/ run directories, DIR/compare.json and DIR/report.html.
                       """), epilog=AB_EXAMPLES, formatter_class=_formatter)
    p.add_argument("experiment", metavar="EXPERIMENT.yaml")
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override an experiment field (repeatable)")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--json", action="store_true", help="print compare.json")
    p.set_defaults(func=_cmd_ab)


def _cmd_ab(a: argparse.Namespace) -> int:
    import asyncio
    from pathlib import Path

    from kvcap.experiment import Experiment, SimExperiment, load_any_experiment, load_experiment
    from kvcap.report.console import render_compare
    from kvcap.specs.scenario import apply_overrides, parse_set

    exp = load_any_experiment(a.experiment)
    if isinstance(exp, SimExperiment):
        return _run_sim_ab(exp, a.out, a.set, a.json, a.quiet)
    exp = load_experiment(a.experiment)
    if a.set:
        from pydantic import ValidationError

        from kvcap.specs.scenario import validation_message

        try:
            exp = Experiment.model_validate(apply_overrides(exp.model_dump(), parse_set(a.set)))
        except ValidationError as exc:
            raise InputError(validation_message(exc, "--set")) from None
    out = Path(a.out)
    result = asyncio.run(_run_ab(exp, out, quiet=a.quiet or a.json))
    _write_report(result, out)
    if a.json:
        print(json.dumps({k: v for k, v in result.items() if k != "summaries"}, indent=2))
    else:
        render_compare(result)
        print(f"report: {out / 'report.html'}")
    return 0


async def _run_ab(exp: Any, out: Any, quiet: bool) -> dict:
    import asyncio
    import signal

    from kvcap.experiment import run_experiment
    from kvcap.report.live import RichProgress

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if quiet or not sys.stderr.isatty():
        return await run_experiment(exp, out, None, stop)
    with RichProgress() as progress:
        return await run_experiment(exp, out, progress, stop)


def _write_report(result: dict, out: Any) -> None:
    from kvcap.report.html import write_html
    from kvcap.report.markdown import render_markdown
    from kvcap.rundir import RunDir

    arms = [result["control"]["arm"], result["treatment"]["arm"]]
    runs = {"control": RunDir(out / arms[0]), "treatment": RunDir(out / arms[1])}
    write_html(out / "report.html", result, runs)
    (out / "report.md").write_text(render_markdown(result))



# ---------------------------------------------------------------- report

REPORT_EXAMPLES = """
examples:
  kvcap report runs/control --out control.html
  kvcap report runs/control runs/treatment --slo ttft_p95=500ms,tpot_p95=80ms --out ab.html
"""


def _add_report(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="self-contained HTML report (and Markdown) for one run or an A/B pair",
                       description=_doc("""
                           One run: per-level plots and server time series. Two runs (control, treatment): the
                           verdict box first, then the plots with SLO lines and capacity markers, the fixed
                           variables, the diagnosis and the raw tables. Works offline; a .md summary is written
                           beside it.
                       """), epilog=REPORT_EXAMPLES, formatter_class=_formatter)
    p.add_argument("dirs", nargs="+", metavar="DIR", help="one run directory, or CONTROL TREATMENT")
    p.add_argument("--slo", metavar="SPEC")
    p.add_argument("--allow-diff", metavar="KEY,...", help="as for compare")
    p.add_argument("--out", default="report.html", metavar="FILE")
    p.set_defaults(func=_cmd_report)


def _cmd_report(a: argparse.Namespace) -> int:
    from pathlib import Path

    from kvcap.analysis.slo import parse_slo
    from kvcap.report.html import write_html, write_html_single
    from kvcap.report.markdown import render_markdown, render_markdown_single
    from kvcap.rundir import RunDir

    slo = parse_slo(a.slo) if a.slo else None
    out = Path(a.out)
    if len(a.dirs) == 1:
        from kvcap.analysis.summary import build_summary

        run = RunDir(a.dirs[0])
        summary = build_summary(run, slo)
        write_html_single(out, summary, run, title=f"kvcap report: {a.dirs[0]}")
        out.with_suffix(".md").write_text(render_markdown_single(summary))
    elif len(a.dirs) == 2:
        from kvcap.analysis.verdict import compare

        allow = {k.strip() for k in (a.allow_diff or "").split(",") if k.strip()}
        result = compare(a.dirs[0], a.dirs[1], slo=slo, allow=allow)
        write_html(out, result, {"control": RunDir(a.dirs[0]), "treatment": RunDir(a.dirs[1])},
                   title=f"kvcap: {a.dirs[0]} vs {a.dirs[1]}")
        out.with_suffix(".md").write_text(render_markdown(result))
    else:
        raise InputError("report takes one run directory or two (control, treatment)")
    print(f"wrote {out} and {out.with_suffix('.md')}")
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


COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_plan, _add_bench, _add_sim, _add_serve_sim, _add_analyze, _add_compare, _add_ab, _add_report, _add_audit, _add_demo]


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
    except OSError as exc:  # unwritable --out, a file where a folder should be, …: the user's to fix
        where = f" {exc.filename!r}" if getattr(exc, "filename", None) else ""
        print(f"kvcap {args.command}: error: {exc.strerror or exc}{where}", file=sys.stderr)
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
