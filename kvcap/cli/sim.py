"""`kvcap sim` and `kvcap serve-sim`: the simulated cluster, batch (a run directory) or live (an HTTP API).

Both read a scenario file plus `--set` overrides; sim's load flags override the scenario's load section, so a
simulated run is planned exactly as the scenario would plan it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvcap.cli import common
from kvcap.errors import InputError

if TYPE_CHECKING:
    from kvcap.rundir.summary import Summary

SIM_EXAMPLES = """
examples:
  kvcap sim scenarios/seed-reference.yaml --out runs/sim-control
  kvcap sim scenarios/seed-reference.yaml --set serving.kv_offload=remote --arm treatment --out runs/sim-treatment
  kvcap sim scenarios/seed-reference.yaml --set cluster.interconnect.bandwidth=400Gbps --concurrency 48,64,96 \\
            --duration 30s --repeats 1 --out runs/sim-400g
  kvcap sim scenarios/seed-reference.yaml --trace data/traces/mooncake_conversation_trace.jsonl.gz \\
            --set serving.kv_offload=remote --duration 300s --out runs/sim-mooncake
"""

SERVE_SIM_EXAMPLES = """
examples:
  kvcap serve-sim scenarios/seed-reference.yaml --port 8000
  kvcap serve-sim scenarios/seed-reference.yaml --set serving.kv_offload=remote --log sim-log.jsonl
  # then, in another shell:
  kvcap bench --url http://127.0.0.1:8000 --concurrency 8,16 --input-tokens 1024 --output-tokens 256 \\
              --metrics-url http://127.0.0.1:8000/metrics --duration 30s --out runs/against-sim
"""


def register(sub: common.Subparsers) -> None:
    _add_sim(sub)
    _add_serve_sim(sub)


# ---------------------------------------------------------------- sim

def _add_sim(sub: common.Subparsers) -> None:
    p = sub.add_parser(
        "sim", help="simulate a cluster (replicas, KV tiers, links, vLLM-style batching) and write a run directory",
        description=common.doc("""
            Runs the scenario's load plan (or --trace) against a simulated cluster and writes the same run directory
            as bench — requests.jsonl, levels.jsonl, telemetry.jsonl (running/waiting/parked, KV and tier usage,
            preemptions, GPU and link utilisation), manifest.json (source "sim") and summary.json — so analyze,
            compare and report work unchanged. Each level starts from an empty cluster.
        """), epilog=SIM_EXAMPLES, formatter_class=common.formatter)
    p.add_argument("scenario", metavar="SCENARIO.yaml")
    common.add_run_dir_flags(p)
    common.add_arm_flag(p)
    p.add_argument("--no-itl", action="store_true", help="do not store per-token gaps (smaller records)")
    common.add_json_flag(p, help="print summary.json at the end")
    common.add_quiet_flag(p, help="no per-level lines")
    add_load_overrides(p)
    p.set_defaults(func=cmd_sim)


def add_load_overrides(p: argparse.ArgumentParser) -> None:
    """sim's load flags and --set (``kvcap search`` takes the same ones for every grid point)."""
    g = p.add_argument_group("load (override the scenario's load section)")
    m = g.add_mutually_exclusive_group()
    m.add_argument("--concurrency", metavar="LIST", help="closed-loop levels, e.g. 8,16,24")
    m.add_argument("--rate", metavar="LIST", help="open-loop levels in req/s, e.g. 0.5,1,2")
    m.add_argument("--trace", metavar="FILE", help="replay a trace: Mooncake JSONL, Splitwise/Azure CSV, kvcap JSONL")
    g.add_argument("--trace-speed", type=common.positive_float, default=1.0, help="trace time compression (1)")
    g.add_argument("--arrival", help="open-loop process: poisson | constant | gamma:cv=X")
    g.add_argument("--warmup", metavar="DURATION")
    g.add_argument("--duration", metavar="DURATION")
    g.add_argument("--requests", type=common.positive_int, help="measured requests per level (instead of --duration)")
    g.add_argument("--repeats", type=common.positive_int)
    g.add_argument("--input-tokens", metavar="DIST", help="N | uniform:a,b | normal:m,sd | lognormal:m,sd")
    g.add_argument("--output-tokens", metavar="DIST")
    g.add_argument("--prefix-tokens", type=int, metavar="N",
                   help="a system prompt shared per group, before each prompt's --input-tokens (as bench's)")
    g.add_argument("--prefix-groups", type=int, metavar="N", help="number of shared-prefix groups")
    g.add_argument("--prompts-per-group", type=int, metavar="N",
                   help="distinct questions per group, shuffled once and cycled (default: every request its own)")
    g.add_argument("--no-unique-prefix", action="store_true",
                   help="the same prompts at every level, back to back on one server: each level starts with the "
                        "prefixes the previous one left cached (as bench --no-unique-prefix sends them)")
    g.add_argument("--turns", type=int, metavar="N",
                   help="multi-turn sessions of N turns, as bench's --turns (1: single requests)")
    g.add_argument("--think-time", metavar="DURATION", help="a session's wait between turns, as bench's")
    g.add_argument("--seed", type=int, help="length and arrival seed (default: the scenario's load.seed, 0)")
    common.add_slo_flag(g, help="e.g. ttft_p95=500ms,tpot_p95=80ms (default: the scenario's)")
    common.add_set_flag(g)


