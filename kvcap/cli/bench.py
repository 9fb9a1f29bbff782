"""`kvcap bench`: load a real OpenAI-compatible endpoint and record a run directory.

Turns the flags into one BenchConfig (target, load plan, request shapes, telemetry, output) and hands it to
kvcap.loadgen.bench; Ctrl-C stops the sweep and still writes the summary.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from kvcap.cli import common
from kvcap.errors import InputError

BENCH_EXAMPLES = """
examples:
  kvcap bench --url http://127.0.0.1:8000 --concurrency 1,2,4,8,16,24 --input-tokens 1024 --output-tokens 256 \\
              --warmup 10s --duration 60s --repeats 3 --slo ttft_p95=500ms,tpot_p95=80ms --out runs/control
  kvcap bench --url http://127.0.0.1:8000/v1 --api chat --rate 0.5,1,2,4 --arrival gamma:cv=2 \\
              --input-tokens lognormal:1024,400 --output-tokens uniform:128,256 --requests 200 --out runs/rate
  kvcap bench --url http://127.0.0.1:8080 --trace data/traces/splitwise_conv.csv.gz --trace-speed 2 \\
              --duration 120s --metrics-url http://127.0.0.1:8080/metrics --out runs/trace
  kvcap bench --url http://gpu-host:8000 --concurrency 256,512,1024 --workers 2 --requests 2000 \\
              --tokenizer ./tokenizer.json --prefix-tokens 512 --prefix-groups 8 --out runs/big