def sim_overrides(a: argparse.Namespace) -> dict[str, Any]:
    """--set and the load flags as one dict of dotted scenario keys."""
    from kvcap.specs.scenario import parse_set

    out: dict[str, Any] = parse_set(a.set)
    if a.concurrency:
        out["load.concurrency"] = [int(x) for x in common.parse_levels(a.concurrency, "--concurrency", True)]
        out["load.rate"] = None
    if a.rate:
        out["load.rate"] = list(common.parse_levels(a.rate, "--rate", False))
        out["load.concurrency"] = None
    flags = {"load.arrival": a.arrival, "load.warmup": a.warmup, "load.duration": a.duration,
             "load.requests": a.requests, "load.repeats": a.repeats, "load.seed": a.seed,
             "workload.input_tokens": a.input_tokens,
             "workload.output_tokens": a.output_tokens, "workload.prefix_tokens": a.prefix_tokens,
             "workload.prefix_groups": a.prefix_groups, "workload.prompts_per_group": a.prompts_per_group,
             "workload.turns": a.turns, "workload.think_time": a.think_time}
    if a.no_unique_prefix:
        flags["workload.unique_prefix"] = False
    out.update({k: v for k, v in flags.items() if v is not None})
    return out


def _sim_config(a: argparse.Namespace) -> Any:
    from pathlib import Path

    from kvcap.sim.run import config_for
    from kvcap.specs.scenario import read_yaml
    from kvcap.workload.trace import read_trace

    data = read_yaml(a.scenario)
    overrides = sim_overrides(a)
    cfg = config_for(data, overrides, Path(a.out), where=a.scenario, trace=read_trace(a.trace) if a.trace else (),
                     trace_file=a.trace, trace_speed=a.trace_speed, slo=a.slo, arm=a.arm, overwrite=a.overwrite,
                     record_itl=not a.no_itl)
    for note in cfg.notes:
        print(f"kvcap sim: note: {note}", file=sys.stderr)
    if not a.trace:
        from kvcap.calibrate.output import extrapolation

        far = extrapolation(cfg.scenario.calibration, cfg.scenario.workload.input_dist.mean)
        if far:
            print(f"kvcap sim: note: {far}", file=sys.stderr)
    return cfg


def level_line(prefix: str = "") -> Callable[[dict[str, Any]], None]:
    """A progress callback that prints one line on stderr per simulated level."""
    def show(info: dict[str, Any]) -> None:
        s = info["sim"]
        print(f"{prefix}{info['mode']} {info['level']:g} (repeat {info['repeat']}): {s['finished']} requests, "
              f"{s['simulated_s']:.0f} s simulated in {s['wall_s']:.2f} s", file=sys.stderr)
    return show