"""


def register(sub: common.Subparsers) -> None:
    p = sub.add_parser(
        "bench", help="load an OpenAI-compatible streaming endpoint: fixed concurrency, fixed rate or a trace",
        description=common.doc("""
            Sweeps load levels against a real endpoint and records every request (requests.jsonl, appended as each
            finishes), the level windows (levels.jsonl), server metrics (telemetry.jsonl), the fixed variables
            (manifest.json) and per-level statistics (summary.json). Open-loop latency counts from the scheduled
            send time. Ctrl-C stops within seconds and still writes the summary (exit 130).
            Before any load, the endpoint is checked (/v1/models, else one 1-token request): down, or not serving
            --model, is one line and exit 1. A closed-loop stream backs off after failures (10 ms doubling to 1 s),
            and the run stops when --max-error-rate of a level's last --error-window requests failed: exit 1, as
            when no request succeeded; summary.json says why ("stopped", "failed").
        """), epilog=BENCH_EXAMPLES, formatter_class=common.formatter)
    _add_target_flags(p.add_argument_group("target"))
    _add_load_flags(p.add_argument_group("load (one of --concurrency, --rate, --trace)"))
    _add_request_flags(p.add_argument_group("requests"))
    _add_output_flags(p.add_argument_group("output"))
    p.set_defaults(func=cmd_bench)


def _add_target_flags(g: common.Flags) -> None:
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


def _add_load_flags(g: common.Flags) -> None:
    m = g.add_mutually_exclusive_group(required=True)
    m.add_argument("--concurrency", metavar="LIST", help="closed loop: concurrent streams per level, e.g. 1,2,4,8")
    m.add_argument("--rate", metavar="LIST", help="open loop: arrivals per second per level, e.g. 0.5,1,2,4")
    m.add_argument("--trace", metavar="FILE", help="replay a trace: Mooncake JSONL, Splitwise/Azure CSV, kvcap JSONL")
    g.add_argument("--arrival", default="poisson", help="open-loop process: poisson | constant | gamma:cv=X")
    g.add_argument("--trace-speed", type=common.positive_float, default=1.0,
                   help="trace time compression (2 = twice as fast)")
    g.add_argument("--warmup", default="10s", metavar="DURATION", help="per level, not measured (10s)")
    g.add_argument("--duration", metavar="DURATION", help="measured time per level (60s unless --requests)")
    g.add_argument("--requests", type=common.positive_int, help="measured requests per level (instead of --duration)")
    g.add_argument("--repeats", type=common.positive_int, default=1, help="repeat the whole sweep N times (1)")
    g.add_argument("--seed", type=int, default=0, help="prompt, length and arrival seed (0)")
    g.add_argument("--max-inflight", type=common.positive_int, default=20_000,
                   help="open-loop cap on streams in flight")
    g.add_argument("--workers", type=common.positive_int, default=1, help="client processes on this host (1)")
    g.add_argument("--ray", metavar="ADDRESS",
                   help="run the --workers as Ray actors on an existing cluster (HOST:PORT of its head); "
                        "needs kvcap[ray] here and kvcap on every node")
    g.add_argument("--placement", choices=("spread", "pack"), default="spread",
                   help="with --ray: one worker per node where it can (spread) or together (pack) (spread)")
    g.add_argument("--max-error-rate", default="90%", metavar="RATE|off",
                   help="stop the run when this share of a level's last --error-window requests failed (90%%)")
    g.add_argument("--error-window", type=common.positive_int, default=50, metavar="N",
                   help="requests the error rule looks back over (50); a level with fewer is never stopped")


def _add_request_flags(g: common.Flags) -> None:
    g.add_argument("--input-tokens", default="1024", metavar="DIST",
                   help="N | uniform:a,b | normal:m,sd | lognormal:m,sd")
    g.add_argument("--output-tokens", default="256", metavar="DIST",
                   help="same forms; forced with max_tokens+ignore_eos")
    g.add_argument("--dataset", metavar="FILE.jsonl",
                   help="rows with 'prompt' or 'messages' (+ optional output_tokens)")
    g.add_argument("--tokenizer", metavar="PATH", help="local HF tokenizer.json: exact prompt token counts")
    g.add_argument("--input-lengths", choices=("server", "local"), default="server",
                   help="size prompts by the server's own count (/tokenize or usage probes, checked before the "
                        "sweep; default) or by the local counter only (--tokenizer, else one word one token)")
    g.add_argument("--prefix-tokens", type=int, default=0,
                   help="a system prompt shared per group, before each prompt's --input-tokens (0: none)")
    g.add_argument("--prefix-groups", type=int, default=0, help="number of shared-prefix groups")
    g.add_argument("--prompts-per-group", type=int, default=None, metavar="N",
                   help="distinct questions per group, shuffled once and cycled as inference-perf does "
                        "(default: every request its own)")
    g.add_argument("--no-unique-prefix", action="store_true",
                   help="do not make prompts unique per run/level (lets a prompt cache hit across runs)")
    g.add_argument("--turns", type=int, default=1, metavar="N",
                   help="multi-turn sessions of N turns: each turn sends every earlier question and planned answer "
                        "plus a new --input-tokens question (1: single requests)")
    g.add_argument("--think-time", default="0", metavar="DURATION",
                   help="a session's wait after a turn's last token before its next turn (e.g. 2s, 500ms)")


def _add_output_flags(g: common.Flags) -> None:
    common.add_run_dir_flags(g)
    common.add_slo_flag(g, help="e.g. ttft_p95=500ms,tpot_p95=80ms,error_rate=1%%")
    g.add_argument("--metrics-url", action="append", metavar="[NODE=]URL",
                   help="a /metrics to sample each second (repeatable; NODE labels its rows, e.g. node1=http://…)")
    g.add_argument("--local-telemetry", action="store_true",
                   help="also sample this host each second: /proc/net/dev per device, and GPUs through NVML when "
                        "nvidia-ml-py is installed (for a client running on the server host)")
    g.add_argument("--prometheus", metavar="URL",
                   help="Prometheus to query after the run for every known series in its window (DCGM, node "
                        "exporter, engines): query_range, step 1 s")
    common.add_arm_flag(g)
    g.add_argument("--fixed", action="append", metavar="KEY=VALUE",
                   help="declare a fixed variable for compare, e.g. cluster.gpus=4 (repeatable)")
    g.add_argument("--vary", action="append", metavar="KEY=VALUE",
                   help="the variable under test and its value in this arm, e.g. serving.kv_offload=host")
    g.add_argument("--record-text", action="store_true", help="store generated text in each record")
    common.add_quiet_flag(g, help="no live progress")
    common.add_json_flag(g, help="print summary.json at the end")


def _bench_config(a: argparse.Namespace) -> Any:
    from pathlib import Path

    from kvcap.analysis.slo import parse_slo
    from kvcap.loadgen.bench import BenchConfig
    from kvcap.loadgen.client import Target
    from kvcap.specs.scenario import parse_set
    from kvcap.units import parse_duration
    from kvcap.workload.loadplan import LoadPlan
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
    load = _load_spec(a)
    trace = read_trace(a.trace) if a.trace else ()
    plan = LoadPlan.from_spec(load, trace=trace, trace_speed=a.trace_speed, max_inflight=a.max_inflight,
                              drain_timeout_s=timeout)
    workload = _workload_spec(a)
    if workload.turns > 1 and (a.trace or a.dataset):
        raise InputError(f"--turns makes generated sessions; {'--trace' if a.trace else '--dataset'} sends its own "
                         "requests")
    from kvcap.telemetry.scrape import parse_target

    for spec in a.metrics_url or []:
        parse_target(spec)
    fixed = parse_set(a.fixed)
    vary = parse_set(a.vary)
    fixed.update(vary)
    return BenchConfig(target=target, plan=plan, out=Path(a.out), input_dist=workload.input_dist,
                       output_dist=workload.output_dist, tokenizer=a.tokenizer, dataset=a.dataset,
                       server_lengths=a.input_lengths == "server",
                       prefix_tokens=workload.prefix_tokens, prefix_groups=workload.prefix_groups,
                       prompts_per_group=workload.prompts_per_group, unique_prefix=not a.no_unique_prefix,
                       turns=workload.turns, think_time_s=workload.think_time,
                       metrics_urls=list(a.metrics_url or []),
                       prometheus=_prometheus_url(a.prometheus), local_telemetry=a.local_telemetry,
                       slo=parse_slo(a.slo), workers=a.workers, overwrite=a.overwrite, arm=a.arm, fixed=fixed,
                       record_text=a.record_text, under_test=sorted(vary), error_rule=_error_rule(a),
                       ray=_ray_address(a.ray), placement=a.placement)


def _ray_address(address: str | None) -> str | None:
    """--ray: Ray must be importable here before anything is sent (InputError: install kvcap[ray])."""
    if address is None:
        return None
    from kvcap.loadgen.ray_workers import import_ray

    import_ray()
    if not address.strip():
        raise InputError("--ray needs the cluster's address, e.g. 10.0.0.1:6379")
    return address.strip()


def _error_rule(a: argparse.Namespace) -> Any:
    """--max-error-rate / --error-window as the rule that stops a run against a failing endpoint."""
    from kvcap.loadgen.guard import ErrorRule
    from kvcap.units import parse_fraction

    if a.max_error_rate.strip().lower() in ("off", "none"):
        return ErrorRule(max_error_rate=None, window=a.error_window)
    rate = parse_fraction(a.max_error_rate, "--max-error-rate")
    if rate <= 0:
        raise InputError("--max-error-rate must be above 0 (or 'off' to never stop)")
    return ErrorRule(max_error_rate=rate, window=a.error_window)


def _load_spec(a: argparse.Namespace) -> Any:
    """Bench's load flags as the one load spec (flag names in the messages of what only flags can get wrong)."""
    from kvcap.specs.fields import validate
    from kvcap.specs.load import LoadSpec
    from kvcap.units import parse_duration
    from kvcap.workload.arrivals import parse_arrival

    parse_arrival(a.arrival)
    given: dict[str, Any] = {"warmup": parse_duration(a.warmup, "--warmup"), "requests": a.requests,
                             "repeats": a.repeats, "arrival": a.arrival, "seed": a.seed}
    if a.concurrency:
        given["concurrency"] = [int(x) for x in common.parse_levels(a.concurrency, "--concurrency", True)]
    elif a.rate:
        given["rate"] = list(common.parse_levels(a.rate, "--rate", False))
    if a.duration:
        given["duration"] = parse_duration(a.duration, "--duration")
        if given["duration"] <= 0:
            raise InputError("--duration must be positive")
    return validate(LoadSpec, given, "bench")


def _workload_spec(a: argparse.Namespace) -> Any:
    from kvcap.specs.fields import validate
    from kvcap.specs.lengths import parse_length
    from kvcap.specs.load import WorkloadSpec
    from kvcap.units import parse_duration

    if a.prefix_tokens < 0 or a.prefix_groups < 0 or (a.prefix_tokens > 0) != (a.prefix_groups > 0):
        raise InputError("--prefix-tokens and --prefix-groups go together and must be positive")
    lengths = {"input_tokens": parse_length(a.input_tokens, "--input-tokens").spec,
               "output_tokens": parse_length(a.output_tokens, "--output-tokens").spec}
    if a.prompts_per_group is not None and (a.prompts_per_group < 1 or not a.prefix_groups):
        raise InputError("--prompts-per-group needs --prefix-tokens and --prefix-groups and must be positive")
    if a.turns < 1:
        raise InputError("--turns must be 1 or more")
    think = parse_duration(a.think_time, "--think-time")
    if think < 0:
        raise InputError("--think-time must be 0 or more")
    sessions: dict[str, Any] = {"turns": a.turns, "think_time": think} if a.turns > 1 or think else {}
    return validate(WorkloadSpec, {**lengths, "prefix_tokens": a.prefix_tokens, "prefix_groups": a.prefix_groups,
                                   "prompts_per_group": a.prompts_per_group, **sessions}, "bench")