def cmd_sim(a: argparse.Namespace) -> int:
    from kvcap.report.console import render_levels
    from kvcap.sim.run import run_sim

    cfg = _sim_config(a)
    summary = run_sim(cfg, progress=None if (a.quiet or a.json) else level_line())
    if a.json:
        common.print_json(summary.to_json())
    else:
        render_levels(summary, title=f"kvcap sim → {cfg.out}")
        print(_speed_line(summary))
    common.print_notes("sim", summary)
    common.print_build_note("sim")
    if cfg.scenario.calibration:
        from kvcap.calibrate.output import batch_extrapolation, queue_extrapolation
        from kvcap.rundir import RunDir

        infos = [lv.sim.to_json() if lv.sim is not None else {} for lv in RunDir(cfg.out).levels()]
        peak = max((int(s.get("running_peak") or 0) for s in infos), default=0)
        waiting = max((int(s.get("waiting_peak") or 0) for s in infos), default=0)
        for far in (batch_extrapolation(cfg.scenario.calibration, peak),
                    queue_extrapolation(cfg.scenario.calibration, waiting)):
            if far:
                print(f"kvcap sim: note: {far}", file=sys.stderr)
    return common.exit_status(summary)


def _speed_line(summary: Summary) -> str:
    s = summary.sim
    if s is None:
        return ""
    rt = f" ({s.realtime_factor:,.0f}× real time)" if s.realtime_factor else ""
    return (f"{s.requests:,} requests, {s.simulated_s:,.0f} s simulated in {s.engine_wall_s:.2f} s{rt}"
            + (" — interrupted: the levels that finished and every finished request are kept"
               if summary.interrupted else ""))


# ---------------------------------------------------------------- serve-sim

def _add_serve_sim(sub: common.Subparsers) -> None:
    p = sub.add_parser(
        "serve-sim", help="serve the simulated cluster in real time behind an OpenAI-compatible streaming API",
        description=common.doc("""
            Runs the scenario's cluster in real time behind /v1/completions and /v1/chat/completions (streaming,
            usage, [DONE]), /v1/models, /health and a vLLM-style /metrics, so any client can benchmark a simulated
            cluster. Prompt length = whitespace-separated words; output length = max_tokens. Binds 127.0.0.1 by
            default. Stops on Ctrl-C.
        """), epilog=SERVE_SIM_EXAMPLES, formatter_class=common.formatter)
    p.add_argument("scenario", metavar="SCENARIO.yaml")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (8000; 0 picks a free one)")
    p.add_argument("--model-name", help="model id to serve (default: the scenario's model)")
    p.add_argument("--log", metavar="FILE.jsonl", help="append the simulator's record of each request")
    common.add_set_flag(p)
    p.set_defaults(func=cmd_serve_sim)


def cmd_serve_sim(a: argparse.Namespace) -> int:
    import asyncio

    from kvcap.sim.cluster import cluster_model
    from kvcap.specs.scenario import load_scenario, parse_set

    if not 0 <= a.port <= 65535:
        raise InputError(f"--port must be 0-65535, got {a.port}")
    cm = cluster_model(load_scenario(a.scenario, parse_set(a.set)))
    asyncio.run(_serve_until_stopped(cm, a))
    return 0


async def _serve_until_stopped(cm: Any, a: argparse.Namespace) -> None:
    """Serves until Ctrl-C/SIGTERM, then closes the server."""
    import asyncio
    from pathlib import Path

    from kvcap.sim.server import describe, serve

    server, _ = await serve(cm, a.host, a.port, Path(a.log) if a.log else None, a.model_name)
    d = describe(cm)
    print(f"kvcap serve-sim: {d['model']} on {d['replicas']} × {d['gpu']} (KV offload {d['kv_offload']}) at "
          f"{server.url}/v1", file=sys.stderr, flush=True)
    stop = asyncio.Event()
    common.on_stop_signals(stop.set)
    try:
        await stop.wait()
    finally:
        await server.close()