def _prometheus_url(url: str | None) -> str | None:
    if url is not None and not url.startswith(("http://", "https://")):
        raise InputError(f"--prometheus must be an http(s):// URL, got {url!r}")
    return url


def cmd_bench(a: argparse.Namespace) -> int:
    import asyncio

    from kvcap.report.console import render_levels

    cfg = _bench_config(a)
    _check_local_inputs(cfg)
    summary = asyncio.run(_bench_until_stopped(cfg, quiet=a.quiet or a.json))
    if a.json:
        common.print_json(summary.to_json())
    else:
        render_levels(summary, title=f"kvcap bench → {cfg.out}")
    common.print_notes("bench", summary)
    return common.exit_status(summary)


def _check_local_inputs(cfg: Any) -> None:
    """Reads --dataset and --tokenizer once before any load is sent, so that a bad file fails at once."""
    if cfg.dataset:
        from kvcap.workload.prompts import load_dataset

        load_dataset(cfg.dataset)
    if cfg.tokenizer:
        from kvcap.workload.prompts import TokenCounter

        TokenCounter(cfg.tokenizer)


async def _bench_until_stopped(cfg: Any, quiet: bool) -> dict:
    """The sweep; the first Ctrl-C/SIGTERM stops it (the summary is still written), a second one aborts."""
    import asyncio

    from kvcap.loadgen.bench import run_bench

    stop = asyncio.Event()
    hits = {"n": 0}

    def on_signal() -> None:
        hits["n"] += 1
        stop.set()
        if hits["n"] == 1:
            print("kvcap bench: stopping — cancelling in-flight requests, writing the summary "
                  "(Ctrl-C again to abort)", file=sys.stderr)
        else:
            os._exit(130)

    common.on_stop_signals(on_signal)
    return await common.with_live_progress(quiet, lambda progress: run_bench(cfg, progress, stop))
